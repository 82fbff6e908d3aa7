"""Steps to a runner in this process (the `ModelRunner`, or the `SimulatedRunner`), for offline
use, for measuring what the gRPC split costs, and for in-process tests of the scheduler.

`InProcessClient` answers a lane as `AioExecutorClient` does over the step stream, and as the
executor's servicer runs a stream's steps (`executor/step_stream.py`): steps run in the order
sent, on a thread of their own (the runner's work never holds the event loop), and may be
pipelined; a multi-step plan's first-pass-only requests are answered after that pass when asked
(`early_results`); where the runner `joins_steps`, a step that joins the running one is taken
between its passes and answered after the pass it joined. The first failure ends the stream: the
steps sent after it are not run, and their results fail; the next step opens another.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from npuserve.proto.step_plan import PlanRunner, StepPlan, StepResult
from npuserve.scheduler.lanes.executor_client import ExecutorError


class _Stream:
    """The steps sent since the last failure: their answers, in order, to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.answers: asyncio.Queue[StepResult | ExecutorError] = asyncio.Queue()
        self.failed = False  # a step failed (set on the runner's thread): the rest are not run
        self.closed = False  # that failure was read (on the loop): the reads after it fail at once

    def answer(self, answer: StepResult | ExecutorError) -> None:
        """From the runner's thread."""
        with contextlib.suppress(RuntimeError):  # NOTE: the loop has closed: nobody waits
            self.loop.call_soon_threadsafe(self.answers.put_nowait, answer)


@dataclass(frozen=True, slots=True)
class _Sent:
    plan: StepPlan
    early_results: bool
    stream: _Stream


class _StepQueue:
    """The steps sent and not yet run, in order; None ends the runner's thread."""

    def __init__(self) -> None:
        self._steps: deque[_Sent | None] = deque()
        self._ready = threading.Condition()

    def put(self, step: _Sent | None) -> None:
        with self._ready:
            self._steps.append(step)
            self._ready.notify()

    def get(self) -> _Sent | None:
        with self._ready:
            self._ready.wait_for(lambda: self._steps)
            return self._steps.popleft()

    def take_if(self, wanted: Callable[[_Sent], bool]) -> _Sent | None:
        """The next step if it has come and is ``wanted``, without waiting."""
        with self._ready:
            if self._steps and (step := self._steps[0]) is not None and wanted(step):
                return self._steps.popleft()
            return None


class _Joining:
    """The steps that join a running one (`JoiningSteps`): those next in its stream that say so."""

    def __init__(self, steps: _StepQueue, stream: _Stream) -> None:
        self._steps, self._stream = steps, stream
        self.answer = stream.answer

    def take(self, max_tokens: int) -> StepPlan | None:
        step = self._steps.take_if(
            lambda step: (
                step.stream is self._stream
                and step.plan.joins_running
                and step.plan.total_num_scheduled_tokens <= max_tokens
            )
        )
        return None if step is None else step.plan


class _PendingStep:
    def __init__(self, client: InProcessClient, stream: _Stream) -> None:
        self.client = client
        self.stream = stream

    async def result(self) -> StepResult:
        stream = self.stream
        if stream.closed:
            raise ExecutorError("CANCELLED", "the step stream was closed after a failed step")
        answer = await stream.answers.get()
        if isinstance(answer, ExecutorError):
            stream.closed = True
            self.client.close_stream(stream)
            raise answer
        return answer


class InProcessClient:
    """Steps to ``runner``, run in order on a thread of the client's (see the module)."""

    def __init__(self, runner: PlanRunner, address: str = "") -> None:
        self.runner = runner
        self.address = address  # where other executors reach the runner (none: empty)
        self.instance_id = ""
        self._joins_steps = runner.info().joins_steps
        self._steps = _StepQueue()
        self._stream: _Stream | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    async def submit(self, plan: StepPlan, early_results: bool = False) -> _PendingStep:
        """Queues a step for the runner (read its answers with ``.result()``, in order)."""
        if self._closed:
            raise ExecutorError("UNAVAILABLE", "the in-process executor is closed")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="in-process-executor", daemon=True)
            self._thread.start()
        if self._stream is None:
            self._stream = _Stream(asyncio.get_running_loop())
        stream = self._stream
        self._steps.put(_Sent(plan, early_results and plan.has_first_pass_only, stream))
        return _PendingStep(self, stream)

    async def health(self) -> bool:
        """A runner in this process serves while the client is open."""
        return not self._closed

    def close_stream(self, stream: _Stream) -> None:
        """Ends ``stream`` if it is still the open one: the next step opens another."""
        if self._stream is stream:
            self._stream = None

    async def close(self) -> None:
        """Ends the runner's thread once the step it runs (if any) is done."""
        if not self._closed:
            self._closed = True
            self._steps.put(None)

    def _run(self) -> None:
        while (step := self._steps.get()) is not None:
            stream = step.stream
            if stream.failed:
                continue
            joining = _Joining(self._steps, stream) if self._joins_steps and step.plan.num_steps else None
            try:
                result = self.runner.execute(
                    step.plan, stream.answer if step.early_results else None, joining
                )
            except ExecutorError as exc:
                stream.failed = True
                stream.answer(exc)
            except Exception as exc:  # as the executor's servicer reports anything unexpected
                stream.failed = True
                stream.answer(ExecutorError("INTERNAL", f"{type(exc).__name__}: {exc}"))
            else:
                stream.answer(result)
