"""`--num-scheduler-steps auto`: each executor's passes per step, chosen from how long the
executor waits for the scheduler.

Multi-step decoding pays the scheduler's per-step costs (planning, the step's gRPC round trip,
the report to the front, each sequence's update and stream message) once for several tokens,
at the price of tokens that arrive in bursts and new requests that wait for the passes in
flight. Worth it only while the scheduler, not the executor, bounds the steps: then the
executor idles between steps and more passes per step turn that idle time into tokens.

A `PassController` watches one lane's steps that land back to back (the lane had work all
along): the executor's own busy time for each (`StepTimings.total_s`) against the time between
landings. While the executor is busy less than `RAISE_BELOW` of that time it doubles the passes,
up to `AUTO_MAX_PASSES`; while it is busy more than `LOWER_ABOVE` it tries half as many. A try
that leaves the executor waiting again is undone at the next decision, and the next try waits
twice as long (`PROBE_BACKOFF_S` .. `MAX_PROBE_BACKOFF_S`), so a lane that needs k passes does
not swing between k and k/2. On an executor whose steps take longer than the scheduler's work
for them (a real model on an NPU, a few executors per scheduler) it stays at one pass, vLLM's
behaviour.
"""

from __future__ import annotations

AUTO_SCHEDULER_STEPS = 0  # the config value of `--num-scheduler-steps auto`
# The most passes one step may run for a request (`--num-scheduler-steps N`): a new request waits
# for its executor's current step, so more would add to its time to first token.
MAX_SCHEDULER_STEPS = 32
AUTO_MAX_PASSES = 16
RAISE_BELOW = 0.75  # the executor's busy share of the time between landings below which passes double
LOWER_ABOVE = 0.95  # ... above which half as many are tried
DECISION_MIN_S = 0.25  # a decision looks at this much time between landings, at least
DECISION_MIN_STEPS = 4  # ... and at this many steps
PROBE_BACKOFF_S = 2.0  # the wait before trying fewer passes again, after a try that failed
MAX_PROBE_BACKOFF_S = 60.0


def check_num_scheduler_steps(steps: int) -> None:
    """ValueError unless ``steps`` is `AUTO_SCHEDULER_STEPS` or 1..`MAX_SCHEDULER_STEPS`."""
    if steps != AUTO_SCHEDULER_STEPS and not 1 <= steps <= MAX_SCHEDULER_STEPS:
        raise ValueError(
            f"--num-scheduler-steps must be auto or within 1..{MAX_SCHEDULER_STEPS}, got {steps}"
        )


class PassController:
    """One lane's passes per step under `--num-scheduler-steps auto` (see the module)."""

    def __init__(self) -> None:
        self.passes = 1
        self._busy_s = 0.0
        self._span_s = 0.0
        self._steps = 0
        self._probe_backoff_s = PROBE_BACKOFF_S
        self._next_probe_at = 0.0  # on the `observe` clock
        self._probing = False  # the last change tried fewer passes

    def observe(self, busy_s: float, span_s: float, now: float) -> int:
        """A step landed ``span_s`` after the one before it (the lane had work in between), and
        the executor was busy ``busy_s`` of that on it; returns the passes for the next steps."""
        if busy_s <= 0.0 or span_s <= 0.0:
            return self.passes  # an executor that reports no timings: nothing to go by
        self._busy_s += min(busy_s, span_s)
        self._span_s += span_s
        self._steps += 1
        if self._span_s < DECISION_MIN_S or self._steps < DECISION_MIN_STEPS:
            return self.passes
        busy_share = self._busy_s / self._span_s
        self._busy_s = self._span_s = 0.0
        self._steps = 0
        self._decide(busy_share, now)
        return self.passes

    def _decide(self, busy_share: float, now: float) -> None:
        probing, self._probing = self._probing, False
        if busy_share < RAISE_BELOW:
            if probing:  # fewer passes left the executor waiting: try again later, and later
                self._probe_backoff_s = min(2 * self._probe_backoff_s, MAX_PROBE_BACKOFF_S)
                self._next_probe_at = now + self._probe_backoff_s
            self.passes = min(2 * self.passes, AUTO_MAX_PASSES)
            return
        if probing:
            self._probe_backoff_s = PROBE_BACKOFF_S  # fewer were enough
        if busy_share > LOWER_ABOVE and self.passes > 1 and now >= self._next_probe_at:
            self.passes //= 2
            self._probing = True
