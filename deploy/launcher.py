"""`npuserve serve`: scheduler and executors as processes on one machine, on loopback.

Children are started with the same Python, report readiness through small JSON files, and are
stopped together: on SIGINT/SIGTERM, when any of them dies, and (Linux) when the launcher itself
dies, through the parent-death signal. No orphan survives the launcher.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class LaunchError(RuntimeError):
    pass


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    ready_file: Path
    log_path: Path | None = None

    def ready(self) -> dict[str, object] | None:
        if not self.ready_file.exists():
            return None
        return json.loads(self.ready_file.read_text())


@dataclass
class Launcher:
    """Starts children in order and stops all of them together."""

    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="npuserve-")))
    children: list[Child] = field(default_factory=list)

    def start(self, name: str, args: Sequence[str], env: dict[str, str] | None = None) -> Child:
        ready_file = self.workdir / f"{name}.ready.json"
        command = [sys.executable, "-m", "npuserve.deploy.cli", *args, "--ready-file", str(ready_file)]
        process = subprocess.Popen(
            command,
            env={**os.environ, **(env or {})},
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        child = Child(name, process, ready_file)
        self.children.append(child)
        log.info("process started", name=name, pid=process.pid)
        return child

    def wait_ready(self, children: Sequence[Child], timeout_s: float) -> list[dict[str, object]]:
        deadline = time.monotonic() + timeout_s
        while True:
            for child in self.children:
                code = child.process.poll()
                if code is not None:
                    raise LaunchError(
                        f"{child.name} exited with code {code} before it was ready (see its log above)"
                    )
            ready = [child.ready() for child in children]
            if all(r is not None for r in ready):
                return ready  # type: ignore[return-value]
            if time.monotonic() > deadline:
                waiting = [c.name for c, r in zip(children, ready, strict=True) if r is None]
                raise LaunchError(f"not ready after {timeout_s:.0f} s: {', '.join(waiting)}")
            time.sleep(0.1)

    def supervise(self) -> int:
        """Blocks until a signal asks to stop (returns 0) or a child dies (returns 1)."""
        stop: dict[str, int | None] = {"signal": None}

        def on_signal(signum: int, _frame: object) -> None:
            stop["signal"] = signum

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        while stop["signal"] is None:
            for child in self.children:
                code = child.process.poll()
                if code is not None:
                    log.error("process exited; stopping the others", name=child.name, exit_code=code)
                    return 1
            time.sleep(0.2)
        log.info("stopping", signal=signal.Signals(stop["signal"]).name)
        return 0

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to every child (the scheduler first), then SIGKILL after the grace period."""
        for child in reversed(self.children):
            if child.process.poll() is None:
                child.process.terminate()
        deadline = time.monotonic() + grace_s
        for child in reversed(self.children):
            remaining = max(0.1, deadline - time.monotonic())
            try:
                child.process.wait(remaining)
            except subprocess.TimeoutExpired:
                log.warning("process did not stop in time; killing it", name=child.name)
                child.process.kill()
                child.process.wait()
        for child in self.children:
            child.ready_file.unlink(missing_ok=True)
