"""What `npuserve bench` reports: per-request timings, their summary, and the table, JSON and plot.

Times are `time.perf_counter()` seconds as the client saw them. TTFT runs from sending a request to
its first token; ITL is the gap between consecutive tokens of one request (tokens that arrive in
the same response share a time, so their gap is 0); TPOT is a request's decode time over its
output tokens after the first; e2e runs from sending to the last token. Throughputs count the
tokens of successful requests over the run's duration (first send to last completion).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it."""

    prompt_tokens: int
    send_time: float
    token_times: list[float] = field(default_factory=list)  # one per output token
    end_time: float | None = None
    cached_prompt_tokens: int = 0  # from the final usage
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_time is not None and bool(self.token_times)

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.send_time

    @property
    def e2e(self) -> float:
        assert self.end_time is not None
        return self.end_time - self.send_time

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.token_times)]

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile, interpolated linearly between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


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


@dataclass(slots=True)
class BenchSummary:
    variant: str
    num_requests: int
    num_failed: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    cached_prompt_tokens: int
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2e_ms: LatencyStats
    first_error: str | None = None

    @property
    def request_throughput(self) -> float:
        return (self.num_requests - self.num_failed) / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def total_token_throughput(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def row(self) -> dict[str, Any]:
        """A flat dict for JSON: counts, throughputs, and `<metric>_<stat>_ms` latencies."""
        row: dict[str, Any] = {
            "variant": self.variant,
            "num_requests": self.num_requests,
            "num_failed": self.num_failed,
            "duration_s": self.duration_s,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
        }
        for name in ("ttft", "tpot", "itl", "e2e"):
            for stat, value in asdict(getattr(self, f"{name}_ms")).items():
                row[f"{name}_{stat}_ms"] = value
        row["first_error"] = self.first_error
        return row


def summarize(variant: str, records: Sequence[RequestRecord], duration_s: float) -> BenchSummary:
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    tpots = [t for t in (r.tpot for r in done) if t is not None]
    return BenchSummary(
        variant=variant,
        num_requests=len(records),
        num_failed=len(failed),
        duration_s=duration_s,
        prompt_tokens=sum(r.prompt_tokens for r in done),
        output_tokens=sum(r.output_tokens for r in done),
        cached_prompt_tokens=sum(r.cached_prompt_tokens for r in done),
        ttft_ms=LatencyStats.of_seconds([r.ttft for r in done]),
        tpot_ms=LatencyStats.of_seconds(tpots),
        itl_ms=LatencyStats.of_seconds([gap for r in done for gap in r.itls]),
        e2e_ms=LatencyStats.of_seconds([r.e2e for r in done]),
        first_error=next((r.error or "no tokens" for r in failed), None),
    )


# -- the table ------------------------------------------------------------------------------------

_COUNTS: list[tuple[str, str, str]] = [
    ("successful requests", "ok", "{:.0f}"),
    ("failed requests", "num_failed", "{:.0f}"),
    ("duration (s)", "duration_s", "{:.2f}"),
    ("requests/s", "request_throughput", "{:.2f}"),
    ("output tokens/s", "output_throughput", "{:.1f}"),
    ("total tokens/s", "total_token_throughput", "{:.1f}"),
    ("prefix cache hit rate", "prefix_cache_hit_rate", "{:.1%}"),
]
_LATENCIES = [("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("e2e", "e2e_ms")]


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def format_table(summaries: Sequence[BenchSummary]) -> str:
    """One column per variant, one line per metric; then each variant against the first."""
    width = max(12, *(len(s.variant) + 2 for s in summaries))
    header = f"{'metric':<24}" + "".join(f"{s.variant:>{width}}" for s in summaries)
    lines = [header, "-" * len(header)]
    for label, attr, fmt in _COUNTS:
        values = [
            s.num_requests - s.num_failed if attr == "ok" else float(getattr(s, attr)) for s in summaries
        ]
        lines.append(f"{label:<24}" + "".join(f"{_cell(v, fmt):>{width}}" for v in values))
    for label, attr in _LATENCIES:
        for stat in ("mean", "p50", "p90", "p99"):
            values = [getattr(getattr(s, attr), stat) for s in summaries]
            lines.append(
                f"{f'{label} {stat} (ms)':<24}" + "".join(f"{_cell(v, '{:.2f}'):>{width}}" for v in values)
            )
    ratios = compare(summaries)
    if ratios:
        lines.append("")
        for r in ratios:
            extras = ", ".join(f"{name} x{_cell(r[key], '{:.2f}')}" for name, key in _RATIO_LABELS[1:])
            lines.append(
                f"{r['variant']} / {r['baseline']} throughput: {r['output_throughput']:.2f} ({extras})"
            )
    return "\n".join(lines)


_RATIO_LABELS = [
    ("throughput", "output_throughput"),
    ("TTFT mean", "ttft_mean_ms"),
    ("TTFT p99", "ttft_p99_ms"),
    ("ITL mean", "itl_mean_ms"),
    ("e2e mean", "e2e_mean_ms"),
]


def compare(summaries: Sequence[BenchSummary]) -> list[dict[str, Any]]:
    """Every variant after the first over the first: output throughput and latency ratios."""
    if len(summaries) < 2:
        return []
    base = summaries[0].row()
    out = []
    for summary in summaries[1:]:
        row = summary.row()
        ratio: dict[str, Any] = {"variant": summary.variant, "baseline": summaries[0].variant}
        for _, key in _RATIO_LABELS:
            ratio[key] = row[key] / base[key] if row[key] is not None and base[key] else None
        out.append(ratio)
    return out


# -- JSON and plot --------------------------------------------------------------------------------


def write_json(path: Path, workload: dict[str, Any], summaries: Sequence[BenchSummary]) -> None:
    """The workload, every variant's summary row and the ratios; infinities become null."""
    payload = {
        "workload": {k: None if isinstance(v, float) and math.isinf(v) else v for k, v in workload.items()},
        "variants": [s.row() for s in summaries],
        "ratios": compare(summaries),
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")


def plot(summaries: Sequence[BenchSummary], path: Path, title: str = "") -> None:
    """Output tokens/s, TTFT and ITL (mean, p50, p90, p99) as bars per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s.variant for s in summaries]
    figure, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    axes[0].bar(names, [s.output_throughput for s in summaries], color="tab:blue")
    axes[0].set_ylabel("output tokens / s")
    axes[0].set_title("throughput")
    stats = ("mean", "p50", "p90", "p99")
    bar_width = 0.8 / len(stats)
    for ax, (label, attr) in zip(axes[1:], [("TTFT", "ttft_ms"), ("ITL", "itl_ms")], strict=True):
        top = 0.0
        for k, stat in enumerate(stats):
            xs = [i + (k - (len(stats) - 1) / 2) * bar_width for i in range(len(names))]
            ys = [getattr(getattr(s, attr), stat) or 0.0 for s in summaries]
            ax.bar(xs, ys, bar_width, label=stat)
            top = max(top, *ys)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylim(0, top * 1.25 or 1.0)  # headroom for the legend
        ax.set_ylabel("ms")
        ax.set_title(label)
        ax.legend(ncol=len(stats), fontsize="small", loc="upper center")
    for ax in axes:
        ax.grid(True, axis="y", alpha=0.3)
        ax.tick_params(axis="x", labelrotation=15)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
