"""KV blocks copied from one executor to another: a step's `kv_pulls` (`StepPlan.kv_pulls`).

The contract: a pull names a source executor (its address and instance id) and pairs of block
ids, the source's and this executor's; the scheduler chooses every id, and holds the source's
blocks unchanged until the pulling step is answered. The pulling step runs its pulls after its
`block_copies` and before its forward pass, each block whole, every layer; its timings report
them as a `KvTransfer` of kind "executor".

Transport: host-staged over gRPC, which works on every device. The pulling executor calls the
source's `ReadBlocks`, a server stream, presenting its own cluster token (`ReadBlocksClient`;
over TLS it trusts its own certificate chain: the executors of one deployment share a
certificate, or a CA that the chain holds). The source copies each chunk, up to `CHUNK_BYTES` of
consecutive blocks of one layer, device -> host as it is sent (`read_blocks`): every message
stays far below the step link's limit (`MAX_STEP_MESSAGE_BYTES`), and neither side holds more
than one chunk in host memory. The pulling executor copies each chunk host -> device into its
blocks as it arrives (`KvPuller`), checking that it fits its own cache (same layers, block
shape and dtype: equal model, dtype, block size and tensor-parallel size on both sides).

Locking on the source: the servicer reads each chunk under its step lock, so a read never runs
during one of its steps (on a device, the read comes after the step that wrote the blocks has
synchronized, and before the next one starts), and a step waits at most one chunk's copy.
NOTE: the pulling step holds its own executor's step lock while it waits for the source's: two
executors whose steps pull from each other at the same time wait on each other until
`PULL_TIMEOUT_S`: the scheduler must plan no such pair (a prefill executor never pulls).

Tensor parallelism: each rank holds a shard of every block (its KV heads), and only rank 0
serves gRPC; moving each rank's shard to the same rank on the other side is not built yet, so a
tensor-parallel group refuses pulls and reads (`PlanError`).

On Ascend a device-to-device path would skip the host. vllm-ascend's disaggregated prefill
(docs.vllm.ai/projects/ascend, "Disaggregated-prefill" design document) has the decode instance
pull the prefill instance's blocks with its MooncakeConnector, through Mooncake's TransferEngine
and its Ascend transport (CANN 8.2.RC1 or later, per the change that adopted it; the NPUs' own
network: HCCS within a node, RoCE between nodes), or the prefill side push them layer by layer
(MooncakeLayerwiseConnector); its MooncakeD2RHConnectorV1 stages them in the decode node's host
memory first, as npuserve does, and its older connector (registered as AscendHcclConnector) moves
them with CANN's LLM-DataDist. An HCCL point-to-point send/recv would need a communicator spanning
both executors, which npuserve's executors (one process group each) do not form. npuserve has
none of these: on an NPU a pull is host-staged as on the CPU, with blocking copies through
pageable host memory (pinned staging buffers would let the copies overlap the network).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import grpc
import torch

from npuserve.executor.rpc_status import KvPullFailed
from npuserve.executor.transfer_tally import TransferTally
from npuserve.proto import executor_pb2 as pb
from npuserve.proto import executor_pb2_grpc as pb_grpc
from npuserve.proto.auth import with_bearer
from npuserve.proto.channel import MAX_STEP_MESSAGE_BYTES, client_channel, message_size_options
from npuserve.proto.plan_checks import PlanError
from npuserve.proto.step_plan import KV_TRANSFER_EXECUTOR, KvPull

# Bytes of one ReadBlocks message's blocks (a single block of one layer may be more).
CHUNK_BYTES = 4 << 20
# A pull's deadline: under the scheduler's default --step-timeout (60 s), so a source that
# stalls fails the pulling step (ABORTED) before the scheduler takes the puller for gone.
PULL_TIMEOUT_S = 30.0
_CHANNEL_OPTIONS = message_size_options(MAX_STEP_MESSAGE_BYTES)

assert CHUNK_BYTES < MAX_STEP_MESSAGE_BYTES // 2


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> "bfloat16", as `ExecutorInfo.dtype` and `BlockChunk.dtype` say it."""
    return str(dtype).removeprefix("torch.")


def _blocks_per_chunk(cache: torch.Tensor) -> int:
    """cache: [2, num_blocks, block_size, Hkv, D]."""
    return max(1, CHUNK_BYTES // (cache[:, 0].numel() * cache.element_size()))


# -- the source ------------------------------------------------------------------------------


def read_blocks(
    kv_caches: list[torch.Tensor], block_ids: list[int], num_blocks: int
) -> Iterator[pb.BlockChunk]:
    """The chunks of ``block_ids`` (`BlockChunk`: layer by layer, in the order asked), each copied
    device -> host as it is taken; a `PlanError` at once for an id outside 1..num_blocks-1.

    kv_caches: [2, num_device_blocks, block_size, Hkv, D] per layer."""
    if block_ids and not (min(block_ids) > 0 and max(block_ids) < num_blocks):
        raise PlanError(f"read of a block id outside 1..{num_blocks - 1}")
    return _chunks(kv_caches, block_ids)


def _chunks(kv_caches: list[torch.Tensor], block_ids: list[int]) -> Iterator[pb.BlockChunk]:
    ids = torch.tensor(block_ids, dtype=torch.int64)  # [n]
    for layer, cache in enumerate(kv_caches):
        per_chunk = _blocks_per_chunk(cache)
        device_ids = ids.to(cache.device)
        for first in range(0, len(block_ids), per_chunk):
            blocks = cache.index_select(1, device_ids[first : first + per_chunk]).cpu()  # [2, c, bs, Hkv, D]
            yield pb.BlockChunk(
                layer=layer,
                first=first,
                shape=blocks.shape,
                dtype=dtype_name(blocks.dtype),
                data=blocks.view(-1).view(torch.uint8).numpy().tobytes(),
            )


# -- the pulling executor --------------------------------------------------------------------


class ReadBlocksClient:
    """`ReadBlocks` calls to source executors, over one channel per address, kept (gRPC
    reconnects a channel whose peer restarted; the instance id tells a restarted source apart)."""

    def __init__(
        self, cluster_token: str | None = None, tls_ca: bytes | None = None, timeout_s: float = PULL_TIMEOUT_S
    ) -> None:
        self._token = cluster_token
        self._tls_ca = tls_ca
        self.timeout_s = timeout_s
        self._stubs: dict[str, pb_grpc.ExecutorStub] = {}
        self._channels: list[grpc.Channel] = []

    def read(self, pull: KvPull) -> Iterator[pb.BlockChunk]:
        """The source's chunks of ``pull.src_block_ids``; `KvPullFailed` for any failure of the call."""
        stub = self._stubs.get(pull.address)
        if stub is None:
            channel = client_channel(pull.address, _CHANNEL_OPTIONS, self._tls_ca)
            self._channels.append(channel)
            stub = self._stubs[pull.address] = pb_grpc.ExecutorStub(with_bearer(channel, self._token))
        request = pb.ReadBlocksRequest(block_ids=pull.src_block_ids, instance_id=pull.instance_id)
        call = stub.ReadBlocks(request, timeout=self.timeout_s)
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
                self.tally.num_bytes += _write(kv_caches, pull, self.client.read(pull))


def _write(kv_caches: list[torch.Tensor], pull: KvPull, chunks: Iterator[pb.BlockChunk]) -> int:
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
