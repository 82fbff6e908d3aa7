"""Structured outputs in the scheduler: grammar compile (cache, errors, time limit), matchers that
follow their request's tokens (rollback, replay), the bitmask on the step wire, and constrained
requests over simulated executors through preemption and executor fail-over."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from harness.hostile_grammars import chained_refs_text, chained_rules
from harness.simulated_engine import SMALL, SimulatedEngine, generate, simulated_engine

from npuserve.proto import executor_pb2
from npuserve.proto.step_codec import CodecError, plan_from_proto, plan_to_proto
from npuserve.proto.step_plan import StepPlan, TokenBitmask, bitmask_words
from npuserve.proto.structured_outputs import StructuredOutputs
from npuserve.scheduler.core.request import InvalidRequestError, SamplingParams
from npuserve.scheduler.structured import grammar_compiler
from npuserve.scheduler.structured import matchers as structured
from npuserve.scheduler.structured.grammar_compiler import GrammarCompiler, _closed_objects
from npuserve.scheduler.structured.matchers import GrammarState, advance_masks
from npuserve.scheduler.text.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "blue"]},
    },
    "required": ["name", "age", "color"],
}


def _compiler(tokenizer: Tokenizer, timeout_s: float = 5.0, max_rules: int = 1_000) -> GrammarCompiler:
    return GrammarCompiler(
        tokenizer.to_json(), 512, tokenizer.eos_token_ids, timeout_s=timeout_s, max_rules=max_rules
    )


def _allowed(mask: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))


def test_a_grammar_compiles_once_per_canonical_constraint(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        compiler = _compiler(tokenizer)
        first = await compiler.compile(StructuredOutputs.json_schema(SCHEMA))
        spaced = StructuredOutputs("json_schema", json.dumps(SCHEMA, indent=2))  # same schema
        assert await compiler.compile(spaced) is first
        assert (compiler.hits, compiler.misses) == (1, 1)
        other = await compiler.compile(StructuredOutputs.json_schema(SCHEMA, compact_whitespace=False))
        assert other is not first and compiler.misses == 2
        compiler.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "constraint",
    [
        StructuredOutputs("json_schema", '{"type": "nope"}'),
        StructuredOutputs("json_schema", '{"type": "object"'),  # not JSON
        StructuredOutputs("regex", "(unclosed"),
        StructuredOutputs("grammar", "start: missing_rule"),
        StructuredOutputs("grammar", 'root ::= "a" undefined'),  # GBNF
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_naming_the_field(
    tokenizer: Tokenizer, constraint: StructuredOutputs
) -> None:
    async def scenario() -> None:
        compiler = _compiler(tokenizer)
        for _ in range(2):  # the refusal is cached too, and still names the field
            with pytest.raises(InvalidRequestError) as refused:
                await compiler.compile(constraint)
            assert refused.value.field == "structured_outputs"
            assert constraint.kind in str(refused.value)
        assert compiler.hits == 1
        compiler.close()

    asyncio.run(scenario())


def test_a_compile_past_the_time_limit_is_killed_and_its_refusal_cached(tokenizer: Tokenizer) -> None:
    """The worker compiling it is killed at the limit (not left running) and replaced; the next
    constraint compiles, and the same constraint again is refused from the cache."""

    async def scenario() -> None:
        compiler = _compiler(tokenizer, timeout_s=0.5, max_rules=10_000)
        compiler.start()
        await compiler.wait_started()
        before = compiler.workers.worker_pids
        slow = StructuredOutputs("grammar", chained_rules(2_000, gbnf=True))  # seconds to compile
        with pytest.raises(InvalidRequestError, match=r"within 0\.5 s") as refused:
            await compiler.compile(slow)
        assert refused.value.field == "structured_outputs"
        assert not any(_alive(pid) for pid in before - compiler.workers.worker_pids)
        assert (await compiler.compile(StructuredOutputs("json_object"))).constraint.kind == "json_object"
        with pytest.raises(InvalidRequestError, match=r"within 0\.5 s"):
            await compiler.compile(slow)
        assert compiler.hits == 1
        compiler.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "constraint",
    [
        StructuredOutputs("json_schema", chained_refs_text(1_000)),  # within every bound
        StructuredOutputs("grammar", chained_rules(3_000)),  # past the rule bound, raised here
    ],
    ids=["json_schema", "grammar"],
)
def test_a_constraint_that_crashes_the_compiler_costs_one_worker(
    tokenizer: Tokenizer, constraint: StructuredOutputs
) -> None:
    async def scenario() -> None:
        compiler = _compiler(tokenizer, max_rules=10_000)
        compiler.start()
        await compiler.wait_started()
        before = compiler.workers.worker_pids
        for _ in range(2):  # the second is refused from the cache: no second crash
            with pytest.raises(InvalidRequestError, match="crashed the grammar compiler") as refused:
                await compiler.compile(constraint)
            assert refused.value.field == "structured_outputs"
        ok = await compiler.compile(StructuredOutputs("regex", "[a-z]{3}"))
        assert ok.constraint.kind == "regex" and compiler.hits == 1
        for _ in range(600):  # the replacement starts in the background
            if len(compiler.workers.worker_pids) == 2:
                break
            await asyncio.sleep(0.05)
        assert len(compiler.workers.worker_pids - before) == 1  # one worker replaced, one kept
        compiler.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (StructuredOutputs("grammar", chained_rules(3_000)), "3002 rules; at most 1000"),
        (StructuredOutputs("grammar", chained_rules(3_000, gbnf=True)), "3002 rules; at most 1000"),
        (StructuredOutputs("grammar", chained_rules(20_000, gbnf=True)), "715593 bytes long"),
        (StructuredOutputs("regex", "a" * 200_000), "200000 bytes long; at most 131072"),
        (StructuredOutputs("choice", choices=("x" * 70_000, "y" * 70_000)), "140000 bytes long"),
    ],
)
def test_a_constraint_past_a_bound_is_refused_before_any_compile(
    tokenizer: Tokenizer, constraint: StructuredOutputs, message: str
) -> None:
    async def scenario() -> None:
        compiler = _compiler(tokenizer)
        with pytest.raises(InvalidRequestError, match=message) as refused:
            await compiler.compile(constraint)
        assert refused.value.field == "structured_outputs"
        assert not compiler._started  # no worker was asked
        compiler.close()

    asyncio.run(scenario())


def test_rules_are_counted_in_lark_and_gbnf() -> None:
    lark = 'start: a b\n?a: "x" | b\n!b.2: "y"\nNAME: /[a-z]+/\n// c: comment\n  | "more"\n'
    assert len(grammar_compiler._RULE_HEAD.findall(lark)) == 4
    gbnf = 'root ::= a\na ::= "x" b\nword-list ::= [a-z]+\n'
    assert len(grammar_compiler._RULE_HEAD.findall(gbnf)) == 3


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_a_matcher_rolls_back_and_replays_to_its_request_tokens(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        compiler = _compiler(tokenizer)
        grammar = await compiler.compile(StructuredOutputs.json_schema(SCHEMA))
        text = '{"name":"Lily","age":7,"color":"red"}'
        tokens = compiler._grammar_vocab()[0].tokenize_str(text)  # no sentencepiece's leading space
        state = grammar.new_state()
        for token in tokens:
            assert token in _allowed(state.mask)
            state.accept(token)
            state.sync(tokens[: state.num_accepted])  # computes the next mask
        assert state.error is None and state.is_complete
        state.sync(tokens[:3])  # rolled back: as a fresh matcher fed the same three tokens
        fresh = grammar.new_state()
        fresh.sync(tokens[:3])
        assert np.array_equal(state.mask, fresh.mask) and not state.is_complete
        for s in (state, fresh):
            s.release()
            s.release()  # idempotent
        assert compiler.num_live_states == 0
        compiler.close()

    asyncio.run(scenario())


def test_objects_take_only_their_properties_unless_the_schema_says_otherwise() -> None:
    closed = _closed_objects({"type": "array", "items": SCHEMA})
    assert closed["items"]["additionalProperties"] is False
    open_schema = {**SCHEMA, "additionalProperties": True}
    assert _closed_objects(open_schema) == open_schema


def test_the_bitmask_crosses_the_step_wire_for_scheduled_rows_only() -> None:
    words = np.arange(2 * bitmask_words(512), dtype="<i4").tobytes()
    plan = StepPlan(step_id=7, num_scheduled_tokens={"a": 1, "b": 1, "c": 3})
    plan.bitmask = TokenBitmask(["c", "a"], words)
    decoded = plan_from_proto(executor_pb2.StepRequest.FromString(plan_to_proto(plan).SerializeToString()))
    assert decoded.bitmask == plan.bitmask
    assert plan_from_proto(plan_to_proto(dataclasses.replace(plan, bitmask=None))).bitmask is None
    for bad in (TokenBitmask(["a", "zz"], words), TokenBitmask(["a", "b"], words[:-2])):
        with pytest.raises(CodecError):
            plan_from_proto(plan_to_proto(dataclasses.replace(plan, bitmask=bad)))


def _constrained(max_tokens: int = 60) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputs.json_schema(SCHEMA))


async def _run_all(sim: SimulatedEngine, ids: list[str]) -> dict[str, tuple[list[int], str | None]]:
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    runs = await asyncio.gather(*(generate(sim.engine, prompt, _constrained(), i) for i in ids))
    return {i: (run.tokens[0], run.finish_reasons[0]) for i, run in zip(ids, runs, strict=True)}


def test_constrained_requests_survive_preemption_and_fail_over(tokenizer: Tokenizer) -> None:
    """The simulated executors sample inside the bitmask (a function of request and position),
    so a constrained request's tokens are known from an undisturbed run: with a pool that forces
    preemption and an executor that goes down mid-run, each request ends with the same tokens,
    valid JSON, and every pool and grammar state comes back."""
    ids = [f"so-{i}" for i in range(8)]

    async def scenario() -> None:
        async with simulated_engine(tokenizer, 1) as sim:
            undisturbed = await _run_all(sim, ids)
        for tokens, reason in undisturbed.values():
            assert reason == "stop"
            jsonschema.validate(json.loads(tokenizer.decode(tokens, True)), SCHEMA)
        tight = dataclasses.replace(SMALL, num_blocks=24)  # 8 requests need more: preemption
        async with simulated_engine(tokenizer, 1, config=tight) as sim:
            assert await _run_all(sim, ids) == undisturbed
            assert sim.engine.lanes["e0"].scheduler.total_preemptions > 0
        async with simulated_engine(tokenizer, 2, failing={"e0": (4, "UNAVAILABLE")}) as sim:
            assert await _run_all(sim, ids) == undisturbed
            assert list(sim.engine.lanes) == ["e1"] and sim.sampled_by()["e0"] > 0
            assert sim.engine.grammars.num_live_states == 0

    asyncio.run(scenario())


def _walk(
    state: GrammarState, rng: np.random.Generator, eos: tuple[int, ...], steps: int
) -> list[int] | None:
    """Samples uniformly inside the mask until EOS, a complete output or `steps` tokens; the
    tokens written (None: the budget ran out first). Every token the mask allows must be one the
    matcher accepts."""
    tokens: list[int] = []
    for _ in range(steps):
        allowed = _allowed(state.mask)
        assert state.matcher is not None and len(allowed)
        for token in allowed:
            probe = state.matcher.deep_copy()
            assert token in eos or probe.consume_token(int(token)), (tokens, int(token), probe.get_error())
        token = int(rng.choice(allowed))
        if token in eos:
            return tokens
        tokens.append(token)
        state.accept(token)
        state.sync(tokens)  # the next mask
        assert state.error is None, state.error
        if state.is_complete:
            return tokens
    return None


@pytest.mark.parametrize(
    "pattern",
    [
        r"[A-Z][a-z]{2,8} is [0-9]{1,2}\.",
        r"(yes|no) and (maybe|never)",
        r"The (cat|dog) sat  on  a [a-z]{1,5}\.",
        r" [a-z]{2,4} [0-9]",
    ],
)
def test_masks_allow_only_what_the_matcher_accepts_around_spaces(tokenizer: Tokenizer, pattern: str) -> None:
    """The demo tokenizer's normalizer strips and collapses spaces; the grammar engine gets one
    that keeps them, so the tokens forced after a space agree with the matcher."""
    compiler = _compiler(tokenizer)
    grammar = compiler.compile_now(StructuredOutputs("regex", pattern))
    rng = np.random.default_rng(7)
    llg = compiler._grammar_vocab()[0]
    for _ in range(6):
        state = grammar.new_state()
        tokens = _walk(state, rng, tokenizer.eos_token_ids, 80)
        assert tokens is not None and re.fullmatch(pattern, llg.decode_str(tokens)), tokens
        state.release()
    compiler.close()


UNBOUNDED = {
    "type": "object",
    "properties": {"a": {"type": "string"}, "b": {"type": "array", "items": {"type": "number"}}},
    "required": ["a", "b"],
}


# Tool calls as a required tool_choice asks for them: an array of calls, each with required
# members, so the comma that opens another call adds far more tokens than CLOSING_SLACK (and with
# no free string, a uniform walk ends each call soon and opens the next).
CALL = {
    "type": "object",
    "properties": {
        "name": {"enum": ["get_weather", "get_time"]},
        "arguments": {
            "type": "object",
            "properties": {
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "dst": {"type": "boolean"},
            },
            "required": ["unit", "days", "dst"],
        },
    },
    "required": ["name", "arguments"],
}
CALLS = {"type": "array", "items": CALL, "minItems": 1}


def _completes(constraint: StructuredOutputs, text: str) -> bool:
    if constraint.kind == "regex":
        return re.fullmatch(constraint.spec, text) is not None
    if constraint.kind == "choice":
        return text in constraint.choices
    value = json.loads(text)
    if constraint.kind == "json_schema":
        jsonschema.validate(value, json.loads(constraint.spec))
    return True


@pytest.mark.parametrize(
    "constraint",
    [
        StructuredOutputs("json_object"),
        StructuredOutputs.json_schema(UNBOUNDED),
        StructuredOutputs.json_schema({"type": "array", "items": UNBOUNDED, "minItems": 1}),
        StructuredOutputs.json_schema(CALLS),
        StructuredOutputs("regex", r"[a-z]+ [a-z]+ [0-9]{3}"),
        StructuredOutputs("choice", choices=("a" * 30, "no")),
    ],
)
def test_a_wandering_output_closes_within_any_budget_from_its_shortest(
    tokenizer: Tokenizer, constraint: StructuredOutputs
) -> None:
    """Uniform sampling inside the mask never ends a free string by itself and opens whatever it
    may; near the budget the mask keeps out what would not fit, then narrows to the constraint's
    closing path, so every output is complete within its budget, down to the shortest output."""
    compiler = _compiler(tokenizer)
    grammar = compiler.compile_now(constraint)
    assert grammar.closing is not None
    shortest = grammar.closing.shortest.cost
    rng = np.random.default_rng(3)
    for budget in sorted({shortest, shortest + 1, 64, 90}):
        for _ in range(4):
            state = grammar.new_state(budget)
            tokens = _walk(state, rng, tokenizer.eos_token_ids, budget)
            assert tokens is not None and len(tokens) <= budget
            assert _completes(constraint, compiler._grammar_vocab()[0].decode_str(tokens))
            state.release()
    assert compiler.num_live_states == 0
    compiler.close()


@pytest.mark.parametrize(
    ("constraint", "shortest"),
    [
        (StructuredOutputs("json_object"), "{}"),
        (StructuredOutputs("choice", choices=("a" * 30, "no")), "no"),
        (StructuredOutputs("regex", r"[a-z]+ [0-9]{2}"), "a 00"),
        (
            StructuredOutputs.json_schema(CALLS),
            '[{"name":"get_time","arguments":{"unit":"celsius","days":1,"dst":false}}]',
        ),
    ],
)
def test_max_tokens_below_the_shortest_output_is_refused_and_at_it_writes_it(
    tokenizer: Tokenizer, constraint: StructuredOutputs, shortest: str
) -> None:
    """A grammar's shortest output takes the shorter way at each choice, not the first one;
    a sequence that may write fewer tokens is refused naming max_tokens, and one that may write
    exactly as many writes that output."""
    compiler = _compiler(tokenizer)
    grammar = compiler.compile_now(constraint)
    assert grammar.closing is not None
    cost = grammar.closing.shortest.cost
    assert grammar.closing.shortest.text == shortest.encode()
    with pytest.raises(InvalidRequestError) as refused:
        grammar.new_state(cost - 1)
    assert refused.value.field == "max_tokens"
    assert str(refused.value).startswith(f"max_tokens {cost - 1} is less than the {cost} tokens")
    state = grammar.new_state(cost)
    tokens = _walk(state, np.random.default_rng(1), tokenizer.eos_token_ids, cost)
    assert tokens is not None and compiler._grammar_vocab()[0].decode_str(tokens) == shortest
    state.release()
    assert compiler.num_live_states == 0
    compiler.close()


@pytest.mark.parametrize(
    "constraint",
    [
        StructuredOutputs("json_object"),
        StructuredOutputs.json_schema(CALLS),
        StructuredOutputs("choice", choices=("a" * 30, "no")),
    ],
)
def test_a_sequence_replayed_elsewhere_masks_as_the_one_it_replays(
    tokenizer: Tokenizer, constraint: StructuredOutputs
) -> None:
    """A matcher built afresh for a sequence's tokens (fail-over) has the mask of the one that
    wrote them at every step, while closing ones too: the guard and the path narrowed to
    depend only on where the output is and how many tokens are left."""
    compiler = _compiler(tokenizer)
    grammar = compiler.compile_now(constraint)
    assert grammar.closing is not None
    rng = np.random.default_rng(11)
    shortest = grammar.closing.shortest.cost
    for budget in (shortest, shortest + 6, shortest + 30):
        state = grammar.new_state(budget)
        tokens: list[int] = []
        while not state.is_complete and len(tokens) < budget:
            twin = grammar.new_state(budget)
            twin.sync(tokens)
            assert np.array_equal(twin.mask, state.mask), (budget, tokens)
            twin.release()
            token = int(rng.choice(_allowed(state.mask)))
            if token in tokenizer.eos_token_ids:
                break
            tokens.append(token)
            state.accept(token)
            advance_masks([state])
        assert _completes(constraint, compiler._grammar_vocab()[0].decode_str(tokens))
        state.release()
    assert compiler.num_live_states == 0
    compiler.close()


def test_masks_on_the_thread_pool_equal_those_row_by_row(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step's masks go to llguidance's thread pool only when they are slow row by row; both
    ways give the same masks."""
    compiler = _compiler(tokenizer)
    grammar = compiler.compile_now(StructuredOutputs.json_schema(UNBOUNDED))
    rng = np.random.default_rng(5)
    rows = [grammar.new_state() for _ in range(8)]
    twins = [grammar.new_state() for _ in range(8)]
    for _ in range(12):
        for row, twin in zip(rows, twins, strict=True):
            allowed = _allowed(row.mask)
            token = int(rng.choice(allowed[~np.isin(allowed, tokenizer.eos_token_ids)]))
            row.accept(token)
            twin.accept(token)
        monkeypatch.setattr(structured, "_PARALLEL_ABOVE_S", 0.0)
        monkeypatch.setattr(structured._MaskCost, "calls", 1)
        advance_masks(rows)
        monkeypatch.setattr(structured, "_PARALLEL_ABOVE_S", float("inf"))
        advance_masks(twins)
        assert all(np.array_equal(row.mask, twin.mask) for row, twin in zip(rows, twins, strict=True))
    for state in rows + twins:
        state.release()
    compiler.close()
