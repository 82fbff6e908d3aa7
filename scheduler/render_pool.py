"""Chat templates rendered in worker processes, bounded in time, memory and output size.

A template is code, and pure-Python rendering can neither be interrupted from another thread nor
share the scheduler's core without slowing its steps. Each render therefore runs in a worker
process, one render at a time: a render that runs past `timeout_s` has its worker killed and
replaced, and a worker may grow by at most `memory_bytes` of address space (beyond that an
allocation fails with MemoryError inside the template). Output size is bounded by
`chat_template.render` itself. Renders wait for a free worker of their pool (or fail at once,
UNAVAILABLE, while no worker runs and none can start); the engine keeps the model's template and
clients' templates in separate pools, so the second cannot hold up the first.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.connection
import os
import resource
import signal
from multiprocessing.context import SpawnProcess
from pathlib import Path

import structlog

from npuserve.scheduler.background import BackgroundTasks
from npuserve.scheduler.chat_template import ChatRender, ChatTemplateError, render
from npuserve.scheduler.tokenizer import TokenizerError

log = structlog.get_logger(__name__)

RENDER_TIMEOUT_S = 5.0
RENDER_MEMORY_BYTES = 1 << 30
WORKER_START_TIMEOUT_S = 60.0
WORKER_START_RETRY_S = 1.0


class RenderUnavailable(RuntimeError):
    """No render worker runs and the last one to start failed (gRPC UNAVAILABLE, HTTP 503):
    a render fails at once rather than waiting for a worker that may never come."""


# What a worker answers: ("ok", text) or ("error", message, field).
# What a call gives: one of those, ("timeout",) or ("died",).
Outcome = tuple[str, ...]


def _serve(conn: multiprocessing.connection.Connection, memory_bytes: int) -> None:
    """A worker's main loop: render each job received, answer its outcome; end on EOF."""
    from npuserve.deploy.process_name import CHAT_RENDER, set_process_name

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the scheduler decides when workers end
    set_process_name(CHAT_RENDER)
    _limit_address_space(memory_bytes)
    conn.send(("ready",))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        outcome: Outcome
        try:
            outcome = ("ok", render(job))
        except ChatTemplateError as exc:
            outcome = ("error", str(exc), exc.field or "")
        except MemoryError:
            outcome = ("error", "the chat template used more memory than allowed", job.field or "")
        conn.send(outcome)


def _limit_address_space(memory_bytes: int) -> None:
    status = Path("/proc/self/status")
    if not status.is_file():
        return
    size_kb = next(
        int(line.split()[1]) for line in status.read_text().splitlines() if line.startswith("VmSize:")
    )
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = size_kb * 1024 + memory_bytes
    resource.setrlimit(
        resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard)
    )


class _Worker:
    """One worker process and the parent's end of its pipe (blocking calls: use from a thread)."""

    def __init__(self, memory_bytes: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process: SpawnProcess = context.Process(
            target=_serve, args=(child, memory_bytes), name="npuserve-render", daemon=True
        )
        self.process.start()
        child.close()
        # NOTE: a render's time starts once the worker has imported what it needs.
        try:
            ready = self.conn.poll(WORKER_START_TIMEOUT_S) and self.conn.recv() == ("ready",)
        except (EOFError, OSError):
            ready = False
        if not ready:
            self.kill()
            raise RuntimeError(
                f"a chat template worker did not start in {WORKER_START_TIMEOUT_S:g} s "
                f"(exit code {self.process.exitcode})"
            )

    def call(self, job: ChatRender, timeout_s: float) -> Outcome:
        """The job's outcome; ("timeout",) past `timeout_s`, ("died",) when the worker ended."""
        try:
            self.conn.send(job)
            if not self.conn.poll(timeout_s):
                return ("timeout",)
            return self.conn.recv()
        except (EOFError, OSError):
            return ("died",)

    def kill(self) -> None:
        if self.process.pid is not None and self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(5)
        self.conn.close()


class RenderPool:
    """`size` render workers; `render` waits for a free one. Start on the event loop with `start`."""

    def __init__(
        self,
        name: str,
        size: int,
        timeout_s: float = RENDER_TIMEOUT_S,
        memory_bytes: int = RENDER_MEMORY_BYTES,
    ) -> None:
        self.name = name
        self.size = size
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self._idle: asyncio.Queue[_Worker] | None = None
        self._workers: set[_Worker] = set()
        self._background = BackgroundTasks()
        self._closed = False
        self._start_error: str | None = None  # why the last worker to start failed, until one starts
        self._first_starts_left = size  # workers whose first start has not succeeded or failed yet
        self._first_starts_done: asyncio.Event | None = None  # from `start` on

    @property
    def worker_pids(self) -> set[int]:
        """Process ids of the started workers."""
        return {w.process.pid for w in self._workers if w.process.pid is not None}

    def start(self) -> None:
        """Starts the workers in the background (a spawned interpreter takes a moment)."""
        self._idle = asyncio.Queue()
        self._first_starts_done = asyncio.Event()
        for _ in range(self.size):
            self._background.spawn(self._add_worker(first=True))
        if not self.size:
            self._first_starts_done.set()

    async def wait_started(self) -> None:
        """Returns once each of `start`'s workers has started, or failed to (and is retried);
        at once for a pool that was not started."""
        if self._first_starts_done is not None:
            await self._first_starts_done.wait()

    def close(self) -> None:
        """Kills the workers (a worker still starting is killed once it has started)."""
        self._closed = True
        for worker in list(self._workers):
            worker.kill()
        self._workers.clear()

    async def render(self, job: ChatRender) -> str:
        """The rendered text; TokenizerError when the template fails or exceeds a limit."""
        worker = await self._free_worker()
        # NOTE: the call runs to its end even when this request is cancelled meanwhile: the worker
        # must finish (or be killed) before another render may use it.
        outcome = await asyncio.shield(self._call(worker, job))
        if outcome[0] == "timeout":
            raise TokenizerError(
                f"the chat template took longer than {self.timeout_s:g} s to render", job.field
            )
        if outcome[0] == "died":
            raise TokenizerError("the chat template ended its render process (out of memory?)", job.field)
        if outcome[0] == "error":
            raise TokenizerError(outcome[1], outcome[2] or None)
        return outcome[1]

    async def _free_worker(self) -> _Worker:
        """The next free worker; RenderUnavailable while none runs and none can start."""
        assert self._idle is not None, "RenderPool.start() was not called"
        while True:
            if self._idle.empty() and not self._workers and self._start_error is not None:
                raise RenderUnavailable(
                    f"no chat template worker can start ({self._start_error}); retry later"
                )
            try:
                return await asyncio.wait_for(self._idle.get(), WORKER_START_RETRY_S)
            except asyncio.TimeoutError:  # NOTE: not the builtin before Python 3.11
                continue  # NOTE: a timed-out `get` took no worker (it takes one only once woken)

    async def _call(self, worker: _Worker, job: ChatRender) -> Outcome:
        outcome = await asyncio.to_thread(worker.call, job, self.timeout_s)
        if outcome[0] in ("timeout", "died"):
            log.warning("chat template render stopped", pool=self.name, why=outcome[0])
            self._workers.discard(worker)
            await asyncio.to_thread(worker.kill)
            self._background.spawn(self._add_worker())
        else:
            self._release(worker)
        return outcome

    async def _add_worker(self, first: bool = False) -> None:
        while not self._closed:
            try:
                worker = await asyncio.to_thread(_Worker, self.memory_bytes)
            except (RuntimeError, OSError) as exc:
                log.error("a chat template worker did not start; retrying", pool=self.name, error=str(exc))
                self._start_error = str(exc)
                if first:
                    self._first_start_ended()
                    first = False
                await asyncio.sleep(WORKER_START_RETRY_S)
                continue
            self._start_error = None
            self._workers.add(worker)
            self._release(worker)
            if first:
                self._first_start_ended()
            return

    def _first_start_ended(self) -> None:
        """One of `start`'s workers started, or failed its first try."""
        self._first_starts_left -= 1
        if not self._first_starts_left and self._first_starts_done is not None:
            self._first_starts_done.set()

    def _release(self, worker: _Worker) -> None:
        if self._closed:
            worker.kill()
        else:
            assert self._idle is not None
            self._idle.put_nowait(worker)
