"""When `npuserve serve` restarts a process that died, and when it gives the process up.

One `RestartPolicy` holds every constant: a dead child waits ``initial_backoff_s`` (1 s) before
its restart, twice as long after each further death (up to ``max_backoff_s``, 30 s), and starts
over at 1 s once it has run ``stable_after_s`` without dying. ``crash_loop_deaths`` deaths within
``crash_loop_window_s`` (5 in 10 minutes) is a crash loop: the child is given up. `RestartHistory`
applies the policy to one child; it reads time from an injected clock, so it is tested without
sleeping.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_after_s: float = 60.0  # a child that ran this long before dying starts the backoff over
    crash_loop_deaths: int = 5
    crash_loop_window_s: float = 600.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError("the backoff must start above 0 and at most at its maximum")
        if self.crash_loop_deaths < 1 or self.crash_loop_window_s <= 0:
            raise ValueError("a crash loop needs at least one death in a positive window")

    def backoff_s(self, consecutive_deaths: int) -> float:
        """The wait before restarting a child after its ``consecutive_deaths``-th quick death."""
        return min(self.initial_backoff_s * 2 ** max(0, consecutive_deaths - 1), self.max_backoff_s)

    def describe(self) -> str:
        return f"{self.crash_loop_deaths} deaths within {self.crash_loop_window_s:g} s"


DEFAULT_RESTART_POLICY = RestartPolicy()


class RestartHistory:
    """The deaths of one child and what the policy makes of them.

    Call `started` when the process starts and `died` when it is seen dead: `died` answers the
    seconds to wait before starting it again, or None when the deaths make a crash loop.
    """

    def __init__(self, policy: RestartPolicy = DEFAULT_RESTART_POLICY, clock: Clock = time.monotonic) -> None:
        self.policy = policy
        self.clock = clock
        self.deaths: deque[float] = deque()  # times of the deaths inside the crash-loop window
        self.consecutive = 0  # deaths since the child last ran for stable_after_s
        self.restarts = 0
        self._started_at = clock()

    def started(self) -> None:
        self._started_at = self.clock()

    def died(self) -> float | None:
        now = self.clock()
        self.deaths.append(now)
        while self.deaths and now - self.deaths[0] > self.policy.crash_loop_window_s:
            self.deaths.popleft()
        if len(self.deaths) >= self.policy.crash_loop_deaths:
            return None
        ran_s = now - self._started_at
        self.consecutive = 1 if ran_s >= self.policy.stable_after_s else self.consecutive + 1
        self.restarts += 1
        return self.policy.backoff_s(self.consecutive)
