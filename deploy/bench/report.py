"""What every benchmark reports, and how: percentiles, text tables, JSON files and plots.

The serving bench (`serving`), the runner bench (`runner`) and the scale bench (`scale`) each
measure their own things; here is how their numbers become a table on stdout, a JSON file and a
PNG. Results go where ``--output-json``/``--plot`` say; JSON without a path goes to
``./bench-results/`` (`save_json`). Plots need matplotlib (``pip install matplotlib``).
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from npuserve.deploy.bench.machine import MachineInfo
    from npuserve.deploy.bench.runner import CaseResult
    from npuserve.deploy.bench.scale_measure import Result
    from npuserve.deploy.bench.serving_metrics import BenchSummary

PERCENTILES = (50, 90, 99)
RESULTS_DIR = Path("bench-results")


# -- numbers ------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile, interpolated linearly between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    return float(np.percentile(values, q))


@dataclass(slots=True, frozen=True)
class LatencyStats:
    """Mean and percentiles in milliseconds; None when there was nothing to measure."""

    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> LatencyStats:
        if not values:
            return cls(None, None, None, None)
        ms = [v * 1000 for v in values]
        p50, p90, p99 = (percentile(ms, q) for q in PERCENTILES)
        return cls(sum(ms) / len(ms), p50, p90, p99)


def cell(value: float | None, fmt: str) -> str:
    """``value`` formatted, or "-" when there is none (None or NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt)


def ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None


# -- files --------------------------------------------------------------------------------------


def save_json(given: Path | None, bench: str, payload: Any) -> None:
    """Writes a bench's results (`write_json`) to ``given``, else to
    ``./bench-results/<bench>-<UTC time>.json``, and says where on stderr."""
    path = given or RESULTS_DIR / f"{bench}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    print(f"results: {write_json(path, payload)}", file=sys.stderr)


def write_json(path: Path, payload: Any) -> Path:
    """``payload`` as indented JSON (infinities become null, paths strings); the folder is made if
    need be."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(payload), indent=2, default=str) + "\n")
    return path


def _finite(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


@contextlib.contextmanager
def figure(
    path: Path, *subplots: int, size: tuple[float, float], dpi: int = 120, title: str = ""
) -> Iterator[Any]:
    """A matplotlib figure of ``subplots`` (rows, columns) axes, saved to ``path`` on exit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*subplots, figsize=size)
    try:
        yield axes
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)


def grouped_bars(
    ax: Any, names: Sequence[str], series: Sequence[tuple[str, Sequence[float | None]]], headroom: float
) -> None:
    """A group of bars per name, in it a bar per series (labelled for a legend; None: no bar);
    the y axis ``headroom`` times the tallest bar, room for the legend."""
    width = 0.8 / len(series)
    top = 0.0
    for k, (label, values) in enumerate(series):
        ys = [value or 0.0 for value in values]
        ax.bar([i + (k - (len(series) - 1) / 2) * width for i in range(len(names))], ys, width, label=label)
        top = max(top, *ys)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylim(0, top * headroom or 1.0)


# -- the serving bench ----------------------------------------------------------------------------

_COUNTS: list[tuple[str, Callable[[BenchSummary], float], str]] = [
    ("successful requests", lambda s: s.num_requests - s.num_failed, ".0f"),
    ("failed requests", lambda s: s.num_failed, ".0f"),
    ("duration (s)", lambda s: s.duration_s, ".2f"),
    ("requests/s", lambda s: s.request_throughput, ".2f"),
    ("output tokens/s", lambda s: s.output_throughput, ".1f"),
    ("total tokens/s", lambda s: s.total_token_throughput, ".1f"),
    ("prefix cache hit rate", lambda s: s.prefix_cache_hit_rate, ".1%"),
]
_LATENCIES = [("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("e2e", "e2e_ms")]
# Under a mixed load: the decode streams' (every request but the long prompts) and the long prompts'.
_MIXED_LATENCIES = [
    ("decode TTFT", "decode_ttft_ms"),
    ("decode ITL", "decode_itl_ms"),
    ("long TTFT", "long_prompt_ttft_ms"),
]
_RATIO_LABELS = [
    ("throughput", "output_throughput"),
    ("TTFT mean", "ttft_mean_ms"),
    ("TTFT p99", "ttft_p99_ms"),
    ("ITL mean", "itl_mean_ms"),
    ("e2e mean", "e2e_mean_ms"),
]


def compare(summaries: Sequence[BenchSummary]) -> list[dict[str, Any]]:
    """Every variant after the first over the first: output throughput and latency ratios."""
    base = summaries[0].row() if summaries else {}
    out = []
    for summary in summaries[1:]:
        row = summary.row()
        ratios = {key: ratio(row[key], base[key]) for _, key in _RATIO_LABELS}
        out.append({"variant": summary.variant, "baseline": summaries[0].variant, **ratios})
    return out


def median_round(rounds: Sequence[Sequence[BenchSummary]]) -> list[BenchSummary]:
    """Per variant (the rounds' columns), its round of median output throughput (the lower
    middle one for an even count): what the table shows when the variants ran several rounds."""
    columns = zip(*rounds, strict=True)
    return [sorted(c, key=lambda s: s.output_throughput)[(len(c) - 1) // 2] for c in columns]


def round_ratios(rounds: Sequence[Sequence[BenchSummary]]) -> list[dict[str, Any]]:
    """Every variant after the first over the first, round by round (they ran interleaved, so
    each round's pair shared the machine's state), and the median of those ratios."""
    out = []
    for index in range(1, len(rounds[0])):
        values = [
            r[index].output_throughput / r[0].output_throughput for r in rounds if r[0].output_throughput
        ]
        out.append(
            {
                "variant": rounds[0][index].variant,
                "baseline": rounds[0][0].variant,
                "output_throughput": values,
                "median": statistics.median(values) if values else None,
            }
        )
    return out


def format_round_ratios(rounds: Sequence[Sequence[BenchSummary]]) -> str:
    return "\n".join(
        f"{r['variant']} / {r['baseline']} throughput over {len(rounds)} rounds: "
        + ", ".join(f"{v:.2f}" for v in r["output_throughput"])
        + f"; median {cell(r['median'], '.2f')}"
        for r in round_ratios(rounds)
    )


def format_serving_table(summaries: Sequence[BenchSummary]) -> str:
    """One column per variant, one line per metric (under a mixed load the decode streams' and
    the long prompts' latencies too); then each variant against the first."""
    width = max(12, *(len(s.variant) + 2 for s in summaries))
    header = f"{'metric':<24}" + "".join(f"{s.variant:>{width}}" for s in summaries)
    lines = [header, "-" * len(header)]
    for label, value, fmt in _COUNTS:
        lines.append(f"{label:<24}" + "".join(f"{cell(float(value(s)), fmt):>{width}}" for s in summaries))
    mixed = any(s.num_long_prompts for s in summaries)
    for label, attr in _LATENCIES + (_MIXED_LATENCIES if mixed else []):
        for stat in ("mean", "p50", "p90", "p99"):
            values = [getattr(getattr(s, attr), stat) for s in summaries]
            lines.append(
                f"{f'{label} {stat} (ms)':<24}" + "".join(f"{cell(v, '.2f'):>{width}}" for v in values)
            )
    ratios = compare(summaries)
    if ratios:
        lines.append("")
        for r in ratios:
            extras = ", ".join(f"{name} x{cell(r[key], '.2f')}" for name, key in _RATIO_LABELS[1:])
            lines.append(
                f"{r['variant']} / {r['baseline']} throughput: {r['output_throughput']:.2f} ({extras})"
            )
    return "\n".join(lines)


def serving_json(
    workload: dict[str, Any], rounds: Sequence[Sequence[BenchSummary]], host: MachineInfo
) -> dict[str, Any]:
    """The workload, every variant's summary row (of its median round) and the ratios, each
    round's rows and ratios when there were several, and the machine."""
    summaries = median_round(rounds)
    payload: dict[str, Any] = {
        "workload": workload,
        "variants": [s.row() for s in summaries],
        "ratios": compare(summaries),
        "machine": host.row(),
    }
    if len(rounds) > 1:
        payload["rounds"] = [[s.row() for s in r] for r in rounds]
        payload["round_ratios"] = round_ratios(rounds)
    return payload


def plot_serving(summaries: Sequence[BenchSummary], path: Path, title: str = "") -> None:
    """Output tokens/s, TTFT and ITL (mean, p50, p90, p99) as bars per variant."""
    names = [s.variant for s in summaries]
    with figure(path, 1, 3, size=(13, 4.2), title=title) as axes:
        axes[0].bar(names, [s.output_throughput for s in summaries], color="tab:blue")
        axes[0].set_ylabel("output tokens / s")
        axes[0].set_title("throughput")
        stats = ("mean", "p50", "p90", "p99")
        for ax, (label, attr) in zip(axes[1:], [("TTFT", "ttft_ms"), ("ITL", "itl_ms")], strict=True):
            series = [(stat, [getattr(getattr(s, attr), stat) for s in summaries]) for stat in stats]
            grouped_bars(ax, names, series, 1.25)
            ax.set_ylabel("ms")
            ax.set_title(label)
            ax.legend(ncol=len(stats), fontsize="small", loc="upper center")
        for ax in axes:
            ax.grid(True, axis="y", alpha=0.3)
            ax.tick_params(axis="x", labelrotation=15)


# -- the runner bench -----------------------------------------------------------------------------


def format_runner_table(results: Sequence[CaseResult]) -> str:
    """One line per (dtype, batch size): both engines' decode tokens/s, the ratio, and whether
    the greedy tokens agree (the share of requests whose tokens are identical: bf16 rounding may
    split ties)."""
    header = (
        f"{'dtype':<9} {'batch':>5} {'npuserve tok/s':>15} {'transformers tok/s':>19} "
        f"{'speed-up':>9} {'same tokens':>12}"
    )
    eager = {(r.dtype, r.batch_size): r for r in results if r.engine == "npuserve-eager"}
    if eager:
        header += f" {'eager tok/s':>12} {'graphs':>8} {'same as eager':>14}"
    lines = [header, "-" * len(header)]
    ours = {(r.dtype, r.batch_size): r for r in results if r.engine == "npuserve"}
    theirs = {(r.dtype, r.batch_size): r for r in results if r.engine == "transformers"}
    for key, mine in ours.items():
        other = theirs.get(key)
        ref_tps = f"{other.decode_tokens_per_s:19.1f}" if other else f"{'-':>19}"
        speedup = f"{mine.decode_tokens_per_s / other.decode_tokens_per_s:8.2f}x" if other else f"{'-':>9}"
        same = _same_tokens(mine, other) if other else "-"
        line = f"{key[0]:<9} {key[1]:>5} {mine.decode_tokens_per_s:15.1f} {ref_tps} {speedup} {same:>12}"
        if key in eager:
            base = eager[key]
            line += (
                f" {base.decode_tokens_per_s:12.1f} {mine.decode_tokens_per_s / base.decode_tokens_per_s:7.2f}x"
                f" {_same_tokens(mine, base):>14}"
            )
        lines.append(line)
    return "\n".join(lines)


def _same_tokens(mine: CaseResult, other: CaseResult) -> str:
    """How many of the requests both engines gave the same tokens, of how many."""
    pairs = zip(mine.output_token_ids, other.output_token_ids, strict=True)
    return f"{sum(x == y for x, y in pairs)}/{len(other.output_token_ids)}"


def plot_runner(results: Sequence[CaseResult], path: Path) -> None:
    """Decode tokens/s against batch size, one line per engine and dtype."""
    with figure(path, size=(7, 4.5)) as axes:
        for engine in ("npuserve", "npuserve-eager", "transformers"):
            for dtype in sorted({r.dtype for r in results}):
                points = sorted(
                    (r.batch_size, r.decode_tokens_per_s)
                    for r in results
                    if r.engine == engine and r.dtype == dtype
                )
                if points:
                    xs, ys = zip(*points, strict=True)
                    style = "--s" if engine == "transformers" else "-o" if engine == "npuserve" else ":^"
                    axes.plot(xs, ys, style, label=f"{engine} {dtype}")
        axes.set_xscale("log", base=2)
        axes.set_xlabel("batch size (concurrent requests)")
        axes.set_ylabel("decode tokens / s")
        axes.set_title("ModelRunner decode throughput vs transformers generate")
        axes.grid(True, alpha=0.3)
        axes.legend()


# -- the scale bench ------------------------------------------------------------------------------

SCALE_COLUMNS: list[tuple[str, str, str]] = [
    ("exec", "executors", "d"),
    ("streams", "concurrency", "d"),
    ("req/s", "requests_per_s", ",.1f"),
    ("req/s sust.", "sustained_requests_per_s", ",.1f"),
    ("out tok/s", "output_tokens_per_s", ",.0f"),
    ("steps/s", "steps_per_s", ",.0f"),
    ("ideal steps/s", "ideal_steps_per_s", ",.0f"),
    ("exec busy", "executor_busy", ".1%"),
    ("sched ms CPU/step", "scheduler_cpu_ms_per_step", ".3f"),
    ("sched us CPU/tok", "scheduler_cpu_us_per_token", ".1f"),
    ("front us CPU/tok", "front_cpu_us_per_token", ".1f"),
    ("workers us CPU/tok", "step_workers_cpu_us_per_token", ".1f"),
    ("API procs us CPU/tok", "api_servers_cpu_us_per_token", ".1f"),
    ("workers us CPU/step", "step_workers_cpu_us_per_step", ",.0f"),
    ("seqs/step", "seqs_per_step", ".1f"),
    ("step wall ms", "mean_step_wall_ms", ".1f"),
    ("TTFT p50 ms", "ttft_p50_ms", ",.0f"),
    ("TTFT p99 ms", "ttft_p99_ms", ",.0f"),
    ("ITL p50 ms", "itl_p50_ms", ",.1f"),
    ("ITL p99 ms", "itl_p99_ms", ",.1f"),
    ("engine TTFT ms", "engine_ttft_mean_ms", ",.0f"),
    ("in engine", "engine_requests", ",.0f"),
    ("no token yet", "awaiting_first_token", ",d"),
    ("no token yet, mean", "awaiting_first_token_mean", ",.0f"),
    ("cores sched/exec/client/other", "", ""),
    ("errors", "num_errors", "d"),
]


# After the first two columns, where a sweep had prefill executors or long prompts.
SCALE_DISAGGREGATION_COLUMNS: list[tuple[str, str, str]] = [
    ("prefill", "prefill_executors", "d"),
    ("long/s", "long_prompt_rate", "g"),
    ("long TTFT p50 ms", "long_ttft_p50_ms", ",.0f"),
    ("long TTFT p99 ms", "long_ttft_p99_ms", ",.0f"),
    ("pulled MB/s", "kv_pulled_mb_per_s", ",.0f"),
]


def _scale_columns(results: Sequence[Result]) -> list[tuple[str, str, str]]:
    rounds = [("round", "round", "d")] if any(r.round > 1 for r in results) else []
    if not any(r.prefill_executors or r.long_prompt_rate for r in results):
        return rounds + SCALE_COLUMNS
    return rounds + SCALE_COLUMNS[:2] + SCALE_DISAGGREGATION_COLUMNS + SCALE_COLUMNS[2:]


def _scale_cells(r: Result, columns: list[tuple[str, str, str]]) -> list[str]:
    """A row's cells; the one column without a field (`SCALE_COLUMNS`' cores) its four core counts."""
    cores = "/".join(
        f"{c:.2f}" for c in (r.scheduler_cores, r.executors_cores, r.client_cores, r.other_cores)
    )
    return [cell(getattr(r, attr), fmt) if attr else cores for _, attr, fmt in columns]


def format_scale_table(results: Sequence[Result]) -> str:
    columns = _scale_columns(results)
    rows = [[title for title, _, _ in columns], *(_scale_cells(r, columns) for r in results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(width) for c, width in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def plot_scale(results: Sequence[Result], path: Path) -> None:
    panels = [
        ("output tokens/s", "output_tokens_per_s"),
        ("steps/s (dashed: ideal)", "steps_per_s"),
        ("scheduler CPU ms per step", "scheduler_cpu_ms_per_step"),
        ("TTFT p99 (ms)", "ttft_p99_ms"),
    ]
    title = "one scheduler over simulated executors\n(client, scheduler and executors share the machine)"
    with figure(path, 2, 2, size=(11, 8), dpi=110, title=title) as grid:
        axes = list(grid.flat)
        for ax, (panel, attr) in zip(axes, panels, strict=True):
            for n in sorted({r.executors for r in results}):
                runs = sorted((r for r in results if r.executors == n), key=lambda r: r.concurrency)
                xs = [r.concurrency for r in runs]
                line = ax.plot(
                    xs, [getattr(r, attr) or math.nan for r in runs], marker="o", label=f"{n} executors"
                )
                if attr == "steps_per_s":
                    ax.plot(xs, [r.ideal_steps_per_s for r in runs], ls="--", color=line[0].get_color())
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent streams")
            ax.set_title(panel)
            ax.grid(alpha=0.3)
            if attr in ("steps_per_s", "ttft_p99_ms"):
                ax.set_yscale("log")
        axes[0].legend()
