"""The scheduler service's settings that are worked out rather than given."""

from __future__ import annotations

import pytest

from npuserve.scheduler.service_config import pipelines_steps


@pytest.mark.parametrize(
    ("asked", "transport", "pipelined"),
    [
        (None, "stream", True),  # the default: on over the step stream, as in vLLM
        (None, "unary", False),  # a call per step cannot carry the next step before an answer
        (False, "stream", False),  # --no-async-scheduling
        (True, "stream", True),
        (True, "unary", True),  # --async-scheduling asked for: its steps take the stream
    ],
)
def test_async_scheduling_is_on_by_default_over_the_step_stream(
    asked: bool | None, transport: str, pipelined: bool
) -> None:
    assert pipelines_steps(asked, transport) is pipelined
