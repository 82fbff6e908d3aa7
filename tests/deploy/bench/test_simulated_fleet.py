"""Many simulated executors in one process (`simulated_fleet`): their ready file, their flags,
and a real scheduler process serving Generate over four of them."""

from __future__ import annotations

import json
import random
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from harness.serve import Served, generate_concurrently, greedy_request, npuserve_process

from npuserve.deploy.bench.simulated_fleet import (
    build_parser,
    config_from_args,
    ready_payload,
    start_simulated,
    stop_all,
)
from npuserve.deploy.launcher import Launcher, LaunchError, python_module
from npuserve.executor.simulated import LatencyModel, SimulatedConfig, request_key, simulated_token

pytestmark = pytest.mark.slow  # starts npuserve processes

SMALL = SimulatedConfig(num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=4)
NUM_EXECUTORS = 4
NUM_STREAMS = 16
NUM_NEW = 6


def test_ready_payload_matches_the_real_executor_for_one_and_lists_many() -> None:
    started = start_simulated(SMALL, "127.0.0.1", 0, 3, "sim")
    try:
        servers = [running for running, _ in started]
        many = ready_payload(servers)
        assert len(set(many["addresses"])) == 3 and many["executor_ids"] == ["sim-0", "sim-1", "sim-2"]
        one = ready_payload(servers[:1])
        assert {"address", "pid", "executor_id", "version", "info"} <= set(one)
        assert one["address"] == many["addresses"][0] and one["info"]["block_size"] == 4
    finally:
        stop_all([running for running, _ in started], grace_s=0)


@contextmanager
def simulated_process(*flags: str, timeout_s: float = 60.0) -> Iterator[tuple[dict, Path]]:
    """`python -m npuserve.deploy.bench.simulated_fleet FLAGS`; yields its ready file and its
    stats file."""
    launcher = Launcher(Path(tempfile.mkdtemp(prefix="npuserve-sim-")))
    stats_file = launcher.workdir / "stats.json"  # type: ignore[operator]
    child = launcher.start(
        "simulated",
        ["--port", "0", "--stats-file", str(stats_file), "--stats-interval", "0.1", *flags],
        command=python_module("npuserve.deploy.bench.simulated_fleet"),
        log_path=launcher.workdir / "simulated.log",  # type: ignore[operator]
    )
    try:
        try:
            (ready,) = launcher.wait_ready([child], timeout_s)
        except LaunchError as exc:
            pytest.fail(f"the simulated executors did not start: {exc}")
        yield ready, stats_file
    finally:
        code = child.stop(grace_s=15)
        assert code == 0, child.log()


def test_scheduler_serves_generate_over_four_simulated_executors(stories_dir: Path) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(20, 300))] for _ in range(NUM_STREAMS)]
    requests = [greedy_request(p, NUM_NEW) for p in prompts]
    for index, request in enumerate(requests):
        request.request_id = f"sim-{index}"
    with simulated_process("--count", str(NUM_EXECUTORS), "--block-size", "16", "--num-blocks", "512") as (
        ready,
        stats_file,
    ):
        assert len(ready["addresses"]) == NUM_EXECUTORS
        scheduler_flags = ("--model", str(stories_dir), "--executors", ",".join(ready["addresses"]))
        with npuserve_process("scheduler", *scheduler_flags, "--port", "0") as (_, scheduler):
            served = Served(scheduler["address"], None)  # type: ignore[arg-type]
            results = generate_concurrently(served.stub(), requests)
            integrity = served.integrity(expect_idle=True)
            steps = served.metric("npuserve:step_seconds_count")
        time.sleep(0.3)  # one more stats write
        stats = json.loads(stats_file.read_text())["executors"]

    assert integrity.ok, integrity.message
    for request, prompt, (token_ids, _, last) in zip(requests, prompts, results, strict=True):
        key = request_key(request.request_id)
        assert token_ids == [simulated_token(key, len(prompt) + i, 512, (2,)) for i in range(NUM_NEW)]
        assert last.completions[-1].finish_reason == "length"
        assert last.usage.completion_tokens == NUM_NEW
    assert sum(s["num_sampled"] for s in stats) == NUM_STREAMS * NUM_NEW
    # NOTE: the step that drops the last finished ids may land after the metric was read.
    assert steps <= sum(s["num_steps"] for s in stats) <= steps + NUM_EXECUTORS


def test_flags_build_the_config() -> None:
    args = build_parser().parse_args(["--base-ms", "2", "--per-token-ms", "0.5", "--eos-token-ids", "2,7",
                                      "--num-blocks", "1000", "--eos-after", "4"])  # fmt: skip
    config = config_from_args(args)
    assert config.latency == LatencyModel(0.002, 0.0005, 0.00001)
    assert (config.num_blocks, config.eos_token_ids, config.eos_after) == (1000, (2, 7), 4)
    with pytest.raises(ValueError, match="num_blocks"):
        config_from_args(build_parser().parse_args(["--num-blocks", "1"]))
