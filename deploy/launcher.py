"""Starting `npuserve` processes: `npuserve serve`, the benchmarks, tensor-parallel ranks and
the tests all launch their children here.

A child is the same Python running ``npuserve.deploy.cli`` (or another npuserve module) with
``--ready-file``, which it writes (`proto.ready_file`) once it serves. Children are stopped
together (SIGTERM, then SIGKILL after a grace period), and (Linux) through the parent-death
signal when the launcher itself dies: no orphan survives it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import structlog

from npuserve.proto.ready_file import read_ready_file

log = structlog.get_logger(__name__)

CLI_MODULE = "npuserve.deploy.cli"
PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 10.0
LOG_TAIL_CHARS = 3000


def _child_setup(nice: int, own_process_group: bool) -> None:  # pragma: no cover - in the child
    """Before exec, in a Linux child: it dies with its parent (SIGTERM), leads a process group of
    its own if asked (still writing to the terminal), and runs ``nice`` lower (before any thread
    starts, so every thread it makes inherits it)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if own_process_group:
        os.setpgid(0, 0)
        # NOTE: out of the terminal's foreground group, a write to it stops the child where the
        # terminal says `tostop`; ignored, the signal lets the write through (and exec keeps it).
        signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    if nice:
        os.nice(nice)


def python_module(module: str = CLI_MODULE) -> list[str]:
    """The command that runs ``module`` with this Python."""
    return [sys.executable, "-m", module]


def device_env(device: str, index: int, count: int, tp_size: int = 1) -> dict[str, str]:
    """Pins executor ``index`` to its ``tp_size`` devices when several share the machine: on npu
    to the ``index``-th group of the NPUs this process sees, so each executor uses its own."""
    if count == 1 or device not in ("npu", "cuda"):
        return {}
    positions = range(index * tp_size, (index + 1) * tp_size)
    if device == "npu":
        from npuserve.executor.npu_devices import VISIBLE_ENV, visible_npu_ids

        visible = visible_npu_ids()
        if len(visible) < count * tp_size:
            raise LaunchError(
                f"{count} executors x --tensor-parallel-size {tp_size} need {count * tp_size} NPUs but "
                f"{len(visible)} are visible ({VISIBLE_ENV}, /dev/davinci*); lower --num-executors"
            )
        return {VISIBLE_ENV: ",".join(str(visible[p]) for p in positions)}
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(p) for p in positions)}


class LaunchError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class Launch:
    """How a child was started, to start it again."""

    args: tuple[str, ...]
    env: dict[str, str] | None
    command: tuple[str, ...] | None
    ready_file: bool
    own_process_group: bool
    nice: int = 0


@dataclass
class Child:
    """One started process; its output goes to ``log_path`` (None: the launcher's own)."""

    name: str
    process: subprocess.Popen[bytes]
    ready_file: Path | None
    log_path: Path | None = None
    launch: Launch | None = None

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    @property
    def pid(self) -> int:
        return self.process.pid

    def ready(self) -> dict[str, Any] | None:
        return read_ready_file(self.ready_file) if self.ready_file is not None else None

    def log(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def exited(self) -> str | None:
        """How the process ended (with the end of its log), or None while it runs."""
        code = self.process.poll()
        if code is None:
            return None
        tail = self.log()[-LOG_TAIL_CHARS:]
        where = f":\n{tail}" if tail else " (see its log above)" if self.log_path is None else ""
        return f"{self.name} (pid {self.pid}) exited with code {code}{where}"

    def kill(self) -> int:
        """SIGKILL now (a crash, as far as the others can tell); its exit code."""
        if self.process.poll() is None:
            self.process.kill()
        return self.process.wait()

    def stop(self, grace_s: float = STOP_GRACE_S) -> int:
        """SIGTERM, then SIGKILL if it still runs after ``grace_s``; its exit code."""
        if self.process.poll() is None:
            self.process.terminate()
        return self.wait_or_kill(grace_s)

    def wait_or_kill(self, grace_s: float) -> int:
        """Its exit code, SIGKILLed if it still runs after ``grace_s``. (It was sent SIGTERM
        already: a second one tells an npuserve process to skip its drain.)"""
        try:
            return self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            log.warning("process did not stop in time; killing it", name=self.name)
            self.process.kill()
            return self.process.wait()


@dataclass
class Launcher:
    """Starts children and stops all of them together (the last started first)."""

    workdir: Path | None = None  # where ready files go (None: a temp folder, made when needed)
    children: list[Child] = field(default_factory=list)

    def start(
        self,
        name: str,
        args: Sequence[str],
        env: dict[str, str] | None = None,
        *,
        command: Sequence[str] | None = None,
        log_path: Path | None = None,
        ready_file: bool = True,
        own_process_group: bool = False,
        nice: int = 0,
    ) -> Child:
        """Runs ``command`` (default: ``python -m npuserve.deploy.cli``) with ``args`` and, unless
        ``ready_file`` is False, ``--ready-file``. ``env`` adds to this process's environment;
        ``log_path`` takes the child's stdout and stderr; ``own_process_group`` keeps a
        terminal's Ctrl-C from reaching it (the launcher stops it) while it stays in this
        process's session, where ``nice`` (`cpu_priority`) counts against its siblings'."""
        launch = Launch(
            tuple(args), env, tuple(command) if command else None, ready_file, own_process_group, nice
        )
        child = self._spawn(name, launch, log_path)
        self.children.append(child)
        return child

    def restart(self, child: Child, args: Sequence[str] | None = None) -> Child:
        """Starts a child that ended again, as it was started (``args``: with these arguments
        instead); the new process takes its place among the children (the log is appended to)."""
        assert child.launch is not None and not child.running, f"{child.name} still runs"
        launch = child.launch if args is None else replace(child.launch, args=tuple(args))
        new = self._spawn(child.name, launch, child.log_path, append_log=True)
        self.children[self.children.index(child)] = new
        return new

    def _spawn(self, name: str, launch: Launch, log_path: Path | None, append_log: bool = False) -> Child:
        ready_path = None
        if launch.ready_file:
            if self.workdir is None:
                self.workdir = Path(tempfile.mkdtemp(prefix="npuserve-"))
            ready_path = self.workdir / f"{name}.ready.json"
            ready_path.unlink(missing_ok=True)  # from an earlier run in the same workdir
        argv = [*(launch.command or python_module()), *launch.args]
        if ready_path is not None:
            argv += ["--ready-file", str(ready_path)]
        output = log_path.open("ab" if append_log else "wb") if log_path is not None else None
        try:
            process = subprocess.Popen(
                argv,
                env={**os.environ, **(launch.env or {})},
                stdout=output,
                stderr=subprocess.STDOUT if output is not None else None,
                preexec_fn=(
                    partial(_child_setup, launch.nice, launch.own_process_group)
                    if sys.platform == "linux"
                    else None
                ),
                # NOTE: where no setup runs in the child, a session of its own is the way to a group.
                start_new_session=launch.own_process_group and sys.platform != "linux",
            )
        finally:
            if output is not None:
                output.close()
        log.info(
            "process started", name=name, pid=process.pid, **({"nice": launch.nice} if launch.nice else {})
        )
        return Child(name, process, ready_path, log_path, launch)

    def wait_ready(
        self, children: Sequence[Child], timeout_s: float, watch: Sequence[Child] | None = None
    ) -> list[dict[str, Any]]:
        """What each of ``children`` wrote to its ready file, once all have; LaunchError when
        ``timeout_s`` passes or a child of ``watch`` (default: every child of this launcher)
        exits first."""
        deadline = time.monotonic() + timeout_s
        while True:
            watched = self.children if watch is None else watch
            exited = [report for child in watched if (report := child.exited()) is not None]
            ready = [child.ready() for child in children]
            if exited:
                raise LaunchError(f"{'; '.join(exited)}\n(before it was ready)")
            if all(r is not None for r in ready):
                return ready  # type: ignore[return-value]
            if time.monotonic() > deadline:
                waiting = [c.name for c, r in zip(children, ready, strict=True) if r is None]
                raise LaunchError(f"not ready after {timeout_s:.0f} s: {', '.join(waiting)}")
            time.sleep(0.05)

    def first_exited(self) -> str | None:
        """How the first child that ended did, or None while all run."""
        return next((report for child in self.children if (report := child.exited()) is not None), None)

    def wait_exit(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for every child to end on its own; True when all have."""
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(max(0.0, deadline - time.monotonic()))
        return all(child.process.poll() is not None for child in self.children)

    def stop(self, grace_s: float = STOP_GRACE_S) -> dict[str, int]:
        """SIGTERM to every child (the last started first), SIGKILL to those still running after
        ``grace_s``; returns each child's exit code by name."""
        for child in reversed(self.children):
            if child.process.poll() is None:
                child.process.terminate()
        deadline = time.monotonic() + grace_s
        for child in reversed(self.children):
            child.wait_or_kill(max(0.1, deadline - time.monotonic()))
        for child in self.children:
            if child.ready_file is not None:
                child.ready_file.unlink(missing_ok=True)
        return {child.name: child.process.returncode for child in self.children}
