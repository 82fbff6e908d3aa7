"""Prefill/decode disaggregation's report, from either bench: how far long prompts arriving move
the decode streams' inter-token latency, colocated and with prefill executors.

Both benches reduce their results to `LoadPoint`s: one configuration (all executors mixed, or
some of them prefill) under one load (the decode streams alone, or with long prompts arriving).
`effects` pairs each configuration's loads: how much the long prompts change its decode ITL p99
(and p50) over the decode-only load. The serving bench (`npuserve bench --compare
colocated,disaggregated`) runs both loads per configuration, in rounds; the scale bench
(`npuserve bench-scale --prefill-executors 0,1 --long-prompt-rate 0,R`) one window each.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from npuserve.deploy.bench.report import cell, figure, grouped_bars
from npuserve.deploy.bench.variants import DECODE_ONLY, DISAGGREGATION_VARIANTS

if TYPE_CHECKING:
    from npuserve.deploy.bench.scale_measure import Result
    from npuserve.deploy.bench.serving_metrics import BenchSummary

DECODE_ONLY_LOAD = "decode only"


@dataclass(slots=True, frozen=True)
class LoadPoint:
    """One configuration under one load: the decode streams' latencies, the long prompts' TTFT."""

    configuration: str  # e.g. "colocated", "disaggregated", "16 executors, 1 prefill x 256 streams"
    load: str  # `DECODE_ONLY_LOAD`, or which long prompts arrived
    output_tokens_per_s: float
    itl_p50_ms: float | None  # the decode streams'
    itl_p99_ms: float | None
    ttft_p50_ms: float | None  # the decode streams'
    ttft_p99_ms: float | None
    long_ttft_p50_ms: float | None = None
    long_ttft_p99_ms: float | None = None

    @property
    def mixed(self) -> bool:
        return self.load != DECODE_ONLY_LOAD


# A point's measures, which the scale bench's `Result` names alike.
MEASURES = [field.name for field in dataclasses.fields(LoadPoint)][2:]


def serving_points(summaries: Sequence[BenchSummary], label: str = "") -> list[LoadPoint]:
    """The serving bench's ``colocated`` and ``disaggregated`` variants (others are left out),
    their configurations followed by ``label``."""
    points = []
    for s in summaries:
        configuration = s.variant.removesuffix(DECODE_ONLY)
        if configuration not in DISAGGREGATION_VARIANTS:
            continue
        load = DECODE_ONLY_LOAD if s.variant.endswith(DECODE_ONLY) else "long prompts"
        itl, ttft, long_ttft = s.decode_itl_ms, s.decode_ttft_ms, s.long_prompt_ttft_ms
        measures = (s.output_throughput, itl.p50, itl.p99, ttft.p50, ttft.p99, long_ttft.p50, long_ttft.p99)
        points.append(LoadPoint(configuration + label, load, *measures))
    return points


def scale_points(results: Sequence[Result]) -> list[LoadPoint]:
    """The scale bench's runs, when any had prefill executors or long prompts (else none)."""
    if not any(r.prefill_executors or r.long_prompt_rate for r in results):
        return []
    rounds = max(r.round for r in results)
    points = []
    for r in results:
        roles = f"{r.prefill_executors} prefill" if r.prefill_executors else "colocated"
        load = f"{r.long_prompt_rate:g} long prompts/s" if r.long_prompt_rate else DECODE_ONLY_LOAD
        label = f", round {r.round}" if rounds > 1 else ""
        configuration = f"{r.executors} executors, {roles} x {r.concurrency} streams{label}"
        points.append(LoadPoint(configuration, load, **{name: getattr(r, name) for name in MEASURES}))
    return points


def _change(value: float | None, base: float | None) -> float | None:
    """``value`` over ``base``, less one (+0.2: 20% more); None where either is missing."""
    return value / base - 1 if value is not None and base else None


def effects(points: Sequence[LoadPoint]) -> list[dict[str, Any]]:
    """Each loaded point against its configuration's decode-only one: ITL p50/p99 before and
    after, their changes, and the long prompts' TTFT."""
    bases = {p.configuration: p for p in points if not p.mixed}
    out = []
    for point in points:
        base = bases.get(point.configuration)
        if not point.mixed or base is None:
            continue
        out.append(
            {
                "configuration": point.configuration,
                "load": point.load,
                "decode_only_itl_p50_ms": base.itl_p50_ms,
                "itl_p50_ms": point.itl_p50_ms,
                "itl_p50_change": _change(point.itl_p50_ms, base.itl_p50_ms),
                "decode_only_itl_p99_ms": base.itl_p99_ms,
                "itl_p99_ms": point.itl_p99_ms,
                "itl_p99_change": _change(point.itl_p99_ms, base.itl_p99_ms),
                "long_ttft_p50_ms": point.long_ttft_p50_ms,
                "long_ttft_p99_ms": point.long_ttft_p99_ms,
            }
        )
    return out


def serving_effects(rounds: Sequence[Sequence[BenchSummary]]) -> list[dict[str, Any]]:
    """The serving bench's `effects` per configuration and load, round by round, with the median
    of the ITL p99 changes (the rounds ran interleaved: each round's pair shared the machine's
    state); none without a decode-only baseline."""
    per_round = [effects(serving_points(r)) for r in rounds]
    out = []
    for index, first in enumerate(per_round[0] if per_round else []):
        column = [r[index] for r in per_round]
        changes = [e["itl_p99_change"] for e in column if e["itl_p99_change"] is not None]
        out.append(
            {
                "configuration": first["configuration"],
                "load": first["load"],
                "median_itl_p99_change": statistics.median(changes) if changes else None,
                "rounds": column,
            }
        )
    return out


def serving_points_by_round(rounds: Sequence[Sequence[BenchSummary]]) -> list[LoadPoint]:
    """Every round's points, each configuration named with its round when there are several (a
    variant's median round may not be its baseline's: the plot shows each pair as it ran)."""
    if len(rounds) == 1:
        return serving_points(rounds[0])
    return [p for i, r in enumerate(rounds) for p in serving_points(r, f", round {i + 1}")]


def format_change(change: float | None) -> str:
    """A `_change` as a signed percentage ("+20%"), "-" where it is missing."""
    return "-" if change is None else f"{change:+.0%}"


def format_effects(over_rounds: Sequence[dict[str, Any]]) -> str:
    """A line per configuration: how far the long prompts move its decode ITL p99, each round."""
    lines = []
    for entry in over_rounds:
        rounds = entry["rounds"]
        each = ", ".join(
            f"{cell(e['decode_only_itl_p99_ms'], ',.1f')} -> {cell(e['itl_p99_ms'], ',.1f')} ms "
            f"({format_change(e['itl_p99_change'])})"
            for e in rounds
        )
        ttft = ", ".join(
            f"{cell(e['long_ttft_p50_ms'], ',.0f')}/{cell(e['long_ttft_p99_ms'], ',.0f')}" for e in rounds
        )
        lines.append(
            f"{entry['configuration']}: {entry['load']} move decode ITL p99 by "
            f"{format_change(entry['median_itl_p99_change'])} (median of {len(rounds)}: {each}); "
            f"long-prompt TTFT p50/p99 ms: {ttft}"
        )
    return "\n".join(lines)


def _tick_labels(configurations: list[str]) -> tuple[list[str], list[str]]:
    """Short names for the configurations: their parts ("16 executors", "1 prefill", "128
    streams", "round 1") but those every one shares, a line each; and the shared parts."""
    parts = [re.split(r", | x ", c) for c in configurations]
    shared = [part for part in parts[0] if all(part in p for p in parts)] if len(parts) > 1 else []
    return ["\n".join(part for part in p if part not in shared) for p in parts], shared


def plot_points(points: Sequence[LoadPoint], path: Path, title: str = "") -> None:
    """Per configuration, bars for each load: the decode streams' ITL p50 and p99, the long
    prompts' TTFT p50 and p99, and output tokens/s."""
    configurations = list(dict.fromkeys(p.configuration for p in points))
    loads = list(dict.fromkeys(p.load for p in points))
    by_key = {(p.configuration, p.load): p for p in points}
    names, shared = _tick_labels(configurations)
    panels = [
        ("decode ITL p50 (ms)", "itl_p50_ms"),
        ("decode ITL p99 (ms)", "itl_p99_ms"),
        ("long-prompt TTFT p50 (ms)", "long_ttft_p50_ms"),
        ("long-prompt TTFT p99 (ms)", "long_ttft_p99_ms"),
        ("output tokens/s", "output_tokens_per_s"),
    ]
    title += f" ({', '.join(shared)})" if shared else ""
    with figure(path, 1, len(panels), size=(4 * len(panels), 4.6), title=title) as axes:
        for ax, (label, attr) in zip(axes, panels, strict=True):
            series = [
                (load, [getattr(by_key.get((c, load)), attr, None) for c in configurations]) for load in loads
            ]
            grouped_bars(ax, names, series, 1.5)
            ax.set_title(label)
            ax.grid(True, axis="y", alpha=0.3)
            ax.tick_params(axis="x", labelsize="small")
        axes[0].legend(fontsize="small", loc="upper left")
