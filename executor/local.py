"""An executor in the caller's process: a runner (the `ModelRunner`, or the `SimulatedRunner`)
behind the same interface as the gRPC client (`info()`, `step(plan)`), for offline use, for
measuring what the gRPC split costs, and for in-process tests of the scheduler."""

from __future__ import annotations

from npuserve.executor.config import ExecutorConfig
from npuserve.executor.model_runner import ModelRunner
from npuserve.executor.servicer import StepRunner
from npuserve.proto.step_plan import ExecutorInfo, StepPlan, StepResult


class LocalExecutor:
    def __init__(self, runner: StepRunner | ExecutorConfig) -> None:
        """A runner, or the config of a `ModelRunner` to build."""
        self.runner = ModelRunner(runner) if isinstance(runner, ExecutorConfig) else runner

    def info(self) -> ExecutorInfo:
        return self.runner.info()

    def step(self, plan: StepPlan) -> StepResult:
        return self.runner.execute(plan)

    def health(self) -> bool:
        return True

    def close(self) -> None:
        pass
