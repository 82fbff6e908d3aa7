"""The engine's side of its scheduler worker processes (`--scheduler-workers`): their lane
reports in, with the tokens they packed for the API server processes passed on; their
acknowledgements out, held while those processes are behind; and a lost worker's requests moved
(or parked while it restarts), and the worker restarted with its executors."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

import structlog

from npuserve.scheduler.core.request import Request
from npuserve.scheduler.lanes.background import BackgroundTasks
from npuserve.scheduler.lanes.step_frames import LaneReport, RelayedPack, apply_report
from npuserve.scheduler.lanes.step_workers import RemoteLane, WorkerHandle
from npuserve.scheduler.lanes.worker_messages import AckReports

if TYPE_CHECKING:
    from npuserve.scheduler.engine.engine import Engine

log = structlog.get_logger(__name__)

__all__ = ["StreamProcesses", "WorkerRelay"]


class StreamProcesses(Protocol):
    """The API server processes that serve client streams (`api_relay.ApiProcessPool`), as the
    engine uses them."""

    def behind(self) -> bool:
        """Too many relayed tokens wait to be applied there: the workers' steps wait too."""

    def forward(self, key: tuple[int, int], pack: RelayedPack) -> None:
        """Tokens a worker packed for API process ``key`` (index, incarnation), passed on as
        they are (dropped if that incarnation is gone)."""

    async def delivered(self, requests: list[Request]) -> dict[str, list[int]]:
        """The output token ids each sequence's stream holds (absent: its process is gone)."""


class WorkerRelay:
    """Handles what an engine's scheduler workers report (event loop thread)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._held_acks: list[WorkerHandle] = []
        self._background = BackgroundTasks()

    def on_report(self, worker: WorkerHandle, report: LaneReport) -> None:
        """One lane report of a scheduler worker (event loop thread)."""
        engine = self.engine
        lane = worker.lanes.get(report.lane_key)
        if lane is None:
            return  # a lane the front has retired; its requests were placed again
        lane.absorb(report)
        if report.relayed:
            assert engine.stream_processes is not None, "tokens packed for API processes"
            for key, pack in report.relayed.items():  # NOTE: unopened: no per-token work here
                engine.stream_processes.forward(key, pack)
        num_tokens = sum(len(update[1]) for update in report.updates) + report.num_relayed_tokens
        event = apply_report(report, engine._sequences.get)
        engine._dispatch(lane, event, (report.num_sequences, num_tokens))

    def on_reports_handled(self, worker: WorkerHandle) -> None:
        """A worker's message of reports is handled: it is acknowledged."""
        engine = self.engine
        # NOTE: the worker's lanes wait while too many go unacknowledged; and so they do while
        # the processes serving client streams are behind (`--api-server-count`).
        if engine.stream_processes is not None and engine.stream_processes.behind():
            self._held_acks.append(worker)
        else:
            worker.send(AckReports())

    def streams_caught_up(self) -> None:
        """The processes serving client streams caught up: the workers held back step again."""
        held, self._held_acks = self._held_acks, []
        for worker in held:
            worker.send(AckReports())

    def on_worker_lost(self, worker: WorkerHandle) -> None:
        """A scheduler worker died: its lanes' requests move (or wait for its restart), and it
        is restarted with the same executors, which start clean (the first plan resets them)."""
        engine = self.engine
        assert engine.step_workers is not None
        lost = list(worker.lanes.values())
        lost_set = set(lost)
        for lane in lost:
            lane.alive = False
            if engine.lanes.get(lane.executor_id) is lane:
                del engine.lanes[lane.executor_id]
        engine._prefill_lanes_lost(lost_set)  # NOTE: their twins; the requests they decode move below
        requests = []
        for req_id, placed in list(engine._lane_of.items()):
            request = engine._sequences.get(req_id)
            if placed in lost_set and request is not None and not request.status.is_finished:
                engine._started(req_id)
                requests.append(request)
        log.error(
            "scheduler worker lost", worker=worker.index, executors=len(lost), requests_moved=len(requests)
        )
        engine._workers_restarting += 1
        reason = f"scheduler worker {worker.index} died"
        # NOTE: the worker sent the tokens of streams served by API processes straight to them:
        # those processes hold what this copy lacks (`Request.relay`).
        streamed = [r for r in requests if r.relay is not None]
        if streamed:
            self._background.spawn(self._take_output_and_fail_over(streamed, reason))
        held_here = [r for r in requests if r.relay is None]
        for request in held_here:
            request.reset_for_recompute()
        engine._fail_over(held_here, reason)
        self._background.spawn(self._restart_worker(worker, lost))

    async def _take_output_and_fail_over(self, requests: list[Request], reason: str) -> None:
        """Moves sequences whose tokens the lost worker sent straight to API processes, once
        those processes have said what they streamed (a process that is gone took its clients
        with it: its sequences end)."""
        engine = self.engine
        assert engine.stream_processes is not None
        try:
            outputs = await engine.stream_processes.delivered(requests)
        except Exception:
            log.exception("the API processes' outputs could not be taken", requests=len(requests))
            outputs = {}
        moving = []
        unrecovered = f"{reason}; its output could not be recovered"
        for request in requests:
            output = outputs.get(request.req_id)
            if output is None:  # it ends (unless it has already)
                engine._end_failed(request, unrecovered)
                continue
            request.take_output(output, None)
            request.reset_for_recompute()
            moving.append(request)
        log.info(
            "outputs taken from the API processes", requests=len(moving), lost=len(requests) - len(moving)
        )
        engine._fail_over(moving, reason)

    async def _restart_worker(self, worker: WorkerHandle, lanes: list[RemoteLane]) -> None:
        engine = self.engine
        assert engine.step_workers is not None
        try:
            # NOTE: serve's restart policy: 1 s, doubling while it keeps dying; a crash loop is given up.
            delay_s = worker.history.died()
            if delay_s is None:
                log.error(
                    "scheduler worker crash-looping; given up",
                    worker=worker.index,
                    deaths=worker.history.policy.describe(),
                )
                return
            await asyncio.sleep(delay_s)
            await asyncio.to_thread(engine.step_workers.restart, worker)
            for lane in lanes:
                if lane.executor_id not in engine.lanes:
                    engine.add_executor(lane.executor_id, lane.client, lane.info)
        except Exception:
            log.exception("scheduler worker restart failed", worker=worker.index)
        finally:
            engine._workers_restarting -= 1
            if not engine.live_lanes and not engine._workers_restarting:
                engine._place_parked("no scheduler worker came back")
