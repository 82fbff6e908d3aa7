"""The restart policy of `npuserve serve`: the backoff doubles up to its cap, a child that ran long
enough starts it over, and 5 deaths within 10 minutes give the child up (a clock is injected:
nothing sleeps)."""

from __future__ import annotations

import pytest
from harness.clock import FakeClock

from npuserve.deploy.runtime.restart_policy import DEFAULT_RESTART_POLICY, RestartHistory, RestartPolicy


def test_the_backoff_doubles_from_one_second_to_its_cap() -> None:
    policy = DEFAULT_RESTART_POLICY
    assert [policy.backoff_s(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 30, 30, 30]


def test_quick_deaths_back_off_then_a_crash_loop_gives_up() -> None:
    clock = FakeClock(1000.0)
    history = RestartHistory(DEFAULT_RESTART_POLICY, clock)
    waits = []
    for _ in range(5):
        clock.now += 3  # dies 3 s after each start
        wait = history.died()
        waits.append(wait)
        if wait is not None:
            clock.now += wait
            history.started()
    assert waits == [1, 2, 4, 8, None]
    assert history.restarts == 4


def test_a_child_that_ran_long_enough_starts_the_backoff_over() -> None:
    clock = FakeClock(1000.0)
    history = RestartHistory(RestartPolicy(crash_loop_deaths=100), clock)
    for expected in (1, 2, 4):
        clock.now += 1
        assert history.died() == expected
        history.started()
    clock.now += DEFAULT_RESTART_POLICY.stable_after_s
    assert history.died() == 1
    history.started()
    clock.now += 1
    assert history.died() == 2


def test_deaths_spread_wider_than_the_window_never_give_up() -> None:
    clock = FakeClock(1000.0)
    history = RestartHistory(DEFAULT_RESTART_POLICY, clock)
    for _ in range(20):  # one death every 3 minutes: at most 4 inside any 10 minutes
        clock.now += 180
        assert history.died() == 1
        history.started()


def test_the_window_counts_deaths_not_restarts() -> None:
    clock = FakeClock(1000.0)
    policy = RestartPolicy(crash_loop_deaths=3, crash_loop_window_s=60, stable_after_s=1000)
    history = RestartHistory(policy, clock)
    assert history.died() == 1
    clock.now += 59
    assert history.died() == 2
    clock.now += 2  # the first death left the window
    assert history.died() == 4
    assert history.died() is None


@pytest.mark.parametrize(
    "fields",
    [
        {"initial_backoff_s": 0},
        {"initial_backoff_s": 40},
        {"crash_loop_deaths": 0},
        {"crash_loop_window_s": 0},
    ],
)
def test_an_impossible_policy_is_refused(fields: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RestartPolicy(**fields)  # type: ignore[arg-type]
