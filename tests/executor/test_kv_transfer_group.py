"""KV pulls between tensor-parallel groups of one size (`kv_transfer_group`), rank by rank: rank r
of the pulling group gets exactly rank r's shard of every block of the source group, through
the two rank 0s. The ranks are threads here, each with its own cache, and the group's exchanges
go through queues and barriers (`ThreadLink`); the source's chunks are gathered the way a
`GroupLeader` gathers them. A failure anywhere (the source's stream, a chunk that does not fit
one rank, a shard the group does not have) fails the pulls on every rank, and no rank waits
for ever. tests/deploy/test_serve_disaggregation_tp.py runs the same over gloo in processes."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from npuserve.executor.kv_transfer import ReadBlocksClient, block_chunk, chunk_spans
from npuserve.executor.kv_transfer_group import GroupKvPuller, gather_shards
from npuserve.executor.rpc_status import KvPullFailed
from npuserve.proto import executor_pb2 as pb
from npuserve.proto.step_plan import KvPull

TP = 2
NUM_LAYERS = 3
NUM_BLOCKS = 24
BLOCK_SIZE = 4
KV_HEADS = 4  # of the whole model: 2 per rank
HEAD_SIZE = 8
WAIT_S = 10.0


class ThreadLink:
    """One rank's end of a group of threads (`ShardLink`)."""

    def __init__(
        self, rank: int, inboxes: list[queue.Queue[Any]], barrier: threading.Barrier, table: list[Any]
    ):
        self.rank, self.size = rank, len(inboxes)
        self._inboxes, self._barrier, self._table = inboxes, barrier, table

    @classmethod
    def group(cls, size: int) -> list[ThreadLink]:
        inboxes: list[queue.Queue[Any]] = [queue.Queue() for _ in range(size)]
        barrier, table = threading.Barrier(size, timeout=WAIT_S), [None] * size
        return [cls(rank, inboxes, barrier, table) for rank in range(size)]

    def send_to(self, rank: int, value: Any) -> None:
        self._inboxes[rank].put(value)

    def receive_from_leader(self) -> Any:
        return self._inboxes[self.rank].get(timeout=WAIT_S)

    def all_gather(self, value: Any) -> list[Any]:
        self._table[self.rank] = value
        self._barrier.wait()
        values = list(self._table)
        self._barrier.wait()
        return values

    def gather_bytes(self, data: torch.Tensor) -> list[torch.Tensor]:
        values = self.all_gather(data.clone())
        return values if self.rank == 0 else []


def shards(seed: int) -> list[list[torch.Tensor]]:
    """A group's caches: rank r holds KV heads [r * 2, r * 2 + 2) of every block of every layer,
    each [2, NUM_BLOCKS, BLOCK_SIZE, 2, HEAD_SIZE]."""
    generator = torch.Generator().manual_seed(seed)
    whole = [
        torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, generator=generator)
        for _ in range(NUM_LAYERS)
    ]
    per_rank = KV_HEADS // TP
    return [
        [layer[..., r * per_rank : (r + 1) * per_rank, :].contiguous() for layer in whole] for r in range(TP)
    ]


def on_ranks(work: Callable[[int], Any], size: int = TP) -> list[Any]:
    """``work(rank)`` on a thread per rank; what each returned or raised, in rank order."""
    outcomes: list[Any] = [None] * size

    def run(rank: int) -> None:
        try:
            outcomes[rank] = work(rank)
        except Exception as exc:
            outcomes[rank] = exc

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(3 * WAIT_S)
    assert not any(thread.is_alive() for thread in threads), "a rank still waits"
    return outcomes


def source_stream(source: list[list[torch.Tensor]], block_ids: list[int]) -> list[pb.BlockChunk]:
    """What a source group's rank 0 sends for a read of ``block_ids``: each chunk gathered from
    every rank (`gather_shards`), one `BlockChunk` per rank, shard 0 first."""
    links = ThreadLink.group(TP)

    def read(rank: int) -> list[pb.BlockChunk]:
        chunks = []
        for layer, first, ids in chunk_spans(source[rank], block_ids):
            gathered = gather_shards(links[rank], source[rank], layer, ids)
            chunks += [block_chunk(layer, first, blocks, shard) for shard, blocks in enumerate(gathered)]
        return chunks

    stream, nothing = on_ranks(read)
    assert nothing == []
    return stream


class StreamClient(ReadBlocksClient):
    """Answers each pull with the chunks ``streams`` holds for its address, then ``then``."""

    def __init__(self, streams: dict[str, list[pb.BlockChunk]], then: Exception | None = None) -> None:
        super().__init__()
        self.streams, self.then = streams, then
        self.sizes: list[int] = []

    def read(self, pull: KvPull, tensor_parallel_size: int = 1) -> Iterator[pb.BlockChunk]:
        self.sizes.append(tensor_parallel_size)
        yield from self.streams[pull.address]
        if self.then is not None:
            raise self.then


def pull_on_ranks(
    pulls: list[KvPull], client: StreamClient
) -> tuple[list[list[torch.Tensor]], list[Any], list[GroupKvPuller]]:
    """Every rank of a pulling group runs ``pulls`` into zeroed caches: (the caches, what each
    rank's run returned or raised, the pullers)."""
    links = ThreadLink.group(TP)
    caches = [[torch.zeros_like(layer) for layer in shards(0)[rank]] for rank in range(TP)]
    pullers = [GroupKvPuller(links[rank], client if rank == 0 else None) for rank in range(TP)]
    outcomes = on_ranks(lambda rank: pullers[rank].run(pulls, caches[rank]))
    return caches, outcomes, pullers


def test_each_rank_gets_its_own_shard_of_every_block_and_rank_0_counts_every_rank() -> None:
    source = shards(seed=1)
    src, dst = [9, 4, 17, 2, 21], [3, 11, 6, 20, 1]
    other_src, other_dst = [5, 7], [8, 9]
    client = StreamClient({"a:1": source_stream(source, src), "b:2": source_stream(source, other_src)})
    pulls = [KvPull("a:1", "", src, dst), KvPull("b:2", "", other_src, other_dst)]
    caches, outcomes, pullers = pull_on_ranks(pulls, client)
    assert outcomes == [None, None]
    assert client.sizes == [TP, TP]  # only rank 0 reads, asking for a group of its size
    pulled = torch.tensor(src + other_src)
    into = torch.tensor(dst + other_dst)
    for rank in range(TP):
        for layer in range(NUM_LAYERS):
            got = caches[rank][layer]
            assert torch.equal(got[:, into], source[rank][layer][:, pulled])
            untouched = [b for b in range(NUM_BLOCKS) if b not in into.tolist()]
            assert not got[:, untouched].any()
    per_block = sum(layer[:, 0].numel() * layer.element_size() for layer in source[0]) * TP
    transfer = pullers[0].tally.take()
    assert transfer.num_bytes == len(pulled) * per_block and transfer.seconds > 0


def test_a_source_that_fails_midway_fails_the_pulls_on_every_rank() -> None:
    source = shards(seed=2)
    src, dst = [9, 4, 17], [3, 11, 6]
    stream = source_stream(source, src)
    failure = KvPullFailed("kv pull from a:1: UNAVAILABLE: the source is gone")
    client = StreamClient({"a:1": stream[: len(stream) // 2]}, then=failure)
    # A second pull that never runs: rank 0 stops at the first failure, and so does every rank.
    _, outcomes, _ = pull_on_ranks([KvPull("a:1", "", src, dst), KvPull("a:1", "", [1], [2])], client)
    for outcome in outcomes:
        assert isinstance(outcome, KvPullFailed) and str(outcome) == str(failure)
    assert len(client.sizes) == 1


def test_a_chunk_that_does_not_fit_one_rank_fails_the_pulls_on_every_rank_naming_it() -> None:
    source = shards(seed=3)
    src, dst = [9, 4], [3, 11]
    stream = source_stream(source, src)
    bad = next(chunk for chunk in stream if chunk.shard == 1)
    bad.shape[:] = [2, bad.shape[1], BLOCK_SIZE, 1, 2 * HEAD_SIZE]  # its bytes would fit, its heads not
    # Rank 1 fails the first pull and still takes the second pull's chunks, as rank 0 sends them.
    client = StreamClient({"a:1": stream, "b:2": source_stream(source, [5])})
    caches, outcomes, _ = pull_on_ranks([KvPull("a:1", "", src, dst), KvPull("b:2", "", [5], [8])], client)
    for outcome in outcomes:
        assert isinstance(outcome, KvPullFailed)
        assert str(outcome).startswith("tensor-parallel rank 1: kv pull from a:1: a chunk")
        assert "tensor-parallel size" in str(outcome)
    assert torch.equal(caches[0][0][:, 8], source[0][0][:, 5])  # rank 0 ran its pulls whole


def test_a_shard_outside_the_group_fails_the_pulls_on_every_rank() -> None:
    source = shards(seed=4)
    stream = source_stream(source, [9])
    stream[1].shard = TP
    client = StreamClient({"a:1": stream})
    _, outcomes, _ = pull_on_ranks([KvPull("a:1", "", [9], [3])], client)
    for outcome in outcomes:
        assert isinstance(
            outcome, KvPullFailed
        ) and "a chunk of shard 2, outside this group's ranks 0..1" in str(outcome)


def test_a_source_without_tensor_parallelism_leaves_rank_1_without_its_shard() -> None:
    """A source that sends shard 0 alone (one that does not know the size asked): rank 1 gets
    nothing, and the pulls fail on every rank."""
    source = shards(seed=5)
    stream = [chunk for chunk in source_stream(source, [9, 4]) if chunk.shard == 0]
    client = StreamClient({"a:1": stream})
    _, outcomes, _ = pull_on_ranks([KvPull("a:1", "", [9, 4], [3, 11])], client)
    for outcome in outcomes:
        assert isinstance(outcome, KvPullFailed)
        assert "tensor-parallel rank 1: kv pull from a:1: the stream ended at layer 0" in str(outcome)
