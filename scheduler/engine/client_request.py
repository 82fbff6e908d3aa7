"""The engine's record of one client request: its sibling sequences and where their outputs go."""

from __future__ import annotations

from npuserve.proto.step_plan import TokenLogprobs
from npuserve.scheduler.core.request import Request, RequestStatus
from npuserve.scheduler.engine.outputs import OutputSink, SequenceUpdate


class ClientRequest:
    """A client request's ``n`` sequences (`Request`s the engine schedules) and the sink that
    turns their tokens into the client's stream (a `RequestStream`, or a relay to the API server
    process that serves the stream)."""

    def __init__(self, request_id: str, children: list[Request], sink: OutputSink) -> None:
        self.request_id = request_id
        self.children = children
        self.index_of = {child.req_id: index for index, child in enumerate(children)}
        self.sink = sink
        self.started = False  # the client has been sent something
        self._finished = [False] * len(children)
        self._num_unfinished = len(children)

    @property
    def finished(self) -> bool:
        return self._num_unfinished == 0

    def is_finished(self, index: int) -> bool:
        return self._finished[index]

    def mark_finished(self, index: int) -> bool:
        """Marks the sequence at ``index`` finished; False if it was already."""
        if self._finished[index]:
            return False
        self._finished[index] = True
        self._num_unfinished -= 1
        return True

    @staticmethod
    def _update(
        index: int,
        request: Request,
        token_ids: list[int],
        logprobs: list[TokenLogprobs | None],
        finished: RequestStatus | None,
        error: str | None,
    ) -> SequenceUpdate:
        return SequenceUpdate(
            index,
            token_ids,
            logprobs,
            None if finished is None else finished.value,
            request.stop_reason,
            error,
            request.num_output_tokens,
            request.num_cached_tokens,
        )

    def deliver(
        self,
        request: Request,
        token_ids: list[int],
        logprobs: list[TokenLogprobs | None],
        finished: RequestStatus | None,
    ) -> str | None:
        """A step's new tokens of one sequence; returns the stop string that ended it, if one
        did where the stream is served in this process."""
        index = self.index_of[request.req_id]  # NOTE: once per token: looked up once
        if self._finished[index]:
            return None
        self.started = True
        stop = self.sink.add(self._update(index, request, token_ids, logprobs, finished, request.error))
        if finished is not None or stop is not None:
            self.mark_finished(index)
        return stop

    def end(self, request: Request, status: RequestStatus, error: str | None) -> None:
        """A sequence ended outside a step (aborted, or its executor failed)."""
        index = self.index_of[request.req_id]
        if not self.mark_finished(index):
            return
        self.started = True
        self.sink.end(self._update(index, request, [], [], status, error))

    def refuse(self, refusal: Exception) -> None:
        """Ends a request that has sent nothing yet with ``refusal`` as the client's status."""
        for index in range(len(self.children)):
            self.mark_finished(index)
        self.sink.refuse(refusal)
