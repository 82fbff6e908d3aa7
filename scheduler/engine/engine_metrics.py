"""The engine's Prometheus bookkeeping: each finished request and each lane step recorded as
it happens, and the gauges over every executor refreshed now and then (`MetricsRecorder`)."""

from __future__ import annotations

import weakref

from npuserve.scheduler.core.request import Request
from npuserve.scheduler.engine.metrics import ExecutorLoad, SchedulerMetrics
from npuserve.scheduler.lanes.lane import Lane, LaneEvent

__all__ = ["MetricsRecorder"]


class MetricsRecorder:
    """Records into ``metrics`` (event loop thread)."""

    def __init__(self, metrics: SchedulerMetrics) -> None:
        self.metrics = metrics
        # Per lane (a rejoined executor is a new lane, its pool's counts start at zero again):
        # the prefix-cache totals already counted.
        self._prefix_counted: weakref.WeakKeyDictionary[Lane, tuple[int, int]] = weakref.WeakKeyDictionary()

    def record_finish(self, request: Request, reason: str, now: float) -> None:
        self.metrics.request_finished(reason)
        self.metrics.e2e_request_latency.observe(now - request.arrival_time)
        if request.first_token_time is not None and request.num_output_tokens > 1:
            tpot = (now - request.first_token_time) / (request.num_output_tokens - 1)
            self.metrics.time_per_output_token.observe(tpot)

    def record_step(self, lane: Lane, event: LaneEvent, num_sequences: int, num_tokens: int) -> None:
        m = self.metrics
        if event.stats is not None:
            m.step(lane.executor_id, event.step_seconds, num_tokens, num_sequences)
            if event.timings is not None:
                m.executors.timed(lane.executor_id, event.timings)
            # NOTE: a counter's inc takes a lock: most steps have no prompt tokens, no preemption
            if event.stats.num_prompt_tokens:
                m.prompt_tokens.inc(event.stats.num_prompt_tokens)
            if event.stats.num_preemptions:
                m.num_preemptions.inc(event.stats.num_preemptions)
            m.executors.tokens(lane.executor_id, event.stats.num_prompt_tokens, num_tokens)
        elif num_tokens:  # the first tokens of a step's admitted requests, before its result
            m.answered_early(num_tokens)
            m.executors.tokens(lane.executor_id, 0, num_tokens)
        now_queries, now_hits = lane.prefix_stats
        queries, hits = self._prefix_counted.get(lane, (0, 0))
        if (now_queries, now_hits) != (queries, hits):  # NOTE: most steps look nothing up
            m.prefix_cache(lane.executor_id, max(0, now_queries - queries), max(0, now_hits - hits))
            self._prefix_counted[lane] = (now_queries, now_hits)

    def refresh_gauges(self, lanes: list[Lane], num_parked: int) -> None:
        """Running, waiting and KV usage over the live ``lanes`` (O(executors): not once a step);
        ``num_parked``: requests waiting for a scheduler worker to restart."""
        m = self.metrics
        m.num_requests_running.set(sum(lane.num_running for lane in lanes))
        m.num_requests_waiting.set(sum(lane.num_waiting for lane in lanes) + num_parked)
        m.kv_cache_usage.set(sum(lane.kv_usage for lane in lanes) / len(lanes) if lanes else 0.0)
        m.executors.refresh(
            [
                ExecutorLoad(
                    lane.executor_id,
                    lane.num_running,
                    lane.num_waiting,
                    lane.kv_usage,
                    lane.num_scheduler_steps,
                )
                for lane in lanes
            ]
        )
