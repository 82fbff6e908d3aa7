"""What `npuserve bench` measures per request, and its summary per variant.

Times are `time.perf_counter()` seconds as the client saw them. TTFT runs from sending a request to
its first token; ITL is the gap between consecutive tokens of one request (tokens that arrive in
the same response share a time, so their gap is 0); TPOT is a request's decode time over its
output tokens after the first; e2e runs from sending to the last token. Throughputs count the
tokens of successful requests over the run's duration (first send to last completion). The
table, JSON and plot are `report`'s.

Under a mixed load (`WorkloadConfig.long_prompts`) the summary also splits the requests: the
decode streams (every request but the long prompts: their TTFT and ITL) and the long prompts
(their TTFT). Without long prompts the decode streams are every request.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from npuserve.deploy.bench.report import LatencyStats


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it."""

    prompt_tokens: int
    send_time: float
    token_times: list[float] = field(default_factory=list)  # one per output token
    end_time: float | None = None
    cached_prompt_tokens: int = 0  # from the final usage
    error: str | None = None
    long_prompt: bool = False  # one of a mixed load's long prompts

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


# A summary row's counts and throughputs, before its latencies.
ROW_COUNTS = (
    "variant", "num_requests", "num_failed", "duration_s", "prompt_tokens", "output_tokens",
    "cached_prompt_tokens", "request_throughput", "output_throughput", "total_token_throughput",
    "prefix_cache_hit_rate", "num_long_prompts",
)  # fmt: skip


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
    decode_ttft_ms: LatencyStats  # the decode streams': every request but the long prompts
    decode_itl_ms: LatencyStats
    long_prompt_ttft_ms: LatencyStats
    num_long_prompts: int = 0
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
        row: dict[str, Any] = {name: getattr(self, name) for name in ROW_COUNTS}
        for name in ("ttft", "tpot", "itl", "e2e", "decode_ttft", "decode_itl", "long_prompt_ttft"):
            for stat, value in asdict(getattr(self, f"{name}_ms")).items():
                row[f"{name}_{stat}_ms"] = value
        row["first_error"] = self.first_error
        return row


def summarize(variant: str, records: Sequence[RequestRecord], duration_s: float) -> BenchSummary:
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    tpots = [t for t in (r.tpot for r in done) if t is not None]
    decode = [r for r in done if not r.long_prompt]
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
        decode_ttft_ms=LatencyStats.of_seconds([r.ttft for r in decode]),
        decode_itl_ms=LatencyStats.of_seconds([gap for r in decode for gap in r.itls]),
        long_prompt_ttft_ms=LatencyStats.of_seconds([r.ttft for r in done if r.long_prompt]),
        num_long_prompts=sum(r.long_prompt for r in records),
        first_error=next((r.error or "no tokens" for r in failed), None),
    )
