"""`npuserve serve`'s supervision of its executors, scheduler and gateway.

A child that dies is started again on the same address (its fixed port: the one it first got),
after the backoff of the one `RestartPolicy`; meanwhile the others serve on, and the scheduler
moves the dead executor's requests to the others (its fail-over) and reconnects to the restarted
executor, which joins with an empty block pool. A child in a crash loop is given up with one log
line. Serving ends (exit 1) only when the scheduler is given up or every executor is.

The first SIGTERM/SIGINT drains in order (`drain`): the gateway and the scheduler first (they
stop admitting and finish the streams in flight), then the executors. A second signal stops every
process at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import structlog

from npuserve.deploy.launcher import Child, Launcher
from npuserve.deploy.runtime.restart_policy import (
    DEFAULT_RESTART_POLICY,
    Clock,
    RestartHistory,
    RestartPolicy,
)
from npuserve.deploy.runtime.shutdown import Shutdown

log = structlog.get_logger(__name__)

Role = Literal["executor", "scheduler", "gateway"]
POLL_S = 0.2
# Beyond --shutdown-timeout, what a draining process gets to exit before it is killed.
EXIT_MARGIN_S = 10.0
FRONT: tuple[Role, ...] = ("gateway", "scheduler")  # stop admitting here first


@dataclass
class Supervised:
    """One child under supervision; ``restart_args`` gives its command line for a restart."""

    child: Child
    role: Role
    restart_args: Callable[[], list[str]]
    history: RestartHistory
    restart_at: float | None = None  # dead, waiting for its backoff
    given_up: bool = False


@dataclass
class Supervisor:
    launcher: Launcher
    policy: RestartPolicy = DEFAULT_RESTART_POLICY
    clock: Clock = time.monotonic
    supervised: list[Supervised] = field(default_factory=list)

    def watch(self, child: Child, role: Role, restart_args: Callable[[], list[str]]) -> None:
        self.supervised.append(Supervised(child, role, restart_args, RestartHistory(self.policy, self.clock)))

    def of_role(self, role: Role) -> list[Supervised]:
        return [s for s in self.supervised if s.role == role]

    def run(self, shutdown: Shutdown) -> int:
        """Restarts children until a signal asks to drain (0) or serving cannot go on (1)."""
        while not shutdown.drain.is_set():
            fatal = self.check()
            if fatal is not None:
                log.error("npuserve serve cannot go on; stopping every process", reason=fatal)
                return 1
            shutdown.drain.wait(POLL_S)
        return 0

    def check(self) -> str | None:
        """One round: restarts those whose backoff is over, notes new deaths; the reason serving
        cannot go on, or None."""
        now = self.clock()
        for s in self.supervised:
            if s.given_up:
                continue
            if s.restart_at is not None:
                if now >= s.restart_at:
                    self._restart(s)
                continue
            code = s.child.process.poll()
            if code is not None:
                self._died(s, code, now)
        if any(s.given_up for s in self.of_role("scheduler")):
            return "the scheduler is in a crash loop"
        executors = self.of_role("executor")
        if executors and all(s.given_up for s in executors):
            return "every executor is given up"
        return None

    def _died(self, s: Supervised, code: int, now: float) -> None:
        wait_s = s.history.died()
        if wait_s is None:
            s.given_up = True
            log.error(
                "crash loop: giving the process up",
                name=s.child.name,
                deaths=self.policy.describe(),
                exit_code=code,
                restarts=s.history.restarts,
            )
            return
        log.warning("process died; restarting it", name=s.child.name, exit_code=code, restart_in_s=wait_s)
        s.restart_at = now + wait_s

    def _restart(self, s: Supervised) -> None:
        s.restart_at = None
        s.child = self.launcher.restart(s.child, s.restart_args())
        s.history.started()
        log.info("process restarted", name=s.child.name, pid=s.child.pid, restarts=s.history.restarts)

    def live_executors(self) -> list[Supervised]:
        return [s for s in self.of_role("executor") if not s.given_up]

    # -- draining --------------------------------------------------------------------------------

    def drain(self, shutdown: Shutdown, timeout_s: float) -> None:
        """SIGTERM to the gateway and the scheduler, which finish what is in flight and exit; then
        to the executors. A second signal (``shutdown.now``) passes on at once: each process
        then stops without waiting."""
        log.info("draining", timeout_s=timeout_s)
        signalled: list[Child] = []
        for roles in (FRONT, ("executor",)):
            children = [s.child for s in self.supervised if s.role in roles and s.child.running]
            for child in children:  # in FRONT's order: the gateway stops admitting first
                child.process.terminate()
            signalled += children

            def exited(group: list[Child] = children) -> bool:
                return not any(child.running for child in group)

            if not shutdown.drain_until(exited, timeout_s + EXIT_MARGIN_S):
                break
        if shutdown.now.is_set():
            log.info("second signal: stopping every process now")
            for child in signalled:
                if child.running:
                    child.process.terminate()  # its second signal: stop now
            # NOTE: the others never drained; the caller's stop ends them (SIGTERM, then SIGKILL).
