"""`PassController` (`--num-scheduler-steps auto`): passes double while the executor waits on the
scheduler, stay at one while it keeps busy, and a try with fewer that leaves it waiting again is
undone and retried later and later. Decisions are fed made-up step times; no clock is read."""

from __future__ import annotations

from npuserve.scheduler.core.step_passes import (
    AUTO_MAX_PASSES,
    DECISION_MIN_S,
    DECISION_MIN_STEPS,
    PROBE_BACKOFF_S,
    PassController,
)


def _decide(controller: PassController, busy_share: float, now: float, step_s: float = 0.1) -> int:
    """Enough steps, each ``step_s`` apart with the executor busy ``busy_share`` of it, for one
    decision at ``now``; the passes after it."""
    steps = max(DECISION_MIN_STEPS, int(DECISION_MIN_S / step_s) + 1)
    before = controller.passes
    for _ in range(steps):
        passes = controller.observe(busy_share * step_s, step_s, now)
    assert controller._steps == 0, "one decision, no more"  # NOTE: fed exactly one window
    assert passes in (before, 2 * before, before // 2, AUTO_MAX_PASSES)
    return passes


def test_an_executor_that_keeps_busy_stays_at_one_pass() -> None:
    controller = PassController()
    for second in range(20):
        assert _decide(controller, 0.98, float(second)) == 1


def test_passes_double_up_to_the_cap_while_the_executor_waits() -> None:
    controller = PassController()
    seen = [_decide(controller, 0.3, float(second)) for second in range(6)]
    assert seen == [2, 4, 8, 16, 16, 16] and AUTO_MAX_PASSES == 16
    # Between the thresholds nothing changes.
    assert _decide(controller, 0.85, 7.0) == AUTO_MAX_PASSES


def test_fewer_passes_are_tried_when_the_executor_is_saturated_and_a_failed_try_backs_off() -> None:
    controller = PassController()
    for second in range(3):
        _decide(controller, 0.3, float(second))
    assert controller.passes == 8
    assert _decide(controller, 0.99, 10.0) == 4  # saturated: try half as many
    assert _decide(controller, 0.5, 10.5) == 8  # the executor waited again: undone
    # The next try waits twice the base backoff; then comes.
    assert _decide(controller, 0.99, 10.5 + 2 * PROBE_BACKOFF_S - 0.1) == 8
    assert _decide(controller, 0.99, 10.5 + 2 * PROBE_BACKOFF_S) == 4
    # A try that keeps the executor busy stands, and resets the backoff: the next comes at once.
    assert _decide(controller, 0.99, 20.0) == 2
    assert _decide(controller, 0.99, 20.1) == 1
    assert _decide(controller, 0.99, 20.2) == 1
    # Failures in a row wait twice as long each time.
    for second in range(3):
        _decide(controller, 0.3, 30.0 + second)
    assert _decide(controller, 0.99, 40.0) == 4
    assert _decide(controller, 0.5, 40.5) == 8
    assert _decide(controller, 0.99, 40.5 + 2 * PROBE_BACKOFF_S) == 4
    assert _decide(controller, 0.5, 45.0) == 8
    assert _decide(controller, 0.99, 45.0 + 4 * PROBE_BACKOFF_S - 0.1) == 8
    assert _decide(controller, 0.99, 45.0 + 4 * PROBE_BACKOFF_S) == 4


def test_a_decision_needs_enough_steps_and_time() -> None:
    controller = PassController()
    for _ in range(DECISION_MIN_STEPS * 10):
        controller.observe(0.0001, DECISION_MIN_S / (DECISION_MIN_STEPS * 100), 0.0)  # too little time
    assert controller.passes == 1
    controller = PassController()
    for _ in range(DECISION_MIN_STEPS - 1):
        controller.observe(0.1, 10.0, 0.0)  # too few steps
    assert controller.passes == 1


def test_an_executor_without_timings_leaves_the_passes_as_they_are() -> None:
    controller = PassController()
    for _ in range(100):
        controller.observe(0.0, 0.1, 0.0)
    assert controller.passes == 1
