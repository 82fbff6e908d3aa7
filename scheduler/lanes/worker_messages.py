"""The messages between the scheduler's front and its worker processes (`step_worker`), each way
over one pipe (`pipe_link`), many to a batch.

The front opens, feeds and stops the lanes of the executors it hands a worker, runs calls on
their schedulers, and acknowledges each batch of reports it has handled (the flow control of
`step_worker.ReportWindow`). A worker says once that it started, then reports every step of its
lanes (`step_frames.LaneReport`) and answers the calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from npuserve.proto.step_plan import ExecutorInfo
from npuserve.scheduler.core.request import Prefilled, Request, RequestStatus
from npuserve.scheduler.core.scheduler import Scheduler
from npuserve.scheduler.lanes.step_frames import LaneReport

# -- front -> worker ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OpenLane:
    """Starts a lane for an executor, its steps to that executor's process only."""

    lane_key: str  # the front's name for the lane (an executor may rejoin as a new lane)
    executor_id: str
    address: str
    info: ExecutorInfo
    instance_id: str  # the process the front's handshake found at ``address``


@dataclass(frozen=True, slots=True)
class SubmitRequests:
    """Requests the front placed on the lane (a worker without the lane reports them evacuated)."""

    lane_key: str
    requests: list[Request]


@dataclass(frozen=True, slots=True)
class FinishRequests:
    """Ends requests of the lane (aborted, or stopped by a stop string)."""

    lane_key: str
    req_ids: list[str]
    status: RequestStatus


@dataclass(frozen=True, slots=True)
class ReleaseHeld:
    """Frees what the lane holds for requests that go on, or ended, elsewhere: prefilled blocks,
    or requests of its own no longer wanted there (`Scheduler.release_held`)."""

    lane_key: str
    req_ids: list[str]


@dataclass(frozen=True, slots=True)
class StartDecode:
    """A request waiting in the lane for its KV was prefilled elsewhere: it pulls it, or computes
    it there (`Scheduler.start_decode`)."""

    lane_key: str
    prefilled: Prefilled


@dataclass(frozen=True, slots=True)
class TakeLaneDown:
    """The executor is gone: the lane's requests are evacuated."""

    lane_key: str
    reason: str


@dataclass(frozen=True, slots=True)
class StopLane:
    lane_key: str


@dataclass(frozen=True, slots=True)
class CallLane:
    """Runs ``fn`` on the lane's scheduler, between steps; answered by `CallReturned` or
    `CallRaised` with the same ``call_id``."""

    call_id: int
    lane_key: str
    fn: Callable[[Scheduler], object]  # picklable: a module-level function or a partial of one


@dataclass(frozen=True, slots=True)
class AckReports:
    """The front has handled one batch that held reports."""


@dataclass(frozen=True, slots=True)
class ExitWorker:
    """The scheduler is stopping: the worker closes its lanes and exits."""


FrontToWorker = (
    OpenLane
    | SubmitRequests
    | FinishRequests
    | ReleaseHeld
    | StartDecode
    | TakeLaneDown
    | StopLane
    | CallLane
    | AckReports
    | ExitWorker
)

# -- worker -> front ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerStarted:
    """The worker's loop runs: it has imported what it runs, and steps at full speed from here."""


@dataclass(frozen=True, slots=True)
class CallReturned:
    call_id: int
    value: object


@dataclass(frozen=True, slots=True)
class CallRaised:
    call_id: int
    message: str
    assertion: bool  # an AssertionError (an integrity check that failed), raised as one again


WorkerToFront = WorkerStarted | LaneReport | CallReturned | CallRaised
