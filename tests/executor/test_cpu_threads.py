"""`--cpu-threads auto`: an executor on the CPU keeps one core fewer than torch's threads when a
decode step costs it at most `MAX_SLOWDOWN` more, timed on the runner itself; the timing steps
leave the runner holding nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from npuserve.executor import cpu_threads
from npuserve.executor.config import ExecutorConfig
from npuserve.executor.cpu_threads import (
    MAX_SLOWDOWN,
    choose_cpu_threads,
)
from npuserve.executor.model_runner import ModelRunner
from npuserve.proto.step_plan import ExecutorInfo, StepPlan, StepResult


@pytest.fixture(autouse=True)
def four_threads() -> Iterator[None]:
    """Torch starts each test at 4 threads, and gets its own back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


class ClockedRunner:
    """Decode steps that take ``step_s`` on 4 threads and ``slowdown`` times that on fewer, on a
    clock of its own (the module's `time`), so the choice does not depend on this machine."""

    def __init__(self, slowdown: float, step_s: float = 0.01) -> None:
        self.slowdown, self.step_s = slowdown, step_s
        self.now = 0.0
        self.held: set[str] = set()
        self.threads_seen: list[int] = []

    def info(self) -> ExecutorInfo:
        return ExecutorInfo("m", "Llama", 16, 64, 128, 8, 256, 512, [2], "float32", "cpu")

    def execute(self, plan: StepPlan) -> StepResult:
        self.held.update(r.req_id for r in plan.new_requests)
        self.held.difference_update(plan.finished_req_ids)
        if plan.num_scheduled_tokens:
            threads = torch.get_num_threads()
            self.threads_seen.append(threads)
            self.now += self.step_s * (1.0 if threads == 4 else self.slowdown)
        return StepResult(plan.step_id)


@pytest.mark.parametrize(("slowdown", "chosen"), [(1.0, 3), (MAX_SLOWDOWN * 0.99, 3), (1.4, 4), (2.0, 4)])
def test_a_core_is_spared_when_it_costs_the_model_little(
    monkeypatch: pytest.MonkeyPatch, slowdown: float, chosen: int
) -> None:
    runner = ClockedRunner(slowdown)
    monkeypatch.setattr(cpu_threads, "time", SimpleNamespace(perf_counter=lambda: runner.now))
    assert choose_cpu_threads(runner) == chosen
    assert torch.get_num_threads() == chosen
    assert set(runner.threads_seen) == {3, 4} and len(runner.threads_seen) == 2 * cpu_threads.TIMING_ROUNDS
    assert not runner.held


def test_one_thread_has_nothing_to_spare() -> None:
    torch.set_num_threads(1)
    runner = ClockedRunner(1.0)
    assert choose_cpu_threads(runner) == 1 and not runner.threads_seen


def test_the_timing_runs_real_steps_on_a_model_runner(stories_dir: Path) -> None:
    runner = ModelRunner(ExecutorConfig(model=str(stories_dir), kv_cache_memory_gib=0.01, device="cpu"))
    assert choose_cpu_threads(runner) in (3, 4)
    assert runner.num_requests == 0
