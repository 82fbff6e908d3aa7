"""What the scale bench's numbers say (`npuserve bench-scale` prints them under its table): where
throughput saturates, the scheduler's CPU per step and token, windows too short for the requests'
lives, the peak, and how far long prompts move the streams' ITL (`disaggregation_report`)."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterator, Sequence

from npuserve.deploy.bench.disaggregation_report import effects, format_change, scale_points
from npuserve.deploy.bench.report import cell
from npuserve.deploy.bench.scale_config import SATURATED_GAIN, TTFT_EXPLODED
from npuserve.deploy.bench.scale_measure import Result


def _saturated(runs: list[Result], along: str) -> Iterator[tuple[Result, Result, float]]:
    """Neighbouring runs (sorted by ``along``) where the larger one raises tokens/s too little."""
    runs.sort(key=lambda r: getattr(r, along))
    for low, high in itertools.pairwise(runs):
        gain = high.output_tokens_per_s / max(low.output_tokens_per_s, 1e-9)
        if gain < SATURATED_GAIN:
            yield low, high, gain


def saturation_notes(results: Sequence[Result]) -> list[str]:
    """Where adding executors or load stops raising throughput, or TTFT explodes (among runs of
    one prefill/decode configuration and long-prompt rate); the scheduler's CPU cost model, short
    windows, the peak, and how far long prompts move the streams' ITL p99."""
    groups: dict[tuple[int, int, float], list[Result]] = {}
    for r in results:
        groups.setdefault((r.round, r.prefill_executors, r.long_prompt_rate), []).append(r)
    rounds = max(r.round for r in results)
    notes = []
    for (round_number, prefill, rate), runs in groups.items():
        prefix = f"round {round_number}, " if rounds > 1 else ""
        if len({key[1:] for key in groups}) > 1:
            roles = f"{prefill} prefill" if prefill else "colocated"
            prefix += f"{roles}, {rate:g} long prompts/s" if rate else f"{roles}, decode only"
        notes += [f"{prefix.removesuffix(', ')}: {note}" if prefix else note for note in _growth_notes(runs)]
    fit = cost_model(results)
    if fit is not None:
        per_step_ms, per_token_us = fit
        notes.append(
            f"scheduler CPU per step ~ {per_step_ms:.2f} ms + {per_token_us:.0f} us x tokens sampled in the "
            f"step (least squares over these runs, every scheduler process summed): one core's worth drives "
            f"at most ~{1e3 / per_step_ms:,.0f} steps/s, ~{1e6 / per_token_us:,.0f} tokens/s"
            if per_step_ms > 0 and per_token_us > 0
            else f"scheduler CPU per step fit: {per_step_ms:.2f} ms + {per_token_us:.0f} us x tokens sampled"
        )
    notes += short_window_notes(results)
    notes += long_prompt_notes(results)
    peak = max(results, key=lambda r: r.output_tokens_per_s)
    notes.append(
        f"peak {peak.output_tokens_per_s:,.0f} tok/s at {peak.executors} executors x {peak.concurrency} streams: "
        f"scheduler at {peak.scheduler_cores:.2f} cores, {peak.scheduler_cpu_ms_per_step:.2f} ms CPU/step, "
        f"executors busy {peak.executor_busy:.0%} (ideal {peak.ideal_output_tokens_per_s:,.0f} tok/s)"
    )
    return notes


def _growth_notes(results: Sequence[Result]) -> list[str]:
    """Among runs of one configuration: where more streams or executors raise tokens/s too
    little, or more streams explode TTFT."""
    notes = []
    by_n: dict[int, list[Result]] = {}
    by_c: dict[int, list[Result]] = {}
    for r in results:
        by_n.setdefault(r.executors, []).append(r)
        by_c.setdefault(r.concurrency, []).append(r)
    for n, runs in sorted(by_n.items()):
        for low, high, gain in _saturated(runs, "concurrency"):
            notes.append(
                f"{n} executors: {low.concurrency} -> {high.concurrency} streams raises tokens/s only "
                f"x{gain:.2f} ({low.output_tokens_per_s:,.0f} -> {high.output_tokens_per_s:,.0f})"
            )
        base = runs[0].ttft_p99_ms
        for r in runs[1:]:
            if base and r.ttft_p99_ms and r.ttft_p99_ms > TTFT_EXPLODED * base:
                notes.append(
                    f"{n} executors: TTFT p99 at {r.concurrency} streams is {r.ttft_p99_ms:,.0f} ms, "
                    f"x{r.ttft_p99_ms / base:.0f} its {base:,.0f} ms at {runs[0].concurrency}"
                )
    for c, runs in sorted(by_c.items()):
        for low, high, gain in _saturated(runs, "executors"):
            notes.append(
                f"{c} streams: {low.executors} -> {high.executors} executors raises tokens/s only x{gain:.2f}"
            )
    return notes


def short_window_notes(results: Sequence[Result]) -> list[str]:
    """Configurations whose window is shorter than a request's mean life (streams over the
    sustained requests/s): their requests/s, TTFT and end-to-end times come from the few
    requests that began or ended in the window (at 64 executors x 4,096 streams on 2 cores a
    request lives about 27 s: a 10 s window saw no first token at all)."""
    notes = []
    for r in results:
        if r.sustained_requests_per_s <= 0:
            continue
        life_s = r.concurrency / r.sustained_requests_per_s
        if life_s > r.window_s:
            notes.append(
                f"{r.executors} executors x {r.concurrency} streams: a request lives ~{life_s:.0f} s, longer "
                f"than the {r.window_s:.0f} s window: its req/s, TTFT and e2e come from the few requests "
                f"that began or ended in it (--duration {math.ceil(2 * life_s)} or more sees whole lives)"
            )
    return notes


def cost_model(results: Sequence[Result]) -> tuple[float, float] | None:
    """(ms per step, us per token): the line through scheduler CPU per step against the output
    tokens sampled per step (one per sequence, or up to `--num-scheduler-steps`), by least
    squares; None when the runs do not spread enough to fit."""
    points = [
        (r.output_tokens_per_s / r.steps_per_s, r.scheduler_cpu_ms_per_step)
        for r in results
        if r.steps_per_s > 0
    ]
    points = [(x, y) for x, y in points if not math.isnan(y)]
    if len(points) < 2 or max(x for x, _ in points) - min(x for x, _ in points) < 4:
        return None
    slope, intercept = statistics.linear_regression(*zip(*points, strict=True))
    return intercept, 1e3 * slope


def long_prompt_notes(results: Sequence[Result]) -> list[str]:
    """How far the long prompts move each configuration's ITL p99 over its decode-only window."""
    return [
        f"{e['configuration']}: {e['load']} move the streams' ITL p99 by "
        f"{format_change(e['itl_p99_change'])} "
        f"({cell(e['decode_only_itl_p99_ms'], ',.1f')} -> {cell(e['itl_p99_ms'], ',.1f')} ms); "
        f"long-prompt TTFT p50/p99 {cell(e['long_ttft_p50_ms'], ',.0f')}/{cell(e['long_ttft_p99_ms'], ',.0f')} ms"
        for e in effects(scale_points(results))
    ]
