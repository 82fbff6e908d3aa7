"""The scale bench's notes on its own results: a window too short to see whole requests."""

from __future__ import annotations

import dataclasses

from npuserve.deploy.bench.scale import saturation_notes, short_window_notes
from npuserve.deploy.bench.scale_measure import Result


def result(executors: int, concurrency: int, window_s: float, sustained_requests_per_s: float) -> Result:
    """A row with these figures and zeros elsewhere (as a run with no tokens would report)."""
    values: dict[str, object] = {field.name: 0 for field in dataclasses.fields(Result)}
    values.update(errors={}, profile=None, output_tokens_per_s=1000.0, steps_per_s=10.0)
    values.update(
        executors=executors,
        concurrency=concurrency,
        window_s=window_s,
        sustained_requests_per_s=sustained_requests_per_s,
    )
    return Result(**values)  # type: ignore[arg-type]


def test_a_window_shorter_than_a_requests_life_is_named_with_the_duration_that_sees_whole_lives() -> None:
    short = result(64, 4096, 10.0, 152.7)  # a request lives 4096 / 152.7 = 26.8 s
    whole = result(16, 1024, 10.0, 163.9)  # 6.2 s: the window sees whole requests
    idle = result(4, 256, 10.0, 0.0)  # nothing completed: nothing to say
    (note,) = short_window_notes([short, whole, idle])
    assert note.startswith("64 executors x 4096 streams: a request lives ~27 s, longer than the 10 s window")
    assert "--duration 54 or more" in note
    assert note in saturation_notes([short, whole])
