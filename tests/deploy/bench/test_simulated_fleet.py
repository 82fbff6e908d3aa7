"""Many simulated executors in one process (`simulated_fleet`): their ready file, their flags,
their roles and KV pulls over the real `ReadBlocks` path in modelled time, and a real scheduler
process serving Generate over four of them."""

from __future__ import annotations

import json
import random
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from harness.blocking_client import BlockingClient
from harness.serve import Served, generate_concurrently, greedy_request, npuserve_process

from npuserve.deploy.bench.simulated_fleet import (
    build_parser,
    config_from_args,
    ready_payload,
    start_simulated,
    stop_all,
)
from npuserve.deploy.launcher import Launcher, LaunchError, python_module
from npuserve.executor import kv_transfer
from npuserve.executor.input_batch import PlanError
from npuserve.executor.simulated import LatencyModel, SimulatedConfig, request_key, simulated_token
from npuserve.proto.step_plan import (
    KV_TRANSFER_EXECUTOR,
    KvPull,
    KvTransfer,
    NewRequest,
    SamplingOptions,
    StepPlan,
)

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


# 1 MiB of KV per token: a block of 4 tokens is one 4 MiB `ReadBlocks` chunk; pulls at 1 GB/s.
PULLED = SimulatedConfig(
    num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=4, kv_bytes_per_token=1 << 20,
    latency=LatencyModel(pull_bytes_per_s=1e9),
)  # fmt: skip


def pulled_request(req_id: str, block_ids: list[int]) -> NewRequest:
    """A request prefilled elsewhere: 8 prompt tokens and its first token, the prompt's KV pulled."""
    return NewRequest(req_id, list(range(3, 12)), 8, SamplingOptions(temperature=0), block_ids, 8)


def test_a_decode_executor_pulls_over_read_blocks_in_its_modelled_time() -> None:
    started = start_simulated(PULLED, "127.0.0.1", 0, 2, "sim", num_prefill=1)
    try:
        (source, prefill), (sink, decode) = started
        assert [runner.info().role for _, runner in started] == ["prefill", "decode"]
        # The source serves the chunks a real cache would be sent as: one per 4 MiB block here.
        reader = kv_transfer.ReadBlocksClient()
        pull = KvPull(source.address, source.servicer.instance_id, [1, 2, 3], [7, 8, 9], "a")
        assert [(c.first, list(c.shape)) for c in reader.read(pull)] == [
            (i, [2, 1, 4, 0, 0]) for i in range(3)
        ]
        reader.close()
        with pytest.raises(PlanError, match=r"outside 1\.\.63"):
            prefill.read_blocks([1, 64])
        # The decode executor pulls two blocks over that path, served: 8 MiB at 1 GB/s.
        pull = KvPull(source.address, source.servicer.instance_id, [1, 2], [5, 6], "a")
        plan = StepPlan(1, [pulled_request("a", [5, 6, 7])], num_scheduled_tokens={"a": 1}, kv_pulls=[pull])
        with BlockingClient(sink.address, timeout_s=10) as client:
            result = client.step(plan)
        assert result.sampled_req_ids == ["a"] and not result.failed_pull_req_ids
        pull_s = 2 * 4 * (1 << 20) / 1e9
        assert result.timings.kv_transfers == [
            KvTransfer(KV_TRANSFER_EXECUTOR, 2 * 4 << 20, pytest.approx(pull_s))
        ]
        assert result.timings.total_s >= pull_s + PULLED.latency.step_seconds(1, 1)
        assert decode.num_pulled_blocks == 2 and decode.stats.pull_s == pytest.approx(pull_s)
        assert prefill.num_pulled_blocks == 0
    finally:
        stop_all([running for running, _ in started], grace_s=0)
    # A source that is gone fails the pull's request only; the step runs, and moves no bytes.
    gone = KvPull(source.address, "", [1], [10], "b")
    failed = decode.execute(
        StepPlan(2, [pulled_request("b", [10, 11, 12])], num_scheduled_tokens={"b": 1}, kv_pulls=[gone])
    )
    assert failed.failed_pull_req_ids == ["b"] and failed.sampled_req_ids == ["b"]
    assert failed.timings.kv_transfers == []
    assert decode.num_pulled_blocks == 2


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
                                      "--num-blocks", "1000", "--eos-after", "4", "--pull-gb-per-s", "2",
                                      "--kv-bytes-per-token", "1024", "--prefill-executors", "1"])  # fmt: skip
    config = config_from_args(args)
    assert config.latency == LatencyModel(0.002, 0.0005, 0.00001, 2e9)
    assert (config.num_blocks, config.eos_token_ids, config.eos_after) == (1000, (2, 7), 4)
    assert config.kv_bytes_per_token == 1024 and args.prefill_executors == 1
    with pytest.raises(ValueError, match="num_blocks"):
        config_from_args(build_parser().parse_args(["--num-blocks", "1"]))
