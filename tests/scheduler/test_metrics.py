"""The scheduler's metrics helpers."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from npuserve.scheduler.metrics import LATENCY_BUCKETS, observe_many


def exposition(registry: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_observe_many_equals_observing_one_at_a_time() -> None:
    one, many = CollectorRegistry(), CollectorRegistry()
    single = Histogram("h", "d", ["m"], buckets=LATENCY_BUCKETS, registry=one).labels("x")
    batched = Histogram("h", "d", ["m"], buckets=LATENCY_BUCKETS, registry=many).labels("x")
    # On a bucket bound, just above one, past the last, and a count of zero.
    for value, count in [(0.001, 3), (0.0011, 2), (0.02, 5), (5000.0, 2), (0.5, 0)]:
        for _ in range(count):
            single.observe(value)
        observe_many(batched, value, count)
    assert exposition(one) == exposition(many)
