"""KV pulls between tensor-parallel groups of one size: rank r's shard of each block (its KV
heads) to rank r (`kv_transfer` has the transport and why it goes through the groups' rank 0s).

The source (`gather_shards`): for each chunk of a read, its rank 0 sends the group a "read"
message between steps (`GroupLeader.read_blocks`), every rank copies its shard of the chunk's
blocks device -> host, and rank 0 gathers them over the group's gloo group and sends them on,
one `BlockChunk` per rank, shard 0 first.

The puller (`GroupKvPuller`): every rank runs the step's pulls. Rank 0 reads each pull's stream,
writes shard 0 into its cache and sends every other chunk to the rank of its shard, point to
point, then an end (or its failure) to every rank; each rank writes and checks its own chunks
(`write_chunks`). Then the ranks agree, in one all-gather: the pulls fail on every rank when any
of them failed one (`KvPullFailed`, each rank's reason), so that all of them treat the same
requests alike and stay in step, and rank 0's tally counts every rank's bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch

from npuserve.executor.kv_transfer import KvPuller, ReadBlocksClient, host_blocks, write_chunks
from npuserve.executor.rpc_status import KvPullFailed
from npuserve.proto import executor_pb2 as pb
from npuserve.proto.step_plan import KvPull

# What rank 0 sends a rank after a pull's last chunk: the pull is over (`None`, or rank 0's reason
# for failing it, a str); a chunk itself is its serialized `BlockChunk` (bytes).
_END = None


class ShardLink(Protocol):
    """The exchanges inside a group that move shards (`RankGroup`'s)."""

    rank: int
    size: int

    def send_to(self, rank: int, value: Any) -> None: ...

    def receive_from_leader(self) -> Any: ...

    def all_gather(self, value: Any) -> list[Any]: ...

    def gather_bytes(self, data: torch.Tensor) -> list[torch.Tensor]: ...


# -- the source ------------------------------------------------------------------------------


def gather_shards(
    group: ShardLink, kv_caches: list[torch.Tensor], layer: int, block_ids: list[int]
) -> list[torch.Tensor]:
    """Every rank at once: this rank's shard of ``block_ids`` of ``layer`` to rank 0. On rank 0,
    every rank's, in rank order, each [2, len(block_ids), block_size, Hkv, D] on the host (an
    empty list elsewhere).

    kv_caches: [2, num_device_blocks, block_size, Hkv, D] per layer, one shape on every rank."""
    own = host_blocks(kv_caches[layer], block_ids)  # [2, c, bs, Hkv, D]
    gathered = group.gather_bytes(own.reshape(-1).view(torch.uint8))
    return [data.view(own.dtype).view(own.shape) for data in gathered]


# -- the puller ------------------------------------------------------------------------------


class GroupKvPuller(KvPuller):
    """One rank's part of a step's pulls (every rank of the group runs them)."""

    def __init__(self, group: ShardLink, client: ReadBlocksClient | None = None) -> None:
        super().__init__(client)
        self.group = group

    def run(self, pulls: list[KvPull], kv_caches: list[torch.Tensor]) -> None:
        """Runs ``pulls`` in order, this rank's shard of each; `KvPullFailed` on every rank when
        any rank failed one (the blocks written so far hold part of it).

        kv_caches: [2, num_device_blocks, block_size, Hkv, D] per layer: this rank's shard."""
        with self.tally.timed():
            pull_shards = self._lead if self.group.rank == 0 else self._follow
            error, num_bytes = pull_shards(pulls, kv_caches)
            outcomes: list[tuple[str | None, int]] = self.group.all_gather((error, num_bytes))
            self.tally.add(sum(moved for _, moved in outcomes))
        failures = [
            reason if rank == 0 else f"tensor-parallel rank {rank}: {reason}"
            for rank, (reason, _) in enumerate(outcomes)
            if reason is not None
        ]
        if failures:
            raise KvPullFailed("; ".join(failures))

    def _lead(self, pulls: list[KvPull], kv_caches: list[torch.Tensor]) -> tuple[str | None, int]:
        """Rank 0: each pull's stream read, shard 0 written here, the others sent on; the first
        failure ends the pulls (and says so to every rank). (reason or None, bytes written)."""
        num_bytes = 0
        for pull in pulls:
            try:
                chunks = self._send_on(pull, self.client.read(pull, self.group.size))
                num_bytes += write_chunks(kv_caches, pull, chunks)
            except KvPullFailed as exc:
                self._end_pull(str(exc))
                return str(exc), num_bytes
            self._end_pull(_END)
        return None, num_bytes

    def _send_on(self, pull: KvPull, chunks: Iterator[pb.BlockChunk]) -> Iterator[pb.BlockChunk]:
        """Shard 0's chunks of ``chunks``; every other one is sent to its rank as it comes."""
        for chunk in chunks:
            if chunk.shard == 0:
                yield chunk
            elif 0 < chunk.shard < self.group.size:
                self.group.send_to(chunk.shard, chunk.SerializeToString())
            else:
                raise KvPullFailed(
                    f"kv pull from {pull.address}: a chunk of shard {chunk.shard}, outside this "
                    f"group's ranks 0..{self.group.size - 1}"
                )

    def _end_pull(self, reason: str | None) -> None:
        for rank in range(1, self.group.size):
            self.group.send_to(rank, reason)

    def _follow(self, pulls: list[KvPull], kv_caches: list[torch.Tensor]) -> tuple[str | None, int]:
        """Ranks >= 1: each pull's chunks as rank 0 sends them, written here; a chunk that does
        not fit fails this rank's pulls, which still take every message rank 0 sends. (this
        rank's reason or None, bytes written)."""
        error, num_bytes = None, 0
        for pull in pulls:
            relay = _Relay(self.group)
            try:
                num_bytes += write_chunks(kv_caches, pull, relay.chunks())
            except KvPullFailed as exc:
                if not relay.leader_failed:
                    error = error or str(exc)
                relay.drain()
            if relay.leader_failed:  # NOTE: rank 0 runs no further pull: neither does this rank
                break
        return error, num_bytes


class _Relay:
    """A rank's chunks of one pull, as its rank 0 sends them."""

    def __init__(self, group: ShardLink) -> None:
        self.group = group
        self.open = True  # rank 0 has more to send for this pull
        self.leader_failed = False

    def chunks(self) -> Iterator[pb.BlockChunk]:
        while self.open:
            message = self._next()
            if isinstance(message, bytes):
                yield pb.BlockChunk.FromString(message)
        if self.leader_failed:
            raise KvPullFailed("the pull failed on rank 0")

    def drain(self) -> None:
        """Takes the rest of the pull's messages (this rank stopped writing them)."""
        while self.open:
            self._next()

    def _next(self) -> Any:
        message = self.group.receive_from_leader()
        if not isinstance(message, bytes):
            self.open = False
            self.leader_failed = message is not _END
        return message
