"""Ascend backend: the torch_npu operators vllm-ascend calls, with no decision of its own.

Every dtype, length and padding the operators read comes from `AttentionMetadata`, built by
`kernels/metadata.py` and tested on CPU; this module only hands those values to the operators.
It is the only module that imports torch_npu, and it cannot run without an Ascend device.

Operators (signatures checked against vllm-ascend ``attention_v1.py``, ``ops/layernorm.py``,
``ops/activation.py``, ``ops/rotary_embedding.py`` and op-plugin's ATB wrappers):

* ``_npu_reshape_and_cache``: ATB ReshapeAndCache, writes keys and values into the paged cache
  in place; slot indices int32.
* ``npu_fused_infer_attention_score``: one call for the whole mixed batch (prefill, prefix hit,
  chunked prefill, decode) in the ``TND`` layout, reading keys and values straight from the paged
  cache through the block table; returns ``(attention_out, softmax_lse)``. In a captured graph,
  its ``.out`` form with a workspace from ``_npu_fused_infer_attention_score_get_max_workspace``,
  in a task group updated before each replay (vllm-ascend ``attention_v1.py``,
  ``compilation/acl_graph.py``).
* ``npu_rms_norm`` returns ``(y, rstd)``; ``npu_add_rms_norm`` returns ``(y, rstd, x1 + x2)``.
* ``npu_swiglu(x)`` is ``silu(x[..., :I]) * x[..., I:]``, the ``gate | up`` layout.
* ``_npu_rotary_embedding``: ATB Rope, rotates queries and keys in place; reads the
  ``cos | sin`` table of `kernels/rope.py`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch_npu

from npuserve.kernels.backends.base import KernelBackend, check_attention_shapes, check_kv_write_shapes
from npuserve.kernels.metadata import AttentionMetadata
from npuserve.kernels.staging import DeviceTransfers, HostTransfers

# NOTE: with sparse_mode 3 ("rightDownCausal") the fused attention kernel takes a compressed
# causal mask of exactly this size, whatever the sequence lengths: 1 (masked) above the
# diagonal, 0 on and below it. Query token i of a request then sees keys up to
# context_len + i, the same rule the torch backend builds by hand.
CAUSAL_MASK_SIZE = 2048
SPARSE_MODE_RIGHT_DOWN_CAUSAL = 3


@functools.cache
def _causal_mask(device: torch.device) -> torch.Tensor:
    """[2048, 2048] int8, built once per device."""
    upper = torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.bool).triu(1)
    return upper.to(torch.int8).to(device)


@dataclass(slots=True)
class _CapturedAttention:
    """One layer's attention call in a captured graph, and what its updates need."""

    handle: Any  # torch_npu._C._NPUTaskGroupHandle
    event: Any  # torch.npu.ExternalEvent the replay waits on
    arguments: dict[str, Any]  # the operator's arguments, lengths those of the capture
    workspace: torch.Tensor
    output: torch.Tensor  # [T, H, D]
    softmax_lse: torch.Tensor


class NpuBackend(KernelBackend):
    name = "npu"

    def __init__(self) -> None:
        # (table the model passed, the same table on the device in the activation dtype)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self._update_stream: Any = None  # torch.npu.Stream of the graph updates, made on first use

    def prepare(self, metadata: AttentionMetadata) -> None:
        # Host lists the kernel reads in every layer: computed once per step.
        metadata.backend_state["actual_seq_lengths"] = metadata.query_ends_host

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        check_kv_write_shapes(key, value, kv_cache, metadata)
        assert metadata.slot_mapping.dtype == torch.int32, metadata.slot_mapping.dtype
        torch_npu._npu_reshape_and_cache(
            key=key,
            value=value,
            key_cache=kv_cache[0],  # [num_blocks, block_size, Hkv, D]
            value_cache=kv_cache[1],
            slot_indices=metadata.slot_mapping,
        )

    def attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_heads, num_kv_heads, head_size = check_attention_shapes(query, kv_cache, metadata)
        assert metadata.block_table.dtype == torch.int32, metadata.block_table.dtype
        if "actual_seq_lengths" not in metadata.backend_state:
            self.prepare(metadata)
        num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
        # [num_blocks, block_size, Hkv * D]: the paged layout the kernel reads (a view, no copy).
        key = kv_cache[0].view(num_blocks, block_size, num_kv_heads * head_size)
        value = kv_cache[1].view(num_blocks, block_size, num_kv_heads * head_size)
        arguments: dict[str, Any] = dict(
            query=query.contiguous(),  # the kernel rejects non-contiguous queries
            key=key,
            value=value,
            atten_mask=_causal_mask(query.device),
            block_table=metadata.block_table,
            input_layout="TND",
            block_size=block_size,
            actual_seq_lengths=metadata.backend_state["actual_seq_lengths"],
            actual_seq_lengths_kv=metadata.seq_lens_host,
            num_key_value_heads=num_kv_heads,
            num_heads=num_heads,
            scale=scale,
            sparse_mode=SPARSE_MODE_RIGHT_DOWN_CAUSAL,
        )
        if metadata.graph_attention is not None:
            return self._capture_attention(arguments, metadata.graph_attention)
        output, _ = torch_npu.npu_fused_infer_attention_score(**arguments)
        return output  # [T, H, D]

    def _capture_attention(self, arguments: dict[str, Any], captured: list[Any]) -> torch.Tensor:
        """The attention call as a graph captures it (vllm-ascend ``full_graph_fia``): its
        lengths are host lists, frozen into the captured task, so it is captured as a task group
        that `update_graph_attention` hands each replay's lengths, behind an external event the
        update records. The workspace is queried once for the longest lengths the block table
        holds, and shared by every layer."""
        query = arguments["query"]
        workspace = captured[0].workspace if captured else None
        if workspace is None:
            workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(**arguments)
        stream = torch.npu.current_stream()  # type: ignore[attr-defined]
        event = torch.npu.ExternalEvent()  # type: ignore[attr-defined]
        event.wait(stream)
        event.reset(stream)
        output = torch.empty_like(query)  # [T, H, D]
        softmax_lse = torch.empty(1, dtype=query.dtype, device=query.device)
        torch.npu.graph_task_group_begin(stream)  # type: ignore[attr-defined]
        torch_npu.npu_fused_infer_attention_score.out(
            **arguments, workspace=workspace, out=[output, softmax_lse]
        )
        handle = torch.npu.graph_task_group_end(stream)  # type: ignore[attr-defined]
        captured.append(_CapturedAttention(handle, event, arguments, workspace, output, softmax_lse))
        return output

    def update_graph_attention(self, captured: list[Any], metadata: AttentionMetadata) -> None:
        """vllm-ascend ``update_graph_params``: on a stream of its own, each captured call is
        given this step's query ends and kv lengths, then its event is recorded so the replay,
        which waits on it, runs the updated call."""
        # NOTE: an update rewrites the captured tasks in place, so the last replay must have
        # finished (vllm-ascend's ACLGraphWrapper synchronizes before replaying, for the same
        # reason). After a step that sampled, the host has waited for it already.
        torch.npu.current_stream().synchronize()  # type: ignore[attr-defined]
        if self._update_stream is None:
            self._update_stream = torch.npu.Stream()  # type: ignore[attr-defined]
        stream = self._update_stream
        lengths = {
            "actual_seq_lengths": metadata.query_ends_host,
            "actual_seq_lengths_kv": metadata.seq_lens_host,
        }
        with torch.npu.stream(stream):  # type: ignore[attr-defined]
            for call in captured:
                torch.npu.graph_task_update_begin(stream, call.handle)  # type: ignore[attr-defined]
                torch_npu.npu_fused_infer_attention_score.out(
                    **{**call.arguments, **lengths},
                    workspace=call.workspace,
                    out=[call.output, call.softmax_lse],
                )
                torch.npu.graph_task_update_end(stream)  # type: ignore[attr-defined]
                call.event.record(stream)

    def host_transfers(self, device: torch.device) -> HostTransfers | None:
        # NOTE: the CPU emulation of torch_npu keeps device tensors in host memory, where torch
        # sees no copy to a device; it models pinned memory and those copies itself.
        emulated: HostTransfers | None = getattr(torch_npu.npu, "emulated_host_memory", None)
        return emulated if emulated is not None else DeviceTransfers(torch_npu.npu)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch_npu.npu_rms_norm(x, weight, eps)[0]

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, _, summed = torch_npu.npu_add_rms_norm(x, residual, weight, eps)
        return normed, summed

    def rotary_embedding(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        head_size: int,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert cos_sin_cache.shape[-1] == head_size, "partial rotary is not supported"
        # NOTE: ATB Rope copies the cos/sin table on its first call and keeps that copy for the
        # life of the process (op-plugin keeps it in a static), so one process serves one
        # table: a second, different table would be silently ignored, hence the check.
        if self._rope_table is None:
            converted = cos_sin_cache.to(device=query.device, dtype=query.dtype).contiguous()
            self._rope_table = (cos_sin_cache, converted)
        source, table = self._rope_table
        assert source is cos_sin_cache or source.data_ptr() == cos_sin_cache.data_ptr(), (
            "the Ascend rotary kernel serves one cos/sin table per process"
        )
        assert table.dtype == query.dtype, (table.dtype, query.dtype)
        # The operator rotates in place and needs contiguous [T, N * D] rows and int64 positions.
        query, key = query.contiguous(), key.contiguous()
        torch_npu._npu_rotary_embedding(positions.to(torch.int64), query, key, head_size, table, True)
        return query, key

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return torch_npu.npu_swiglu(x.contiguous())  # rejects non-contiguous input
