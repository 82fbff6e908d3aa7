"""Work that may run away or crash, run in killable worker processes: chat templates, grammars.

A chat template is code, and pure-Python rendering can neither be interrupted from another thread
nor share the scheduler's core without slowing its steps; a grammar compile runs native code that
a hostile grammar can keep busy for minutes or crash outright (llguidance overflows its stack on
a chain of a few thousand rules). Each job therefore runs in a worker process, one job at a time:
a job that runs past `timeout_s` has its worker killed and replaced, a worker that dies on a job
fails that job alone and is replaced, and a worker may grow by at most `memory_bytes` of address
space beyond what its setup left (beyond that an allocation fails inside the job). Jobs wait for
a free worker of their pool (or fail at once, UNAVAILABLE, while no worker runs and none can
start). Each pool serves one kind of job; the engine keeps the model's template, clients'
templates and grammars in separate pools, so one cannot hold up another.

A pool's `setup` is what a worker runs once it has started: a picklable callable (a module-level
function, or a `functools.partial` of one) that returns the job handler. A handler answers a
`JobAnswer`; `run` gives the job's `Outcome` (`sandbox_outcomes`).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.connection
import os
import resource
import signal
from collections.abc import Callable
from multiprocessing.context import SpawnProcess
from pathlib import Path
from typing import Any

import structlog

from npuserve.scheduler.lanes.background import BackgroundTasks
from npuserve.scheduler.text.sandbox_outcomes import (
    JobAnswer,
    JobTimedOut,
    Outcome,
    WorkerDied,
    WorkerReady,
)

log = structlog.get_logger(__name__)

JOB_TIMEOUT_S = 5.0
WORKER_MEMORY_BYTES = 1 << 30
WORKER_START_TIMEOUT_S = 60.0
WORKER_START_RETRY_S = 1.0


class SandboxUnavailable(RuntimeError):
    """No worker of a pool runs and the last one to start failed (gRPC UNAVAILABLE, HTTP 503):
    a job fails at once rather than waiting for a worker that may never come."""


Setup = Callable[[], Callable[[Any], JobAnswer]]  # a worker's setup, returning its job handler


def _serve(conn: multiprocessing.connection.Connection, setup: Setup, role: str, memory_bytes: int) -> None:
    """A worker's main loop: run each job received, answer its outcome; end on EOF."""
    from npuserve.deploy.runtime.process_name import set_process_name

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the scheduler decides when workers end
    set_process_name(role)
    handler = setup()
    statm = Path("/proc/self/statm")  # its first field: the address space's size, in pages
    if statm.is_file():  # NOTE: the limit counts from what the setup left
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        soft = int(statm.read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE") + memory_bytes
        resource.setrlimit(
            resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard)
        )
    conn.send(WorkerReady())
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(handler(job))  # NOTE: an exception ends the worker: its job's outcome is WorkerDied


class _Worker:
    """One worker process and the parent's end of its pipe (blocking calls: use from a thread)."""

    def __init__(self, setup: Setup, role: str, memory_bytes: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process: SpawnProcess = context.Process(
            target=_serve, args=(child, setup, role, memory_bytes), name=role, daemon=True
        )
        self.process.start()
        child.close()
        # NOTE: a job's time starts once the worker has imported and set up what it needs.
        try:
            ready = self.conn.poll(WORKER_START_TIMEOUT_S) and isinstance(self.conn.recv(), WorkerReady)
        except (EOFError, OSError):
            ready = False
        if not ready:
            self.kill()
            raise RuntimeError(
                f"a {role} worker did not start in {WORKER_START_TIMEOUT_S:g} s "
                f"(exit code {self.process.exitcode})"
            )

    def call(self, job: object, timeout_s: float) -> Outcome:
        """The job's outcome: the handler's answer, JobTimedOut past `timeout_s`, WorkerDied when
        the worker ended."""
        try:
            self.conn.send(job)
            if not self.conn.poll(timeout_s):
                return JobTimedOut()
            answer: JobAnswer = self.conn.recv()
            return answer
        except (EOFError, OSError):
            return WorkerDied()

    def kill(self) -> None:
        if self.process.pid is not None and self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(5)
        self.conn.close()


class SandboxPool:
    """`size` workers that run `setup`'s handler; `run` waits for a free one. Start on the event
    loop with `start`. ``role`` names the workers' processes (`deploy.process_name`) and logs."""

    def __init__(
        self,
        name: str,
        size: int,
        setup: Setup,
        role: str,
        timeout_s: float = JOB_TIMEOUT_S,
        memory_bytes: int = WORKER_MEMORY_BYTES,
    ) -> None:
        self.name = name
        self.size = size
        self.setup = setup
        self.role = role
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self._idle: asyncio.Queue[_Worker] | None = None
        self._workers: set[_Worker] = set()
        self._background = BackgroundTasks()
        self._closed = False
        self._start_error: str | None = None  # why the last worker to start failed, until one starts
        self._first_tries: list[asyncio.Future[None]] = []  # done once `start`'s workers tried once

    @property
    def worker_pids(self) -> set[int]:
        """Process ids of the started workers."""
        return {w.process.pid for w in self._workers if w.process.pid is not None}

    def start(self) -> None:
        """Starts the workers in the background (a spawned interpreter takes a moment)."""
        self._idle = asyncio.Queue()
        self._first_tries = [asyncio.get_running_loop().create_future() for _ in range(self.size)]
        for first_try in self._first_tries:
            self._background.spawn(self._add_worker(first_try))

    async def wait_started(self) -> None:
        """Returns once each of `start`'s workers has started, or failed to (and is retried);
        at once for a pool that was not started."""
        await asyncio.gather(*self._first_tries)

    def close(self) -> None:
        """Kills the workers (a worker still starting is killed once it has started)."""
        self._closed = True
        for worker in list(self._workers):
            worker.kill()
        self._workers.clear()

    async def run(self, job: object) -> Outcome:
        """The job's outcome (see the module's doc); SandboxUnavailable while no worker runs and
        none can start."""
        assert self._idle is not None, "SandboxPool.start() was not called"
        while True:
            if self._idle.empty() and not self._workers and self._start_error is not None:
                raise SandboxUnavailable(
                    f"no {self.role} worker can start ({self._start_error}); retry later"
                )
            try:
                worker = await asyncio.wait_for(self._idle.get(), WORKER_START_RETRY_S)
                break
            except asyncio.TimeoutError:  # NOTE: not the builtin before Python 3.11
                continue  # NOTE: a timed-out `get` took no worker (it takes one only once woken)
        # NOTE: the call runs to its end even when its caller is cancelled meanwhile: the worker
        # must finish (or be killed) before another job may use it.
        return await asyncio.shield(self._call(worker, job))

    async def _call(self, worker: _Worker, job: object) -> Outcome:
        outcome = await asyncio.to_thread(worker.call, job, self.timeout_s)
        if isinstance(outcome, JobTimedOut | WorkerDied):
            why = type(outcome).__name__
            log.warning("a sandboxed job was stopped", role=self.role, pool=self.name, why=why)
            self._workers.discard(worker)
            await asyncio.to_thread(worker.kill)
            self._background.spawn(self._add_worker())
        else:
            self._release(worker)
        return outcome

    async def _add_worker(self, first_try: asyncio.Future[None] | None = None) -> None:
        """Starts a worker, trying until one starts; ``first_try`` is done once the first try ended."""
        while not self._closed:
            try:
                worker = await asyncio.to_thread(_Worker, self.setup, self.role, self.memory_bytes)
            except (RuntimeError, OSError) as exc:
                log.error("a worker did not start; retrying", role=self.role, pool=self.name, error=str(exc))
                self._start_error = str(exc)
                if first_try is not None and not first_try.done():
                    first_try.set_result(None)
                await asyncio.sleep(WORKER_START_RETRY_S)
                continue
            self._start_error = None
            self._workers.add(worker)
            self._release(worker)
            break
        if first_try is not None and not first_try.done():
            first_try.set_result(None)

    def _release(self, worker: _Worker) -> None:
        if self._closed:
            worker.kill()
        else:
            assert self._idle is not None
            self._idle.put_nowait(worker)
