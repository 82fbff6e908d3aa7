"""A simulated executor's KV pulls without bytes: the `ReadBlocks` chunks its source serves, and
its puller's read and check of them (`npuserve.executor.simulated`).

A source serves the chunks a real cache of the same blocks would be sent as (`kv_transfer`: one
per `KV_CHUNK_BYTES` of KV), each empty, so a pull sends as many messages as for a real cache, read
beside the source's steps as there. This module loads no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from npuserve.proto import executor_pb2 as pb
from npuserve.proto.channel import KV_CHUNK_BYTES
from npuserve.proto.plan_checks import check_read_block_ids
from npuserve.proto.step_plan import KvPull

# A source executor's `ReadBlocks` of a pull's blocks (`kv_transfer.ReadBlocksClient.read`).
BlockReader = Callable[[KvPull], Iterator[pb.BlockChunk]]


def read_blocks(
    block_ids: list[int], num_blocks: int, block_size: int, block_bytes: int
) -> Iterator[pb.BlockChunk]:
    """The chunks of ``block_ids``, in order, each of shape [2, blocks, block_size, 0, 0] and no
    data; a `PlanError` at once for an id outside 1..num_blocks-1 (``block_bytes``: the modelled
    KV of one block)."""
    check_read_block_ids(block_ids, num_blocks)
    return _chunks(len(block_ids), block_size, max(1, KV_CHUNK_BYTES // block_bytes))


def _chunks(count: int, block_size: int, per_chunk: int) -> Iterator[pb.BlockChunk]:
    for first in range(0, count, per_chunk):
        shape = [2, min(per_chunk, count - first), block_size, 0, 0]
        yield pb.BlockChunk(layer=0, first=first, shape=shape, dtype="bfloat16")


def check_chunks(pull: KvPull, chunks: Iterator[pb.BlockChunk]) -> None:
    """Reads a source's chunks of ``pull``: consecutive blocks from the first, every one once, as
    `read_blocks` sends them; else `KvPullFailed`, as a real executor's pull fails."""
    covered = 0
    for chunk in chunks:
        count = chunk.shape[1] if len(chunk.shape) == 5 else 0
        if chunk.first != covered or not 0 < count <= len(pull.dst_block_ids) - covered:
            covered = -1
            break
        covered += count
    if covered != len(pull.dst_block_ids):
        from npuserve.executor.rpc_status import KvPullFailed  # NOTE: loads torch, as the reader has

        raise KvPullFailed(
            f"kv pull from {pull.address}: its chunks do not cover the {len(pull.dst_block_ids)} "
            "blocks asked for in order (the source must be a simulated executor)"
        )


def run_pull(reader: BlockReader, pull: KvPull) -> bool:
    """Reads and checks the source's chunks of ``pull``; False where the pull failed
    (`KvPullFailed`: the source is gone, refused, or sent chunks that do not cover the blocks),
    which fails its request only, as a real executor's pull does."""
    from npuserve.executor.rpc_status import KvPullFailed  # NOTE: loads torch, as the reader has

    try:
        check_chunks(pull, reader(pull))
    except KvPullFailed:
        return False
    return True
