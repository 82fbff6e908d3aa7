"""`npuserve bench --compare colocated,disaggregated`: the mixed load (long prompts arriving while
the others decode), its variants and their decode-only baselines, the decode streams' and long
prompts' figures, how far the long prompts move decode ITL p99; and a launched P/D server under
the mixed load, each long prompt prefilled on the prefill executor and pulled by the decode one."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import grpc
import pytest
from harness.serve import metric_by_role

from npuserve.deploy.bench import disaggregation_report, report
from npuserve.deploy.bench import serving as benchmark
from npuserve.deploy.bench.serving_metrics import RequestRecord, summarize
from npuserve.deploy.bench.targets import GrpcTarget
from npuserve.deploy.bench.variants import parse_variants
from npuserve.deploy.bench.workload import WorkloadConfig, build_workload, warmup_requests
from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc

VOCAB = 512


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    benchmark.add_bench_flags(parser)
    return parser.parse_args(list(argv))


# -- the mixed load ----------------------------------------------------------------------------------


def test_long_prompts_follow_the_others_evenly_spaced_and_leave_them_unchanged() -> None:
    plain = WorkloadConfig(num_requests=6, prompt_len_min=8, prompt_len_max=16, output_len=32)
    mixed = WorkloadConfig(
        num_requests=6, prompt_len_min=8, prompt_len_max=16, output_len=32,
        long_prompts=3, long_prompt_len=100, long_prompt_rate=4.0, long_output_len=5,
    )  # fmt: skip
    requests = build_workload(mixed, VOCAB)
    assert requests[:6] == build_workload(plain, VOCAB)
    long = requests[6:]
    assert [r.index for r in long] == [6, 7, 8] and all(r.long_prompt for r in long)
    assert [r.arrival_s for r in long] == [0.25, 0.5, 0.75]
    assert {len(r.prompt_token_ids) for r in long} == {100} and {r.output_len for r in long} == {5}
    assert len({tuple(r.prompt_token_ids) for r in long}) == 3
    warmup = warmup_requests(mixed, VOCAB, token_budget=20)
    assert sum(r.long_prompt for r in warmup) == 1  # the long shape warmed up too, at once
    assert all(r.arrival_s == 0 and r.output_len <= 4 for r in warmup)
    assert not any(r.prompt_token_ids in [q.prompt_token_ids for q in requests] for r in warmup)


@pytest.mark.parametrize(
    "kwargs",
    [{"long_prompts": -1}, {"long_prompt_len": 0}, {"long_prompt_rate": 0.0}, {"long_output_len": 0}],
)
def test_mixed_load_rejects_bad_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="--long"):
        WorkloadConfig(**{"long_prompts": 2, **kwargs})  # type: ignore[arg-type]


def test_summary_splits_decode_streams_from_long_prompts() -> None:
    records = [
        RequestRecord(10, 0.0, [0.1, 0.2, 0.6], end_time=0.6),  # a decode stream: gaps 0.1, 0.4
        RequestRecord(12, 0.0, [0.1, 0.3, 0.4], end_time=0.4),  # gaps 0.2, 0.1
        RequestRecord(500, 0.1, [0.9, 0.95], end_time=0.95, long_prompt=True),  # TTFT 0.8
    ]
    s = summarize("disaggregated", records, duration_s=1.0)
    assert s.num_long_prompts == 1
    assert s.decode_ttft_ms.p50 == pytest.approx(100.0) and s.long_prompt_ttft_ms.p50 == pytest.approx(800.0)
    assert s.decode_itl_ms.mean == pytest.approx(200.0)  # the long prompt's gap is not a decode one
    row = s.row()
    assert row["decode_itl_p99_ms"] == s.decode_itl_ms.p99 and row[
        "long_prompt_ttft_p99_ms"
    ] == pytest.approx(800.0)
    assert "long TTFT p99 (ms)" in report.format_serving_table([s])


# -- variants ---------------------------------------------------------------------------------------


def test_colocated_and_disaggregated_run_after_their_decode_only_baselines() -> None:
    args = _args("--compare", "colocated,disaggregated", "--num-executors", "3", "--long-prompts", "2")
    variants = parse_variants(args)
    assert [(v.name, v.prefill_executors, v.decode_only) for v in variants] == [
        ("colocated-decode-only", 0, True),
        ("colocated", 0, False),
        ("disaggregated-decode-only", 1, True),
        ("disaggregated", 1, False),
    ]
    plain = parse_variants(_args("--compare", "disaggregated", "--num-executors", "2"))
    assert [v.name for v in plain] == ["disaggregated"]  # no long prompts: no baseline to run


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (("--compare", "disaggregated"), "--prefill-executors must be"),  # one executor
        (("--compare", "colocated"), "--num-executors >= 2"),
        (("--compare", "disaggregated", "--num-executors", "2", "--prefill-executors", "2"), "fewer than"),
        (("--compare", "disaggregated", "--num-executors", "2", "--address", "h:1"), "omit --address"),
        (
            (
                "--compare",
                "disaggregated",
                "--num-executors",
                "2",
                "--long-prompts",
                "1",
                "--long-prompt-len",
                "384",
            ),
            "above --max-local-prefill-length 384",
        ),
    ],
)
def test_bad_disaggregation_variants_are_refused(argv: tuple[str, ...], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_variants(_args(*argv))


def test_disaggregated_server_gets_roles_and_sends_only_long_prompts_to_prefill() -> None:
    args = _args("--compare", "disaggregated", "--num-executors", "3", "--prompt-len-max", "200")
    colocated, disaggregated = (
        benchmark.Variant(name, "grpc", True, prefill_executors=n) for name, n in (("c", 0), ("d", 1))
    )
    assert benchmark._server_spec(args, "m", "dummy", colocated).roles == ()
    spec = benchmark._server_spec(args, "m", "dummy", disaggregated)
    assert spec.roles == ("prefill", "decode", "decode") and spec.num_executors == 3
    assert "--max-local-prefill-length=200" in spec.scheduler_args
    given = _args("--num-executors", "2", "--max-local-prefill-length", "50")
    assert (
        "--max-local-prefill-length=50"
        in benchmark._server_spec(given, "m", "dummy", disaggregated).scheduler_args
    )


def _summary(variant: str, itl_gaps: list[float]) -> object:
    times = [0.0]
    for gap in itl_gaps:
        times.append(times[-1] + gap)
    records = [RequestRecord(10, 0.0, times, end_time=times[-1])]
    if not variant.endswith("-decode-only"):
        records.append(RequestRecord(400, 0.0, [0.5, 0.6], end_time=0.6, long_prompt=True))
    return summarize(variant, records, duration_s=1.0)


def test_effects_say_how_far_long_prompts_move_decode_itl_p99_each_round() -> None:
    rounds = [
        [
            _summary("colocated-decode-only", [0.01] * 99),
            _summary("colocated", [0.01] * 90 + [0.05] * 9),
            _summary("disaggregated-decode-only", [0.01] * 99),
            _summary("disaggregated", [0.01] * 99),
        ]
        for _ in range(2)
    ]
    effects = disaggregation_report.serving_effects(rounds)  # type: ignore[arg-type]
    assert [(e["configuration"], len(e["rounds"])) for e in effects] == [
        ("colocated", 2),
        ("disaggregated", 2),
    ]
    colocated, disaggregated = effects
    assert colocated["median_itl_p99_change"] == pytest.approx(4.0)  # 10 ms -> 50 ms
    assert disaggregated["median_itl_p99_change"] == pytest.approx(0.0)
    assert colocated["rounds"][0]["long_ttft_p50_ms"] == pytest.approx(500.0)
    text = disaggregation_report.format_effects(effects)
    assert "colocated: long prompts move decode ITL p99 by +400%" in text
    assert "disaggregated: long prompts move decode ITL p99 by +0%" in text


# -- a launched server under the mixed load -----------------------------------------------------------


@pytest.mark.slow  # an `npuserve executor` pair and a scheduler
def test_a_launched_pd_server_prefills_long_prompts_apart_and_decodes_every_stream(
    stories_dir: Path, tmp_path: Path
) -> None:
    args = _args(
        *("--model", str(stories_dir), "--compare", "disaggregated", "--num-executors", "2"),
        *("--kv-cache-memory", "0.02", "--num-requests", "4", "--prompt-len-min", "16"),
        *("--prompt-len-max", "32", "--output-len", "24", "--long-prompts", "2", "--long-prompt-len", "300"),
        *("--long-prompt-rate", "20", "--long-output-len", "4"),
    )
    workload = WorkloadConfig(
        num_requests=4, prompt_len_min=16, prompt_len_max=32, output_len=24,
        long_prompts=2, long_prompt_len=300, long_prompt_rate=20.0, long_output_len=4,
    )  # fmt: skip
    requests = build_workload(workload, VOCAB)
    (baseline, mixed) = parse_variants(args)
    spec = benchmark._server_spec(args, str(stories_dir), "auto", mixed)
    with benchmark.launched_server(spec, timeout_s=120) as address:
        only = [r for r in requests if not r.long_prompt]
        first = benchmark.measure(GrpcTarget(address, baseline.name), workload, only)
        second = benchmark.measure(GrpcTarget(address, mixed.name), workload, requests)
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.SchedulerStub(channel)
            text = stub.GetMetrics(pb.GetMetricsRequest(), timeout=10).text
            check = stub.CheckIntegrity(pb.CheckIntegrityRequest(expect_idle=True), timeout=10)
    assert check.ok, check.message
    assert (first.num_failed, second.num_failed) == (0, 0), (first.first_error, second.first_error)
    assert second.output_tokens == 4 * 24 + 2 * 4 and second.num_long_prompts == 2
    assert second.long_prompt_ttft_ms.p50 is not None and second.decode_itl_ms.p99 is not None
    assert first.long_prompt_ttft_ms.p50 is None and first.decode_itl_ms.p99 is not None
    # Only the long prompts prefilled on the prefill executor; the decode one pulled their KV.
    prompt_tokens = metric_by_role(text, "npuserve:executor_prompt_tokens_total")
    assert prompt_tokens["prefill"] == 2 * 300
    assert prompt_tokens["decode"] >= sum(len(r.prompt_token_ids) for r in only)  # then cached
    assert metric_by_role(text, "npuserve:kv_transfer_bytes_total", kind="executor")["decode"] > 0
    (effect,) = disaggregation_report.serving_effects([[first, second]])
    assert effect["configuration"] == "disaggregated" and effect["rounds"][0]["itl_p99_ms"] is not None
    written = report.write_json(tmp_path / "bench.json", {"long_prompt_effects": [effect]})
    assert json.loads(written.read_text())["long_prompt_effects"][0]["load"] == "long prompts"
