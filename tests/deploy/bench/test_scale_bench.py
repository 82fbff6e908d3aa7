"""`npuserve bench-scale` end to end on a small sweep: simulated executors, a real scheduler with
its worker process, the closed-loop client (over GenerateMany calls; `test_serving` runs the
benches' `--client-call generate`); every stream completes without an error and the JSON holds
one row per configuration with the scheduler's CPU split by role: front, step workers and API
processes, and the simulated executors run at the niceness asked for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts the simulated executors and a scheduler


def test_a_small_sweep_runs_clean_and_reports_each_configuration(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    # fmt: off
    command = [
        sys.executable, "-m", "npuserve.deploy.bench.scale",
        "--executors", "1,2", "--concurrency", "8", "--warmup", "0.5", "--duration", "1",
        "--prompt-len", "16-32", "--output-len", "8-16", "--block-size", "16", "--max-num-seqs", "16",
        "--scheduler-workers", "1", "--api-server-count", "2", "--executor-nice", "7",
        "--output-json", str(out), "--plot", str(tmp_path / "scale.png"),
    ]
    # fmt: on
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["config"]["client_call"] == "generate-many"
    rows = {(r["executors"], r["concurrency"]): r for r in report["results"]}
    assert set(rows) == {(1, 8), (2, 8)}
    for row in rows.values():
        assert row["num_errors"] == 0, row["errors"]
        assert row["output_tokens_per_s"] > 0 and row["num_completed"] > 0
        # The scheduler's CPU, split by role: the front, its step worker, its API processes
        # (told apart by their process names); their sum is the whole (render workers aside).
        roles = ("front_cpu_us_per_token", "step_workers_cpu_us_per_token", "api_servers_cpu_us_per_token")
        assert all(row[role] > 0 for role in roles)
        assert sum(row[role] for role in roles) == pytest.approx(row["scheduler_cpu_us_per_token"], rel=0.05)
        assert row["step_workers_cpu_us_per_step"] > 0
        assert row["executors_nice"] == 7  # they stand in for devices elsewhere: they yield the cores
        # Streams without a token yet, averaged over the window: never more than are open.
        assert 0 <= row["awaiting_first_token_mean"] <= row["concurrency"]
    assert (tmp_path / "scale.png").stat().st_size > 0


def test_a_disaggregated_sweep_pulls_long_prompts_and_reports_the_streams_itl(tmp_path: Path) -> None:
    """One prefill and one decode simulated executor; a window of streams alone, then one with long
    prompts arriving, which prefill apart and are pulled over `ReadBlocks` (each window ends with
    the pools idle and intact: `wait_idle`)."""
    out = tmp_path / "scale.json"
    # fmt: off
    command = [
        sys.executable, "-m", "npuserve.deploy.bench.scale",
        "--executors", "2", "--concurrency", "4", "--warmup", "0.5", "--duration", "1",
        "--prompt-len", "16-32", "--output-len", "8-16", "--block-size", "16", "--max-num-seqs", "8",
        "--scheduler-workers", "1", "--api-server-count", "1", "--prefill-executors", "1",
        "--long-prompt-rate", "0,8", "--long-prompt-len", "200", "--long-output-len", "4",
        "--output-json", str(out), "--plot", str(tmp_path / "scale.png"),
    ]
    # fmt: on
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    alone, mixed = sorted(report["results"], key=lambda r: r["long_prompt_rate"])
    assert (alone["prefill_executors"], alone["long_prompt_rate"], mixed["long_prompt_rate"]) == (1, 0, 8)
    for row in (alone, mixed):
        assert row["num_errors"] == 0, row["errors"]
        assert row["itl_p99_ms"] is not None and row["itl_p99_ms"] >= row["itl_p50_ms"] >= 0
    assert alone["long_ttft_p50_ms"] is None and alone["kv_pulled_mb_per_s"] == 0
    assert mixed["num_long_first_tokens"] > 0 and mixed["long_ttft_p99_ms"] > 0
    assert mixed["kv_pulled_mb_per_s"] > 0  # the decode executor pulled the long prompts' KV
    assert any("8 long prompts/s move the streams' ITL p99 by" in note for note in report["notes"])
    assert (tmp_path / "scale.png").stat().st_size > 0
