"""The scale bench's notes on its own results: a window too short to see whole requests; runs of
the same size but other prefill/decode configurations or long-prompt rates are not taken for
saturation, and the long prompts' effect on the streams' ITL p99 is named."""

from __future__ import annotations

import dataclasses

from npuserve.deploy.bench.scale_measure import Result
from npuserve.deploy.bench.scale_notes import saturation_notes, short_window_notes


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


def test_long_prompt_runs_are_compared_with_their_decode_only_window_not_taken_for_saturation() -> None:
    runs = []
    for prefill, rate, itl_p99 in ((0, 0.0, 10.0), (0, 4.0, 30.0), (1, 0.0, 12.0), (1, 4.0, 13.2)):
        run = result(16, 1024, 10.0, 0.0)
        run.prefill_executors, run.long_prompt_rate, run.itl_p99_ms = prefill, rate, itl_p99
        run.long_ttft_p50_ms, run.long_ttft_p99_ms = (80.0, 120.0) if rate else (None, None)
        runs.append(run)
    notes = saturation_notes(runs)
    assert not any("raises tokens/s only" in note for note in notes)  # equal sizes, other loads
    assert (
        "16 executors, colocated x 1024 streams: 4 long prompts/s move the streams' ITL p99 by +200% "
        in "\n".join(notes)
    )
    assert any(
        n.startswith(
            "16 executors, 1 prefill x 1024 streams: 4 long prompts/s move the streams' ITL p99 by +10% (12.0 -> 13.2 ms)"
        )
        for n in notes
    )
