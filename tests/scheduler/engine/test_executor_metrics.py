"""Per-executor metrics (`npuserve:executor_*`, label `executor`): the engine in this process
over simulated executors keeps them equal to what its lanes did (steps, prefix-cache lookups,
running requests), marks a lost executor down and counts its rejoin as a restart; the series of
an executor gone for good are removed after a while."""

from __future__ import annotations

import asyncio

from harness.simulated_engine import (
    MODEL,
    SMALL,
    ControlledExecutor,
    SimulatedEngine,
    generate,
    simulated_engine,
)
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from npuserve.executor.simulated import SimulatedRunner
from npuserve.proto.step_plan import KvTransfer, StepTimings
from npuserve.scheduler.core.request import SamplingParams
from npuserve.scheduler.engine.metrics import DEPARTED_SERIES_TTL_S, ExecutorLoad, ExecutorMetrics
from npuserve.scheduler.text.prompts import PromptInput
from npuserve.scheduler.text.tokenizer import Tokenizer


def samples(text: str) -> dict[tuple[str, str], float]:
    """(series name, executor) -> value of every per-executor sample; ("name", "") for the others
    (summed over their other labels)."""
    found: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "le" in sample.labels:
                continue
            key = (sample.name, sample.labels.get("executor", ""))
            found[key] = found.get(key, 0.0) + sample.value
    return found


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 31 + i * 7) % 500 + 3 for i in range(n)]


async def held_in_steps(sim: SimulatedEngine, num_requests: int) -> None:
    """Until ``num_requests`` are in the engine, some running, and every lane's executor holds its
    step (both take some of them here).

    NOTE: a request that reaches its lane while the executor holds a step waits there until the
    step is let go: it is in the engine, not running."""
    for _ in range(1000):
        lanes = sim.engine.lanes
        if (
            sim.engine.num_active_requests == num_requests
            and any(lane.num_running for lane in lanes.values())
            and all(sim.executors[e].paused.is_set() for e in lanes)
        ):
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the requests did not reach held steps")


def test_per_executor_series_follow_the_lanes(tokenizer: Tokenizer) -> None:
    """e0 is lost after 3 steps under load: its requests finish on e1, it reads as down, and it
    rejoins (one restart). Step counts and prefix lookups add up to the aggregate series and to
    each pool's own counts; while steps are held, the running gauges equal the lanes'."""

    async def scenario() -> None:
        async with simulated_engine(tokenizer, 2, failing={"e0": (3, "UNAVAILABLE")}) as sim:
            engine = sim.engine
            shared = prompt(12, 1)  # three full blocks that later requests find cached
            params = SamplingParams(max_tokens=10, ignore_eos=True)
            await asyncio.gather(*(generate(engine, shared + prompt(3, i), params) for i in range(6)))
            await sim.wait_idle()  # the step that drops the finished requests counts too
            assert list(engine.lanes) == ["e1"]
            engine.refresh_gauges()
            lost = samples(engine.metrics.render())
            assert lost[("npuserve:executor_up", "e0")] == 0 and lost[("npuserve:executor_up", "e1")] == 1
            assert lost[("npuserve:executor_num_requests_running", "e0")] == 0
            assert lost[("npuserve:executor_step_seconds_count", "e0")] == 3  # the steps it served
            assert lost[("npuserve:executor_step_seconds_count", "e1")] == engine.lanes["e1"].num_steps
            assert lost[("npuserve:executor_restarts_total", "e0")] == 0

            # e0 comes back (a new process, an empty pool); both hold their steps from now on, so
            # that the requests they take stay running.
            sim.executors["e0"] = ControlledExecutor(SimulatedRunner(SMALL), pause_at=0)
            engine.add_executor("e0", sim.executors["e0"], sim.executors["e0"].info())
            sim.executors["e1"].pause_at = sim.executors["e1"].num_steps
            held = [
                engine.generate(PromptInput(token_ids=shared + prompt(3, 10 + i)), params) for i in range(3)
            ]
            firsts = [asyncio.ensure_future(anext(stream)) for stream in held]
            await held_in_steps(sim, 3)
            engine.refresh_gauges()
            during = samples(engine.metrics.render())
            for executor_id, lane in engine.lanes.items():
                key = ("npuserve:executor_num_requests_running", executor_id)
                assert during[key] == lane.num_running
            assert sum(
                v for (name, e), v in during.items() if name == "npuserve:executor_num_requests_running"
            )
            assert during[("vllm:num_requests_running", "")] == sum(
                lane.num_running for lane in engine.lanes.values()
            )
            sim.resume()
            for first, stream in zip(firsts, held, strict=True):
                await first
                async for _ in stream:
                    pass
            await sim.wait_idle()
            engine.refresh_gauges()
            after = samples(engine.metrics.render())
            assert after[("npuserve:executor_up", "e0")] == 1
            assert after[("npuserve:executor_scheduler_steps", "e0")] == 1  # one pass a step: the default
            assert after[("npuserve:executor_restarts_total", "e0")] == 1
            assert after[("npuserve:executor_restarts_total", "e1")] == 0
            pools = await engine.prefix_cache_stats()
            for name in ("prefix_cache_queries", "prefix_cache_hits"):
                per_executor = {e: v for (n, e), v in after.items() if n == f"npuserve:executor_{name}_total"}
                assert sum(per_executor.values()) == after[(f"vllm:{name}_total", "")]
                # The rejoined e0's series go on from its lost pool's counts with its new pool's.
                new_on_e0 = (
                    after[(f"npuserve:executor_{name}_total", "e0")]
                    - lost[(f"npuserve:executor_{name}_total", "e0")]
                )
                assert new_on_e0 == pools["e0"][0 if name == "prefix_cache_queries" else 1]
            assert after[("npuserve:executor_prefix_cache_hits_total", "e1")] == pools["e1"][1] > 0
            steps = {e: v for (n, e), v in after.items() if n == "npuserve:executor_step_seconds_count"}
            assert sum(steps.values()) == after[("npuserve:step_seconds_count", "")]

    asyncio.run(scenario())


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def executors_in(registry: CollectorRegistry) -> dict[str, set[str]]:
    """Series name -> the executors it has samples of."""
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            found.setdefault(sample.name, set()).add(sample.labels["executor"])
    return found


def test_departed_series_go_after_a_while_and_a_returning_address_is_a_restart() -> None:
    registry, clock = CollectorRegistry(), Clock()
    metrics = ExecutorMetrics(registry, MODEL, clock)
    metrics.joined("a", "10.0.0.1:50061")
    metrics.joined("b", "10.0.0.2:50061")
    metrics.step("b", 0.01)
    metrics.prefix_cache("b", 8, 4)
    metrics.step_failed("b")
    metrics.step_joined("b")
    metrics.step_joined("b")
    metrics.timed("b", StepTimings(graph_passes=3, eager_passes=1))  # four passes, three replays
    transfers = [
        KvTransfer("host_tier", 4096, 0.002),
        KvTransfer("executor", 8192, 0.25),
        KvTransfer("new", 1, 1),
    ]
    metrics.timed("b", StepTimings(eager_passes=1, kv_transfers=transfers))
    assert metrics.steps.labels(MODEL, "b", "graph")._value.get() == 3
    assert metrics.steps.labels(MODEL, "b", "eager")._value.get() == 2
    assert metrics.kv_transfer_bytes.labels(MODEL, "b", "host_tier")._value.get() == 4096
    assert metrics.kv_transfer_seconds.labels(MODEL, "b", "host_tier")._sum.get() == 0.002
    assert metrics.kv_transfer_bytes.labels(MODEL, "b", "executor")._value.get() == 8192
    assert metrics.kv_transfer_seconds.labels(MODEL, "b", "executor")._sum.get() == 0.25
    assert 'kind="new"' not in generate_latest(registry).decode()  # a kind it does not know
    assert metrics.failed_steps.labels(MODEL, "b")._value.get() == 1
    assert metrics.joined_steps.labels(MODEL, "b")._value.get() == 2
    assert metrics.failed_steps.labels(MODEL, "a")._value.get() == 0  # there from the start
    assert metrics.joined_steps.labels(MODEL, "a")._value.get() == 0
    metrics.refresh([ExecutorLoad("a", 2, 1, 0.5, 8)])  # b is gone
    series = executors_in(registry)
    assert series["npuserve:executor_up"] == {"a", "b"}  # b stays, at 0, for alerts to see
    assert metrics.up.labels(MODEL, "b")._value.get() == 0
    assert metrics.scheduler_steps.labels(MODEL, "a")._value.get() == 8  # the passes a's steps run
    clock.now = DEPARTED_SERIES_TTL_S - 1
    metrics.refresh([ExecutorLoad("a", 2, 1, 0.5)])
    assert executors_in(registry)["npuserve:executor_step_seconds_count"] == {"a", "b"}
    clock.now = DEPARTED_SERIES_TTL_S + 1
    metrics.refresh([ExecutorLoad("a", 2, 1, 0.5)])
    assert all(executors == {"a"} for executors in executors_in(registry).values())
    metrics.step("b", 0.01)  # a late report of the departed executor adds nothing
    metrics.prefix_cache("b", 8, 4)
    metrics.step_failed("b")
    metrics.step_joined("b")
    metrics.timed("b", StepTimings(graph_passes=1, kv_transfers=[KvTransfer("executor", 1, 0.1)]))
    metrics.refresh([ExecutorLoad("b", 1, 0, 0.1)])  # nor a load of one that has not joined
    assert all(executors == {"a"} for executors in executors_in(registry).values())
    # Another id at b's address: b's host came back under a new name, which counts as a restart.
    metrics.joined("c", "10.0.0.2:50061")
    assert metrics.restarts.labels(MODEL, "c")._value.get() == 1
    assert metrics.restarts.labels(MODEL, "a")._value.get() == 0


def test_an_executor_replaced_mid_step_stays_served_and_counts_one_restart(tokenizer: Tokenizer) -> None:
    """e0 restarts (a new instance registers) while its old lane waits in a step: the new lane
    serves on, though the old one reports going down afterwards, and e0 is up with one restart."""

    async def scenario() -> None:
        async with simulated_engine(tokenizer, 2, pause_at=1) as sim:
            engine = sim.engine
            params = SamplingParams(max_tokens=12, ignore_eos=True)
            running = asyncio.ensure_future(generate(engine, prompt(9, 3), params, "r"))
            holder = await sim.wait_paused()
            old_lane = engine.lanes[holder]
            replacement = ControlledExecutor(SimulatedRunner(SMALL))
            engine.add_executor(holder, replacement, replacement.info())  # the old lane is taken down
            new_lane = engine.lanes[holder]
            sim.resume()
            result = await running
            assert result.tokens[0] == sim.expected_tokens("r", 9, 12)
            await sim.wait_idle()
            assert not old_lane.alive and engine.lanes[holder] is new_lane
            engine.refresh_gauges()
            found = samples(engine.metrics.render())
            assert found[("npuserve:executor_up", holder)] == 1
            assert found[("npuserve:executor_restarts_total", holder)] == 1

    asyncio.run(scenario())


def test_a_drained_executor_leaves_without_reading_as_down(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with simulated_engine(tokenizer, 2) as sim:
            engine = sim.engine
            engine.drain_executor("e1", "stopped on purpose")  # idle: removed at once
            assert list(engine.lanes) == ["e0"]
            engine.refresh_gauges()
            found = samples(engine.metrics.render())
            assert not [key for key in found if key[1] == "e1"]
            assert found[("npuserve:executor_up", "e0")] == 1

    asyncio.run(scenario())
