"""`npuserve serve` end to end: real processes, real gRPC, outputs checked against transformers.

Every scenario ends with the scheduler's block-pool integrity check passing with no block in use.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from harness.reference import save_random_llama, transformers_greedy
from harness.serve import collect, generate_concurrently, greedy_request, serve

from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto.error_details import error_field

pytestmark = pytest.mark.slow  # `npuserve serve` in processes of its own

transformers = pytest.importorskip("transformers")

NUM_STREAMS = 32
NUM_NEW = 16


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path) -> Path:
    """A random-weight Llama with the TinyStories tokenizer (vocab 512)."""
    return save_random_llama(
        tmp_path_factory.mktemp("random-llama"),
        stories_dir,
        seed=0,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,  # spread logits: no argmax ties for float rounding to flip
    )


@pytest.fixture(scope="module")
def stories_without_template(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path) -> Path:
    """The demo model less its chat template: chat requests to it are refused."""
    path = tmp_path_factory.mktemp("stories260K-no-template")
    for file in stories_dir.iterdir():
        if file.name != "chat_template.jinja":
            shutil.copy(file, path / file.name)
    return path


def prompts(
    count: int, seed: int, min_len: int = 3, max_len: int = 60, prefix: list[int] | None = None
) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=generator).tolist()
    return [(prefix or []) + torch.randint(3, 512, (n,), generator=generator).tolist() for n in lengths]


def assert_idle_and_intact(served) -> None:
    check = served.integrity(expect_idle=True)
    assert check.ok, check.message
    assert all(e.num_requests == 0 and e.num_free_blocks == e.num_blocks for e in check.executors)


@pytest.mark.parametrize("which", ["stories260K", "random-llama"])
def test_concurrent_greedy_streams_match_transformers(
    which: str, stories_dir: Path, random_llama: Path
) -> None:
    model_dir = stories_dir if which == "stories260K" else random_llama
    prompt_ids = prompts(NUM_STREAMS, seed=1)
    expected = transformers_greedy(model_dir, prompt_ids, NUM_NEW)
    with serve(model_dir, "--kv-cache-memory", "0.02") as served:
        results = generate_concurrently(served.stub(), [greedy_request(p, NUM_NEW) for p in prompt_ids])
        assert [tokens for tokens, _, _ in results] == expected
        for (_, _, last), ids in zip(results, prompt_ids, strict=True):
            assert last.completions[-1].finish_reason == "length"
            assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(ids), NUM_NEW)
        assert_idle_and_intact(served)


def test_prefix_caching_hits_with_identical_outputs(random_llama: Path) -> None:
    shared = prompts(1, seed=2, min_len=80, max_len=80)[0]  # five full blocks of 16
    first_wave = prompts(8, seed=3, min_len=4, max_len=20, prefix=shared)
    second_wave = prompts(8, seed=4, min_len=4, max_len=20, prefix=shared)
    expected = transformers_greedy(random_llama, first_wave + second_wave, NUM_NEW)
    outputs = {}
    for caching in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
        with serve(random_llama, "--kv-cache-memory", "0.02", caching) as served:
            stub = served.stub()
            first = generate_concurrently(stub, [greedy_request(p, NUM_NEW) for p in first_wave])
            second = generate_concurrently(stub, [greedy_request(p, NUM_NEW) for p in second_wave])
            outputs[caching] = [tokens for tokens, _, _ in first + second]
            cached = [last.usage.cached_prompt_tokens for _, _, last in second]
            hits = served.metric("vllm:prefix_cache_hits_total")
            if caching == "--enable-prefix-caching":
                assert min(cached) >= 80 - 16 and hits >= 8 * 64
                assert served.metric("vllm:prefix_cache_queries_total") >= hits
            else:
                assert max(cached) == 0 and hits == 0
            assert_idle_and_intact(served)
    assert outputs["--enable-prefix-caching"] == outputs["--no-enable-prefix-caching"] == expected


def test_preemption_keeps_greedy_outputs(random_llama: Path) -> None:
    # 2 layers x 2 KV heads x 16 dims x (K, V) x 16 tokens x 4 bytes = 8 KiB a block: 48 blocks
    # hold 768 tokens, while 24 requests of ~40 + 40 tokens want about 1,900.
    prompt_ids = prompts(24, seed=5, min_len=20, max_len=60)
    expected = transformers_greedy(random_llama, prompt_ids, 40)
    flags = ("--kv-cache-memory", str(48 * 8192 / 2**30), "--max-model-len", "128")
    with serve(random_llama, *flags) as served:
        results = generate_concurrently(served.stub(), [greedy_request(p, 40) for p in prompt_ids])
        assert [tokens for tokens, _, _ in results] == expected
        assert served.metric("vllm:num_preemptions_total") > 0
        assert_idle_and_intact(served)


def test_abort_frees_blocks(stories_dir: Path) -> None:
    with serve(stories_dir, "--kv-cache-memory", "0.02") as served:
        stub = served.stub()
        # A client that goes away mid-stream.
        call = stub.Generate(greedy_request([1, 403, 407, 261, 378], 400))
        for _ in range(3):
            next(call)
        call.cancel()
        assert_idle_and_intact(served)
        # An explicit Abort from another client.
        request = greedy_request([1, 403, 407], 400)
        request.request_id = "to-abort"
        results: list[str] = []

        def consume() -> None:
            for response in stub.Generate(request):
                results.extend(c.finish_reason for c in response.completions if c.finish_reason)

        consumer = threading.Thread(target=consume)
        consumer.start()
        deadline = time.monotonic() + 10
        while not stub.Abort(pb.AbortRequest(request_id="to-abort")).found:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        consumer.join(10)
        assert results == ["abort"]
        assert not stub.Abort(pb.AbortRequest(request_id="to-abort")).found
        assert_idle_and_intact(served)


def _chat(role: str, template: str | None = None) -> pb.GenerateRequest:
    chat = pb.ChatPrompt(messages=[pb.ChatMessage(role=role, content="hi")], chat_template=template)
    return pb.GenerateRequest(chat=chat)


# (request, status, words in the message, the field its BadRequest detail names)
INVALID = grpc.StatusCode.INVALID_ARGUMENT
BAD_REQUESTS = [
    (
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 600)),
        INVALID,
        "maximum context length is 512",
        "prompt",
    ),
    (pb.GenerateRequest(text=""), INVALID, "prompt", "prompt"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 99999])), INVALID, "prompt", "prompt"),
    (pb.GenerateRequest(), INVALID, "prompt", "prompt"),
    (
        pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=-1)),
        INVALID,
        "temperature",
        "temperature",
    ),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=1.5)), INVALID, "top_p", "top_p"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(n=0)), INVALID, "n must", "n"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(logprobs=21)), INVALID, "logprobs", "logprobs"),
    (
        pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=600)),
        INVALID,
        "max_tokens",
        "max_tokens",
    ),
    (pb.GenerateRequest(text="hi", model="gpt-4"), grpc.StatusCode.NOT_FOUND, "gpt-4", None),
    (_chat("user"), INVALID, "chat template", None),
    (_chat("wizard", "{{ messages }}"), INVALID, "role must be", "messages[0].role"),
    (_chat("user", "{% if %}"), INVALID, "not valid jinja", "chat_template"),
]


def test_bad_requests_are_refused_and_serving_goes_on(stories_without_template: Path) -> None:
    # Request templates trusted, so an invalid one reaches the template compiler.
    with serve(
        stories_without_template, "--kv-cache-memory", "0.02", "--trust-request-chat-template"
    ) as served:
        stub = served.stub()
        for request, code, words, field in BAD_REQUESTS:
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Generate(request, timeout=10))
            assert caught.value.code() == code, (request, caught.value.details())
            assert words in caught.value.details(), caught.value.details()
            assert error_field(caught.value) == field, caught.value.details()
        tokens, text, _ = collect(stub, greedy_request([1, 403, 407, 261, 378], 8))
        assert len(tokens) == 8 and text.startswith(", there was")
        assert_idle_and_intact(served)


def test_text_prompt_stop_strings_and_siblings(stories_dir: Path) -> None:
    with serve(stories_dir, "--kv-cache-memory", "0.02") as served:
        stub = served.stub()
        sampling = pb.SamplingParams(temperature=0, max_tokens=60, stop=["Lily"])
        _, text, last = collect(stub, pb.GenerateRequest(text="Once upon a time", sampling=sampling))
        assert text == ", there was a little girl named "
        assert last.completions[-1].finish_reason == "stop" and last.completions[-1].stop_string == "Lily"
        sampling.include_stop_str_in_output = True
        _, text, _ = collect(stub, pb.GenerateRequest(text="Once upon a time", sampling=sampling))
        assert text.endswith("named Lily")
        # n = 3 seeded siblings: three different stories, reproducible.
        sampling = pb.SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=20, logprobs=2)
        runs = []
        for _ in range(2):
            texts = ["", "", ""]
            for response in stub.Generate(pb.GenerateRequest(text="Once upon a time", sampling=sampling)):
                for completion in response.completions:
                    texts[completion.index] += completion.text
                    assert all(len(lp.top) == 2 and lp.rank >= 1 for lp in completion.logprobs)
            runs.append(texts)
        assert runs[0] == runs[1] and len(set(runs[0])) == 3
        assert_idle_and_intact(served)


@pytest.mark.parametrize(
    ("flags", "unkeyed"),
    [(("--api-key", "sk-k"), 401), (("--allow-unauthenticated",), 200)],
    ids=["key", "allowed"],
)
def test_serve_on_every_interface_says_where_it_listens(
    stories_dir: Path, flags: tuple[str, ...], unkeyed: int
) -> None:
    """With a key, or allowed without one (its gateway is told so too, or it would not start)."""
    with serve(stories_dir, "--kv-cache-memory", "0.02", "--host", "0.0.0.0", *flags) as served:
        assert served.url.startswith("http://0.0.0.0:")
        assert any(f"OpenAI API at {served.url}" in line for line in served.log)
        port = served.url.rsplit(":", 1)[1]
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            assert http.get("/v1/models").status_code == unkeyed
            keyed = http.get("/v1/models", headers={"Authorization": "Bearer sk-k"})
            assert keyed.status_code == 200, keyed.text
