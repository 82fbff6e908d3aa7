"""When a lane's next step is due: the executor's time per forward pass, learnt from the steps
that land, and under `--num-scheduler-steps auto` the passes per step (`PassController`).

A step sent while the one before it ran (async scheduling) took from that one's landing to its
own: a step's time is measured from whichever came later, its send or the last landing.
"""

from __future__ import annotations

import time

from npuserve.scheduler.core.scheduler_config import SchedulerConfig
from npuserve.scheduler.core.step_passes import PassController

LAUNCH_LEAD_PASSES = 2  # a step after a multi-pass one is sent this many passes before it ends


class StepPacing:
    """One lane's step timings (on the lane's task)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.last_landed = 0.0
        # The executor's seconds per forward pass, over the multi-pass steps that landed (an
        # average that moves with the batch): when their next step is due.
        self.pass_seconds = 0.0
        # `--num-scheduler-steps auto`: the passes per step, from how long the executor waits.
        self.controller = PassController() if config.auto_passes else None
        self._had_work = False  # the lane had work when its last step landed

    def elapsed_s(self, sent_at: float, now: float) -> float:
        """How long a step sent at ``sent_at`` has been the executor's."""
        return now - max(sent_at, self.last_landed)

    def landed(
        self, num_passes: int, busy_s: float, seconds: float, now: float, has_work: bool
    ) -> int | None:
        """A step of ``num_passes`` landed at ``now`` after ``seconds`` (`elapsed_s`), the
        executor busy ``busy_s`` on it; ``has_work``: the lane has more. Returns the passes per
        step it chose, when that changed (under auto)."""
        chosen = None
        if self.controller is not None:
            if self._had_work:  # landed right after the one before: the executor's time between
                passes = self.controller.observe(busy_s, now - self.last_landed, now)
                if passes != self.config.num_scheduler_steps:
                    self.config.num_scheduler_steps = chosen = passes
            self._had_work = has_work
        self.last_landed = now
        if num_passes > 1:
            per_pass = seconds / num_passes
            self.pass_seconds = 0.8 * self.pass_seconds + 0.2 * per_pass if self.pass_seconds else per_pass
        return chosen

    def interrupted(self) -> None:
        """A step failed: the next one to land does not follow one that landed."""
        self._had_work = False

    def passes_left(self, num_passes: int, sent_at: float, queued: bool) -> float:
        """About how many of a step's passes the executor has yet to start (all of them while
        the step is ``queued`` behind another)."""
        if num_passes <= 1 or not self.pass_seconds:
            return 0.0
        if queued:
            return float(num_passes)
        return num_passes - self.elapsed_s(sent_at, time.perf_counter()) / self.pass_seconds

    def launch_delay_s(self, num_passes: int, sent_at: float) -> float:
        """How long to wait before sending the step after a running one of ``num_passes``: none
        after a one-pass step (sent at once, to hide the round trip); after a multi-pass step,
        until `LAUNCH_LEAD_PASSES` of its passes should be left. Sent at once, it would hold every
        request that arrives during the running one back by a whole further step of passes; sent
        then, their wait is about what it is without async scheduling, and the executor still has
        the next step before it needs it (or it goes out as the step lands, should that be first).

        NOTE: in the scale bench (16 executors x 1,024 streams, 8 passes a step, 2 cores, three
        interleaved runs each) this took the clients' TTFT p50 from 210-274 to 147-156 ms and
        the streams without a first token from 204-238 to 108-141, for the same tokens/s; a
        lead of one pass lost 6% of the tokens/s (one worker's loop serves many lanes: a
        launch can come late)."""
        if num_passes <= 1 or not self.pass_seconds:
            return 0.0
        elapsed_s = self.elapsed_s(sent_at, time.perf_counter())
        return (num_passes - LAUNCH_LEAD_PASSES) * self.pass_seconds - elapsed_s
