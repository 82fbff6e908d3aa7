"""What the engine, the router and the step loop share about a lane (one executor's requests and
steps): the `Lane` they use, the `LaneEvent` it reports, the `StepClient` its steps go through,
and whether a failed step means its executor is gone.

A lane is an `ExecutorLane` (`async_lane`: a task on an event loop of this process) or a
`RemoteLane` (`step_workers`: one in a scheduler worker process, seen through its reports).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from npuserve.proto.step_plan import StepPlan, StepResult, StepTimings
from npuserve.scheduler.core.block_hash import BlockHash
from npuserve.scheduler.core.request import Prefilled, Request, RequestStatus
from npuserve.scheduler.core.scheduler import RequestUpdate, Scheduler, StepStats

T = TypeVar("T")

# Step failures that mean the executor itself is gone (hung past the step timeout, or refusing
# this scheduler), whatever it answers after. Any other (INVALID_ARGUMENT, INTERNAL, and
# UNAVAILABLE: a connection that broke, which a network blip does as well as a death) is asked
# of the executor: `down_reason`.
EXECUTOR_DOWN_CODES = frozenset({"DEADLINE_EXCEEDED", "CANCELLED", "UNKNOWN", "UNAUTHENTICATED"})

# A lane's step in flight may take this long to end when the lane closes.
LANE_CLOSE_TIMEOUT_S = 5.0


def executor_is_down(exc: Exception) -> bool:
    return getattr(exc, "code", None) in EXECUTOR_DOWN_CODES


def down_reason(executor_id: str, exc: Exception, answers_health: bool) -> str | None:
    """Why a failed step means its executor is gone (None: the executor still serves, and the
    step's requests run again: `Scheduler.fail_step`).

    The status alone can say "gone" (`EXECUTOR_DOWN_CODES`), but not always when it is, nor
    when it is not: a stream whose executor was killed can end as INTERNAL from gRPC's own
    client (a write after the connection broke replaces the stream's status:
    `generate_many.LOST_STATUS_DETAILS`), and one whose connection reset under a live executor
    ends UNAVAILABLE. So any other failure leaves the executor in only while the same process
    still answers `Health` as serving (``answers_health``: asked after the failure, unless its
    status already says gone)."""
    if executor_is_down(exc):
        return f"executor {executor_id} is unreachable: {exc}"
    if not answers_health:
        return f"executor {executor_id} is unreachable (a step failed with {exc}, and it answers no health check)"
    return None


class PendingStep(Protocol):
    async def result(self) -> StepResult:
        """The step's next answer: an early one (`StepResult.partial`) or one of a step that
        joined it, where the client gives those, then its result."""


class StepClient(Protocol):
    """What a lane needs of an executor: the gRPC client (`AioExecutorClient`), or a runner in
    this process (`InProcessClient`). Its failures are `ExecutorError`s. ``address`` and
    ``instance_id`` name the executor process to others (where its blocks are pulled from;
    empty for a runner no other executor reaches)."""

    address: str
    instance_id: str

    async def submit(self, plan: StepPlan, early_results: bool = False) -> PendingStep: ...

    async def health(self) -> bool:
        """Whether the executor answers and serves, as the process the lane's steps went to."""

    async def close(self) -> None: ...


@dataclass(slots=True)
class LaneEvent:
    """Reported after every step, and when requests end or leave outside a step."""

    updates: list[RequestUpdate] = field(default_factory=list)
    ended: list[Request] = field(default_factory=list)  # aborted, stopped from outside, or failed
    error: str | None = None  # why `ended` requests failed (or why the executor went down)
    # Requests to place on another executor: this one went down (or was down when they came).
    evacuated: list[Request] = field(default_factory=list)
    lane_down: bool = False
    stats: StepStats | None = None
    step_seconds: float = 0.0
    executor_draining: bool = False  # the executor said so in its step's answer
    failed_step: bool = False  # a step failed while the executor still served (`_fail_steps`)
    joined_step: bool = False  # a step that ran inside another's pass landed (`StepPlan.joins_running`)
    timings: StepTimings | None = None  # what the executor measured of the step (its answer's)


class Lane(Protocol):
    """What the engine and the router use of a lane."""

    executor_id: str
    role: str  # the executor's (`ExecutorInfo.role`): prefill, decode or mixed
    alive: bool
    draining: bool  # set by the engine: no new requests, its own finish here
    queued_requests: int  # placed here without a token yet (kept by the engine)
    queued_blocks: int  # their prompts' blocks
    queued_prefill_blocks: int  # of those, the blocks not cached here when they were placed

    @property
    def client(self) -> StepClient:
        """The executor's client in this process: health checks, profiling."""

    @property
    def load(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def has_work(self) -> bool:
        """A step to send: requests, or finished ones the executor must still drop."""

    @property
    def num_running(self) -> int: ...

    @property
    def num_scheduler_steps(self) -> int:
        """The passes its steps run now (`--num-scheduler-steps`; under auto, the last choice)."""

    @property
    def num_used_blocks(self) -> int: ...

    @property
    def kv_usage(self) -> float: ...

    @property
    def prefix_stats(self) -> tuple[int, int]:
        """(prompt tokens looked up, of them found in the prefix cache)."""

    def cached_tier(self, block_hash: BlockHash) -> int:
        """Where the lane's pool holds a prefix-cache hash (`BlockPool.tier_of`)."""

    def start(self) -> None: ...

    async def aclose(self, timeout_s: float) -> None:
        """Ends the lane and closes its client."""

    def take_down(self, reason: str) -> None:
        """The executor left (its registration expired, say): every request is handed back."""

    def submit(self, requests: list[Request]) -> None: ...

    def finish(self, req_ids: list[str], status: RequestStatus) -> None: ...

    def release_held(self, req_ids: list[str]) -> None:
        """Frees, with no report, what the lane holds for requests that go on (or ended)
        elsewhere: prefilled blocks (pulled, or never to be), or requests of its own no longer
        wanted here (`Scheduler.release_held`)."""

    def start_decode(self, prefilled: Prefilled) -> None:
        """A request waiting here for its KV (`Request.remote_prefill`) starts: it pulls it from
        where it was prefilled, or computes it (`Scheduler.start_decode`)."""

    def call(self, fn: Callable[[Scheduler], T]) -> Future[T]:
        """Runs ``fn(scheduler)`` between the lane's steps (e.g. an integrity check)."""
