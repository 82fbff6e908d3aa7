"""The scheduler's metrics helpers: step observations tallied without locks, added when read."""

from __future__ import annotations

import pytest
from harness.serve import metric_total
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from npuserve.scheduler.engine.metrics import LATENCY_BUCKETS, HistogramTally, SchedulerMetrics


def exposition(registry: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_a_tally_flushed_equals_observing_each_value() -> None:
    one, many = CollectorRegistry(), CollectorRegistry()
    single = Histogram("h", "d", ["m"], buckets=LATENCY_BUCKETS, registry=one).labels("x")
    tallied = Histogram("h", "d", ["m"], buckets=LATENCY_BUCKETS, registry=many).labels("x")
    tally = HistogramTally()
    tally.flush_into(tallied)  # nothing gathered: nothing added
    for value, count in [(0.001, 3), (0.0011, 2), (0.02, 5), (5000.0, 2), (0.5, 0), (0.02, 1)]:
        for _ in range(count):
            single.observe(value)
        tally.add(value, count)
    assert exposition(one) != exposition(many)  # gathered, not yet added
    tally.flush_into(tallied)
    assert exposition(one) == exposition(many)
    tally.flush_into(tallied)  # flushed once: the tally starts over
    assert exposition(one) == exposition(many)


def test_steps_show_in_the_series_once_they_are_read() -> None:
    metrics = SchedulerMetrics("m")
    metrics.executors.joined("e0")
    for _ in range(3):
        metrics.step("e0", 0.02, 4, 4)
    metrics.step("gone", 0.02, 1, 1)  # an executor without series: counted in the totals only
    text = metrics.render()
    assert 'vllm:generation_tokens_total{model_name="m"} 13.0' in text
    assert 'vllm:inter_token_latency_seconds_count{model_name="m"} 13.0' in text
    assert 'npuserve:step_seconds_count{model_name="m"} 4.0' in text
    assert 'npuserve:executor_step_seconds_count{executor="e0",model_name="m"} 3.0' in text
    assert 'vllm:generation_tokens_total{model_name="m"} 13.0' in metrics.render()  # not added twice


def test_a_multi_step_steps_tokens_share_it_as_their_inter_token_latency() -> None:
    """Two sequences that sampled four tokens each in a 0.08 s step: eight tokens, each 0.02 s
    after the one before on average (a client gets them in bursts of four)."""
    metrics = SchedulerMetrics("m")
    metrics.step("e0", 0.08, 8, 2)
    text = metrics.render()
    assert 'vllm:generation_tokens_total{model_name="m"} 8.0' in text
    assert 'vllm:inter_token_latency_seconds_count{model_name="m"} 8.0' in text
    assert metric_total(text, "vllm:inter_token_latency_seconds_sum") == pytest.approx(0.16)


def test_a_tally_observes_one_at_a_time_into_a_histogram_of_another_layout() -> None:
    """A prometheus_client without `_buckets`/`_sum`: each count lands in its bucket all the same."""

    class OtherLayout:
        def __init__(self) -> None:
            self.values: list[float] = []

        def observe(self, value: float) -> None:
            self.values.append(value)

    tally, other = HistogramTally(), OtherLayout()
    tally.add(0.0011, 2)
    tally.add(5000.0)
    tally.flush_into(other)  # type: ignore[arg-type]
    assert other.values == [0.005, 0.005, LATENCY_BUCKETS[-1] * 2]
