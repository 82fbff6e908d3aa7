"""Fail-over: the requests of an executor that is lost move to the others, each resuming from
the tokens it has; one that has lost too many executors (`MAX_FAILOVERS`), or finds none left,
fails. While a scheduler worker restarts and no other lane is up, they wait for it (parked).
A mixin of `Engine`, which provides what is declared here."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog

from npuserve.scheduler.core.request import Request, RequestStatus
from npuserve.scheduler.engine.engine_config import NoExecutorError
from npuserve.scheduler.engine.engine_metrics import MetricsRecorder

if TYPE_CHECKING:
    from npuserve.scheduler.engine.client_request import ClientRequest
    from npuserve.scheduler.lanes.lane import Lane

log = structlog.get_logger(__name__)

__all__ = ["MAX_FAILOVERS", "FailOver"]

MAX_FAILOVERS = 3  # executors a request may lose before it fails


class FailOver:
    recorder: MetricsRecorder
    _clients: dict[str, ClientRequest]
    _client_of_seq: dict[str, ClientRequest]  # req_id of a sequence -> its client request
    # Requests of a lost scheduler worker, held while it restarts when no other lane is left.
    _parked: list[Request]
    _workers_restarting: int

    if TYPE_CHECKING:  # provided by `Engine`

        @property
        def live_lanes(self) -> list[Lane]: ...

        @property
        def routable_lanes(self) -> list[Lane]: ...

        def _place(self, siblings: list[Request]) -> Lane: ...

        def _forget_if_finished(self, client: ClientRequest) -> None: ...

    def _mark_failed(self, request: Request) -> None:
        """A sequence that cannot go on: it failed, its matcher is freed, its finish counted."""
        request.status = RequestStatus.FINISHED_ERROR
        if request.grammar is not None:
            request.grammar.release()
        self.recorder.record_finish(request, "error", time.monotonic())

    def _end_failed(self, request: Request, why: str) -> None:
        """Ends one sequence that cannot go on (unless it has already ended) with ``why``."""
        client = self._client_of_seq.get(request.req_id)
        if client is not None and not request.status.is_finished:
            self._mark_failed(request)
            client.end(request, RequestStatus.FINISHED_ERROR, why)
            self._forget_if_finished(client)

    def _fail_over(self, requests: list[Request], reason: str, count: bool = True) -> None:
        """Moves requests of a lost executor to others; each resumes from the tokens it has.
        While a scheduler worker restarts and no other lane is up, they wait for it."""
        if requests and not self.live_lanes and self._workers_restarting:
            self._parked.extend(requests)
            return
        by_client: dict[ClientRequest, list[Request]] = {}
        for request in requests:
            client = self._client_of_seq.get(request.req_id)
            if client is not None and client.request_id in self._clients:  # else: aborted meanwhile
                by_client.setdefault(client, []).append(request)
            elif request.grammar is not None:
                request.grammar.release()
        for client, siblings in by_client.items():
            if count:
                for request in siblings:
                    request.num_failovers += 1
            available = bool(self.routable_lanes)
            if not available or siblings[0].num_failovers > MAX_FAILOVERS:
                why = "no executor is available" if not available else f"lost {MAX_FAILOVERS} executors"
                for request in siblings:
                    self._mark_failed(request)
                if not available and not client.started:
                    # NOTE: nothing was sent: to the client this is a request that came while no
                    # executor was up (UNAVAILABLE, HTTP 503 with Retry-After), not a failed one.
                    client.refuse(NoExecutorError(f"{why} ({reason}); retry once one has joined"))
                else:
                    for request in siblings:
                        client.end(request, RequestStatus.FINISHED_ERROR, f"{why} ({reason})")
                self._forget_if_finished(client)
                continue
            lane = self._place(siblings)
            log.info(
                "requests moved", request_id=client.request_id, to_executor=lane.executor_id, reason=reason
            )

    def _place_parked(self, reason: str) -> None:
        """Places the requests parked while a scheduler worker restarted (a lane is up again)."""
        if self._parked:
            parked, self._parked = self._parked, []
            self._fail_over(parked, reason, count=False)
