"""The simulated executors' pull: it lands only when the source's chunks cover the blocks asked
for once each, in order, as `read_blocks` sends them; anything else fails its request."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from npuserve.executor.rpc_status import KvPullFailed
from npuserve.executor.simulated_kv import BlockReader, read_blocks, run_pull
from npuserve.proto import executor_pb2 as pb
from npuserve.proto.step_plan import KvPull

PULL = KvPull("src:1", "", [1, 2, 3, 4], [5, 6, 7, 8], "r")


def chunk(first: int, count: int) -> pb.BlockChunk:
    return pb.BlockChunk(layer=0, first=first, shape=[2, count, 16, 0, 0], dtype="bfloat16")


def reader_of(*chunks: tuple[int, int]) -> BlockReader:
    return lambda pull: iter([chunk(first, count) for first, count in chunks])


def test_the_chunks_read_blocks_sends_land() -> None:
    def reader(pull: KvPull) -> Iterator[pb.BlockChunk]:
        return read_blocks(pull.src_block_ids, 16, 16, 1 << 20)  # one block a chunk

    assert run_pull(reader, PULL)
    assert run_pull(reader_of((0, 4)), PULL)
    assert run_pull(reader_of((0, 1), (1, 3)), PULL)


@pytest.mark.parametrize(
    "chunks",
    [
        [(0, 1), (2, 2)],  # a gap
        [(0, 2), (1, 3)],  # an overlap
        [(0, 3)],  # short
        [(0, 5)],  # past the last block
        [(0, 2), (2, 0)],  # an empty chunk
        [],  # nothing
    ],
)
def test_chunks_that_do_not_cover_the_blocks_once_in_order_fail_the_pull(
    chunks: list[tuple[int, int]],
) -> None:
    assert not run_pull(reader_of(*chunks), PULL)


def test_a_source_that_refuses_fails_the_pull() -> None:
    def refusing(pull: KvPull) -> Iterator[pb.BlockChunk]:
        yield chunk(0, 1)
        raise KvPullFailed("source gone")

    assert not run_pull(refusing, PULL)
