"""The public API's protobuf messages to engine types and back: unset optional fields keep the
engine's defaults, set ones (zero included) are taken, prompts of every kind, outputs with
logprobs, stop reasons, errors and usage, and the request errors that name their field."""

from __future__ import annotations

import dataclasses

import pytest

from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto.step_plan import TokenLogprobs
from npuserve.scheduler.api.api_codec import (
    continuation_from_proto,
    fill_text,
    output_to_proto,
    pool_state_to_proto,
    prompt_from_proto,
    sampling_from_proto,
)
from npuserve.scheduler.core.request import InvalidRequestError, SamplingParams
from npuserve.scheduler.engine.engine_probes import PoolState
from npuserve.scheduler.engine.outputs import CompletionDelta, GenerateOutput, Usage
from npuserve.scheduler.text.prompts import PromptInput
from npuserve.scheduler.text.tokenizer import Tokenizer


def wire(message: pb.GenerateRequest) -> pb.GenerateRequest:
    """The message as the server receives it."""
    return pb.GenerateRequest.FromString(message.SerializeToString())


def test_unset_sampling_fields_keep_the_defaults() -> None:
    assert sampling_from_proto(wire(pb.GenerateRequest()).sampling) == SamplingParams()


def test_every_set_sampling_field_is_taken_zeros_included() -> None:
    given = SamplingParams(
        n=3, max_tokens=7, temperature=0.0, top_p=0.5, top_k=0, min_p=0.1, seed=0, presence_penalty=-1.0,
        frequency_penalty=0.5, repetition_penalty=1.2, stop=["\n", "END"], stop_token_ids=[5, 6],
        include_stop_str_in_output=True, ignore_eos=True, min_tokens=2, logprobs=0, skip_special_tokens=False,
    )  # fmt: skip
    message = pb.GenerateRequest(sampling=pb.SamplingParams(**dataclasses.asdict(given)))
    taken = sampling_from_proto(wire(message).sampling)
    assert taken == given
    assert (taken.temperature, taken.seed, taken.logprobs) == (0.0, 0, 0)  # set, not defaulted


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        (pb.SamplingParams(temperature=-0.5), "temperature"),
        (pb.SamplingParams(n=0), "n"),
        (pb.SamplingParams(max_tokens=0), "max_tokens"),
        (pb.SamplingParams(top_p=0.0), "top_p"),
        (pb.SamplingParams(logprobs=21), "logprobs"),
        (pb.SamplingParams(stop=[""]), "stop"),
        (pb.SamplingParams(stop_token_ids=[512]), "stop_token_ids"),
        (pb.SamplingParams(max_tokens=2, min_tokens=3), "min_tokens"),
    ],
)
def test_out_of_range_sampling_fields_are_named(sampling: pb.SamplingParams, field: str) -> None:
    params = sampling_from_proto(wire(pb.GenerateRequest(sampling=sampling)).sampling)
    with pytest.raises(InvalidRequestError) as error:
        params.validate(vocab_size=512)
    assert error.value.field == field and field in str(error.value)


def test_prompts_of_every_kind() -> None:
    assert prompt_from_proto(wire(pb.GenerateRequest(text="hi"))) == PromptInput(text="hi")
    assert prompt_from_proto(wire(pb.GenerateRequest(text="hi", add_special_tokens=False))) == PromptInput(
        text="hi", add_special_tokens=False
    )
    assert prompt_from_proto(wire(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2])))) == PromptInput(
        token_ids=[1, 2]
    )
    chat = pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="hello")])
    assert prompt_from_proto(wire(pb.GenerateRequest(chat=chat))) == PromptInput(
        messages=[{"role": "user", "content": "hello"}]
    )
    chat.add_generation_prompt, chat.chat_template = False, "{{ messages }}"
    assert prompt_from_proto(wire(pb.GenerateRequest(chat=chat, add_special_tokens=True))) == PromptInput(
        messages=[{"role": "user", "content": "hello"}],
        add_generation_prompt=False,
        chat_template="{{ messages }}",
        add_special_tokens=True,
    )
    tokenize = pb.TokenizeRequest(text="hi", add_special_tokens=False)
    assert prompt_from_proto(tokenize) == PromptInput(text="hi", add_special_tokens=False)


def test_a_request_without_a_prompt_names_the_prompt() -> None:
    for message in (pb.GenerateRequest(), pb.TokenizeRequest()):
        with pytest.raises(InvalidRequestError) as error:
            prompt_from_proto(message)
        assert error.value.field == "prompt"


def test_outputs_with_logprobs_stop_reasons_errors_and_usage(tokenizer: Tokenizer) -> None:
    once, upon = tokenizer.encode("Once upon", add_special_tokens=False)
    output = GenerateOutput(
        "r",
        [
            CompletionDelta(
                0, "Once upon", [once, upon], [TokenLogprobs(-0.25, 1, [once, 9], [-0.25, -3.0])] * 2
            ),
            CompletionDelta(1, "", [], finish_reason="stop", stop_reason="END"),
            CompletionDelta(2, "", [], finish_reason="stop", stop_reason=2),
            CompletionDelta(3, "", [], finish_reason="error"),
        ],
        prompt_token_ids=[1, once],
        usage=Usage(prompt_tokens=2, completion_tokens=5, cached_prompt_tokens=1),
        finished=True,
        error="executor e0 failed",
    )
    message = pb.GenerateResponse.FromString(
        output_to_proto(output, tokenizer, return_prompt=True).SerializeToString()
    )
    first, by_string, by_token, failed = message.completions
    assert (first.index, first.text, list(first.token_ids), first.finish_reason) == (
        0,
        "Once upon",
        [once, upon],
        "",
    )
    assert [lp.token for lp in first.logprobs] == [" Once", " upon"]  # as inside a stream: spaces stay
    assert [(lp.token_id, lp.logprob, lp.rank) for lp in first.logprobs] == [
        (once, -0.25, 1),
        (upon, -0.25, 1),
    ]
    assert [(t.token_id, t.logprob) for t in first.logprobs[0].top] == [(once, -0.25), (9, -3.0)]
    assert first.logprobs[0].top[0].token == " Once"
    assert first.error_message == "" and first.WhichOneof("stop_reason") is None
    assert (by_string.finish_reason, by_string.stop_string, by_string.error_message) == ("stop", "END", "")
    assert (by_token.WhichOneof("stop_reason"), by_token.stop_token_id) == ("stop_token_id", 2)
    assert (failed.finish_reason, failed.error_message) == ("error", "executor e0 failed")
    assert list(message.prompt.token_ids) == [1, once] and message.prompt.text.endswith("Once")
    assert (
        message.usage.prompt_tokens,
        message.usage.completion_tokens,
        message.usage.cached_prompt_tokens,
    ) == (2, 5, 1)

    quiet = output_to_proto(dataclasses.replace(output, usage=None), tokenizer, return_prompt=False)
    assert not quiet.HasField("prompt") and not quiet.HasField("usage")


@pytest.mark.parametrize("token_ids", [[403], [403, 407, 261]])
def test_a_text_output_is_written_as_its_whole_output_would_be(
    tokenizer: Tokenizer, token_ids: list[int]
) -> None:
    text = tokenizer.decode(token_ids)
    msg = pb.GenerateResponse()
    fill_text(msg, "r1", 1, text, token_ids)
    output = GenerateOutput("r1", [CompletionDelta(1, text, token_ids)])
    assert msg == output_to_proto(output, tokenizer, return_prompt=True)


def test_a_continuation_is_each_choices_tokens_and_the_first_response_says_it_resumed(
    tokenizer: Tokenizer,
) -> None:
    new = wire(pb.GenerateRequest(text="Once"))
    assert continuation_from_proto(new) is None
    resumed = pb.GenerateRequest(text="Once")
    resumed.continuations.add(token_ids=[403, 407])
    resumed.continuations.add()  # a choice that had nothing yet
    continuation = continuation_from_proto(wire(resumed))
    assert continuation is not None and continuation.token_ids == ([403, 407], [])
    first = GenerateOutput("r1", [CompletionDelta(1, "", [])], resumed_tokens=2)
    assert output_to_proto(first, tokenizer, return_prompt=False).resumed_tokens == 2


def test_pool_state_round_trip() -> None:
    state = PoolState("e0", num_blocks=64, num_free_blocks=60, num_cached_blocks=7, num_requests=1,
                      prefix_cache_queries=100, prefix_cache_hits=48)  # fmt: skip
    message = pb.ExecutorPoolState.FromString(pool_state_to_proto(state).SerializeToString())
    assert PoolState(**{f.name: getattr(message, f.name) for f in dataclasses.fields(PoolState)}) == state
