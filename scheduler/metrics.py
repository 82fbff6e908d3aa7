"""Prometheus metrics of the scheduler, named as vLLM names them so existing dashboards work."""

from __future__ import annotations

import bisect

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip


def observe_many(histogram: Histogram, value: float, count: int) -> None:
    """``count`` observations of one value (a step's inter-token latency, once per token it
    produced) at the cost of one: prometheus_client has no batch observe, so this adds to the
    child's sum and bucket directly (its layout: `_sum`, `_buckets`, `_upper_bounds`)."""
    if count <= 0:
        return
    buckets = getattr(histogram, "_buckets", None)
    bounds = getattr(histogram, "_upper_bounds", None)
    total = getattr(histogram, "_sum", None)
    if buckets is None or bounds is None or total is None:  # another layout: one at a time
        for _ in range(count):
            histogram.observe(value)
        return
    total.inc(value * count)
    buckets[bisect.bisect_left(bounds, value)].inc(count)


class SchedulerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)

        self.num_requests_running = gauge("vllm:num_requests_running", "Requests in model execution batches.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be processed.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.model_name = model_name
        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds", "Time to first token.")
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds", "Inter-token latency.")
        self.time_per_output_token = histogram(
            "vllm:time_per_output_token_seconds", "Mean time per output token of each request."
        )
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency."
        )
        self.step_seconds = histogram("npuserve:step_seconds", "Wall time of one executor step.")

    def request_finished(self, finished_reason: str) -> None:
        self._success.labels(self.model_name, finished_reason).inc()

    def render(self) -> str:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry).decode()
