"""A simulated executor's KV pulls without bytes: the `ReadBlocks` chunks its source serves, its
puller's read and check of them, and their modelled time beside its steps
(`npuserve.executor.simulated`).

A source serves the chunks a real cache of the same blocks would be sent as (`kv_transfer`: one
per `KV_CHUNK_BYTES` of KV), each empty, so a pull sends as many messages as for a real cache, read
beside the source's steps as there. The puller reads them as the step that carries the pull
begins; the pull then lands in modelled time (`ModelledPulls`). This module loads no torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import NamedTuple

from npuserve.executor.pulls_beside_steps import PullOutcomes, named_blocks
from npuserve.proto import executor_pb2 as pb
from npuserve.proto.channel import KV_CHUNK_BYTES
from npuserve.proto.plan_checks import check_read_block_ids
from npuserve.proto.step_plan import KV_TRANSFER_EXECUTOR, KvPull, KvTransfer, StepPlan

# A source executor's `ReadBlocks` of a pull's blocks (`kv_transfer.ReadBlocksClient.read`).
BlockReader = Callable[[KvPull], Iterator[pb.BlockChunk]]


def read_blocks(
    block_ids: list[int], num_blocks: int, block_size: int, block_bytes: int
) -> Iterator[pb.BlockChunk]:
    """The chunks of ``block_ids``, in order, each of shape [2, blocks, block_size, 0, 0] and no
    data; a `PlanError` at once for an id outside 1..num_blocks-1 (``block_bytes``: the modelled
    KV of one block)."""
    check_read_block_ids(block_ids, num_blocks)
    count, per_chunk = len(block_ids), max(1, KV_CHUNK_BYTES // block_bytes)
    return (
        pb.BlockChunk(
            layer=0, first=first, shape=[2, min(per_chunk, count - first), block_size, 0, 0], dtype="bfloat16"
        )
        for first in range(0, count, per_chunk)
    )


def run_pull(reader: BlockReader, pull: KvPull) -> bool:
    """Reads the source's chunks of ``pull``; False where the pull failed: the source is gone or
    refused (`KvPullFailed`), or its chunks are not the consecutive blocks from the first, every
    one once, as `read_blocks` sends them. That fails its request only, as a real executor's pull
    does."""
    from npuserve.executor.rpc_status import KvPullFailed  # NOTE: loads torch, as the reader has

    covered = 0
    try:
        for chunk in reader(pull):
            count = chunk.shape[1] if len(chunk.shape) == 5 else 0
            if chunk.first != covered or not 0 < count <= len(pull.dst_block_ids) - covered:
                return False
            covered += count
    except KvPullFailed:
        return False
    return covered == len(pull.dst_block_ids)


class _ModelledPull(NamedTuple):
    lands_at: float  # time.perf_counter()
    req_id: str
    dst_block_ids: list[int]
    seconds: float


class ModelledPulls:
    """One simulated executor's pulls beside its steps: each read at once through ``reader``
    (None: none is read), then landing its modelled seconds (``seconds_of`` its bytes) after
    the one before it, or after the step that carried it began; their outcomes go to
    ``outcomes`` (a failed read's at once, a landing's once `land` sees its time has come)."""

    def __init__(
        self,
        reader: BlockReader | None,
        outcomes: PullOutcomes,
        seconds_of: Callable[[int], float],
        block_bytes: int,
    ) -> None:
        self.reader = reader
        self.outcomes = outcomes
        self.seconds_of = seconds_of
        self.block_bytes = block_bytes
        self.num_blocks = 0  # blocks landed so far
        self._running: deque[_ModelledPull] = deque()  # in order of landing

    @property
    def next_landing(self) -> float | None:
        return self._running[0].lands_at if self._running else None

    def start(self, pulls: list[KvPull], started: float) -> None:
        """A step that began at ``started`` carries ``pulls`` (checked: `check_kv_pulls`)."""
        running = self._running
        for pull in pulls:
            if self.reader is not None and not run_pull(self.reader, pull):
                self.outcomes.settle(pull.req_id, landed=False)
                continue
            seconds = self.seconds_of(len(pull.dst_block_ids) * self.block_bytes)
            after = max(started, running[-1].lands_at) if running else started
            running.append(_ModelledPull(after + seconds, pull.req_id, pull.dst_block_ids, seconds))

    def begins_at(self, plan: StepPlan, started: float) -> float:
        """When a step that began at ``started`` begins in modelled time: once every pull that
        writes a block it names has landed (the scheduler plans none such; as the real runner)."""
        if not self._running:
            return started
        blocks = set(named_blocks(plan))
        return max([started, *(p.lands_at for p in self._running if not blocks.isdisjoint(p.dst_block_ids))])

    def land(self, now: float) -> KvTransfer:
        """Settles the pulls that have landed by ``now``: their bytes and modelled seconds."""
        running, num_blocks, seconds = self._running, 0, 0.0
        while running and running[0].lands_at <= now:
            pull = running.popleft()
            self.outcomes.settle(pull.req_id, landed=True)
            num_blocks += len(pull.dst_block_ids)
            seconds += pull.seconds
        self.num_blocks += num_blocks
        return KvTransfer(KV_TRANSFER_EXECUTOR, num_blocks * self.block_bytes, seconds)

    def clear(self) -> None:
        """Forgets the running pulls (a new scheduler: none lands for it)."""
        self._running.clear()
