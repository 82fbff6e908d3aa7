"""One `StepStream` call run as a pipeline: the scheduler's steps are read and decoded on one
thread, run in order on another, and their answers encoded and sent by the call's handler.

The scheduler's async scheduling sends step N+1 while the executor runs step N. Run in the
call's handler alone, step N+1 would wait, after step N, for N's answer to be encoded and sent
and for N+1 to be received and decoded, with two hand-offs between gRPC's threads. Here the step
thread takes the next plan as soon as it finishes a step, and the reading, encoding and sending
overlap the next step's run. On stories260K over gRPC (`npuserve bench --compare
offline,grpc-stream`, 2 cores) the step thread's idle time between decode steps went from
0.7-2.0 ms to 0.19-0.25 ms (medians per round). There, with the scheduler and the client on the
same two cores, the work moved into the steps (a decode step took 1.43x its thread's CPU time,
as before, and tokens/s stayed within the noise): it pays where the executor has cores to
spare, or waits on its device while the answers are written.

Order is the stream's: answers go back in the order the steps came, a step's early answer
(`early_results`) before its result, except that a step that joins the running one
(`StepPlan.joins_running`) is taken before one of that one's passes (its first, when it came
before that step began) and answered after the pass it joined, before the running step's result; a failure (a plan that cannot be read, a step that fails, a
broken request stream) is raised by `answers` after the answers of the steps before it, and ends
the stream there: the steps after it are not run.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar, cast

from npuserve.proto import executor_pb2 as pb
from npuserve.proto.step_plan import FirstPassAnswer, JoiningSteps, StepPlan, StepResult

# A step as read: its plan, and whether its first pass's result is answered early.
ReadStep = Callable[[pb.StepRequest], tuple[StepPlan, bool]]
RunStep = Callable[[StepPlan, FirstPassAnswer | None, JoiningSteps | None], StepResult]
AnswerStep = Callable[[StepResult], pb.StepResponse]

T = TypeVar("T")
_END: Any = object()  # the request stream ended; no more answers
_NONE: Any = object()  # nothing held back (`_Channel.take_if`)


class _Channel(Generic[T]):
    """A queue from one thread to another that carries a failure, or the end, in order."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._held: Any = _NONE  # looked at by `take_if` and not taken: `get` gives it first

    def put(self, item: T | BaseException) -> None:
        """An item, or a failure that `get` raises in its place."""
        self._queue.put(item)

    def end(self) -> None:
        self._queue.put(_END)

    def get(self) -> T | None:
        """The next item, waiting for it; None at the end; raises a failure put in its place.
        One reader only (as for `take_if`)."""
        item, self._held = self._held, _NONE
        if item is _NONE:
            item = self._queue.get()
        if item is _END:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def take_if(self, wanted: Callable[[T], bool]) -> T | None:
        """The next item if it has come and is ``wanted``, without waiting; else None, and the
        item (or the end, or a failure) stays next for `get`."""
        if self._held is _NONE:
            try:
                self._held = self._queue.get_nowait()
            except queue.Empty:
                return None
        item = self._held
        if item is _END or isinstance(item, BaseException) or not wanted(item):
            return None
        self._held = _NONE
        return cast(T, item)


class _Joining:
    """The steps that join the one the step thread runs (`JoiningSteps`): those next in the
    stream that say so, taken between its passes; their answers go out in the stream's order."""

    def __init__(self, steps: _Channel[tuple[StepPlan, bool]], results: _Channel[StepResult]) -> None:
        self._steps, self._results = steps, results

    def take(self, max_tokens: int) -> StepPlan | None:
        step = self._steps.take_if(
            lambda step: step[0].joins_running and step[0].total_num_scheduled_tokens <= max_tokens
        )
        return None if step is None else step[0]

    def answer(self, result: StepResult) -> None:
        self._results.put(result)


class StepStreamPipeline:
    """The steps of one StepStream call, read, run and answered on three threads (see above).

    The call's handler iterates `answers` and calls `close` when it is done (the client went
    away, or the stream ended): a step that is running then finishes, and no further step runs.
    """

    def __init__(
        self, requests: Iterator[pb.StepRequest], read: ReadStep, run: RunStep, answer: AnswerStep
    ) -> None:
        self._read, self._run, self._answer = read, run, answer
        self._steps: _Channel[tuple[StepPlan, bool]] = _Channel()
        self._results: _Channel[StepResult] = _Channel()
        self._closed = False
        threading.Thread(
            target=self._read_steps, args=(requests,), name="step-stream-read", daemon=True
        ).start()
        threading.Thread(target=self._run_steps, name="step-stream-run", daemon=True).start()

    def answers(self) -> Iterator[pb.StepResponse]:
        """Each step's answers, in order (raises the stream's failure where it comes)."""
        while (result := self._results.get()) is not None:
            yield self._answer(result)

    def close(self) -> None:
        self._closed = True
        self._steps.end()  # NOTE: wakes the step thread if it waits for a step

    def _read_steps(self, requests: Iterator[pb.StepRequest]) -> None:
        try:
            for request in requests:
                self._steps.put(self._read(request))
                if self._closed:
                    return
        except BaseException as exc:  # NOTE: a plan that cannot be read, or the stream broke
            self._steps.put(exc)
        else:
            self._steps.end()

    def _run_steps(self) -> None:
        results = self._results
        joining = _Joining(self._steps, results)
        try:
            while not self._closed and (step := self._steps.get()) is not None:
                plan, early_results = step
                results.put(self._run(plan, results.put if early_results else None, joining))
        except BaseException as exc:
            results.put(exc)
        else:
            results.end()
