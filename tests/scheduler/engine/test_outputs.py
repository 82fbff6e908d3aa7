"""What clients receive: a request's stream of deltas (text, stop strings, siblings, usage),
deltas held to `--stream-interval` tokens, outputs coalesced for a client that reads slower
than tokens arrive, and handed to a listener as they are made (`GenerateMany`)."""

from __future__ import annotations

import asyncio

from harness.simulated_engine import simulated_engine

from npuserve.proto.step_plan import TokenLogprobs
from npuserve.scheduler.core.request import RequestStatus, SamplingParams
from npuserve.scheduler.engine.outputs import (
    CompletionDelta,
    GenerateOutput,
    RequestStream,
    SequenceUpdate,
    coalesce,
)
from npuserve.scheduler.text.prompts import PromptInput
from npuserve.scheduler.text.tokenizer import Tokenizer

# "Once upon a time, there was a little girl." in stories260K's vocabulary
STORY = [403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 426]
PROMPT = [1]


def make_stream(tokenizer: Tokenizer, params: SamplingParams, stream_interval: int = 1) -> RequestStream:
    return RequestStream("r", tokenizer, params, PROMPT, stream_interval)


def feed(
    stream: RequestStream,
    choice: int,
    token_id: int,
    finished: RequestStatus | None = None,
    logprobs: TokenLogprobs | None = None,
) -> str | None:
    """One step's token for one sequence, as the engine passes it on."""
    status = None if finished is None else finished.value
    num_output = stream.sequences[choice].num_output_tokens + 1
    return stream.add(SequenceUpdate(choice, [token_id], [logprobs], status, None, None, num_output, 0))


def drain(stream: RequestStream) -> list[GenerateOutput]:
    outputs = []
    while not stream.queue.empty():
        outputs.append(stream.queue.get_nowait())
    return outputs


def test_a_listener_gets_the_outputs_made_before_it_then_each_as_it_is_made(tokenizer: Tokenizer) -> None:
    stream = make_stream(tokenizer, SamplingParams(max_tokens=4))
    feed(stream, 0, STORY[0])
    heard: list[GenerateOutput] = []
    stream.listen(heard.append)
    assert [o.completions[0].text for o in heard] == ["Once"] and stream.queue.empty()
    feed(stream, 0, STORY[1])
    assert [o.completions[0].text for o in heard] == ["Once", " upon"]  # at once: nothing queued
    feed(stream, 0, STORY[2])
    feed(stream, 0, STORY[3], RequestStatus.FINISHED_LENGTH)
    assert [o.finished for o in heard] == [False, False, False, True] and stream.queue.empty()
    assert heard[0].prompt_token_ids == PROMPT and heard[-1].usage is not None


def test_deltas_carry_text_the_prompt_first_and_the_usage_last(tokenizer: Tokenizer) -> None:
    stream = make_stream(tokenizer, SamplingParams(max_tokens=4))
    for token_id in STORY[:3]:
        assert feed(stream, 0, token_id) is None
    feed(stream, 0, STORY[3], RequestStatus.FINISHED_LENGTH)
    outputs = drain(stream)
    assert [o.completions[0].text for o in outputs] == ["Once", " upon", " a", " time"]
    assert [o.prompt_token_ids for o in outputs] == [PROMPT, None, None, None]
    assert [o.finished for o in outputs] == [False, False, False, True] and stream.finished
    assert [o.completions[0].finish_reason for o in outputs] == [None, None, None, "length"]
    assert outputs[-1].usage is not None
    assert (outputs[-1].usage.prompt_tokens, outputs[-1].usage.completion_tokens) == (1, 4)
    assert all(o.usage is None for o in outputs[:-1])
    assert feed(stream, 0, 9) is None  # a step that ran while the end was on its way: ignored
    assert stream.queue.empty()


def test_a_stop_string_ends_the_output_before_it(tokenizer: Tokenizer) -> None:
    for include, tail in ((False, ""), (True, "little")):
        stream = make_stream(tokenizer, SamplingParams(stop=["little"], include_stop_str_in_output=include))
        stopped = [feed(stream, 0, token_id) for token_id in STORY[:9]]
        assert stopped == [None] * 8 + ["little"]  # the engine then stops the request
        outputs = drain(stream)
        assert "".join(o.completions[0].text for o in outputs) == "Once upon a time, there was a " + tail
        last = outputs[-1].completions[0]
        assert (last.finish_reason, last.stop_reason, outputs[-1].finished) == ("stop", "little", True)


def test_a_stop_string_inside_an_update_of_several_tokens_counts_only_those_kept(
    tokenizer: Tokenizer,
) -> None:
    """A multi-step step (or a `--stream-interval` group) brings a sequence several tokens at
    once: those after the one that completed the stop string are dropped from its text, its
    token ids and its usage."""
    stream = make_stream(tokenizer, SamplingParams(stop=["little"]))
    assert stream.add(SequenceUpdate(0, STORY[:4], [None] * 4, None, None, None, 4, 0)) is None
    # "little" ends at the 9th token; the 10th to 12th came with it.
    assert stream.add(SequenceUpdate(0, STORY[4:12], [None] * 8, None, None, None, 12, 0)) == "little"
    outputs = drain(stream)
    assert "".join(o.completions[0].text for o in outputs) == "Once upon a time, there was a "
    assert [t for o in outputs for t in o.completions[0].token_ids] == STORY[:9]
    assert outputs[-1].finished and outputs[-1].usage is not None
    assert outputs[-1].usage.completion_tokens == 9


def test_siblings_finish_apart_and_the_stream_ends_with_the_last(tokenizer: Tokenizer) -> None:
    stream = make_stream(tokenizer, SamplingParams(n=2, max_tokens=2))
    feed(stream, 0, STORY[0])
    feed(stream, 1, STORY[1])
    stream.end(SequenceUpdate(1, [], [], "error", None, "executor e0 failed", 1, 0))
    feed(stream, 0, STORY[1], RequestStatus.FINISHED_LENGTH)
    outputs = drain(stream)
    assert [(o.completions[0].index, o.completions[0].finish_reason, o.finished) for o in outputs] == [
        (0, None, False),
        (1, None, False),
        (1, "error", False),
        (0, "length", True),
    ]
    assert outputs[-1].error == "executor e0 failed"
    assert outputs[-1].usage is not None and outputs[-1].usage.completion_tokens == 3
    stream.end(SequenceUpdate(1, [], [], "abort", None, None, 1, 0))  # ended already: nothing more is sent
    assert stream.queue.empty()


def test_a_stream_interval_sends_the_first_token_alone_then_groups_up_to_the_last(
    tokenizer: Tokenizer,
) -> None:
    stream = make_stream(tokenizer, SamplingParams(max_tokens=10, logprobs=1), stream_interval=4)
    for i, token_id in enumerate(STORY[:10]):
        status = RequestStatus.FINISHED_LENGTH if i == 9 else None
        assert feed(stream, 0, token_id, status, TokenLogprobs(-1.0 * i, 1, [token_id], [-1.0 * i])) is None
        if i == 2:
            assert stream.queue.qsize() == 1  # tokens 2 and 3 wait for two more
    outputs = drain(stream)
    deltas = [o.completions[0] for o in outputs]
    assert [d.token_ids for d in deltas] == [STORY[:1], STORY[1:5], STORY[5:9], STORY[9:10]]
    assert "".join(d.text for d in deltas) == tokenizer.decode(STORY[:10])
    assert [lp.top_token_ids[0] for d in deltas for lp in d.logprobs] == STORY[:10]
    assert [o.prompt_token_ids for o in outputs] == [PROMPT, None, None, None]
    assert [(d.finish_reason, o.finished) for d, o in zip(deltas, outputs, strict=True)][-1] == (
        "length",
        True,
    )
    assert outputs[-1].usage is not None and outputs[-1].usage.completion_tokens == 10


def test_a_stream_interval_never_holds_an_end(tokenizer: Tokenizer) -> None:
    # A stop string found inside a held group ends it at once, the stop string cut off.
    stream = make_stream(tokenizer, SamplingParams(stop=["little"]), stream_interval=16)
    stopped = [feed(stream, 0, token_id) for token_id in STORY[:9]]
    assert stopped == [None] * 8 + ["little"]
    outputs = drain(stream)
    assert [len(o.completions[0].token_ids) for o in outputs] == [1, 8]
    assert "".join(o.completions[0].text for o in outputs) == "Once upon a time, there was a "
    assert (outputs[-1].completions[0].finish_reason, outputs[-1].finished) == ("stop", True)

    # An end outside a step (an abort, a failed executor) brings what was held; siblings hold apart.
    stream = make_stream(tokenizer, SamplingParams(n=2), stream_interval=16)
    for token_id in STORY[:3]:
        feed(stream, 0, token_id)
        feed(stream, 1, token_id)
    stream.end(SequenceUpdate(1, [], [], "abort", None, None, 3, 0))
    stream.end(SequenceUpdate(0, [], [], "abort", None, None, 3, 0))
    deltas = [(d.index, d.token_ids, d.finish_reason) for o in drain(stream) for d in o.completions]
    assert deltas == [
        (0, STORY[:1], None),
        (1, STORY[:1], None),
        (1, STORY[1:3], "abort"),
        (0, STORY[1:3], "abort"),
    ]
    assert stream.finished


def test_coalesce_merges_what_waits_per_choice_up_to_the_end(tokenizer: Tokenizer) -> None:
    stream = make_stream(tokenizer, SamplingParams(n=2, max_tokens=3))
    for token_id in STORY[:2]:
        feed(stream, 0, token_id)
        feed(stream, 1, token_id)
    first = stream.queue.get_nowait()
    merged = coalesce(first, stream.queue)
    assert merged is first and stream.queue.empty() and not merged.finished
    assert [(d.index, d.text, d.token_ids) for d in merged.completions] == [
        (0, "Once upon", STORY[:2]),
        (1, "Once upon", STORY[:2]),
    ]
    assert merged.prompt_token_ids == PROMPT

    feed(stream, 0, STORY[2], RequestStatus.FINISHED_LENGTH)
    feed(stream, 1, STORY[2], RequestStatus.FINISHED_LENGTH)
    last = coalesce(stream.queue.get_nowait(), stream.queue)
    assert last.finished and last.usage is not None and last.usage.completion_tokens == 6
    assert [(d.index, d.text, d.finish_reason) for d in last.completions] == [
        (0, " a", "length"),
        (1, " a", "length"),
    ]


def test_coalesce_keeps_logprobs_with_their_tokens_and_stops_at_a_finished_output() -> None:
    def output(index: int, tokens: list[int], finished: bool = False) -> GenerateOutput:
        logprobs = [TokenLogprobs(-0.5 * t, 1, [t], [-0.5 * t]) for t in tokens]
        delta = CompletionDelta(index, "x" * len(tokens), tokens, logprobs, "stop" if finished else None)
        return GenerateOutput("r", [delta], finished=finished)

    queue: asyncio.Queue[GenerateOutput] = asyncio.Queue()
    for item in (output(0, [5, 6]), output(0, [7], finished=True), output(0, [8])):
        queue.put_nowait(item)
    merged = coalesce(output(0, [4]), queue)
    (delta,) = merged.completions
    assert delta.token_ids == [4, 5, 6, 7] and delta.text == "xxxx"
    assert [lp.top_token_ids for lp in delta.logprobs] == [[4], [5], [6], [7]]
    assert (delta.finish_reason, merged.finished) == ("stop", True)
    assert queue.qsize() == 1  # nothing is merged past the end


def test_a_slow_reader_gets_one_output_with_everything_that_arrived(tokenizer: Tokenizer) -> None:
    """Through the engine: a client that reads once after the request has finished gets all the
    remaining tokens (and their logprobs) in one output, which is the last."""

    async def scenario() -> None:
        async with simulated_engine(tokenizer, num_executors=1, pause_at=1) as sim:
            params = SamplingParams(max_tokens=20, logprobs=2)
            stream = sim.engine.generate(PromptInput(token_ids=[1, *STORY]), params, "slow")
            first = await anext(stream)
            assert len(first.completions[0].token_ids) == 1  # the second step waits
            sim.resume()
            await sim.wait_idle()  # every token has arrived by now
            outputs = [output async for output in stream]
            assert len(outputs) == 1 and outputs[0].finished
            tokens = first.completions[0].token_ids + outputs[0].completions[0].token_ids
            assert tokens == sim.expected_tokens("slow", 1 + len(STORY), 20)
            (delta,) = outputs[0].completions
            assert len(delta.logprobs) == len(delta.token_ids) == 19
            assert [lp.top_token_ids[0] for lp in delta.logprobs] == delta.token_ids
            assert delta.finish_reason == "length"
            assert outputs[0].usage is not None and outputs[0].usage.completion_tokens == 20

    asyncio.run(scenario())


def test_a_text_listener_hears_what_the_outputs_would_say(tokenizer: Tokenizer) -> None:
    # The same updates into a stream with only an output listener and into one that also takes
    # text (`GenerateMany`'s usual event): the outputs they amount to are the same, outputs made
    # only where there is more than text to say (the prompt, logprobs, an end, a held group).
    def run(stream_interval: int, group: int, with_text: bool) -> tuple[list[GenerateOutput], int]:
        params = SamplingParams(n=2, max_tokens=12, stop=["little"], logprobs=1)
        stream = make_stream(tokenizer, params, stream_interval)
        heard: list[GenerateOutput] = []
        texts = []

        def on_text(choice: int, text: str, token_ids: list[int]) -> None:
            texts.append(choice)
            heard.append(GenerateOutput("r", [CompletionDelta(choice, text, token_ids)]))

        stream.listen(heard.append, on_text if with_text else None)
        for start in range(0, 12, group):
            token_ids = STORY[start : start + group]
            logprobs = [
                TokenLogprobs(-1.0, 1, [t], [-1.0]) if start + i in (4, 5) else None
                for i, t in enumerate(token_ids)
            ]
            for choice in (0, 1):
                state = stream.sequences[choice]
                finished = "length" if choice == 1 and start + group >= 8 else None
                num_output = state.num_output_tokens + len(token_ids)
                if not state.finished:
                    stream.add(
                        SequenceUpdate(choice, token_ids, logprobs, finished, None, None, num_output, 0)
                    )
        return heard, len(texts)

    for stream_interval, group in ((1, 1), (1, 2), (4, 1), (4, 4)):
        plain, none_heard = run(stream_interval, group, with_text=False)
        with_text, num_texts = run(stream_interval, group, with_text=True)
        assert with_text == plain and none_heard == 0
        assert num_texts > 0 if group >= stream_interval else num_texts == 0
