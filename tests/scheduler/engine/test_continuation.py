"""Resumed generations (`GenerateRequest.continuations`) through the engine over simulated
executors: cut after any of its outputs, a generation resumed from the tokens delivered so far
streams exactly the rest of the undisturbed run (text, tokens, finish and stop reason, usage),
whatever the cut splits (a character of byte tokens, a stop string's held-back text); a
continuation that does not fit the request is refused before anything is queued."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest
from harness.simulated_engine import Collected, collect_outputs, simulated_engine

from npuserve.scheduler.core.request import InvalidRequestError, SamplingParams
from npuserve.scheduler.engine.continuation import Continuation
from npuserve.scheduler.engine.engine import Engine
from npuserve.scheduler.engine.outputs import client_outputs
from npuserve.scheduler.text.prompts import PromptInput
from npuserve.scheduler.text.tokenizer import Tokenizer

PROMPT = [1, 403, 261, 370, 275, 288]
MAX_TOKENS = 40


async def run(
    engine: Engine, params: SamplingParams, continuation: Continuation | None = None, request_id: str = "r"
) -> Collected:
    opened = await engine.open(PromptInput(token_ids=PROMPT), params, request_id, None, continuation)
    async with aclosing(client_outputs(opened)) as outputs:
        return collect_outputs([output async for output in outputs])


def cuts(run: Collected) -> list[tuple[int, str]]:
    """Where a client's stream can be cut: after each output but the last, (the tokens and the
    text of choice 0 it had received)."""
    received, tokens, text = [], 0, ""
    for output in run.outputs[:-1]:
        for delta in output.completions:
            tokens, text = tokens + len(delta.token_ids), text + delta.text
        received.append((tokens, text))
    return received


def same_usage(resumed: Collected, undisturbed: Collected) -> bool:
    """The same prompt and completion tokens; the prompt tokens found in the prefix cache are
    the cache's (the resumed run finds the undisturbed one's), never more than the prompt."""
    usage, expected = resumed.last.usage, undisturbed.last.usage
    assert usage is not None and expected is not None
    return (usage.prompt_tokens, usage.completion_tokens) == (
        expected.prompt_tokens,
        expected.completion_tokens,
    ) and usage.cached_prompt_tokens <= usage.prompt_tokens


def stop_string_of(text: str) -> str:
    """A stop string the run's text holds once only, about two thirds in."""
    for start in range(2 * len(text) // 3, len(text) - 3):
        candidate = text[start : start + 3]
        if candidate.strip() and text.count(candidate) == 1:
            return candidate
    raise AssertionError(f"no stop string found in {text!r}")


def test_a_generation_resumed_after_any_output_streams_the_rest_of_the_undisturbed_run(
    tokenizer: Tokenizer,
) -> None:
    """The simulated tokens are random over the stories vocabulary, byte tokens included, so
    the cuts fall inside characters too; with a stop string, inside its held-back text."""

    async def scenario() -> None:
        async with simulated_engine(tokenizer, num_executors=1) as sim:
            free = await run(sim.engine, SamplingParams(max_tokens=MAX_TOKENS))
            stop = stop_string_of(free.text[0])
            for params in (
                SamplingParams(max_tokens=MAX_TOKENS),
                SamplingParams(max_tokens=MAX_TOKENS, stop=[stop]),
            ):
                undisturbed = await run(sim.engine, params)
                tokens = undisturbed.tokens[0]
                assert len(undisturbed.outputs) > 10
                # Some cuts fall inside a character: byte tokens whose text has not come yet.
                assert any(d.token_ids and not d.text for o in undisturbed.outputs for d in o.completions)
                for num_received, text_received in cuts(undisturbed):
                    resumed = await run(sim.engine, params, Continuation((tokens[:num_received],)))
                    assert resumed.outputs[0].resumed_tokens == num_received
                    assert all(o.resumed_tokens == 0 for o in resumed.outputs[1:])
                    assert tokens[:num_received] + resumed.tokens[0] == tokens
                    assert text_received + resumed.text[0] == undisturbed.text[0], num_received
                    assert resumed.finish_reasons == undisturbed.finish_reasons
                    assert (
                        resumed.last.completions[-1].stop_reason
                        == undisturbed.last.completions[-1].stop_reason
                    )
                    assert same_usage(resumed, undisturbed)
            assert undisturbed.finish_reasons == {0: "stop"} and not undisturbed.text[0].endswith(stop)
            await sim.wait_idle()

    asyncio.run(scenario())


def test_each_choice_of_a_resumed_request_goes_on_from_its_own_tokens(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with simulated_engine(tokenizer, num_executors=2) as sim:
            params = SamplingParams(n=3, max_tokens=12)
            undisturbed = await run(sim.engine, params)
            delivered = tuple(undisturbed.tokens[i][:k] for i, k in enumerate((0, 5, 11)))
            resumed = await run(sim.engine, params, Continuation(delivered))
            for i in range(3):
                assert delivered[i] + resumed.tokens[i] == undisturbed.tokens[i]
            assert resumed.outputs[0].resumed_tokens == 16
            assert same_usage(resumed, undisturbed)
            await sim.wait_idle()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("params", "token_ids", "message"),
    [
        (SamplingParams(n=2, max_tokens=8), ([5],), "has 1 entries for 2 choices"),
        (SamplingParams(max_tokens=8), ([5, 512],), "token ids must be in [0, 512)"),
        (
            SamplingParams(max_tokens=3),
            ([5, 6, 7],),
            "continuations[0] has 3 tokens, and that choice may have 3",
        ),
        (SamplingParams(), ([5] * (128 - len(PROMPT)),), "may have 122: it is complete"),
    ],
)
def test_a_continuation_that_does_not_fit_the_request_is_refused(
    tokenizer: Tokenizer, params: SamplingParams, token_ids: tuple[list[int], ...], message: str
) -> None:
    async def scenario() -> None:
        async with simulated_engine(tokenizer, num_executors=1) as sim:
            with pytest.raises(InvalidRequestError) as refused:
                await run(sim.engine, params, Continuation(token_ids))
            assert refused.value.field == "continuations" and message in str(refused.value)
            assert sim.engine.num_active_requests == 0

    asyncio.run(scenario())


def test_a_continuation_that_already_ends_at_a_stop_string_is_refused(tokenizer: Tokenizer) -> None:
    async def scenario() -> None:
        async with simulated_engine(tokenizer, num_executors=1) as sim:
            ids = tokenizer.encode("the end. More", add_special_tokens=False)
            with pytest.raises(InvalidRequestError, match=r"continuations\[0\] ends at a stop string"):
                await run(sim.engine, SamplingParams(max_tokens=30, stop=["end."]), Continuation((ids,)))
            assert sim.engine.num_active_requests == 0

    asyncio.run(scenario())
