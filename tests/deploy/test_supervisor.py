"""`npuserve serve`'s supervisor over real (tiny) processes and an injected clock: a dead child is
started again with its restart command line after the policy's backoff, a crash loop gives it up,
and only the loss of every executor (or of the scheduler) ends serving."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

from harness.clock import FakeClock

from npuserve.deploy.launcher import Launcher
from npuserve.deploy.runtime.restart_policy import DEFAULT_RESTART_POLICY
from npuserve.deploy.runtime.shutdown import Shutdown
from npuserve.deploy.supervisor import Role, Supervisor

SHELL = ["sh"]
DIES = ["-c", "exit 3"]
LIVES = ["-c", "sleep 60"]


def supervised(tmp_path: Path, children: dict[str, tuple[Role, list[str]]]) -> tuple[Supervisor, FakeClock]:
    clock = FakeClock()
    launcher = Launcher(tmp_path)
    supervisor = Supervisor(launcher, DEFAULT_RESTART_POLICY, clock)
    for name, (role, args) in children.items():
        child = launcher.start(name, args, command=SHELL, ready_file=False)
        supervisor.watch(child, role, lambda args=args: [*args, "restarted"])
    return supervisor, clock


def settle(supervisor: Supervisor) -> None:
    """Waits for the children that die at once to be dead (no time passes on the clock)."""
    for s in supervisor.supervised:
        if s.child.launch is not None and s.child.launch.args[:2] == tuple(DIES):
            s.child.process.wait(10)


def test_a_crash_loop_is_given_up_and_only_losing_every_executor_ends_serving(tmp_path: Path) -> None:
    supervisor, clock = supervised(
        tmp_path,
        {"executor-0": ("executor", DIES), "executor-1": ("executor", LIVES), "gateway": ("gateway", DIES)},
    )
    by_name = {s.child.name: s for s in supervisor.supervised}
    try:
        waits = []
        for _ in range(5):
            settle(supervisor)
            assert supervisor.check() is None  # executor-1 serves on
            zero = by_name["executor-0"]
            if zero.given_up:
                break
            assert zero.restart_at is not None
            waits.append(zero.restart_at - clock.now)
            clock.now = zero.restart_at
            assert supervisor.check() is None
            assert zero.child.launch is not None and zero.child.launch.args[-1] == "restarted"
        assert waits == [1, 2, 4, 8]  # then the fifth death within 10 minutes gives it up
        assert by_name["executor-0"].given_up and by_name["gateway"].given_up
        assert not by_name["executor-1"].given_up and by_name["executor-1"].history.restarts == 0

        one = by_name["executor-1"]
        for _ in range(DEFAULT_RESTART_POLICY.crash_loop_deaths):
            one.child.process.send_signal(signal.SIGKILL)
            one.child.process.wait(10)
            verdict = supervisor.check()
            if one.given_up:
                break
            assert verdict is None and one.restart_at is not None
            clock.now = one.restart_at
            supervisor.check()
        assert verdict == "every executor is given up"
    finally:
        supervisor.launcher.stop(grace_s=1)


def test_the_scheduler_in_a_crash_loop_ends_serving(tmp_path: Path) -> None:
    supervisor, clock = supervised(
        tmp_path, {"executor-0": ("executor", LIVES), "scheduler": ("scheduler", DIES)}
    )
    (scheduler,) = supervisor.of_role("scheduler")
    try:
        verdict = None
        for _ in range(DEFAULT_RESTART_POLICY.crash_loop_deaths):
            settle(supervisor)
            verdict = supervisor.check()
            if scheduler.restart_at is not None:
                clock.now = scheduler.restart_at
                supervisor.check()
        assert scheduler.given_up and verdict == "the scheduler is in a crash loop"
    finally:
        supervisor.launcher.stop(grace_s=1)


def drains_forever(trapped: Path) -> list[str]:
    """A shell that drains (ignores) the first SIGTERM and dies of the second; it creates
    ``trapped`` once its trap is set."""
    return ["-c", f"trap 'trap - TERM' TERM; : > '{trapped}'; while :; do sleep 0.05; done"]


def test_a_second_signal_during_the_drain_stops_every_process_at_once(tmp_path: Path) -> None:
    roles: dict[str, Role] = {"executor-0": "executor", "scheduler": "scheduler", "gateway": "gateway"}
    trapped = {name: tmp_path / f"{name}.trapped" for name in roles}
    supervisor, _ = supervised(
        tmp_path, {name: (role, drains_forever(trapped[name])) for name, role in roles.items()}
    )
    shutdown = Shutdown()
    shutdown.on_signal()  # the first: drain
    try:
        deadline = time.monotonic() + 30
        while not all(path.exists() for path in trapped.values()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert all(path.exists() for path in trapped.values()), "the shells did not set their traps"
        second = threading.Timer(0.5, shutdown.on_signal)  # arrives while the front drains
        second.start()
        supervisor.drain(shutdown, timeout_s=60)
        second.join()
        codes = supervisor.launcher.stop(grace_s=0.5)  # what serve does next
        # The gateway and the scheduler died of their second SIGTERM, passed on by the drain; the
        # executor, never signalled before, drains at the stop's SIGTERM and is killed after 0.5 s.
        assert codes == {
            "executor-0": -signal.SIGKILL,
            "scheduler": -signal.SIGTERM,
            "gateway": -signal.SIGTERM,
        }
    finally:
        supervisor.launcher.stop(grace_s=1)
