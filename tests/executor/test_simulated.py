"""The simulated executor speaks the real step protocol: the real client drives it, and its steps
last what its latency model says (no timing asserts: the sleeps it asks for are recorded). Many in one process, under a
real scheduler: tests/deploy/bench/test_simulated_fleet.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest
from harness.blocking_client import BlockingClient
from harness.step_driver import OneJoiningStep

from npuserve.executor import simulated
from npuserve.executor.input_batch import PlanError
from npuserve.executor.pulls_beside_steps import POLL_WAIT_S
from npuserve.executor.server import start_executor_server
from npuserve.executor.simulated import (
    LatencyModel,
    SimulatedConfig,
    SimulatedRunner,
    request_key,
    simulated_token,
)
from npuserve.proto.step_plan import (
    KV_TRANSFER_EXECUTOR,
    CachedRequest,
    KvPull,
    KvTransfer,
    NewRequest,
    SamplingOptions,
    StepPlan,
    StepResult,
    TokenBitmask,
    bitmask_words,
)
from npuserve.scheduler.lanes.executor_client import ExecutorError

SMALL = SimulatedConfig(num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=4)
PROMPT = [1, 403, 407, 261, 378]


def new(req_id: str, block_ids: list[int], prompt: list[int] = PROMPT, **sampling: object) -> NewRequest:
    options = SamplingOptions(temperature=0, **sampling)  # type: ignore[arg-type]
    return NewRequest(req_id, list(prompt), len(prompt), options, block_ids, 0)


@pytest.fixture
def served() -> Iterator[tuple[SimulatedRunner, BlockingClient]]:
    runner = SimulatedRunner(SMALL)
    running = start_executor_server(runner, "127.0.0.1", 0, "sim")
    with BlockingClient(running.address, timeout_s=10) as client:
        yield runner, client
    running.stop(grace_s=0)


def test_client_drives_chunked_prefill_decode_and_finish(
    served: tuple[SimulatedRunner, BlockingClient],
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
    served: tuple[SimulatedRunner, BlockingClient], plan: StepPlan, message: str
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


def test_bitmasks_are_checked_as_the_real_runner_checks_them() -> None:
    """A row for a request that samples nothing, or rows of the wrong width, are refused with
    `ModelRunner`'s messages; a valid row confines its request to the tokens it allows."""
    runner = SimulatedRunner(SMALL)
    vocab_size = runner.info().vocab_size
    bits = np.zeros(bitmask_words(vocab_size) * 32, dtype=np.uint8)
    bits[77] = 1
    only_77 = np.packbits(bits, bitorder="little").tobytes()
    chunk = StepPlan(1, new_requests=[new("a", [1, 2])], num_scheduled_tokens={"a": 3})
    chunk.bitmask = TokenBitmask(["a"], only_77)
    with pytest.raises(PlanError, match="samples no token"):
        runner.execute(chunk)
    whole = StepPlan(2, new_requests=[new("a", [1, 2])], num_scheduled_tokens={"a": 5})
    whole.bitmask = TokenBitmask(["a"], only_77[:-4])
    with pytest.raises(PlanError, match="is not 1 rows of"):
        runner.execute(whole)
    whole.step_id, whole.bitmask = 3, TokenBitmask(["a"], only_77)
    assert runner.execute(whole).sampled_token_ids == [77]


def three_passes_for_a() -> tuple[SimulatedRunner, StepPlan]:
    """A runner with a step time per pass, and a plan that admits "a" for three passes and "b"
    for one."""
    latency = LatencyModel(base_s=0.02, per_token_s=0.0001, per_seq_s=0.001)
    runner = SimulatedRunner(SimulatedConfig(latency=latency, num_blocks=64, block_size=4))
    plan = StepPlan(
        1,
        new_requests=[new("a", [1, 2]), new("b", [3, 4])],
        num_scheduled_tokens={"a": 5, "b": 5},
        num_steps={"a": 3},
    )
    return runner, plan


def test_multi_step_plans_sample_the_tokens_single_steps_would_and_take_each_pass_s_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request with three passes samples at three positions, the tokens three steps would give
    it; a request in the middle of its prefill cannot run more than one; each pass is modelled."""
    sleeps: list[float] = []
    monkeypatch.setattr(simulated.time, "sleep", sleeps.append)
    runner, plan = three_passes_for_a()
    latency = runner.config.latency
    result = runner.execute(plan)
    assert result.sampled_req_ids == ["a", "b", "a", "a"]
    assert result.sampled_token_ids == [
        runner.token_for("a", 5),
        runner.token_for("b", 5),
        runner.token_for("a", 6),
        runner.token_for("a", 7),
    ]
    assert runner.stats.modeled_s == pytest.approx(
        latency.step_seconds(10, 2) + 2 * latency.step_seconds(1, 1)
    )
    assert sum(sleeps) <= runner.stats.modeled_s
    after = runner.execute(StepPlan(2, num_scheduled_tokens={"a": 1}))  # it goes on from its last token
    assert after.sampled_token_ids == [runner.token_for("a", 8)]
    with pytest.raises(PlanError, match="samples no token in the first"):
        runner.execute(
            StepPlan(30, new_requests=[new("c", [5, 6])], num_scheduled_tokens={"c": 2}, num_steps={"c": 2})
        )
    with pytest.raises(PlanError, match="beyond its blocks"):
        runner.execute(
            StepPlan(4, new_requests=[new("d", [7, 8])], num_scheduled_tokens={"d": 5}, num_steps={"d": 5})
        )


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


def test_the_first_pass_only_requests_are_answered_after_the_first_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``on_first_pass`` a request that runs one pass of a multi-step plan is answered once
    that pass's modelled time is up, before the later passes; the result names the others only."""
    events: list[object] = []
    monkeypatch.setattr(simulated.time, "sleep", lambda s: events.append("sleep"))
    runner, plan = three_passes_for_a()
    result = runner.execute(plan, on_first_pass=events.append)
    early = StepResult(1, ["b"], [runner.token_for("b", 5)], [None], partial=True)
    assert events == ["sleep", early, "sleep"]
    assert result.sampled_req_ids == ["a"] * 3 and not result.partial
    assert result.sampled_token_ids == [runner.token_for("a", k) for k in (5, 6, 7)]
    # Nothing to answer early: every request runs all its passes, or none runs more than one.
    quiet: list[StepResult] = []
    more_blocks = [CachedRequest("a", [5]), CachedRequest("b", [6])]
    every = StepPlan(
        2, cached_requests=more_blocks, num_scheduled_tokens={"a": 1, "b": 1}, num_steps={"a": 2, "b": 2}
    )
    runner.execute(every, quiet.append)
    runner.execute(StepPlan(3, num_scheduled_tokens={"a": 1, "b": 1}), quiet.append)
    assert not quiet


def test_a_step_that_joins_runs_in_the_next_pass_and_is_answered_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A joining step taken before the second pass samples its requests' first tokens there,
    the tokens it would sample alone; it is answered once that pass's modelled time (its prompt
    tokens counted in it) is up, before the running step ends."""
    events: list[object] = []
    monkeypatch.setattr(simulated.time, "sleep", lambda s: events.append("sleep"))
    runner, plan = three_passes_for_a()
    joiner = StepPlan(2, new_requests=[new("c", [7, 8])], num_scheduled_tokens={"c": 5}, joins_running=True)
    result = runner.execute(plan, joining=OneJoiningStep(joiner, events))
    answer = StepResult(2, ["c"], [runner.token_for("c", 5)], [None])
    latency = runner.config.latency
    joined_pass_s = latency.step_seconds(1, 1) + latency.joined_seconds(5, 1)
    answer.timings.total_s = joined_pass_s
    # The first pass, the joined one, its answer, the third pass (waits are asked per pass: the
    # recorded sleeps take no time, so each end is waited for again).
    assert events == ["sleep", "sleep", answer, "sleep", "sleep"]
    token = runner.token_for
    assert result.sampled_token_ids == [token("a", 5), token("b", 5), token("a", 6), token("a", 7)]
    modeled = latency.step_seconds(10, 2) + joined_pass_s + latency.step_seconds(1, 1)
    assert runner.stats.modeled_s == pytest.approx(modeled)
    alone = SimulatedRunner(runner.config)
    assert (
        alone.execute(dataclasses.replace(joiner, joins_running=False)).sampled_token_ids
        == answer.sampled_token_ids
    )
    assert runner.holds("c")  # it runs on in the next steps


def test_a_step_there_before_the_running_one_began_joins_its_first_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A joining step that came while the multi-pass step waited to run (sent after it) is taken
    before that step's first pass and runs beside its prompts; it is answered once that pass's
    modelled time (its tokens counted in it) is up."""
    events: list[object] = []
    monkeypatch.setattr(simulated.time, "sleep", lambda s: events.append("sleep"))
    runner, plan = three_passes_for_a()
    joiner = StepPlan(2, new_requests=[new("c", [7, 8])], num_scheduled_tokens={"c": 5}, joins_running=True)
    joining = OneJoiningStep(joiner, events, absent_for=0)
    result = runner.execute(plan, joining=joining)
    latency = runner.config.latency
    first_pass_s = latency.step_seconds(10, 2) + latency.joined_seconds(5, 1)
    answer = StepResult(2, ["c"], [runner.token_for("c", 5)], [None])
    answer.timings.total_s = first_pass_s
    # The first pass, its answer, then the two later passes and the step's end.
    assert events == ["sleep", answer, "sleep", "sleep", "sleep"]
    assert joining.asked_with[0] == runner.config.max_num_batched_tokens - 10  # the room beside a and b
    token = runner.token_for
    assert result.sampled_token_ids == [token("a", 5), token("b", 5), token("a", 6), token("a", 7)]
    assert runner.stats.modeled_s == pytest.approx(first_pass_s + 2 * latency.step_seconds(1, 1))


def test_a_joining_step_without_room_in_a_pass_waits_for_one_with_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pass takes no joining step whose tokens would take it past max_num_batched_tokens: one
    there before the first pass (10 tokens of the plan's own) joins the second (1 of its own)."""
    events: list[object] = []
    monkeypatch.setattr(simulated.time, "sleep", lambda s: events.append("sleep"))
    runner, plan = three_passes_for_a()
    runner = SimulatedRunner(dataclasses.replace(runner.config, max_num_batched_tokens=12))
    joiner = StepPlan(2, new_requests=[new("c", [7, 8])], num_scheduled_tokens={"c": 5}, joins_running=True)
    joining = OneJoiningStep(joiner, events, absent_for=0)
    runner.execute(plan, joining=joining)
    assert joining.asked_with[:2] == [2, 11]  # refused beside the first pass, taken beside the second
    latency = runner.config.latency
    answer = StepResult(2, ["c"], [runner.token_for("c", 5)], [None])
    answer.timings.total_s = latency.step_seconds(1, 1) + latency.joined_seconds(5, 1)
    assert events == ["sleep", "sleep", answer, "sleep", "sleep"]


@pytest.mark.parametrize("refused", ["a request it holds", "more than an admission"])
def test_a_refused_joining_step_fails_the_running_one_and_drops_both(refused: str) -> None:
    runner, plan = three_passes_for_a()
    joiner = StepPlan(2, new_requests=[new("a", [7, 8])], num_scheduled_tokens={"a": 5}, joins_running=True)
    if refused == "more than an admission":
        joiner = StepPlan(
            2, new_requests=[new("c", [7, 8])], num_scheduled_tokens={"c": 5, "b": 1}, joins_running=True
        )
    with pytest.raises(PlanError, match=r"already running|does more than admit"):
        runner.execute(plan, joining=OneJoiningStep(joiner, []))
    assert runner.num_requests == 0


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


def test_a_plan_for_an_earlier_instance_of_the_executor_is_unavailable(
    served: tuple[SimulatedRunner, BlockingClient],
) -> None:
    """A scheduler that handshook before the executor restarted on the same address must not
    trust the new process with its requests: UNAVAILABLE (it reconnects), the state untouched."""
    runner, client = served
    client.info()
    client.step(StepPlan(1, new_requests=[new("a", [1, 2])], num_scheduled_tokens={"a": 5}))
    with BlockingClient(client.address, timeout_s=10) as stale:
        stale.info()
        assert stale.instance_id == client.instance_id != ""
        stale.instance_id = "an-earlier-instance"
        with pytest.raises(ExecutorError) as failure:
            stale.step(StepPlan(2, cached_requests=[CachedRequest("a", [])], num_scheduled_tokens={"a": 1}))
    assert failure.value.code == "UNAVAILABLE" and "restarted" in failure.value.message
    assert runner.num_requests == 1 and runner.stats.num_steps == 1


def test_a_draining_executor_is_not_ready_but_steps_until_it_holds_nothing() -> None:
    running = start_executor_server(SimulatedRunner(SMALL), "127.0.0.1", 0, "sim")
    try:
        with BlockingClient(running.address, timeout_s=10) as client:
            client.info()
            client.step(
                StepPlan(1, new_requests=[new("a", [1, 2]), new("b", [3, 4])], num_scheduled_tokens={"a": 5})
            )
            running.servicer.draining = True
            assert not client.health()  # readiness fails
            with pytest.raises(ExecutorError) as refused:
                client.info()  # no new scheduler
            assert refused.value.code == "UNAVAILABLE"
            result = client.step(StepPlan(2, num_scheduled_tokens={"a": 1, "b": 5}))  # steps go on
            assert result.draining and result.sampled_req_ids == ["a", "b"]
            assert running.servicer.num_held_requests == 2
            client.step(StepPlan(3, finished_req_ids=["a"], num_scheduled_tokens={"b": 1}))
            assert running.servicer.num_held_requests == 1
            client.step(StepPlan(4, finished_req_ids=["b"]))
            assert running.servicer.num_held_requests == 0
    finally:
        running.stop(grace_s=0)


def test_a_refused_plan_leaves_the_server_counting_only_what_the_runner_holds() -> None:
    """A refused plan drops every request it names, scheduled or not; a drain then waits for
    none of them."""
    runner = SimulatedRunner(SMALL)
    running = start_executor_server(runner, "127.0.0.1", 0, "sim")
    try:
        with BlockingClient(running.address, timeout_s=10) as client:
            client.info()
            client.step(StepPlan(1, new_requests=[new("a", [1, 2])], num_scheduled_tokens={"a": 5}))
            assert running.servicer.num_held_requests == 1
            with pytest.raises(ExecutorError, match="already running"):  # "a" again, and "x" unscheduled
                client.step(StepPlan(2, new_requests=[new("x", [5, 6]), new("a", [7, 8])]))
            assert runner.num_requests == running.servicer.num_held_requests == 0
    finally:
        running.stop(grace_s=0)


def test_a_step_older_than_one_of_its_scheduler_that_ran_is_refused_and_changes_nothing(
    served: tuple[SimulatedRunner, BlockingClient],
) -> None:
    """A step stream that broke may leave steps queued on the executor after the scheduler went on
    over a new stream: a step older than one of the same scheduler (session) that ran is not
    run (FAILED_PRECONDITION), since it would advance requests the scheduler has since sent
    again whole. Another scheduler's steps have ids of their own."""
    runner, client = served
    client.step(StepPlan(50, new_requests=[new("a", [1, 2])], num_scheduled_tokens={"a": 5}, session=7))
    with pytest.raises(ExecutorError) as stale:
        client.step(StepPlan(49, num_scheduled_tokens={"a": 1}, session=7))
    assert stale.value.code == "FAILED_PRECONDITION" and "older than step 50" in stale.value.message
    assert runner.num_requests == 1 and runner.stats.num_steps == 1  # not run, and "a" kept
    assert client.step(StepPlan(51, num_scheduled_tokens={"a": 1}, session=7)).sampled_req_ids == ["a"]
    other = StepPlan(3, new_requests=[new("b", [3, 4])], num_scheduled_tokens={"b": 5}, session=8)
    assert client.step(other).sampled_req_ids == ["b"]  # another scheduler on the same executor


def test_pulls_land_beside_the_steps_in_modelled_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pull carried at time t lands at t plus its bytes over the pull rate, after the pulls
    before it; the first result that ends after that names it, and no step's modelled time holds
    it. A step with nothing to run waits for the next landing, but no longer than `POLL_WAIT_S`.
    (A clock of its own: time passes only as the runner sleeps.)"""
    clock = [100.0]
    monkeypatch.setattr(simulated.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(simulated.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    block_bytes = SMALL.block_size * SMALL.kv_bytes_per_token
    latency = LatencyModel(base_s=0.01, per_token_s=0.0, per_seq_s=0.0, pull_bytes_per_s=block_bytes / 0.0125)
    runner = SimulatedRunner(dataclasses.replace(SMALL, latency=latency))

    def pull(req_id: str, dst: list[int]) -> KvPull:
        return KvPull("source:1", "", [b + 20 for b in dst], dst, req_id)

    results = [
        runner.execute(
            StepPlan(1, [new("b", [1, 2])], num_scheduled_tokens={"b": 5}, kv_pulls=[pull("a", [10, 11])])
        )
    ]
    results += [runner.execute(StepPlan(step, num_scheduled_tokens={"b": 1})) for step in (2, 3)]
    assert [r.landed_pull_req_ids for r in results] == [[], [], ["a"]]  # at 100.025; steps end every 10 ms
    assert [r.timings.kv_transfers for r in results] == [
        [],
        [],
        [KvTransfer(KV_TRANSFER_EXECUTOR, 2 * block_bytes, pytest.approx(0.025))],
    ]
    assert runner.stats.modeled_s == pytest.approx(3 * latency.step_seconds(1, 1))
    assert runner.num_pulled_blocks == 2

    # With nothing to run, a step waits for the landing; the plan that dropped "a" took its outcome.
    polled = runner.execute(StepPlan(4, finished_req_ids=["a"], kv_pulls=[pull("c", [12])]))
    assert polled.landed_pull_req_ids == ["c"] and clock[0] == pytest.approx(100.03 + 0.0125)
    assert polled.timings.total_s == 0.0 and runner.stats.busy_s == pytest.approx(0.03)
    long = runner.execute(StepPlan(5, finished_req_ids=["c"], kv_pulls=[pull("d", list(range(20, 36)))]))
    assert not long.landed_pull_req_ids and clock[0] == pytest.approx(100.0425 + POLL_WAIT_S)
    assert runner.stats.pull_s == pytest.approx(0.025 + 0.0125)
