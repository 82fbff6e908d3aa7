"""An executor in the caller's process: the ModelRunner behind the same interface as the gRPC
client (`info()`, `step(plan)`), for offline use and for measuring what the gRPC split costs."""

from __future__ import annotations

from npuserve.executor.config import ExecutorConfig
from npuserve.executor.model_runner import ModelRunner
from npuserve.proto.step_plan import ExecutorInfo, StepPlan, StepResult


class LocalExecutor:
    def __init__(self, config: ExecutorConfig) -> None:
        self.runner = ModelRunner(config)

    def info(self) -> ExecutorInfo:
        return self.runner.info()

    def step(self, plan: StepPlan) -> StepResult:
        return self.runner.execute(plan)

    def health(self) -> bool:
        return True

    def close(self) -> None:
        pass
