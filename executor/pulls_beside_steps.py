"""KV pulls that run beside an executor's steps (`StepPlan.kv_pulls`): their outcomes, told to the
scheduler in its step results, and the thread that runs them in order.

A step's plan starts its pulls; the step and the next ones run at once, while each pull copies
its blocks, which no step touches until it has landed (the scheduler schedules none of the
request's tokens until a result says so). `PullOutcomes` holds what each pull came to, landed or
failed, and every final result names it (`StepResult.landed_pull_req_ids`,
`failed_pull_req_ids`) until a plan names its request again (sent whole, scheduled, dropped or
pulled once more) after a result has named it, or resets: a result lost on the way (a broken
step stream) costs no outcome, and the scheduler takes each outcome once.

`BackgroundPulls` runs one executor's pulls on one thread of their own, in the order the plans
gave them. A step that names a block a pull still writes (the scheduler plans none such, but a
pull of a step that failed may outlive it) waits for that pull first; a step that runs no token
waits a little for an outcome (`POLL_WAIT_S`), so that a scheduler with nothing else to run
learns of a landing soon without sending empty steps back to back. A tensor-parallel group runs
its pulls inside the step instead (its ranks' collectives must not interleave with the step's),
and tells them in that step's result. This module loads no torch (the simulated executor models
its pulls with `PullOutcomes` alone).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator

import structlog

from npuserve.proto.step_plan import KvPull, StepPlan, StepResult

log = structlog.get_logger(__name__)

# The longest a step that runs no token waits for a pull's outcome.
POLL_WAIT_S = 0.025


def names(plan: StepPlan) -> set[str]:
    """The requests a plan names: sent whole, scheduled, dropped or pulled."""
    return {
        *plan.num_scheduled_tokens,
        *plan.finished_req_ids,
        *(request.req_id for request in plan.new_requests),
        *(pull.req_id for pull in plan.kv_pulls),
    }


def named_blocks(plan: StepPlan) -> Iterator[int]:
    """The device blocks a plan names: its requests' blocks, its copies' device blocks."""
    for request in plan.new_requests:
        yield from request.block_ids
    for cached in plan.cached_requests:
        yield from cached.new_block_ids
    for copy in plan.block_copies:
        yield copy.src if copy.to_host else copy.dst


def is_poll(plan: StepPlan) -> bool:
    """Whether a plan does nothing but ask how its executor's pulls went (the scheduler sends one
    only while it has nothing else to send and a pull runs, as far as it knows)."""
    return not (plan.num_scheduled_tokens or plan.finished_req_ids or plan.kv_pulls or plan.reset)


class PullOutcomes:
    """Each request's last pull outcome, until the scheduler has surely taken it (thread-safe:
    a pull thread settles, the step thread reports)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._landed: dict[str, bool] = {}  # req_id -> landed (else failed)
        self._reported: set[str] = set()  # of them, those a result has named
        # An outcome settled since the last report (`BackgroundPulls.wait_for_outcome`).
        self.fresh = False

    def settle(self, req_id: str, landed: bool) -> None:
        with self._lock:
            self._landed[req_id] = landed
            self._reported.discard(req_id)
            self.fresh = True

    def acknowledge(self, plan: StepPlan) -> None:
        """A plan came: the outcomes a result has named of the requests it names are taken (all
        of them, if it resets). One no result has named yet stays: the scheduler may name the
        request for another reason (it drops a request ended meanwhile once it knows)."""
        if not self._reported and not plan.reset:
            return
        with self._lock:
            if plan.reset:
                self._landed.clear()
                self._reported.clear()
                return
            taken = self._reported.intersection(names(plan))
            for req_id in taken:
                del self._landed[req_id]
            self._reported -= taken

    def report(self, result: StepResult) -> None:
        """Names every outcome not yet taken in a final result."""
        with self._lock:
            result.landed_pull_req_ids = [r for r, landed in self._landed.items() if landed]
            result.failed_pull_req_ids = [r for r, landed in self._landed.items() if not landed]
            self._reported.update(self._landed)
            self.fresh = False


class BackgroundPulls:
    """One thread that runs an executor's pulls in order (``run_pull``: True when the pull
    landed, False when it failed) and settles their outcomes."""

    def __init__(self, run_pull: Callable[[KvPull], bool], outcomes: PullOutcomes) -> None:
        self._run_pull = run_pull
        self.outcomes = outcomes
        self._cond = threading.Condition()
        self._queued: deque[KvPull] = deque()
        self._running: KvPull | None = None
        self._thread: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        """Pulls are queued or running."""
        return bool(self._queued) or self._running is not None

    def start(self, pulls: list[KvPull]) -> None:
        """Queues ``pulls`` (checked: `check_kv_pulls`) after those before them."""
        with self._cond:
            self._queued.extend(pulls)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="kv-pulls", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def wait_for_blocks(self, plan: StepPlan) -> None:
        """Returns once no pull queued or running writes a block that ``plan`` names (its
        requests' blocks, its copies' device blocks)."""
        blocks = set(named_blocks(plan))
        with self._cond:
            self._cond.wait_for(
                lambda: all(blocks.isdisjoint(p.dst_block_ids) for p in [self._running, *self._queued] if p)
            )

    def wait_for_outcome(self, plan: StepPlan, timeout_s: float = POLL_WAIT_S) -> None:
        """For a step that ran no token: returns once a pull has an outcome not yet reported, or
        ``timeout_s`` has passed; at once when no pull runs, unless the plan did nothing at all
        (`is_poll`: then its scheduler believes a pull runs, and it waits the whole while)."""
        poll = is_poll(plan)
        with self._cond:
            self._cond.wait_for(lambda: self.outcomes.fresh or not (poll or self.busy), timeout_s)

    def cancel(self) -> None:
        """Drops the queued pulls (their blocks were never written) and waits for the running
        one: a new scheduler plans every block afresh (`StepPlan.reset`)."""
        with self._cond:
            self._queued.clear()
            self._cond.wait_for(lambda: self._running is None)

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queued))
                pull = self._running = self._queued.popleft()
            try:
                landed = self._run_pull(pull)
            except Exception:  # NOTE: never let the thread die: the pull fails its request only
                log.exception("kv pull crashed", request_id=pull.req_id)
                landed = False
            self.outcomes.settle(pull.req_id, landed)
            with self._cond:
                self._running = None
                self._cond.notify_all()
