"""An executor's step runner that fails the way devices do, for tests of the step clients."""

from __future__ import annotations

import dataclasses
import time

from npuserve.proto.step_plan import ExecutorInfo, FirstPassAnswer, JoiningSteps, StepPlan, StepResult

SLOW_STEP_S = 0.5


class FaultyRunner:
    """Step 0 fails as a device fault would, step 1 takes `SLOW_STEP_S`, the others succeed."""

    def __init__(self, info: ExecutorInfo) -> None:
        self._info = dataclasses.replace(info, joins_steps=False)  # it takes no joining step
        self.num_requests = 0  # it holds no request state

    def info(self) -> ExecutorInfo:
        return self._info

    def execute(
        self,
        plan: StepPlan,
        on_first_pass: FirstPassAnswer | None = None,
        joining: JoiningSteps | None = None,
    ) -> StepResult:
        if plan.step_id == 0:
            raise RuntimeError("device lost")
        if plan.step_id == 1:
            time.sleep(SLOW_STEP_S)
        return StepResult(step_id=plan.step_id)
