"""What rank 0 of a tensor-parallel group sends the other ranks (`RankGroup.send`), one type each:
they act on each in order, in lockstep with rank 0 (`parallel.run_follower`)."""

from __future__ import annotations

from dataclasses import dataclass

from npuserve.proto.step_plan import StepPlan


@dataclass(frozen=True, slots=True)
class RunStep:
    """Run this step, as rank 0 does."""

    plan: StepPlan


@dataclass(frozen=True, slots=True)
class ReadShards:
    """Give rank 0 this rank's shard of these blocks of one layer (`gather_shards`), for another
    group's pull."""

    layer: int
    block_ids: list[int]


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Rank 0 is alive and idle: the others' receive does not time out."""


@dataclass(frozen=True, slots=True)
class StopRanks:
    """The group stops."""


RankMessage = RunStep | ReadShards | Heartbeat | StopRanks
