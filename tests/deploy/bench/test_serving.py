"""`npuserve bench`: workload generation, summary math, reports, and offline and gRPC runs on
stories260K."""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import pytest

from npuserve.deploy.bench import machine, report
from npuserve.deploy.bench import serving as benchmark
from npuserve.deploy.bench.report import LatencyStats, compare, format_serving_table, percentile
from npuserve.deploy.bench.serving_metrics import BenchSummary, RequestRecord, summarize
from npuserve.deploy.bench.workload import FIRST_TOKEN_ID, WorkloadConfig, build_workload, warmup_requests

VOCAB = 512


# -- workload -----------------------------------------------------------------------------------------


def test_workload_lengths_and_token_ids_in_range() -> None:
    config = WorkloadConfig(num_requests=50, prompt_len_min=10, prompt_len_max=20, seed=3)
    requests = build_workload(config, VOCAB)
    assert [r.index for r in requests] == list(range(50))
    lengths = {len(r.prompt_token_ids) for r in requests}
    assert min(lengths) >= 10 and max(lengths) <= 20 and len(lengths) > 1
    assert all(FIRST_TOKEN_ID <= t < VOCAB for r in requests for t in r.prompt_token_ids)
    assert all(r.arrival_s == 0 for r in requests)  # rate inf: all at once


def test_shared_prefix_leads_every_prompt() -> None:
    config = WorkloadConfig(num_requests=8, prompt_len_min=24, prompt_len_max=40, shared_prefix_len=16)
    requests = build_workload(config, VOCAB)
    prefix = requests[0].prompt_token_ids[:16]
    assert all(r.prompt_token_ids[:16] == prefix for r in requests)
    assert len({tuple(r.prompt_token_ids[16:]) for r in requests}) == 8  # the rest differs
    no_prefix = build_workload(WorkloadConfig(num_requests=8, prompt_len_min=24, prompt_len_max=40), VOCAB)
    assert len({tuple(r.prompt_token_ids[:16]) for r in no_prefix}) == 8


def test_workload_is_reproducible_per_seed() -> None:
    def prompts(seed: int, rate: float = math.inf) -> list[list[int]]:
        config = WorkloadConfig(
            num_requests=6, prompt_len_min=8, prompt_len_max=32, seed=seed, request_rate=rate
        )
        return [r.prompt_token_ids for r in build_workload(config, VOCAB)]

    assert prompts(7) == prompts(7)
    assert prompts(7) != prompts(8)
    assert prompts(7, rate=5.0) == prompts(7)  # arrivals draw from their own stream


def test_poisson_arrivals_have_the_requested_mean_rate() -> None:
    config = WorkloadConfig(num_requests=4000, prompt_len_min=1, prompt_len_max=1, request_rate=20.0)
    arrivals = [r.arrival_s for r in build_workload(config, VOCAB)]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(1 / 20.0, rel=0.05)
    # exponential gaps: the standard deviation equals the mean
    std = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert std == pytest.approx(mean, rel=0.1)


def test_warmup_has_the_workload_shapes_but_its_own_tokens() -> None:
    config = WorkloadConfig(num_requests=64, prompt_len_min=100, prompt_len_max=200, shared_prefix_len=50)
    workload = build_workload(config, VOCAB)
    warmup = warmup_requests(config, VOCAB, token_budget=1000)
    assert 2 <= len(warmup) < 10
    assert sum(len(r.prompt_token_ids) for r in warmup) <= 1000
    assert all(100 <= len(r.prompt_token_ids) <= 200 for r in warmup)
    prefixes = {tuple(r.prompt_token_ids[:16]) for r in workload}
    assert not any(tuple(r.prompt_token_ids[:16]) in prefixes for r in warmup)
    assert len(warmup_requests(config, VOCAB, token_budget=1)) == 2  # at least two


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_requests": 0},
        {"prompt_len_min": 10, "prompt_len_max": 5},
        {"output_len": 0},
        {"prompt_len_min": 8, "shared_prefix_len": 9},
        {"request_rate": 0.0},
    ],
)
def test_workload_config_rejects_bad_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        WorkloadConfig(**kwargs)  # type: ignore[arg-type]


# -- summary math -------------------------------------------------------------------------------------


def test_percentile_interpolates_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile([5.0], 99) == 5.0
    assert LatencyStats.of_seconds([]) == LatencyStats(None, None, None, None)


def test_summary_on_hand_made_timings() -> None:
    records = [
        # sent at 0: tokens at 0.1, 0.2, 0.4 -> TTFT 100 ms, ITLs 100 and 200 ms, e2e 400 ms
        RequestRecord(10, 0.0, [0.1, 0.2, 0.4], end_time=0.4, cached_prompt_tokens=0),
        # sent at 1: tokens at 1.3, 1.4, 1.5 -> TTFT 300 ms, ITLs 100 and 100 ms, e2e 500 ms
        RequestRecord(30, 1.0, [1.3, 1.4, 1.5], end_time=1.5, cached_prompt_tokens=16),
        RequestRecord(99, 0.5, [], error="UNAVAILABLE: gone"),  # failed: counted, not measured
    ]
    s = summarize("x", records, duration_s=2.0)
    assert (s.num_requests, s.num_failed, s.first_error) == (3, 1, "UNAVAILABLE: gone")
    assert (s.prompt_tokens, s.output_tokens, s.cached_prompt_tokens) == (40, 6, 16)
    assert s.request_throughput == pytest.approx(1.0)
    assert s.output_throughput == pytest.approx(3.0)
    assert s.total_token_throughput == pytest.approx(23.0)
    assert s.prefix_cache_hit_rate == pytest.approx(0.4)
    assert s.ttft_ms.mean == pytest.approx(200) and s.ttft_ms.p50 == pytest.approx(200)
    assert s.ttft_ms.p99 == pytest.approx(298)
    assert s.itl_ms.mean == pytest.approx(125) and s.itl_ms.p50 == pytest.approx(100)
    assert s.tpot_ms.mean == pytest.approx(125)  # (150 + 100) / 2
    assert s.e2e_ms.mean == pytest.approx(450)
    row = s.row()
    assert row["ttft_p90_ms"] == pytest.approx(280) and row["variant"] == "x"


def test_table_json_and_ratios(tmp_path: Path) -> None:
    fast = summarize("offline", [RequestRecord(10, 0.0, [0.1, 0.2], end_time=0.2)], duration_s=1.0)
    slow = summarize("grpc", [RequestRecord(10, 0.0, [0.2, 0.4], end_time=0.4)], duration_s=2.0)
    (ratio,) = compare([fast, slow])
    assert ratio["output_throughput"] == pytest.approx(0.5)
    assert ratio["ttft_mean_ms"] == pytest.approx(2.0)
    table = format_serving_table([fast, slow])
    assert "grpc / offline throughput: 0.50" in table
    assert "TTFT p99 (ms)" in table and "offline" in table.splitlines()[0]
    path = tmp_path / "bench.json"
    host = machine.describe()
    report.write_json(
        path, report.serving_json({"num_requests": 1, "request_rate": math.inf}, [[fast, slow]], host)
    )
    payload = json.loads(path.read_text())
    assert payload["workload"]["request_rate"] is None
    assert [v["variant"] for v in payload["variants"]] == ["offline", "grpc"]
    assert payload["ratios"][0]["output_throughput"] == pytest.approx(0.5)
    assert payload["machine"]["python_ns_per_op"] == host.python_ns_per_op > 0
    assert "rounds" not in payload


def summary_at(variant: str, duration_s: float) -> BenchSummary:
    """A variant's summary of one request whose one output token took ``duration_s``."""
    return summarize(variant, [RequestRecord(10, 0.0, [0.1], end_time=duration_s)], duration_s=duration_s)


def test_rounds_report_the_median_round_and_each_rounds_ratio(tmp_path: Path) -> None:
    """With --repeat, each variant's table column is its median round, and the ratios are taken
    round by round (the variants ran interleaved) and their median reported."""
    rounds = [
        [summary_at("offline", 1.0), summary_at("grpc", 1.1)],  # grpc 10/11 of offline
        [summary_at("offline", 2.0), summary_at("grpc", 1.0)],  # x2: offline had a slow round
        [summary_at("offline", 1.0), summary_at("grpc", 1.25)],  # x0.8
    ]
    median = report.median_round(rounds)
    assert [s.output_throughput for s in median] == [pytest.approx(1.0), pytest.approx(1 / 1.1)]
    (ratios,) = report.round_ratios(rounds)
    assert ratios["output_throughput"] == [pytest.approx(1 / 1.1), pytest.approx(2.0), pytest.approx(0.8)]
    assert ratios["median"] == pytest.approx(1 / 1.1)
    assert report.format_round_ratios(rounds) == (
        "grpc / offline throughput over 3 rounds: 0.91, 2.00, 0.80; median 0.91"
    )
    path = report.write_json(tmp_path / "b.json", report.serving_json({}, rounds, machine.describe()))
    payload = json.loads(path.read_text())
    assert [len(r) for r in payload["rounds"]] == [2, 2, 2]
    assert payload["round_ratios"][0]["median"] == pytest.approx(1 / 1.1)
    assert payload["ratios"][0]["output_throughput"] == pytest.approx(1 / 1.1)  # median rounds


def test_repeat_must_be_positive() -> None:
    assert benchmark.run_bench(_args("--repeat", "0")) == 2


# -- variants and flags ---------------------------------------------------------------------------------


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    benchmark.add_bench_flags(parser)
    return parser.parse_args(list(argv))


def test_variants_from_mode_and_compare() -> None:
    names = lambda *argv: [v.name for v in benchmark.parse_variants(_args("--model", "m", *argv))]  # noqa: E731
    assert names() == ["offline"]
    assert names("--address", "h:1") == ["grpc"]
    assert names("--compare", "offline,grpc-stream") == ["offline", "grpc-stream"]
    assert names("--compare", "host-tier", "--kv-cache-memory", "0.5") == ["host-tier-on", "host-tier-off"]
    on, off = benchmark.parse_variants(
        _args("--model", "m", "--compare", "host-tier", "--kv-cache-memory", "0.5")
    )
    assert (on.kv_host_memory_gib, off.kv_host_memory_gib) == (2.0, 0.0)
    variants = benchmark.parse_variants(_args("--model", "m", "--compare", "caching"))
    assert [(v.kind, v.enable_prefix_caching) for v in variants] == [("offline", True), ("offline", False)]
    (grpc,) = benchmark.parse_variants(_args("--model", "m", "--mode", "grpc"))
    assert grpc.kind == "grpc"
    for bad in ("offline,offline", "offline,nope"):
        with pytest.raises(ValueError):
            benchmark.parse_variants(_args("--model", "m", "--compare", bad))


def test_launched_server_gets_the_offline_engine_flags() -> None:
    args = _args("--model", "m", "--kv-cache-memory", "0.5", "--num-executors", "2")
    variant = benchmark.Variant("grpc-stream", "grpc", False)
    spec = benchmark._server_spec(args, "m", "dummy", variant)
    executor = dict(flag.split("=", 1) for flag in spec.executor_args if "=" in flag)
    assert executor["--model"] == "m" and executor["--kv-cache-memory"] == "0.5"
    assert executor["--load-format"] == "dummy" and executor["--max-num-seqs"] == "256"
    assert executor["--log-level"] == "warning"
    assert "--block-size" not in executor  # unset flags keep the executor's defaults
    scheduler = dict(flag.split("=", 1) for flag in spec.scheduler_args if "=" in flag)
    assert scheduler["--model"] == "m" and "--async-scheduling" in spec.scheduler_args
    assert "--no-enable-prefix-caching" in spec.scheduler_args
    assert spec.num_executors == 2


# -- offline runs on the shared tiny model -------------------------------------------------------------


def _offline(stories_dir: Path, enable_prefix_caching: bool = True) -> benchmark.OfflineTarget:
    from npuserve.executor.config import ExecutorConfig

    config = ExecutorConfig(model=str(stories_dir), kv_cache_memory_gib=0.05)
    return benchmark.OfflineTarget(config, enable_prefix_caching=enable_prefix_caching)


def test_offline_run_produces_every_token(stories_dir: Path) -> None:
    config = WorkloadConfig(num_requests=8, prompt_len_min=16, prompt_len_max=48, output_len=8)
    requests = build_workload(config, VOCAB)
    warmup = warmup_requests(config, VOCAB)
    s = benchmark.measure(_offline(stories_dir), config, requests, warmup)
    assert (s.num_requests, s.num_failed, s.output_tokens) == (8, 0, 8 * 8)
    assert s.prompt_tokens == sum(len(r.prompt_token_ids) for r in requests)
    assert s.duration_s > 0 and s.output_throughput > 0
    for stats in (s.ttft_ms, s.itl_ms, s.tpot_ms, s.e2e_ms):
        assert stats.mean is not None and stats.mean > 0
        assert stats.p50 is not None and stats.p99 is not None and 0 <= stats.p50 <= stats.p99
    assert s.ttft_ms.mean <= s.e2e_ms.mean  # type: ignore[operator]


def test_shared_prefix_hits_the_cache_only_with_caching_on(stories_dir: Path) -> None:
    config = WorkloadConfig(
        num_requests=8, prompt_len_min=40, prompt_len_max=48, output_len=4, shared_prefix_len=32
    )
    requests = build_workload(config, VOCAB)
    on = benchmark.measure(_offline(stories_dir, True), config, requests)
    off = benchmark.measure(_offline(stories_dir, False), config, requests)
    assert on.num_failed == off.num_failed == 0
    assert on.cached_prompt_tokens > 0 and on.prefix_cache_hit_rate > 0
    assert off.cached_prompt_tokens == 0 and off.prefix_cache_hit_rate == 0


@pytest.mark.slow
def test_run_bench_compares_caching_and_writes_json_and_plot(
    stories_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    args = _args(
        *("--model", str(stories_dir), "--compare", "caching", "--kv-cache-memory", "0.05"),
        *("--num-requests", "4", "--prompt-len-min", "40", "--prompt-len-max", "48"),
        *("--output-len", "4", "--shared-prefix-len", "32", "--disable-tqdm"),
        *("--output-json", str(out), "--plot", str(png)),
    )
    assert benchmark.run_bench(args) == 0
    printed = capsys.readouterr().out
    assert "prefix-cache-off / prefix-cache-on throughput:" in printed
    payload = json.loads(out.read_text())
    hits = {v["variant"]: v["cached_prompt_tokens"] for v in payload["variants"]}
    assert hits["prefix-cache-on"] > 0 and hits["prefix-cache-off"] == 0
    assert png.stat().st_size > 0


def test_run_bench_reports_a_workload_too_long_for_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    args = _args(  # no --model: the bundled stories260K
        *("--kv-cache-memory", "0.05", "--num-requests", "2"),
        *("--prompt-len-min", "500", "--prompt-len-max", "500", "--output-len", "64", "--disable-tqdm"),
    )
    assert benchmark.run_bench(args) == 1
    assert "max_model_len 512" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("client_call", ["generate-many", "generate"])
def test_grpc_mode_launches_serve_and_counts_every_token(
    stories_dir: Path, tmp_path: Path, client_call: str
) -> None:
    out = tmp_path / "bench.json"
    args = _args(
        *(
            "--model",
            str(stories_dir),
            "--mode",
            "grpc",
            "--client-call",
            client_call,
        ),
        *("--kv-cache-memory", "0.05", "--num-requests", "4", "--prompt-len-min", "16"),
        *("--prompt-len-max", "32", "--output-len", "4", "--disable-tqdm", "--output-json", str(out)),
    )
    assert benchmark.run_bench(args) == 0
    (row,) = json.loads(out.read_text())["variants"]
    assert (row["variant"], row["num_failed"], row["output_tokens"]) == ("grpc", 0, 16)
    assert row["ttft_mean_ms"] > 0


def test_a_presets_tokenizer_is_one_the_grammar_compiler_reads(tmp_path: Path) -> None:
    """Else the scheduler's grammar worker fails to start, and starts again every few seconds
    while the bench runs."""
    import llguidance

    from npuserve.scheduler.structured.grammar_compiler import grammar_tokenizer_json

    model = benchmark.materialise_preset("llama-150m", tmp_path, seed=0)
    tokenizer_json = grammar_tokenizer_json((model / "tokenizer.json").read_text())
    assert llguidance.LLTokenizer(tokenizer_json, n_vocab=32000, eos_token=2) is not None
