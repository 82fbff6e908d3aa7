"""ModelRunner on the real TinyStories 260K model: the executor's promises to the scheduler.

Seeded sampling is a function of (logits, seed, position) only, so a request gets the same tokens
on any runner, alone or in any batch, in any order, under any chunking. Logprobs, min_tokens and
penalties act per request. A retried step id is answered without running again; a plan that
contradicts the executor's state is refused and drops the requests it names, and the runner
keeps serving.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from harness.step_driver import DrivenRequest, StepDriver

from npuserve.executor.config import ExecutorConfig
from npuserve.executor.input_batch import PlanError
from npuserve.executor.model_runner import ModelRunner
from npuserve.proto.step_plan import NewRequest, SamplingOptions, StepPlan, TokenBitmask, bitmask_words

PROMPT = [1, 403, 407, 261, 378]  # "Once upon a time"
GREEDY = SamplingOptions(temperature=0)
TARGET_SAMPLING = SamplingOptions(temperature=0.8, top_p=0.9, seed=1)


def make_runner(stories_dir: Path, **kwargs: object) -> ModelRunner:
    return ModelRunner(ExecutorConfig(model=str(stories_dir), kv_cache_memory_gib=0.01, **kwargs))


def random_prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return [1, *torch.randint(3, 512, (length - 1,), generator=generator).tolist()]


def outputs(driver: StepDriver, requests: list[DrivenRequest], token_budget: int = 10_000) -> list[list[int]]:
    """Runs the requests to completion on the driver's runner; their outputs in the same order."""
    driver.token_budget = token_budget
    driver.run(requests)
    return [r.output for r in requests]


def greedy_reference(stories_dir: Path, prompt: list[int], num_tokens: int) -> list[int]:
    (output,) = outputs(
        StepDriver(make_runner(stories_dir)), [DrivenRequest("ref", prompt, num_tokens, GREEDY)]
    )
    return output


# ------------------------------------------------------------------------ seeded sampling


def target() -> DrivenRequest:
    return DrivenRequest("target", PROMPT, 16, TARGET_SAMPLING)


def others() -> list[DrivenRequest]:
    """Five requests of other prompt and output lengths and other sampling settings."""
    specs: list[tuple[int, int, SamplingOptions]] = [
        (1, 5, GREEDY),
        (13, 20, SamplingOptions(temperature=1.0, top_k=20, seed=7)),
        (30, 9, SamplingOptions(temperature=0.7)),  # unseeded: the runner draws a seed
        (4, 14, SamplingOptions(temperature=1.2, min_p=0.1, seed=9, num_logprobs=2)),
        (
            22,
            3,
            SamplingOptions(
                temperature=0.9, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, seed=11
            ),
        ),
    ]
    return [
        DrivenRequest(f"other{i}", random_prompt(length, seed=i), num_tokens, sampling)
        for i, (length, num_tokens, sampling) in enumerate(specs)
    ]


@pytest.mark.slow
def test_seeded_sampling_is_batch_and_run_invariant(stories_dir: Path) -> None:
    """A seeded request samples the same tokens on two runners, alone, among five other requests,
    in another order, and under a small token budget that chunks the prefills differently."""
    first, second = make_runner(stories_dir), make_runner(stories_dir)
    driver_a, driver_b = StepDriver(first), StepDriver(second, seed=1)
    (alone,) = outputs(driver_a, [target()])
    assert outputs(driver_b, [target()]) == [alone]

    mixed = others()
    mixed.insert(2, target())
    reordered = [*reversed(others()), target()]
    chunked = [target(), *others()]
    outputs(driver_a, mixed)
    outputs(driver_b, reordered)
    outputs(driver_a, chunked, token_budget=3)  # the target's 5-token prefill takes two steps
    runs = [{r.req_id: r.output for r in requests} for requests in (mixed, reordered, chunked)]
    assert [run["target"] for run in runs] == [alone] * 3
    assert outputs(driver_a, [target()]) == [alone]  # and again on a runner that served all that

    # The other seeded (and greedy) requests are just as invariant; only the unseeded one may vary.
    for req_id in ["other0", "other1", "other3", "other4"]:
        assert runs[0][req_id] == runs[1][req_id] == runs[2][req_id], req_id

    # The draw is random: another seed, or greedy, gives other tokens.
    (other_seed,) = outputs(
        driver_a, [DrivenRequest("t2", PROMPT, 16, SamplingOptions(temperature=0.8, top_p=0.9, seed=99))]
    )
    assert other_seed != alone
    assert alone != greedy_reference(stories_dir, PROMPT, 16)


@pytest.mark.slow
def test_unseeded_sampling_repeats_for_the_same_runner_seed(stories_dir: Path) -> None:
    """Unseeded requests draw their seeds from a generator seeded by ExecutorConfig.seed, one per
    request in arrival order: the same plans on a runner with the same seed give the same tokens.
    (Only that is relied on; a different arrival order may hand the seeds out differently.)"""

    def run(seed: int) -> list[list[int]]:
        requests = [DrivenRequest(f"u{i}", PROMPT, 12, SamplingOptions(temperature=1.0)) for i in range(2)]
        return outputs(StepDriver(make_runner(stories_dir, seed=seed)), requests)

    first = run(seed=0)
    assert run(seed=0) == first
    assert first[0] != first[1]  # each request draws its own seed
    assert run(seed=1) != first


# ------------------------------------------------------------------------------- logprobs


def test_logprobs_only_for_requests_that_ask(stories_dir: Path) -> None:
    """num_logprobs=3 gives 3 descending top entries and the sampled token's logprob and rank;
    a greedy token is the top entry (rank 1); requests without logprobs get None each step."""
    requests = [
        DrivenRequest("greedy-lp", PROMPT, 8, SamplingOptions(temperature=0, num_logprobs=3)),
        DrivenRequest("plain", PROMPT, 8, SamplingOptions(temperature=1.0, seed=5)),
        DrivenRequest("sampled-lp", PROMPT, 8, SamplingOptions(temperature=1.5, seed=6, num_logprobs=2)),
    ]
    outputs(StepDriver(make_runner(stories_dir)), requests)
    greedy_lp, plain, sampled_lp = requests
    assert plain.logprobs == [None] * 8
    for token, lp in zip(greedy_lp.output, greedy_lp.logprobs, strict=True):
        assert lp is not None
        assert len(lp.top_token_ids) == len(lp.top_logprobs) == 3
        assert lp.rank == 1 and lp.top_token_ids[0] == token
        assert lp.logprob == lp.top_logprobs[0]
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
        assert all(x <= 0 for x in lp.top_logprobs)
        assert sum(math.exp(x) for x in lp.top_logprobs) <= 1 + 1e-6
    ranks = []
    for token, lp in zip(sampled_lp.output, sampled_lp.logprobs, strict=True):
        assert lp is not None and len(lp.top_token_ids) == 2
        assert lp.rank >= 1 and lp.logprob <= lp.top_logprobs[0]
        assert (lp.rank == 1) == (token == lp.top_token_ids[0])
        ranks.append(lp.rank)
    assert max(ranks) > 1  # temperature 1.5 leaves the top token at least once
    # Asking for logprobs does not change the tokens.
    assert greedy_lp.output == greedy_reference(stories_dir, PROMPT, 8)


# ------------------------------------------------------------------------------ min_tokens


def test_min_tokens_blocks_stop_ids_until_reached(stories_dir: Path) -> None:
    """A stop id greedy would emit as its third token is avoided while fewer than min_tokens
    outputs exist and allowed once min_tokens outputs exist."""
    greedy = greedy_reference(stories_dir, PROMPT, 8)
    stop = greedy[2]
    assert stop not in greedy[:2]

    def run(min_tokens: int) -> list[int]:
        sampling = SamplingOptions(temperature=0, min_tokens=min_tokens, stop_token_ids=(stop,))
        return outputs(StepDriver(make_runner(stories_dir)), [DrivenRequest("m", PROMPT, 8, sampling)])[0]

    blocked = run(min_tokens=3)
    assert blocked[:2] == greedy[:2]
    assert stop not in blocked[:3]
    assert run(min_tokens=2) == greedy  # two outputs exist when the third is sampled: allowed
    assert run(min_tokens=0) == greedy  # stop ids alone are the scheduler's business
    first_blocked = SamplingOptions(temperature=0, min_tokens=1, stop_token_ids=(greedy[0], 999, -3))
    (out,) = outputs(StepDriver(make_runner(stories_dir)), [DrivenRequest("f", PROMPT, 1, first_blocked)])
    assert out[0] != greedy[0]  # ids outside the vocabulary are ignored


# ------------------------------------------------------------------------------- penalties


@pytest.mark.slow
def test_repetition_penalty_changes_greedy_output_deterministically(stories_dir: Path) -> None:
    """repetition_penalty 1.5 changes the greedy story, the same way on every run, and a
    penalised request batched with a plain one does not penalise its neighbour."""
    greedy = greedy_reference(stories_dir, PROMPT, 32)
    penalised = SamplingOptions(temperature=0, repetition_penalty=1.5)
    (first,) = outputs(StepDriver(make_runner(stories_dir)), [DrivenRequest("p", PROMPT, 32, penalised)])
    assert first != greedy
    together = [DrivenRequest("p", PROMPT, 32, penalised), DrivenRequest("g", PROMPT, 32, GREEDY)]
    assert outputs(StepDriver(make_runner(stories_dir)), together) == [first, greedy]


# ---------------------------------------------------------------------- step-id idempotency


def test_repeated_step_id_returns_same_result_without_advancing(stories_dir: Path) -> None:
    """Re-executing the last plan (same step_id) returns the identical result, leaves tokens,
    computed counts and the KV cache as they were, and the next step continues correctly."""
    expected = greedy_reference(stories_dir, PROMPT, 4)
    runner = make_runner(stories_dir)
    request = NewRequest("a", list(PROMPT), len(PROMPT), GREEDY, block_ids=[5], num_computed_tokens=0)
    first_plan = StepPlan(step_id=0, new_requests=[request], num_scheduled_tokens={"a": len(PROMPT)})
    first = runner.execute(first_plan)
    row = runner.batch.row_of["a"]
    state = (int(runner.batch.num_tokens[row]), int(runner.batch.num_computed_tokens[row]))
    caches = [cache.clone() for cache in runner.kv_caches]

    assert runner.execute(first_plan) == first
    assert (int(runner.batch.num_tokens[row]), int(runner.batch.num_computed_tokens[row])) == state
    assert all(torch.equal(a, b) for a, b in zip(caches, runner.kv_caches, strict=True))
    assert runner.batch.num_reqs == 1

    tokens = list(first.sampled_token_ids)
    for step_id in range(1, 4):
        plan = StepPlan(step_id=step_id, num_scheduled_tokens={"a": 1})
        result = runner.execute(plan)
        assert runner.execute(plan) == result  # every step may be retried
        tokens += result.sampled_token_ids
    assert tokens == expected
    assert runner.batch.num_tokens[row] == len(PROMPT) + 4


# ---------------------------------------------------------------------------- plan errors


@pytest.mark.slow
def test_plan_error_drops_named_requests_and_runner_keeps_serving(stories_dir: Path) -> None:
    """A new request scheduled with an unknown one is refused as a whole: PlanError, the new
    request is dropped (num_reqs as before), a running request the plan did not name is kept,
    and both it and a fresh request are then served exactly as on an untouched runner."""
    background_prompt = random_prompt(9, seed=3)
    expected_background = greedy_reference(stories_dir, background_prompt, 10)
    expected_fresh = greedy_reference(stories_dir, PROMPT, 10)
    runner = make_runner(stories_dir)
    driver = StepDriver(runner)
    background = DrivenRequest("bg", background_prompt, 10, GREEDY)
    driver.step([background])
    driver.step([background])
    assert runner.batch.num_reqs == 1

    bad = StepPlan(
        step_id=driver.step_id,
        new_requests=[NewRequest("ok", list(PROMPT), len(PROMPT), GREEDY, [driver.free_blocks.pop()], 0)],
        num_scheduled_tokens={"ok": len(PROMPT), "ghost": 1},
    )
    driver.step_id += 1
    with pytest.raises(PlanError, match="'ghost' is scheduled but unknown"):
        runner.execute(bad)
    assert runner.batch.num_reqs == 1
    assert set(runner.batch.row_of) == {"bg"}

    fresh = DrivenRequest("ok", PROMPT, 10, GREEDY)  # the scheduler re-sends it whole
    driver.run([background, fresh])
    assert background.output == expected_background
    assert fresh.output == expected_fresh
    assert runner.batch.num_reqs == 0


def test_plan_error_also_drops_running_requests_it_names(stories_dir: Path) -> None:
    """A running request named in a refused plan is dropped too (the scheduler re-sends it),
    and the same request id can then be admitted again."""
    runner = make_runner(stories_dir)
    driver = StepDriver(runner)
    running = DrivenRequest("run", PROMPT, 4, GREEDY)
    driver.step([running])
    bad_block = NewRequest("bad", [1, 2], 2, GREEDY, block_ids=[0], num_computed_tokens=0)
    plan = StepPlan(
        step_id=driver.step_id, new_requests=[bad_block], num_scheduled_tokens={"run": 1, "bad": 2}
    )
    driver.step_id += 1
    with pytest.raises(PlanError, match="block id outside"):
        runner.execute(plan)
    assert runner.batch.num_reqs == 0
    again = DrivenRequest("run", PROMPT, 4, GREEDY)
    driver.run([again])
    assert again.output == greedy_reference(stories_dir, PROMPT, 4)


def _allow_only(token: int, vocab_size: int) -> bytes:
    """One bitmask row of packed int32 words allowing just ``token``."""
    bits = np.zeros(bitmask_words(vocab_size) * 32, dtype=np.uint8)
    bits[token] = 1
    return np.packbits(bits, bitorder="little").view("<i4").tobytes()


def test_bitmask_confines_its_request_and_a_bad_one_is_refused_before_the_forward(stories_dir: Path) -> None:
    """A bitmask row for a request that samples nothing this step is a PlanError raised before the
    forward (the KV cache is as it was); a valid row makes the request sample its one allowed
    token, not the greedy one."""
    runner = make_runner(stories_dir)
    vocab_size = runner.model_config.vocab_size
    greedy = greedy_reference(stories_dir, PROMPT, 1)[0]
    allowed = 7 if greedy != 7 else 8
    request = NewRequest("a", list(PROMPT), len(PROMPT), GREEDY, block_ids=[5], num_computed_tokens=0)
    caches = [cache.clone() for cache in runner.kv_caches]
    chunk = StepPlan(  # a prefill chunk that stops mid-prompt: it samples no token
        step_id=0,
        new_requests=[request],
        num_scheduled_tokens={"a": 2},
        bitmask=TokenBitmask(["a"], _allow_only(allowed, vocab_size)),
    )
    with pytest.raises(PlanError, match="samples no token"):
        runner.execute(chunk)
    assert all(torch.equal(a, b) for a, b in zip(caches, runner.kv_caches, strict=True))
    assert runner.batch.num_reqs == 0

    whole = StepPlan(
        step_id=1,
        new_requests=[request],
        num_scheduled_tokens={"a": len(PROMPT)},
        bitmask=TokenBitmask(["a"], _allow_only(allowed, vocab_size)),
    )
    assert runner.execute(whole).sampled_token_ids == [allowed]


# ------------------------------------------------------------------------ multi-step decoding


def test_multi_step_plans_sample_what_single_steps_sample(stories_dir: Path) -> None:
    """Four passes per step (greedy, seeded, penalised, with logprobs and min_tokens, prefills
    chunked under a small budget, new requests answered after the first pass or started in a
    step that joins a later pass) give every request the tokens and logprobs one pass per step
    gives: each later pass feeds back the token the one before sampled."""
    stop = greedy_reference(stories_dir, PROMPT, 8)[2]
    specs = [
        *others(),
        target(),
        DrivenRequest("min", PROMPT, 7, SamplingOptions(temperature=0, min_tokens=3, stop_token_ids=(stop,))),
    ]

    def run(
        num_steps: int, token_budget: int, answer_early: bool = False, join_new: bool = False
    ) -> list[DrivenRequest]:
        requests = [DrivenRequest(r.req_id, r.prompt, r.max_new_tokens, r.sampling) for r in specs]
        runner = make_runner(stories_dir, seed=5)
        driver = StepDriver(runner, num_steps=num_steps, answer_early=answer_early, join_new=join_new)
        if join_new:  # two requests first; the others come while they run, and join their passes
            driver.token_budget = token_budget
            driver.step(requests[:2])
        outputs(driver, requests, token_budget)
        assert runner.batch.num_reqs == 0
        assert bool(driver.early_answers) == answer_early
        assert len(driver.joined_answers) == driver.num_joined == join_new
        return requests

    def same(a: list[DrivenRequest], b: list[DrivenRequest]) -> None:
        for x, y in zip(a, b, strict=True):
            assert x.output == y.output, x.req_id
            for lx, ly in zip(x.logprobs, y.logprobs, strict=True):  # float sums of other batches
                assert (lx is None) == (ly is None), x.req_id
                if lx is not None and ly is not None:
                    assert (lx.rank, lx.top_token_ids) == (ly.rank, ly.top_token_ids)
                    assert lx.logprob == pytest.approx(ly.logprob, abs=1e-4)

    single = run(num_steps=1, token_budget=10_000)
    same(run(num_steps=4, token_budget=10_000), single)
    same(run(num_steps=3, token_budget=7), single)  # prefills chunked: only sampling requests run on
    # New requests run one pass, answered early, while the running ones run their four.
    same(run(num_steps=4, token_budget=7, answer_early=True), single)
    # New requests start in a step that joins the second pass of the running ones' step: their
    # prompts run in the same forward as those requests' decodes (`StepPlan.joins_running`).
    same(run(num_steps=4, token_budget=10_000, join_new=True), single)
    assert any(r.logprobs[0] is not None for r in single)


def test_multi_step_plan_is_refused_where_it_cannot_run(stories_dir: Path) -> None:
    """More than one pass for a request that samples nothing in the first, or whose blocks do not
    hold the later passes' tokens, is a PlanError before any forward; the KV cache is as it was."""
    runner = make_runner(stories_dir)
    caches = [cache.clone() for cache in runner.kv_caches]

    def new(block_ids: list[int]) -> NewRequest:
        return NewRequest("a", list(PROMPT), len(PROMPT), GREEDY, block_ids=block_ids, num_computed_tokens=0)

    chunk = StepPlan(0, [new([5])], num_scheduled_tokens={"a": 2}, num_steps={"a": 2})
    with pytest.raises(PlanError, match="samples no token in the first"):
        runner.execute(chunk)
    block_size = runner.block_size
    full = [1, *random_prompt(block_size - 1, seed=2)]  # fills its one block: no slot for a second pass
    tight = StepPlan(
        1,
        [NewRequest("b", full, len(full), GREEDY, block_ids=[6], num_computed_tokens=0)],
        num_scheduled_tokens={"b": len(full)},
        num_steps={"b": 2},
    )
    with pytest.raises(PlanError, match="beyond its blocks"):
        runner.execute(tight)
    assert all(torch.equal(a, b) for a, b in zip(caches, runner.kv_caches, strict=True))
    assert runner.batch.num_reqs == 0


# ------------------------------------------------------------------------------------ info


def test_info_reports_capacity(stories_dir: Path) -> None:
    """The capacity handshake reports what the scheduler needs to plan for this executor."""
    runner = make_runner(stories_dir, max_num_seqs=8, max_model_len=256)
    info = runner.info()
    block_bytes = 2 * 16 * 4 * 8 * 5 * 4  # k+v, block 16, 4 kv heads, head_dim 8, 5 layers, fp32
    assert info.block_size == 16
    assert info.num_blocks == runner.num_blocks == int(0.01 * 2**30) // block_bytes
    assert info.max_model_len == 256
    assert info.max_num_seqs == 8
    assert info.dtype == "float32"
    assert info.device == "cpu"
    assert info.eos_token_ids == [2]
    assert info.vocab_size == 512
    assert info.model == "stories260K" and info.architecture == "LlamaForCausalLM"
    assert info.tensor_parallel_size == 1


def test_cpu_threads_set_the_processes_torch_threads_on_the_cpu(stories_dir: Path) -> None:
    """``--cpu-threads``: how many threads torch computes with, where the model runs on the CPU
    (`npuserve serve` gives executors one core fewer than the host's)."""
    before = torch.get_num_threads()
    try:
        make_runner(stories_dir, device="cpu", cpu_threads=1)
        assert torch.get_num_threads() == 1
        make_runner(stories_dir, device="cpu")  # not given: left as it is
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
