"""The simulated executor speaks the real step protocol: the real client drives it, a real
scheduler process serves Generate over four of them, and its steps last what its latency
model says (no timing asserts: the sleeps it asks for are recorded)."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from harness.serve import Served, generate_concurrently, greedy_request, npuserve_process

from npuserve.executor import simulated
from npuserve.executor.input_batch import PlanError
from npuserve.executor.simulated import (
    LatencyModel,
    SimulatedConfig,
    SimulatedRunner,
    build_parser,
    config_from_args,
    ready_payload,
    request_key,
    simulated_token,
    start_simulated,
    stop_all,
)
from npuserve.proto.step_plan import (
    CachedRequest,
    NewRequest,
    SamplingOptions,
    StepPlan,
)
from npuserve.scheduler.executor_client import ExecutorClient, ExecutorError

SMALL = SimulatedConfig(num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=4)
PROMPT = [1, 403, 407, 261, 378]
NUM_EXECUTORS = 4
NUM_STREAMS = 16
NUM_NEW = 6


def new(req_id: str, block_ids: list[int], prompt: list[int] = PROMPT, **sampling: object) -> NewRequest:
    options = SamplingOptions(temperature=0, **sampling)  # type: ignore[arg-type]
    return NewRequest(req_id, list(prompt), len(prompt), options, block_ids, 0)


@pytest.fixture
def served() -> Iterator[tuple[SimulatedRunner, ExecutorClient]]:
    ((running, runner),) = start_simulated(SMALL, "127.0.0.1", 0, 1, "sim")
    with ExecutorClient(running.address, timeout_s=10) as client:
        yield runner, client
    stop_all([running], grace_s=0)


def test_client_drives_chunked_prefill_decode_and_finish(
    served: tuple[SimulatedRunner, ExecutorClient],
) -> None:
    runner, client = served
    info = client.info()
    assert info == runner.info() and client.executor_id == "sim"
    assert (info.block_size, info.num_blocks, info.vocab_size, info.eos_token_ids) == (4, 64, 512, [2])

    # A 5-token prompt in chunks of 3 and 2 (a token comes only at the end), then two decodes.
    first = client.step(StepPlan(1, new_requests=[new("a", [9, 3])], num_scheduled_tokens={"a": 3}))
    assert first.sampled_req_ids == [] and first.step_id == 1
    second = client.step(
        StepPlan(2, new_requests=[new("b", [5, 6], num_logprobs=2)], num_scheduled_tokens={"a": 2, "b": 5})
    )
    assert second.sampled_req_ids == ["a", "b"]
    assert second.sampled_token_ids == [runner.token_for("a", 5), runner.token_for("b", 5)]
    assert second.logprobs[0] is None
    assert second.logprobs[1] is not None and len(second.logprobs[1].top_token_ids) == 2
    assert second.logprobs[1].top_token_ids[0] == second.sampled_token_ids[1]
    only_sampled = client.step(
        StepPlan(30, new_requests=[new("c", [7], prompt=[5], num_logprobs=0)], num_scheduled_tokens={"c": 1})
    )
    assert only_sampled.logprobs[0] is not None and only_sampled.logprobs[0].top_token_ids == []
    third = client.step(
        StepPlan(3, cached_requests=[CachedRequest("a", [11])], num_scheduled_tokens={"a": 1, "b": 1})
    )
    assert third.sampled_token_ids == [runner.token_for("a", 6), runner.token_for("b", 6)]
    assert third.timings.total_s >= SMALL.latency.step_seconds(2, 2) * 0.9

    assert client.step(StepPlan(3)) == third  # a retried step id answers the same
    client.step(StepPlan(4, finished_req_ids=["a"]))
    assert runner.num_requests == 2
    client.step(StepPlan(5, reset=True))
    assert runner.num_requests == 0
    assert runner.stats.num_steps == 6 and runner.stats.num_sampled == 5


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (StepPlan(10, cached_requests=[CachedRequest("ghost", [4])]), "not on this executor"),
        (StepPlan(11, num_scheduled_tokens={"ghost": 1}), "scheduled but unknown"),
        (StepPlan(12, new_requests=[new("x", [1, 2])], num_scheduled_tokens={"x": 6}), "known tokens"),
        (StepPlan(13, new_requests=[new("x", [1])], num_scheduled_tokens={"x": 5}), "blocks"),
        (StepPlan(14, new_requests=[new("x", [1, 64])], num_scheduled_tokens={"x": 5}), "block id"),
        (StepPlan(15, new_requests=[new("x", [1, 2], prompt=[])]), "0 tokens"),
    ],
)
def test_refused_plans_are_invalid_argument(
    served: tuple[SimulatedRunner, ExecutorClient], plan: StepPlan, message: str
) -> None:
    runner, client = served
    with pytest.raises(ExecutorError) as failure:
        client.step(plan)
    assert failure.value.code == "INVALID_ARGUMENT" and message in failure.value.message
    assert runner.num_requests == 0  # the plan's requests are dropped, as the real runner does
    assert client.step(StepPlan(20, new_requests=[new("ok", [1, 2])], num_scheduled_tokens={"ok": 5}))


def test_duplicates_and_max_num_seqs_are_refused() -> None:
    runner = SimulatedRunner(SMALL)
    runner.execute(StepPlan(1, new_requests=[new(f"r{i}", [i + 1, i + 10]) for i in range(4)]))
    with pytest.raises(PlanError, match="already running"):
        runner.execute(StepPlan(2, new_requests=[new("r0", [30, 31])]))
    assert runner.num_requests == 3  # a refused plan drops what it names, r0 included
    runner.execute(StepPlan(3, new_requests=[new("r8", [40, 41])]))
    with pytest.raises(PlanError, match="max_num_seqs"):
        runner.execute(StepPlan(4, new_requests=[new("r9", [30, 31])]))


def test_tokens_are_deterministic_and_eos_only_when_asked() -> None:
    never = SimulatedRunner(SimulatedConfig(vocab_size=8, eos_token_ids=(2, 5)))
    tokens = [never.token_for(f"req-{i}", p) for i in range(50) for p in range(20)]
    assert set(tokens) == {0, 1, 3, 4, 6, 7}
    assert tokens == [
        simulated_token(request_key(f"req-{i}"), p, 8, (2, 5)) for i in range(50) for p in range(20)
    ]

    runner = SimulatedRunner(SimulatedConfig(eos_after=3))
    plan = StepPlan(0, new_requests=[new("e", [1, 2])], num_scheduled_tokens={"e": 5})
    outputs = []
    for step in range(4):
        outputs += runner.execute(plan).sampled_token_ids
        plan = StepPlan(step + 1, num_scheduled_tokens={"e": 1})
    assert outputs[2] == 2 and 2 not in outputs[:2] + outputs[3:]


def test_steps_take_the_modelled_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step lasts at least its modelled time; it sleeps what its bookkeeping left of that time
    (the sleeps asked for are recorded, not timed), and the runner counts the modelled time."""
    latency = LatencyModel(base_s=0.02, per_token_s=0.0001, per_seq_s=0.001)
    runner = SimulatedRunner(SimulatedConfig(latency=latency, block_size=16))
    prompts = {f"r{i}": [3 + i] * 25 for i in range(4)}
    plans = [
        StepPlan(
            0,
            new_requests=[
                new(r, [i * 2 + 1, i * 2 + 2], prompt=p) for i, (r, p) in enumerate(prompts.items())
            ],
            num_scheduled_tokens={r: 25 for r in prompts},
        ),
        *(StepPlan(step, num_scheduled_tokens={r: 1 for r in prompts}) for step in range(1, 6)),
    ]
    prefill, decode = latency.step_seconds(100, 4), latency.step_seconds(4, 4)  # 34 ms, 24.4 ms
    timings = runner.execute(plans[0]).timings
    assert timings is not None and timings.total_s >= prefill  # a real sleep: never shorter
    slept: list[float] = []
    monkeypatch.setattr(simulated.time, "sleep", slept.append)
    decodes = [runner.execute(plan).timings for plan in plans[1:]]
    assert len(slept) == 5
    for seconds, timings in zip(slept, decodes, strict=True):
        assert timings is not None and timings.prepare_s + seconds == pytest.approx(decode)
    assert runner.stats.modeled_s == pytest.approx(prefill + 5 * decode)
    assert runner.stats.num_tokens == 120 and runner.stats.num_seqs == 24


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
    """`python -m npuserve.executor.simulated FLAGS`; yields its ready file and its stats file."""
    tmp = Path(tempfile.mkdtemp(prefix="npuserve-sim-"))
    ready_file, stats_file = tmp / "ready.json", tmp / "stats.json"
    command = [sys.executable, "-m", "npuserve.executor.simulated", "--port", "0", "--ready-file",
               str(ready_file), "--stats-file", str(stats_file), "--stats-interval", "0.1", *flags]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout_s
        while not ready_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"the simulated executors did not start:\n{process.communicate()[1]}")
            time.sleep(0.05)
        yield json.loads(ready_file.read_text()), stats_file
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
        assert code == 0, process.communicate()[1]


@pytest.mark.slow
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
