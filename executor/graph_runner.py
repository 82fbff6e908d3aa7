"""Graph mode for decode: pure-decode forward passes captured once per bucket size, then replayed.

A Python model launches hundreds of small kernels per step, and at small and medium batch sizes
the device waits on the host between them; a captured graph launches them all in one call
(vllm-ascend captures decode steps in ACL graphs by default, vLLM in CUDA graphs).

Capture (`DecodeGraphs.capture`, at start-up, after the KV cache is allocated, on every rank of
a tensor-parallel group: their collectives are captured too). Sizes are captured largest first,
into one private memory pool, after one eager run of the largest (first-use costs: operator
selection, workspaces, the rotary table, the causal mask), every row a padded one. The model reads only static tensors: the token ids, positions, slot mapping, block
table and kv lengths of the largest size, each bucket's graph a prefix of them. The rotary
embedding gathers its cos/sin from the static positions inside the graph.

Replay (`DecodeGraphs.load`, then `DecodeGraph.replay`). A pure-decode pass of ``B`` requests, ``B`` no larger than the
largest size, pads to its bucket ``N``: the static inputs get the ``B`` requests' rows and
``N - B`` padded rows, through the pinned staging buffers. A padded row is token 0 at position
0 with one token of context, whose key and value go to the scratch block and whose attention
reads only that block: the KV cache has one block more than the scheduler's pool (block
``num_blocks``, which no plan may name), so padding never touches a request's blocks and the
executor invents no block id. The attention's host-side lengths are then handed to the captured
calls (`KernelBackend.update_graph_attention`: on Ascend a task update per layer, as
vllm-ascend's ``update_graph_params``), and the graph replays. Only the model's forward is
captured: logits, the structured-output bitmask and sampling run eagerly on the ``B`` real rows,
so constrained rows replay like any other.

Passes that are not pure decode (a prefill chunk in the batch) and batches over the largest size
run eagerly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields
from typing import Any, Protocol

import numpy as np
import structlog
import torch

from npuserve.executor.config import ModelConfig
from npuserve.executor.input_batch import StepInputs
from npuserve.executor.kv_cache import GIB
from npuserve.kernels import NULL_BLOCK_ID, AttentionMetadata, KernelBackend
from npuserve.kernels.staging import HostStaging

log = structlog.get_logger(__name__)

# (input_ids [T], positions [T], kv_caches, metadata) -> hidden [T, hidden]
Forward = Callable[[torch.Tensor, torch.Tensor, list[torch.Tensor], AttentionMetadata], torch.Tensor]


class DeviceGraph(Protocol):
    """``torch.npu.NPUGraph`` / ``torch.cuda.CUDAGraph``: what npuserve calls of one."""

    def replay(self) -> None: ...


class GraphDevice:
    """The graph API of a device family, ``kind`` "npu" (``torch.npu``, ACL graphs) or "cuda"
    (``torch.cuda``, CUDA graphs). Both follow torch.cuda's: a graph object, a ``graph(g,
    pool=...)`` context manager that captures into it, ``graph_pool_handle()`` for a pool several
    graphs share, and ``memory_reserved()``, whose growth over the captures is what the pool
    holds. The emulated NPU implements the same calls (`npuserve.kernels.npu_emulation.graphs`)."""

    def __init__(self, kind: str) -> None:
        assert kind in ("npu", "cuda"), kind
        self.kind = kind
        self.module: Any = getattr(torch, kind)

    def new_graph(self) -> DeviceGraph:
        return self.module.NPUGraph() if self.kind == "npu" else self.module.CUDAGraph()

    def pool_handle(self) -> object:
        return self.module.graph_pool_handle()

    def capture(self, graph: DeviceGraph, pool: object) -> AbstractContextManager[Any]:
        """Captures the work queued inside the block into ``graph``, its memory from ``pool``."""
        return self.module.graph(graph, pool=pool)

    def memory_reserved(self) -> int:
        return int(self.module.memory_reserved())

    def synchronize(self) -> None:
        self.module.synchronize()


@dataclass(slots=True)
class StaticInputs:
    """The device tensors every captured graph reads, sized for the largest bucket ``M``."""

    input_ids: torch.Tensor  # [M] int64
    positions: torch.Tensor  # [M] int64
    slot_mapping: torch.Tensor  # [M] int32
    block_table: torch.Tensor  # [M, W] int32, W the most blocks a request holds
    seq_lens: torch.Tensor  # [M] int32
    query_start_loc: torch.Tensor  # [M + 1] int32: 0, 1, ..., M (one query token a row)

    @classmethod
    def allocate(cls, size: int, width: int, device: torch.device) -> StaticInputs:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(
            input_ids=zeros(size, dtype=torch.int64),
            positions=zeros(size, dtype=torch.int64),
            slot_mapping=zeros(size, dtype=torch.int32),
            block_table=zeros(size, width, dtype=torch.int32),
            seq_lens=zeros(size, dtype=torch.int32),
            query_start_loc=torch.arange(size + 1, dtype=torch.int32).to(device),
        )


@dataclass(slots=True)
class DecodeGraph:
    """One bucket's captured forward: ``size`` rows."""

    size: int
    graph: DeviceGraph
    metadata: AttentionMetadata  # over the static inputs' first ``size`` rows
    hidden: torch.Tensor  # [size, hidden]: the graph's output, rewritten by each replay

    def replay(self, num_reqs: int) -> torch.Tensor:
        """[num_reqs, hidden]: the forward of the pass `DecodeGraphs.load` loaded (a view of
        the graph's output: valid until this graph replays again)."""
        self.graph.replay()
        return self.hidden[:num_reqs]


class DecodeGraphs:
    """The captured decode graphs of one runner, and the steps that replay them."""

    def __init__(
        self,
        graphs: list[DecodeGraph],
        static: StaticInputs,
        backend: KernelBackend,
        staging: HostStaging,
        scratch_block: int,
        block_size: int,
    ) -> None:
        self.graphs = sorted(graphs, key=lambda g: g.size)  # the buckets, smallest first
        self.static = static
        self.backend = backend
        self.staging = staging
        self.scratch_block = scratch_block
        self.block_size = block_size

    @property
    def sizes(self) -> list[int]:
        return [graph.size for graph in self.graphs]

    @classmethod
    def capture(
        cls,
        device: GraphDevice,
        forward: Forward,
        kv_caches: list[torch.Tensor],
        backend: KernelBackend,
        staging: HostStaging,
        sizes: list[int],
        block_size: int,
        max_blocks_per_req: int,
        scratch_block: int,
        tensor_device: torch.device,
    ) -> DecodeGraphs:
        """Captures a graph of each size (largest first, one pool) and logs what it took."""
        assert sizes, "no size to capture"
        start = time.perf_counter()
        reserved_before = device.memory_reserved()
        largest = max(sizes)
        static = StaticInputs.allocate(largest, max_blocks_per_req, tensor_device)
        graphs = cls([], static, backend, staging, scratch_block, block_size)
        pool = device.pool_handle()
        graphs.load_padding(largest)
        # NOTE: one eager run first, of the largest size, pays what is paid once (operator
        # selection, workspaces, the rotary table, the causal mask) outside any graph. It gets
        # views of its own: a backend may key per-forward caches on the tensor objects it is
        # given (the torch backend's cos/sin), and a capture must find nothing cached.
        forward(*graphs.step_tensors(largest), kv_caches, graphs.step_metadata(largest))
        for size in sorted(sizes, reverse=True):
            graphs.load_padding(size)
            metadata = graphs.step_metadata(size)
            metadata.graph_attention = []
            graph = device.new_graph()
            with device.capture(graph, pool):
                backend.prepare(metadata)
                hidden = forward(*graphs.step_tensors(size), kv_caches, metadata)
            graphs.graphs.insert(0, DecodeGraph(size, graph, metadata, hidden))  # smallest first
        device.synchronize()
        seconds = time.perf_counter() - start
        pool_bytes = device.memory_reserved() - reserved_before
        log.info(
            "decode graphs captured",
            sizes=graphs.sizes,
            seconds=round(seconds, 3),
            pool_gib=round(pool_bytes / GIB, 4),
        )
        return graphs

    # -- one step ---------------------------------------------------------------------------

    def bucket(self, num_reqs: int) -> DecodeGraph | None:
        """The smallest graph with room for ``num_reqs`` rows; None above the largest."""
        for graph in self.graphs:
            if graph.size >= num_reqs:
                return graph
        return None

    def load(self, inputs: StepInputs) -> DecodeGraph | None:
        """Readies the graph of a pure-decode pass's bucket to replay it: the pass's rows and
        padded ones in the static inputs, its lengths in the captured attention. None for a pass
        to run eagerly (not pure decode, or more requests than the largest graph)."""
        num_reqs = len(inputs.query_lens)
        if len(inputs.input_ids) != num_reqs:  # a query longer than one token
            return None
        graph = self.bucket(num_reqs)
        if graph is None:
            return None
        graph.metadata.seq_lens_host = self._load(graph.size, inputs)
        self.backend.update_graph_attention(graph.metadata.graph_attention or [], graph.metadata)
        return graph

    def _load(self, size: int, inputs: StepInputs) -> list[int]:
        """Copies the pass's rows, then padded rows up to ``size``, into the static inputs;
        returns the kv lengths of all ``size`` rows."""
        num_reqs = len(inputs.query_lens)
        pad = size - num_reqs
        scratch_slot = self.scratch_block * self.block_size
        width = self.static.block_table.shape[1]
        table = np.full((size, width), NULL_BLOCK_ID, dtype=np.int32)
        table[:num_reqs] = inputs.block_table[:, :width]
        table[num_reqs:, 0] = self.scratch_block
        seq_lens = np.concatenate([inputs.seq_lens, np.ones(pad, dtype=inputs.seq_lens.dtype)])
        rows = {
            "input_ids": np.concatenate([inputs.input_ids, np.zeros(pad, dtype=inputs.input_ids.dtype)]),
            "positions": np.concatenate([inputs.positions, np.zeros(pad, dtype=inputs.positions.dtype)]),
            "slot_mapping": np.concatenate([inputs.slot_mapping, np.full(pad, scratch_slot, dtype=np.int32)]),
            "block_table": table,
            "seq_lens": seq_lens,
        }
        for name, array in rows.items():
            self.staging.copy_into(getattr(self.static, name)[:size], f"graph_{name}", array)
        return seq_lens.tolist()

    def load_padding(self, size: int) -> None:
        """Every one of the first ``size`` rows a padded one (for warm-up and capture)."""
        empty = {field.name: np.zeros(0, dtype=np.int64) for field in fields(StepInputs)}
        empty["block_table"] = np.zeros((0, self.static.block_table.shape[1]), dtype=np.int32)
        self._load(size, StepInputs(**empty))

    def step_tensors(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [size], positions [size]): fresh views of the static inputs."""
        return self.static.input_ids[:size], self.static.positions[:size]

    def step_metadata(self, size: int) -> AttentionMetadata:
        """The metadata of a ``size``-row pure decode over the static inputs (padded rows'
        lengths until a step loads its own)."""
        static = self.static
        width = static.block_table.shape[1]
        return AttentionMetadata(
            num_reqs=size,
            num_tokens=size,
            block_size=self.block_size,
            max_query_len=1,
            # NOTE: the longest a request may be, not this step's: a graph's shapes are fixed.
            max_seq_len=width * self.block_size,
            query_start_loc=static.query_start_loc[: size + 1],
            seq_lens=static.seq_lens[:size],
            block_table=static.block_table[:size],
            slot_mapping=static.slot_mapping[:size],
            query_lens_host=[1] * size,
            seq_lens_host=[1] * size,
        )


def pool_estimate_bytes(config: ModelConfig, sizes: list[int], dtype: torch.dtype, tp_size: int) -> int:
    """What the graphs' pool will take, for the KV cache's budget: twice the live activations of
    one layer's decode at the largest size (the pool's graphs share its memory), plus every
    graph's output and a fused-attention workspace per graph. A start-up log line gives the
    pool's measured size."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q_size = config.num_heads * head_dim // tp_size
    kv_size = max(1, config.num_kv_heads // tp_size) * head_dim
    intermediate = config.intermediate_size // tp_size
    per_token = 4 * hidden + 2 * (q_size + 2 * kv_size) + 3 * intermediate
    layer = max(sizes) * per_token * dtype.itemsize
    outputs = sum(sizes) * hidden * dtype.itemsize
    workspaces = len(sizes) * (4 << 20)
    return 2 * layer + outputs + workspaces
