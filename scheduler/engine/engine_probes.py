"""Looking into an engine's executors: block-pool integrity checks, prefix-cache counts, and
profiling. Each reads its lanes (on their tasks or workers, between steps) or their executors."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from npuserve.scheduler.core.scheduler import Scheduler
from npuserve.scheduler.engine.engine_config import NoExecutorError
from npuserve.scheduler.lanes.lane import Lane

if TYPE_CHECKING:
    from npuserve.scheduler.structured.grammar_compiler import GrammarCompiler

__all__ = [
    "PoolState",
    "ProfilingUnavailable",
    "check_integrity",
    "prefix_cache_stats",
    "start_profile",
    "stop_profile",
]


class ProfilingUnavailable(RuntimeError):
    """Profiling asked of an executor that cannot profile (gRPC UNIMPLEMENTED, HTTP 400)."""


@dataclass(slots=True)
class PoolState:
    executor_id: str
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_requests: int
    prefix_cache_queries: int
    prefix_cache_hits: int


def _checked_state(executor_id: str, scheduler: Scheduler, expect_idle: bool = False) -> PoolState:
    scheduler.check_integrity(expect_idle)
    pool = scheduler.kv.pool
    return PoolState(
        executor_id=executor_id,
        num_blocks=pool.num_blocks - 1,
        num_free_blocks=pool.num_free_blocks,
        num_cached_blocks=len(pool.cached_blocks),
        num_requests=len(scheduler.requests),
        prefix_cache_queries=scheduler.kv.stats.queries,
        prefix_cache_hits=scheduler.kv.stats.hits,
    )


def _prefix_stats(scheduler: Scheduler) -> tuple[int, int]:
    return scheduler.kv.stats.queries, scheduler.kv.stats.hits


async def check_integrity(
    lanes: list[Lane], grammars: GrammarCompiler, expect_idle: bool = False
) -> list[PoolState]:
    """Every lane's block pool passes its integrity check (run on the lanes, between
    steps); raises AssertionError naming the first violation. Returns each pool's state."""
    states = []
    for lane in lanes:
        checked = partial(_checked_state, lane.executor_id, expect_idle=expect_idle)
        states.append(await asyncio.wrap_future(lane.call(checked)))
    live = grammars.num_live_states
    assert not (expect_idle and live), f"{live} grammar states of finished requests are still held"
    return states


async def prefix_cache_stats(lanes: list[Lane]) -> dict[str, tuple[int, int]]:
    """Per executor: (prompt tokens looked up, tokens found in the cache)."""
    return {lane.executor_id: await asyncio.wrap_future(lane.call(_prefix_stats)) for lane in lanes}


async def start_profile(lanes: list[Lane]) -> list[str]:
    """Starts profiling on each of the live ``lanes``' executors; returns their ids. A failure
    (profiling off, or already running) raises the executor's error, named by its id."""
    await _on_executors(lanes, "start_profile")
    return [lane.executor_id for lane in lanes]


async def stop_profile(lanes: list[Lane]) -> dict[str, list[str]]:
    """Ends the profile of each of the live ``lanes``' executors; returns the trace files each wrote."""
    files = await _on_executors(lanes, "stop_profile")
    return {lane.executor_id: list(f) for lane, f in zip(lanes, files, strict=True)}


async def _on_executors(lanes: list[Lane], method: str) -> list[Any]:
    """Calls ``method`` of every lane's client at once (none: NoExecutorError)."""
    if not lanes:
        raise NoExecutorError("no executor is available to profile")
    return await asyncio.gather(*(_on_executor(lane, method) for lane in lanes))


async def _on_executor(lane: Lane, method: str) -> Any:
    call = getattr(lane.client, method, None)
    if call is None:
        raise ProfilingUnavailable(f"executor {lane.executor_id} runs in-process and cannot profile")
    try:
        return await call()
    except Exception as exc:
        # NOTE: keep the executor's status code (see SchedulerServicer), add its id.
        exc.args = (f"executor {lane.executor_id}: {getattr(exc, 'message', exc)}",)
        raise
