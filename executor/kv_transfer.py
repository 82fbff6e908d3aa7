"""KV blocks copied from one executor to another: a step's `kv_pulls` (`StepPlan.kv_pulls`).

The contract: a pull names a source executor (its address and instance id) and pairs of block
ids, the source's and this executor's; the scheduler chooses every id, and holds the source's
blocks unchanged until the pull has landed. The step that carries a pull starts it after its
`block_copies`; it runs beside that step and the next ones, each block whole, every layer
(`pulls_beside_steps`; a tensor-parallel group runs it inside the step), and the first result
after it names it landed or failed (`StepResult.landed_pull_req_ids`, `failed_pull_req_ids`),
its bytes and seconds in that result's timings as a `KvTransfer` of kind "executor". A pull that
fails fails its request only (`ModelRunner._pull`).

Transport: host-staged over gRPC, which works on every device. The pulling executor calls the
source's `ReadBlocks`, a server stream, presenting its own cluster token (`ReadBlocksClient`;
over TLS it trusts its own certificate chain: the executors of one deployment share a
certificate, or a CA that the chain holds). The source copies each chunk, up to `KV_CHUNK_BYTES` of
consecutive blocks of one layer, device -> host as it is sent (`read_blocks`): every message
stays far below the step link's limit (`MAX_STEP_MESSAGE_BYTES`), and neither side holds more
than one chunk in host memory. The pulling executor copies each chunk host -> device into its
blocks as it arrives (`KvPuller`), checking that it fits its own cache (same layers, block
shape and dtype: equal model, dtype, block size and tensor-parallel size on both sides).

Reads beside steps: the source reads the blocks while its steps go on, taking no step lock. No
step writes a block a pull names: the source's step that computed them has answered, and the
scheduler holds them, out of every later plan, until the pull has landed. So a pull never
waits for the source's step in flight (a long prefill), and two executors pulling from each other
cannot wait on each other. On a device the read's copies queue on the device's stream behind the
work already queued there (a side stream would let them overlap it). A tensor-parallel group's
reads go between its steps (the group leader's lock), as its ranks act in lockstep.

Tensor parallelism (`kv_transfer_group`): each rank holds a shard of every block (its KV heads),
and rank r of the pulling group takes its shard from rank r of the source group; both groups
must be of the same size (the source refuses a read asked by a group of another size,
INVALID_ARGUMENT, which fails the pull). The shards travel between the two groups' rank 0s, over
the one authenticated link that already joins each executor to the others (its port, cluster
token and TLS), and inside each group over the group's own gloo channel: the source's rank 0
gathers each span of blocks from every rank (`BlockChunk.shard` tells them apart) and the
puller's rank 0 relays each rank's chunks to it. Ranks >= 1 then need no port, address or
credentials of their own, the scheduler plans a pull as it does for one device, and a group
spread over nodes works as its steps do. The cost: every shard but rank 0's crosses a group's
host link once more on each side, and the two rank 0s carry all of them, one chunk at a time.
(Every rank serving its own shard would spread the network load over the ranks, but needs a gRPC
port per rank, published to the pullers, and the cluster's credentials on every rank.) The
pull's `KvTransfer` counts every rank's bytes, and its seconds last until every rank has written
its shard.

On Ascend a device-to-device path would skip the host: vllm-ascend's disaggregated prefill
("Disaggregated-prefill" design document) pulls blocks with Mooncake's TransferEngine over the
NPUs' own network (HCCS within a node, RoCE between nodes; CANN 8.2.RC1 or later), pushes them
layer by layer (MooncakeLayerwiseConnector), stages them in host memory as npuserve does
(MooncakeD2RHConnectorV1), or moves them with CANN's LLM-DataDist (AscendHcclConnector). An HCCL
send/recv would need a communicator spanning both executors, which npuserve's (one process group
each) do not form. On an NPU a pull is host-staged as on the CPU, with blocking copies through
pageable host memory (pinned staging buffers would let the copies overlap the network).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import grpc
import torch

from npuserve.executor.dtypes import dtype_name
from npuserve.executor.rpc_status import KvPullFailed
from npuserve.executor.transfer_tally import TransferTally
from npuserve.proto import executor_pb2 as pb
from npuserve.proto import executor_pb2_grpc as pb_grpc
from npuserve.proto.auth import with_bearer
from npuserve.proto.channel import (
    KV_CHUNK_BYTES,
    MAX_STEP_MESSAGE_BYTES,
    client_channel,
    message_size_options,
)
from npuserve.proto.plan_checks import check_read_block_ids
from npuserve.proto.step_plan import KV_TRANSFER_EXECUTOR, KvPull

# A pull's deadline: under the scheduler's default --step-timeout (60 s), so a source that
# stalls fails the pull (its request computes its prompt instead) before the scheduler takes
# the puller for gone.
PULL_TIMEOUT_S = 30.0
_CHANNEL_OPTIONS = message_size_options(MAX_STEP_MESSAGE_BYTES)

assert KV_CHUNK_BYTES < MAX_STEP_MESSAGE_BYTES // 2


# -- the source ------------------------------------------------------------------------------


def read_blocks(
    kv_caches: list[torch.Tensor], block_ids: list[int], num_blocks: int
) -> Iterator[pb.BlockChunk]:
    """The chunks of ``block_ids`` (`BlockChunk`: layer by layer, in the order asked), each copied
    device -> host as it is taken; a `PlanError` at once for an id outside 1..num_blocks-1.

    kv_caches: [2, num_device_blocks, block_size, Hkv, D] per layer."""
    check_read_block_ids(block_ids, num_blocks)
    return (
        block_chunk(layer, first, host_blocks(kv_caches[layer], ids))
        for layer, first, ids in chunk_spans(kv_caches, block_ids)
    )


def chunk_spans(kv_caches: list[torch.Tensor], block_ids: list[int]) -> Iterator[tuple[int, int, list[int]]]:
    """(layer, first, ids): the blocks of each chunk of a read, in `read_blocks`' order (the same
    on every rank of a group: its ranks' caches have one shape)."""
    for layer, cache in enumerate(kv_caches):  # cache: [2, num_blocks, block_size, Hkv, D]
        per_chunk = max(1, KV_CHUNK_BYTES // (cache[:, 0].numel() * cache.element_size()))
        for first in range(0, len(block_ids), per_chunk):
            yield layer, first, block_ids[first : first + per_chunk]


def host_blocks(cache: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """cache: [2, num_device_blocks, block_size, Hkv, D] -> a host copy of its ``block_ids``,
    [2, len(block_ids), block_size, Hkv, D]."""
    return cache.index_select(1, torch.tensor(block_ids, dtype=torch.int64, device=cache.device)).cpu()


def block_chunk(layer: int, first: int, blocks: torch.Tensor, shard: int = 0) -> pb.BlockChunk:
    """blocks: [2, c, block_size, Hkv, D] on the host -> their `BlockChunk` (``shard``: the
    tensor-parallel rank whose KV heads they are)."""
    return pb.BlockChunk(
        layer=layer,
        first=first,
        shape=blocks.shape,
        dtype=dtype_name(blocks.dtype),
        data=blocks.reshape(-1).view(torch.uint8).numpy().tobytes(),
        shard=shard,
    )


# -- the pulling executor --------------------------------------------------------------------


class ReadBlocksClient:
    """`ReadBlocks` calls to source executors, over one channel per address, kept (gRPC
    reconnects a channel whose peer restarted; the instance id tells a restarted source apart)."""

    def __init__(self, cluster_token: str | None = None, tls_ca: bytes | None = None) -> None:
        self._token = cluster_token
        self._tls_ca = tls_ca
        self._stubs: dict[str, pb_grpc.ExecutorStub] = {}
        self._channels: list[grpc.Channel] = []

    def read(self, pull: KvPull, tensor_parallel_size: int = 1) -> Iterator[pb.BlockChunk]:
        """The source's chunks of ``pull.src_block_ids`` (every rank's shards, for a puller of
        ``tensor_parallel_size`` ranks); `KvPullFailed` for any failure of the call."""
        stub = self._stubs.get(pull.address)
        if stub is None:
            channel = client_channel(pull.address, _CHANNEL_OPTIONS, self._tls_ca)
            self._channels.append(channel)
            stub = self._stubs[pull.address] = pb_grpc.ExecutorStub(with_bearer(channel, self._token))
        request = pb.ReadBlocksRequest(
            block_ids=pull.src_block_ids,
            instance_id=pull.instance_id,
            tensor_parallel_size=tensor_parallel_size,
        )
        call = stub.ReadBlocks(request, timeout=PULL_TIMEOUT_S)
        try:
            yield from call
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            raise KvPullFailed(
                f"kv pull from {pull.address}: {code.name if code else 'error'}: {details}"
            ) from None
        finally:
            call.cancel()  # NOTE: a no-op once the stream ended; ends it where the reader stopped early

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
        self._stubs.clear()
        self._channels.clear()


class KvPuller:
    """Runs a step's pulls into this executor's cache and tallies what they moved."""

    def __init__(self, client: ReadBlocksClient | None = None) -> None:
        self.client = client or ReadBlocksClient()
        self.tally = TransferTally(KV_TRANSFER_EXECUTOR)

    def run(self, pulls: list[KvPull], kv_caches: list[torch.Tensor]) -> None:
        """Runs ``pulls`` in order (checked by the caller: `check_kv_pulls`); `KvPullFailed` when a
        source fails or sends what does not fit (the blocks written so far hold part of it).

        kv_caches: [2, num_device_blocks, block_size, Hkv, D] per layer."""
        with self.tally.timed():
            for pull in pulls:
                self.tally.add(write_chunks(kv_caches, pull, self.client.read(pull)))


def write_chunks(kv_caches: list[torch.Tensor], pull: KvPull, chunks: Iterator[pb.BlockChunk]) -> int:
    """Writes each chunk into its blocks of ``pull.dst_block_ids`` as it comes; the bytes written.
    The chunks must come in `read_blocks`' order and cover every block of every layer once."""
    dst = torch.tensor(pull.dst_block_ids, dtype=torch.int64)  # [n]
    num_dst = len(pull.dst_block_ids)
    layer, first, written = 0, 0, 0
    for chunk in chunks:
        if layer == len(kv_caches):
            raise KvPullFailed(f"kv pull from {pull.address}: more layers than this executor's {layer}")
        cache = kv_caches[layer]
        shape = tuple(chunk.shape)
        expected = (2, shape[1] if len(shape) == 5 else 0, *cache.shape[2:])
        if (
            (chunk.layer, chunk.first) != (layer, first)
            or shape != expected
            or not 0 < shape[1] <= num_dst - first
            or chunk.dtype != dtype_name(cache.dtype)
            or len(chunk.data) != math.prod(shape) * cache.element_size()
        ):
            raise KvPullFailed(
                f"kv pull from {pull.address}: a chunk (layer {chunk.layer}, block {chunk.first}, "
                f"shape {list(shape)}, {chunk.dtype}) does not fit this executor's cache (layer "
                f"{layer}, block {first}, blocks of shape {list(cache.shape[2:])}, "
                f"{dtype_name(cache.dtype)}): both sides need the same model, dtype, block size "
                "and tensor-parallel size"
            )
        # NOTE: bytearray: torch reads no read-only buffer without a warning; the copy is one chunk.
        blocks = torch.frombuffer(bytearray(chunk.data), dtype=torch.uint8).view(cache.dtype).view(shape)
        count = shape[1]
        cache.index_copy_(1, dst[first : first + count].to(cache.device), blocks.to(cache.device))
        written += len(chunk.data)
        first += count
        if first == num_dst:
            layer, first = layer + 1, 0
    if layer != len(kv_caches):
        raise KvPullFailed(
            f"kv pull from {pull.address}: the stream ended at layer {layer}, block {first}, of "
            f"{len(kv_caches)} layers"
        )
    return written
