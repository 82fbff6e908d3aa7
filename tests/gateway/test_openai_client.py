"""The gateway through the official `openai` client, against `npuserve serve` with no `--model`: the
bundled stories260K demo model and its story chat template.

Greedy outputs must equal what the scheduler's own gRPC Generate returns for the same prompt.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import httpx
import pytest
from harness.demo_story import ONCE, ONCE_60, stream_the_story
from harness.serve import Served, serve_checked, streamed_chat_with_logprobs

from npuserve.deploy.demo_model import DEMO_MODEL_NAME
from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc
from npuserve.proto.auth import bearer_metadata

pytestmark = pytest.mark.slow  # a scheduler, executor and gateway in processes of their own

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def served(api_key: str) -> Iterator[Served]:
    with serve_checked(None, "--kv-cache-memory", "0.02", "--api-key", api_key) as served:
        yield served


def grpc_text(served: Served, **request: object) -> tuple[str, pb.GenerateResponse]:
    text, last = "", None
    for response in served.stub().Generate(pb.GenerateRequest(**request), timeout=60):
        text += "".join(c.text for c in response.completions)
        last = response
    assert last is not None
    return text, last


def test_models_lists_the_demo_model_by_name(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [DEMO_MODEL_NAME] == ["stories260K"]
    assert models[0].owned_by == "npuserve"


def test_greedy_completion_is_the_known_story_and_the_grpc_output(
    client: openai.OpenAI, served: Served, model: str
) -> None:
    completion = client.completions.create(model=model, prompt=ONCE, temperature=0, max_tokens=60)
    choice = completion.choices[0]
    assert choice.text == ONCE_60
    assert choice.finish_reason == "length"
    assert completion.usage.prompt_tokens == 5
    assert completion.usage.completion_tokens == 60
    assert completion.usage.total_tokens == 65
    for prompt in ("The little dog", "Tom and Sue went to"):
        text, _ = grpc_text(served, text=prompt, sampling=pb.SamplingParams(temperature=0, max_tokens=30))
        ours = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=30)
        assert ours.choices[0].text == text


def test_streaming_completion_with_usage(client: openai.OpenAI, model: str) -> None:
    chunks = stream_the_story(client, model)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ONCE_60
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (5, 60)
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_strings_end_with_finish_reason_stop(client: openai.OpenAI, model: str) -> None:
    completion = client.completions.create(
        model=model, prompt=ONCE, temperature=0, max_tokens=60, stop="Lily"
    )
    assert completion.choices[0].text == ", there was a little girl named "
    assert completion.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=model, prompt=ONCE, temperature=0, max_tokens=60, stop=["park", "Lily"], stream=True
    )
    chunks = [c for c in streamed if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == ", there was a little girl named "
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(client: openai.OpenAI, model: str) -> None:
    completion = client.completions.create(model=model, prompt=ONCE, temperature=0, max_tokens=8, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 8
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    for token, lp, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert len(top) == 2  # greedy: the sampled token is the best of the two
        assert top[token] == pytest.approx(lp) and max(top.values()) == pytest.approx(lp)
    # Token texts keep their leading spaces: joined, they are the completion.
    assert "".join(logprobs.tokens) == completion.choices[0].text


def test_n_choices_with_a_seed_are_reproducible(client: openai.OpenAI, model: str) -> None:
    def run() -> list[str]:
        completion = client.completions.create(
            model=model, prompt=ONCE, n=3, seed=7, temperature=1.0, max_tokens=20
        )
        assert sorted(c.index for c in completion.choices) == [0, 1, 2]
        assert completion.usage.completion_tokens == 60
        return [c.text for c in sorted(completion.choices, key=lambda c: c.index)]

    first = run()
    assert run() == first and len(set(first)) == 3


def test_batched_prompts_index_choices_per_prompt(client: openai.OpenAI, model: str) -> None:
    prompts = [ONCE, [1, 403, 407, 261, 378]]  # a text and token ids
    completion = client.completions.create(model=model, prompt=prompts, n=2, temperature=0, max_tokens=10)
    texts = {c.index: c.text for c in completion.choices}
    assert sorted(texts) == [0, 1, 2, 3]
    assert texts[0] == texts[1] == ONCE_60[: len(texts[0])]
    assert texts[2] == texts[3] and texts[2].startswith(", there was")
    assert completion.usage.completion_tokens == 40


def test_echo_prepends_the_prompt(client: openai.OpenAI, model: str) -> None:
    completion = client.completions.create(model=model, prompt=ONCE, temperature=0, max_tokens=5, echo=True)
    assert completion.choices[0].text == ONCE + ", there was a little"
    chunks = client.completions.create(
        model=model, prompt=ONCE, temperature=0, max_tokens=5, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ONCE + ", there was a little"


def test_chat_matches_grpc_and_streams_logprobs(client: openai.OpenAI, served: Served, model: str) -> None:
    messages = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "A cat"}]
    chat = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_completion_tokens=20
    )
    choice = chat.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert chat.usage.completion_tokens == 20
    prompt = pb.ChatPrompt(messages=[pb.ChatMessage(**m) for m in messages])
    text, last = grpc_text(served, chat=prompt, sampling=pb.SamplingParams(temperature=0, max_tokens=20))
    assert choice.message.content == text and chat.usage.prompt_tokens == last.usage.prompt_tokens

    chunks, streamed, entries = streamed_chat_with_logprobs(client, model, messages, 20)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert streamed == text
    assert len(entries) == 20
    assert all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in entries)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_chat_is_one_story_the_model_continues(client: openai.OpenAI, model: str) -> None:
    """The demo template writes the conversation as one story: a user message that starts the
    known story gets the known continuation, and an earlier assistant turn is part of the story."""
    alone = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": ONCE}], temperature=0, max_tokens=60
    )
    assert alone.choices[0].message.content == ONCE_60
    assert alone.usage.prompt_tokens == 5
    turns = [
        {"role": "system", "content": "Tell a story."},
        {"role": "user", "content": "Once upon a time,"},
        {"role": "assistant", "content": "there was a little girl"},
        {"role": "user", "content": "named"},
    ]
    chat = client.chat.completions.create(model=model, messages=turns, temperature=0, max_tokens=10)
    story = client.completions.create(
        model=model, prompt="Once upon a time, there was a little girl named", temperature=0, max_tokens=10
    )
    assert chat.choices[0].message.content == story.choices[0].text
    assert chat.choices[0].message.content.startswith(" Lily")


def test_chat_text_parts_are_joined(client: openai.OpenAI, model: str) -> None:
    parts = [{"type": "text", "text": "A cat"}, {"type": "text", "text": "and a dog"}]
    joined = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": parts}], temperature=0, max_tokens=10
    )
    plain = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "A cat\nand a dog"}], temperature=0, max_tokens=10
    )
    assert joined.choices[0].message.content == plain.choices[0].message.content


def test_tokenize_detokenize_round_trip(served: Served, api_key: str) -> None:
    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(base_url=served.url, headers=headers, timeout=30) as http:
        tokens = http.post("/tokenize", json={"prompt": ONCE}).json()
        assert tokens["count"] == len(tokens["tokens"]) == 5 and tokens["max_model_len"] == 512
        text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
        assert text.endswith(ONCE)
        no_bos = http.post("/tokenize", json={"prompt": ONCE, "add_special_tokens": False}).json()
        assert no_bos["tokens"] == tokens["tokens"][1:]
        assert http.post("/detokenize", json={"tokens": no_bos["tokens"]}).json()["prompt"] == ONCE
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": " hi "}]}).json()
        assert chat["tokens"] == http.post("/tokenize", json={"prompt": "hi"}).json()["tokens"]


def test_open_routes_health_version_metrics(served: Served) -> None:
    with httpx.Client(base_url=served.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/version").json()["version"]
        metrics = http.get("/metrics")
        assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
        for name in (
            "npuserve:gateway_requests_total",
            "vllm:num_requests_running",
            "vllm:kv_cache_usage_perc",
        ):
            assert name in metrics.text


def test_profiling_needs_the_key(served: Served, api_key: str) -> None:
    """Profiling does work (an executor traces every op): not for anyone who reaches the port."""
    with httpx.Client(base_url=served.url, timeout=30) as http:
        for route in ("/start_profile", "/stop_profile"):
            refused = http.post(route)
            assert refused.status_code == 401, refused.text
            assert refused.json()["error"]["code"] == "invalid_api_key"
            keyed = http.post(route, headers={"Authorization": f"Bearer {api_key}"})
            assert keyed.status_code == 400 and "--profile-dir" in keyed.text  # past the key: off here


def test_the_api_key_guards_the_schedulers_grpc_api_too(served: Served, api_key: str) -> None:
    """`serve --api-key` sets the key on both fronts; the gateway presents it to the scheduler."""
    bare = pb_grpc.SchedulerStub(grpc.insecure_channel(served.address))
    with pytest.raises(grpc.RpcError) as refused:
        bare.ListModels(pb.ListModelsRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert bare.Health(pb.HealthRequest(), timeout=10).serving, "Health stays open for probes"
    keyed = bare.ListModels(pb.ListModelsRequest(), timeout=10, metadata=bearer_metadata(api_key))
    assert keyed.models[0].id == DEMO_MODEL_NAME
