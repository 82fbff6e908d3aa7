"""The gateway over a scheduler that runs several passes per step (`--num-scheduler-steps 4`) and
relays tokens through a scheduler worker and two API processes: each update then carries up to
four tokens of a sequence, and what the official `openai` client sees must be what one pass per
step gives (the known story, stop strings, usage, logprobs), in fewer chunks.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from harness.demo_story import ONCE, ONCE_60, stream_the_story
from harness.serve import Served, collect, greedy_request, serve_checked, streamed_chat_with_logprobs

from npuserve.deploy.demo_model import DEMO_MODEL_DIR
from npuserve.scheduler.text.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # a scheduler, its worker and API processes, an executor, a gateway

openai = pytest.importorskip("openai")

PASSES = 4


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    flags = ("--num-scheduler-steps", str(PASSES), "--scheduler-workers", "1", "--api-server-count", "2")
    with serve_checked(None, "--kv-cache-memory", "0.02", *flags) as served:
        yield served


@pytest.fixture(scope="module")
def tokens_to_lily(served: Served) -> int:
    """How many of ONCE's greedy output tokens it takes to complete "Lily" (over gRPC)."""
    tokenizer = Tokenizer.from_pretrained(DEMO_MODEL_DIR)
    prompt = tokenizer.encode(ONCE)
    ids, text, _ = collect(served.stub(), greedy_request(prompt, 60))
    assert text == ONCE_60
    return next(k for k in range(1, len(ids) + 1) if "Lily" in tokenizer.decode(prompt + ids[:k]))


def test_the_known_story_in_bursts_streamed_or_not(client: openai.OpenAI, model: str) -> None:
    whole = client.completions.create(model=model, prompt=ONCE, temperature=0, max_tokens=60)
    assert whole.choices[0].text == ONCE_60 and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 60
    chunks = stream_the_story(client, model)
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert "".join(texts) == ONCE_60
    assert len(texts) < 60 / 2  # up to four tokens a chunk: the passes' tokens come together
    assert chunks[-1].usage.completion_tokens == 60
    # A limit that is no multiple of the passes: nothing is computed or sent past it.
    seven = client.completions.create(model=model, prompt=ONCE, temperature=0, max_tokens=7)
    assert ONCE_60.startswith(seven.choices[0].text) and seven.usage.completion_tokens == 7


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_inside_a_burst_cuts_the_text_and_the_usage(
    client: openai.OpenAI, tokens_to_lily: int, model: str, stream: bool
) -> None:
    kept = ", there was a little girl named "
    assert tokens_to_lily % PASSES, "the stop string must end inside a step's tokens"
    response = client.completions.create(
        model=model,
        prompt=ONCE,
        temperature=0,
        max_tokens=60,
        stop="Lily",
        stream=stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    )
    if stream:
        chunks = list(response)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
    else:
        text, finish, usage = response.choices[0].text, response.choices[0].finish_reason, response.usage
    assert (text, finish) == (kept, "stop")
    assert usage.completion_tokens == tokens_to_lily  # the tokens after the stop are not counted


def test_chat_logprobs_come_one_per_token(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "A cat"}]
    whole = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=21)
    chunks, text, entries = streamed_chat_with_logprobs(client, model, messages, 21)
    assert text == whole.choices[0].message.content
    assert len(entries) == 21 == chunks[-1].usage.completion_tokens
    assert all(
        len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in entries
    )


def test_seeded_siblings_repeat_and_differ(client: openai.OpenAI, model: str) -> None:
    def sample() -> list[str]:
        completion = client.completions.create(
            model=model, prompt=ONCE, temperature=1.0, max_tokens=30, n=2, seed=7
        )
        assert [c.index for c in completion.choices] == [0, 1]
        assert completion.usage.completion_tokens == 60
        return [c.text for c in completion.choices]

    first = sample()
    assert sample() == first and first[0] != first[1]
