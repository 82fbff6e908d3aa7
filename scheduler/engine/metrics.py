"""Prometheus metrics of the scheduler, named as vLLM names them so existing dashboards work.

Besides vLLM's aggregate series, `ExecutorMetrics` keeps npuserve's per-executor ones (label
`executor`): whether the executor serves, its KV usage, running and waiting requests, step time,
prefix-cache lookups, and how often it joined again after going down.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from npuserve.proto.step_plan import EXECUTOR_ROLE_MIXED, KV_TRANSFER_KINDS, StepTimings

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
# How an executor's forward passes ran (`ExecutorMetrics.steps`), in `StepTimings`' order.
PASS_MODES = ("graph", "eager")
# How long a departed executor's series stay (at executor_up 0, for alerts to see) before they go.
DEPARTED_SERIES_TTL_S = 600.0


@dataclass(frozen=True, slots=True)
class ExecutorLoad:
    """One serving executor's load, read off its lane."""

    executor_id: str
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_scheduler_steps: int = 1  # the passes its steps run now (`--num-scheduler-steps`)


@dataclass(slots=True)
class _Executor:
    """One executor with series: its step-path children (labels() costs a lookup under a lock)
    and since when it is gone."""

    step_seconds: Histogram
    prefix_cache_queries: Counter
    prefix_cache_hits: Counter
    passes: tuple[Counter, ...]  # of `steps`, one per mode of `PASS_MODES`
    kv_transfer_bytes: dict[str, Counter]  # by kind, of `KV_TRANSFER_KINDS`
    kv_transfer_seconds: dict[str, Histogram]
    prompt_tokens: Counter
    generation_tokens: Counter
    departed_at: float | None = None
    steps: HistogramTally = field(default_factory=lambda: HistogramTally())  # not yet in step_seconds


class ExecutorMetrics:
    """The `npuserve:executor_*` series, labelled by model and executor.

    An executor id (or address) that joins again after it was seen counts as a restart. An
    executor missing from a refresh reads as down (executor_up 0, its load 0); DEPARTED_SERIES_TTL_S
    later every series of it is removed, unless it came back. One that drained (stopped on
    purpose) loses its series at once: its leaving is no fault to alert on.

    Ownership: called on the engine's event loop thread only.
    """

    def __init__(
        self, registry: CollectorRegistry, model_name: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        labels = ["model_name", "executor"]
        self.model_name = model_name
        self._clock = clock

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"npuserve:executor_{name}", doc, labels, registry=registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"npuserve:executor_{name}", doc, labels, registry=registry)

        self.up = gauge("up", "1 while the scheduler serves on the executor, 0 once it is gone.")
        self.kv_cache_usage = gauge(
            "kv_cache_usage_perc", "The executor's KV-cache usage. 1 means 100 percent usage."
        )
        self.num_requests_running = gauge("num_requests_running", "Requests in the executor's batches.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting for the executor.")
        self.scheduler_steps = gauge(
            "scheduler_steps",
            "Forward passes a step of the executor runs for its decoding sequences (--num-scheduler-steps, "
            "or what auto chose last).",
        )
        self.step_seconds = Histogram("npuserve:executor_step_seconds", "Wall time of one step of the executor.",
                                      labels, buckets=LATENCY_BUCKETS, registry=registry)  # fmt: skip
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prefix cache queries on the executor, in tokens."
        )
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prefix cache hits on the executor, in tokens.")
        self.prompt_tokens = counter(
            "prompt_tokens",
            "Prompt tokens the executor computed (those found in its prefix cache, or pulled from "
            "another executor's, not counted).",
        )
        self.generation_tokens = counter("generation_tokens", "Tokens the executor sampled.")
        self.restarts = counter(
            "restarts", "Times the executor (by id or address) joined again after going down or restarting."
        )
        self.failed_steps = counter(
            "failed_steps",
            "Steps the executor failed while it still served (a device error, a step stream whose "
            "connection reset); their requests ran again on it, or ended after a second failure.",
        )
        self.joined_steps = counter(
            "joined_steps",
            "Steps that started requests inside a multi-pass step of the executor: their prompts "
            "ran in its next pass, so they did not wait for it to end.",
        )
        # NOTE: a third label, so it is kept apart from `_series` (removed by its own two modes).
        self.steps = Counter(
            "npuserve:executor_steps",
            "Forward passes of the executor's steps (one a step, or --num-scheduler-steps), by how they "
            'ran: mode="graph" replayed a captured decode graph, mode="eager" ran the model op by op.',
            [*labels, "mode"],
            registry=registry,
        )
        # NOTE: `kind` names the transfer (`KV_TRANSFER_KINDS`): "host_tier", the copies between
        # an executor's device blocks and its host-memory tier (--kv-host-memory); "executor",
        # the blocks it pulled from another executor's cache (named by the puller, which
        # measures the whole transfer: the source's read, the network and its own writes).
        self.kv_transfer_bytes = Counter(
            "npuserve:kv_transfer_bytes",
            "KV cache bytes the executor copied into or out of its device blocks: to and from its "
            'host-memory tier (kind="host_tier"), or from another executor (kind="executor").',
            [*labels, "kind"],
            registry=registry,
        )
        self.kv_transfer_seconds = Histogram(
            "npuserve:kv_transfer_seconds",
            "Seconds the KV block transfers of one kind took in one step of the executor.",
            [*labels, "kind"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        # NOTE: an info series (`npuserve:executor_info`, always 1), as Prometheus exporters give
        # constant labels: joined on an executor's other series by `executor`.
        self.executor_info = Info(
            "npuserve:executor",
            "1 for each executor the scheduler knows (its series go with its others), with its role "
            "(--role): prefill, decode or mixed.",
            labels,
            registry=registry,
        )
        self._labelled_by_kind: dict[Counter | Histogram, tuple[str, ...]] = {self.steps: PASS_MODES, self.kv_transfer_bytes: KV_TRANSFER_KINDS,
                                  self.kv_transfer_seconds: KV_TRANSFER_KINDS}  # fmt: skip
        self._gauges = (self.up, self.kv_cache_usage, self.num_requests_running, self.num_requests_waiting,
                        self.scheduler_steps)  # fmt: skip
        self._series = (*self._gauges, self.step_seconds, self.prefix_cache_queries, self.prefix_cache_hits,
                        self.prompt_tokens, self.generation_tokens, self.restarts, self.failed_steps, self.joined_steps,
                        self.executor_info)  # fmt: skip
        self._executors: dict[str, _Executor] = {}  # those with series
        self._seen: set[str] = set()  # every executor id and address that ever joined

    def joined(self, executor_id: str, address: str | None = None, role: str = EXECUTOR_ROLE_MIXED) -> None:
        """The executor serves (again, with a fresh block pool), in ``role``."""
        names = {executor_id} if address is None else {executor_id, address}
        rejoined = bool(names & self._seen)
        self._seen |= names
        labels = (self.model_name, executor_id)
        for metric in self._series:  # every series from the start, so a first increase shows
            metric.labels(*labels)
        self._executors[executor_id] = _Executor(
            self.step_seconds.labels(*labels),
            self.prefix_cache_queries.labels(*labels),
            self.prefix_cache_hits.labels(*labels),
            tuple(self.steps.labels(*labels, mode) for mode in PASS_MODES),
            {kind: self.kv_transfer_bytes.labels(*labels, kind) for kind in KV_TRANSFER_KINDS},
            {kind: self.kv_transfer_seconds.labels(*labels, kind) for kind in KV_TRANSFER_KINDS},
            self.prompt_tokens.labels(*labels),
            self.generation_tokens.labels(*labels),
        )
        self.up.labels(*labels).set(1)
        self.executor_info.labels(*labels).info({"role": role})  # NOTE: replaces a role it had before
        if rejoined:
            self.restarts.labels(self.model_name, executor_id).inc()

    def left(self, executor_id: str) -> None:
        """The executor drained and left."""
        if self._executors.pop(executor_id, None) is not None:
            self._remove_series(executor_id)

    def _remove_series(self, executor_id: str) -> None:
        for metric in self._series:
            metric.remove(self.model_name, executor_id)
        for by_kind, kinds in self._labelled_by_kind.items():
            for kind in kinds:
                by_kind.remove(self.model_name, executor_id, kind)

    def step(self, executor_id: str, seconds: float) -> None:
        executor = self._executors.get(executor_id)
        if executor is not None:  # else: a late report of an executor whose series are gone
            executor.steps.add(seconds)

    def flush(self) -> None:
        """Adds the steps gathered since the last flush to the series."""
        for executor in self._executors.values():
            executor.steps.flush_into(executor.step_seconds)

    def timed(self, executor_id: str, timings: StepTimings) -> None:
        """What the executor measured of a step: its forward passes by mode (graph replays,
        eager), and its KV block transfers by kind."""
        executor = self._executors.get(executor_id)
        if executor is None:
            return
        for counter, count in zip(executor.passes, (timings.graph_passes, timings.eager_passes), strict=True):
            if count:
                counter.inc(count)
        for transfer in timings.kv_transfers:
            transferred = executor.kv_transfer_bytes.get(transfer.kind)
            if transferred is not None:  # NOTE: a kind this scheduler does not know is not counted
                transferred.inc(transfer.num_bytes)
                executor.kv_transfer_seconds[transfer.kind].observe(transfer.seconds)

    def tokens(self, executor_id: str, num_prompt: int, num_generated: int) -> None:
        """Prompt tokens a step of the executor computed, and tokens it sampled."""
        executor = self._executors.get(executor_id)
        if executor is not None:
            if num_prompt:
                executor.prompt_tokens.inc(num_prompt)
            if num_generated:
                executor.generation_tokens.inc(num_generated)

    def step_failed(self, executor_id: str) -> None:
        if executor_id in self._executors:
            self.failed_steps.labels(self.model_name, executor_id).inc()

    def step_joined(self, executor_id: str) -> None:
        if executor_id in self._executors:
            self.joined_steps.labels(self.model_name, executor_id).inc()

    def prefix_cache(self, executor_id: str, queries: int, hits: int) -> None:
        executor = self._executors.get(executor_id)
        if executor is not None:
            executor.prefix_cache_queries.inc(queries)
            executor.prefix_cache_hits.inc(hits)

    def refresh(self, loads: Iterable[ExecutorLoad]) -> None:
        """The serving executors' load; every other known executor is down."""
        now = self._clock()
        serving = set()
        for load in loads:
            if load.executor_id not in self._executors:
                continue
            serving.add(load.executor_id)
            labels = (self.model_name, load.executor_id)
            self.num_requests_running.labels(*labels).set(load.num_running)
            self.num_requests_waiting.labels(*labels).set(load.num_waiting)
            self.kv_cache_usage.labels(*labels).set(load.kv_cache_usage)
            self.scheduler_steps.labels(*labels).set(load.num_scheduler_steps)
        for executor_id, executor in list(self._executors.items()):
            if executor_id in serving:
                executor.departed_at = None
            elif executor.departed_at is None:
                executor.departed_at = now
                for gauge in self._gauges:
                    gauge.labels(self.model_name, executor_id).set(0)
            elif now - executor.departed_at >= DEPARTED_SERIES_TTL_S:
                del self._executors[executor_id]
                self._remove_series(executor_id)


class HistogramTally:
    """Observations of one histogram gathered with no lock (a list index per observation) and
    added to it at once by `flush_into`: the step path observes, a scrape flushes."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)  # the last: past every bound (+Inf)
        self.total = 0.0

    def add(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, value)] += count
        self.total += value * count

    def flush_into(self, histogram: Histogram) -> None:
        """Adds what was gathered to ``histogram`` (buckets `LATENCY_BUCKETS`) and starts over."""
        counts, total = self.counts, self.total
        if not any(counts):
            return
        self.counts, self.total = [0] * len(counts), 0.0
        # NOTE: prometheus_client has no batch observe: this adds to the child's sum and buckets
        # directly (its layout: `_sum`, `_buckets`). Under another layout each count is observed
        # at its bucket's bound, one at a time (the sum is then approximate).
        buckets = getattr(histogram, "_buckets", None)
        total_value = getattr(histogram, "_sum", None)
        if buckets is None or total_value is None or len(buckets) != len(counts):
            bounds = (*LATENCY_BUCKETS, LATENCY_BUCKETS[-1] * 2)  # the last: a value past every bound
            for value, count in zip(bounds, counts, strict=True):
                for _ in range(count):
                    histogram.observe(value)
            return
        total_value.inc(total)
        for bucket, count in zip(buckets, counts, strict=True):
            if count:
                bucket.inc(count)


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
        self.executors = ExecutorMetrics(r, model_name)
        self._success_by_reason: dict[str, Counter] = {}
        self._steps = HistogramTally()  # what `step` gathered and `flush` has not added yet
        self._inter_token = HistogramTally()
        self._generated = 0

    def request_finished(self, finished_reason: str) -> None:
        counter = self._success_by_reason.get(finished_reason)
        if counter is None:  # NOTE: `labels` looks the child up under a lock: once per reason
            counter = self._success_by_reason[finished_reason] = self._success.labels(
                self.model_name, finished_reason
            )
        counter.inc()

    def step(self, executor_id: str, seconds: float, num_tokens: int, num_sequences: int) -> None:
        """One step of an executor, in which ``num_sequences`` sequences sampled ``num_tokens``
        tokens: with multi-step decoding several each, so a token's share of the step, its
        inter-token latency, is the step over the tokens per sequence. Gathered without a lock
        (the step path runs this per step) and added to the series when they are read (`render`)."""
        self._steps.add(seconds)
        if num_tokens:
            self._inter_token.add(seconds * num_sequences / num_tokens, num_tokens)
        self._generated += num_tokens
        self.executors.step(executor_id, seconds)

    def answered_early(self, num_tokens: int) -> None:
        """Tokens a multi-step plan's first pass gave before the step's result
        (`early_first_tokens`): generated, in no step of their own."""
        self._generated += num_tokens

    def flush(self) -> None:
        """Adds what the step path gathered to the series."""
        self._steps.flush_into(self.step_seconds)
        self._inter_token.flush_into(self.inter_token_latency)
        if self._generated:
            self.generation_tokens.inc(self._generated)
            self._generated = 0
        self.executors.flush()

    def prefix_cache(self, executor_id: str, queries: int, hits: int) -> None:
        """New prefix-cache lookups of an executor (in prompt tokens, and of them found)."""
        self.prefix_cache_queries.inc(queries)
        self.prefix_cache_hits.inc(hits)
        self.executors.prefix_cache(executor_id, queries, hits)

    def render(self) -> str:
        """The Prometheus text exposition of every metric."""
        self.flush()
        return generate_latest(self.registry).decode()
