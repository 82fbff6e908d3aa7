"""Bad input over raw HTTP: every refusal is a 4xx with an OpenAI error body, never a 5xx, and the
server is left idle and intact. Also: a gateway whose scheduler is down answers 503."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from harness.serve import Served, serve

pytestmark = pytest.mark.slow  # a scheduler, executor and gateway in processes of their own

MAX_REQUEST_BYTES = 65536
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served(stories_dir: Path, api_key: str) -> Iterator[Served]:
    flags = (
        "--kv-cache-memory",
        "0.02",
        "--api-key",
        api_key,
        "--max-request-bytes",
        str(MAX_REQUEST_BYTES),
    )
    with serve(stories_dir, *flags) as served:
        yield served


@pytest.fixture(scope="module")
def http(served: Served, api_key: str) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(base_url=served.url, headers=headers, timeout=30) as client:
        yield client


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param, error
    return error


# (path, JSON body, expected param or None)
BAD_JSON_REQUESTS = [
    (COMPLETIONS, {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": -5}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 10**12}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "n": 1000}, "n"),
    (COMPLETIONS, {"prompt": "hi", "n": -1}, "n"),
    (COMPLETIONS, {"prompt": "hi", "temperature": -1}, "temperature"),
    (COMPLETIONS, {"prompt": "hi", "temperature": "hot"}, "temperature"),
    (COMPLETIONS, {"prompt": "hi", "top_p": 2}, "top_p"),
    (COMPLETIONS, {"prompt": "hi", "top_k": -7}, "top_k"),
    (COMPLETIONS, {"prompt": "hi", "presence_penalty": 9}, "presence_penalty"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 50}, "logprobs"),
    (COMPLETIONS, {"prompt": "hi", "min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    (COMPLETIONS, {"prompt": "hi", "seed": 2**70}, "seed"),
    (COMPLETIONS, {"prompt": "hi", "stop": [""]}, "stop"),
    (COMPLETIONS, {"prompt": "hi", "stop": 5}, "stop"),
    (COMPLETIONS, {"prompt": "hi", "stop_token_ids": [99999]}, "stop_token_ids"),
    (COMPLETIONS, {"prompt": "hi", "best_of": 3}, "best_of"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"5": 10}}, "logit_bias"),
    (COMPLETIONS, {"prompt": "hi", "stream": True, "temperature": -1}, "temperature"),
    (COMPLETIONS, {"prompt": "hi", "stream_options": {"include_usage": "yes please"}}, None),
    (COMPLETIONS, {}, "prompt"),
    (COMPLETIONS, {"prompt": ""}, "prompt"),
    (COMPLETIONS, {"prompt": []}, "prompt"),
    (COMPLETIONS, {"prompt": [[]]}, "prompt"),
    (COMPLETIONS, {"prompt": [1, "a"]}, "prompt"),
    (COMPLETIONS, {"prompt": {"text": "hi"}}, "prompt"),
    (COMPLETIONS, {"prompt": [1, 99999]}, "prompt"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL] * 200}, "tools"),
    (CHAT, {}, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"content": "hi"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content",
    ),
    (CHAT, {"messages": USER, "top_logprobs": 2}, None),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    (CHAT, {"messages": USER, "max_completion_tokens": -1}, "max_completion_tokens"),
    (CHAT, {"messages": USER, "max_tokens": -1}, "max_tokens"),
    (CHAT, {"messages": USER, "max_completion_tokens": 600}, "max_completion_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "hi " * 600}]}, "messages"),
    (CHAT, {"messages": USER, "chat_template": "/etc/passwd"}, "chat_template"),
    (CHAT, {"messages": USER, "chat_template": "{% if %}"}, "chat_template"),
    (
        CHAT,
        {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]},
        "tools[0].function.parameters",
    ),
    (CHAT, {"messages": USER, "response_format": {"type": "xml"}}, "response_format.type"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_JSON_REQUESTS)
def test_bad_request_is_a_400_naming_the_field(
    http: httpx.Client, path: str, body: dict, param: str | None
) -> None:
    assert_openai_error(http.post(path, json=body), 400, param)


# (raw body, what the message says)
BAD_BODIES = [
    (b'{"prompt": "hi",', "not valid JSON"),
    (b"", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    (b'{"prompt": "hi", "temperature": Infinity}', "temperature"),
    (b'{"prompt": "\xff\xfe caf\xe9"}', "UTF-8"),
    (b'{"prompt": "a lone surrogate \\ud800"}', "cannot be encoded"),
    (b"[" * 30_000 + b"]" * 30_000, "not valid JSON"),
    (b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", "not valid JSON"),
]


@pytest.mark.parametrize(("raw", "words"), BAD_BODIES)
def test_malformed_bodies_are_a_400(http: httpx.Client, raw: bytes, words: str) -> None:
    response = http.post(COMPLETIONS, content=raw, headers={"Content-Type": "application/json"})
    assert words in assert_openai_error(response, 400)["message"]


def test_oversized_bodies_are_a_413(http: httpx.Client) -> None:
    body = json.dumps({"prompt": "x" * MAX_REQUEST_BYTES}).encode()
    assert_openai_error(http.post(COMPLETIONS, content=body), 413)

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit holds as the body streams
        yield b'{"prompt": "'
        for _ in range(MAX_REQUEST_BYTES // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    assert_openai_error(http.post(COMPLETIONS, content=chunked()), 413)


def test_prompt_longer_than_the_context_names_both_lengths(http: httpx.Client) -> None:
    error = assert_openai_error(http.post(COMPLETIONS, json={"prompt": [5] * 600}), 400, "prompt")
    assert "512" in error["message"] and "600" in error["message"]
    text = " ".join(["Once upon a time"] * 200)
    count = http.post("/tokenize", json={"prompt": text}).json()["count"]
    error = assert_openai_error(http.post(COMPLETIONS, json={"prompt": text, "stream": True}), 400)
    assert "512" in error["message"] and str(count) in error["message"]
    error = assert_openai_error(http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 600}), 400)
    assert "512" in error["message"] and "600" in error["message"]


def test_request_chat_templates_are_refused_unless_trusted(http: httpx.Client) -> None:
    body = {"messages": USER, "chat_template": "{{ messages[0].content }}"}
    for path in (CHAT, "/tokenize"):
        error = assert_openai_error(http.post(path, json=body), 400, "chat_template")
        assert "--trust-request-chat-template" in error["message"]
    assert http.post("/tokenize", json={"messages": USER}).status_code == 200  # the model's own


def test_prompt_that_cannot_fit_is_refused_from_its_size(http: httpx.Client) -> None:
    error = assert_openai_error(http.post("/tokenize", json={"prompt": "ab " * 20_000}), 400, "prompt")
    assert "512" in error["message"] and "at least" in error["message"]


def test_top_logprobs_over_the_limit_is_named_as_the_client_sent_it(http: httpx.Client) -> None:
    body = {"messages": USER, "logprobs": True, "top_logprobs": 21}
    error = assert_openai_error(http.post(CHAT, json=body), 400, "top_logprobs")
    assert error["message"] == "top_logprobs must be in [0, 20], got 21"


def test_unknown_model_is_a_404(http: httpx.Client) -> None:
    error = assert_openai_error(http.post(COMPLETIONS, json={"prompt": "hi", "model": "gpt-4"}), 404, "model")
    assert error["code"] == "model_not_found" and "gpt-4" in error["message"]
    assert_openai_error(http.post(CHAT, json={"messages": USER, "model": "gpt-4", "stream": True}), 404)


def test_api_key_is_required_on_the_api_routes_only(served: Served, api_key: str) -> None:
    with httpx.Client(base_url=served.url, timeout=30) as anonymous:
        for path in (COMPLETIONS, CHAT, "/tokenize", "/detokenize"):
            assert_openai_error(anonymous.post(path, json={"prompt": "hi"}), 401)
        assert_openai_error(anonymous.get("/v1/models"), 401)
        for header in ("Bearer wrong-key", f"Basic {api_key}", "Bearer", f"Bearer {api_key}x"):
            response = anonymous.get("/v1/models", headers={"Authorization": header})
            assert_openai_error(response, 401)
        for path in ("/health", "/metrics", "/version"):
            assert anonymous.get(path).status_code == 200
        ok = anonymous.get("/v1/models", headers={"Authorization": f"Bearer {api_key}"})
        assert ok.status_code == 200


def test_unknown_routes_and_methods_have_openai_bodies(http: httpx.Client) -> None:
    assert_openai_error(http.get("/v1/nothing"), 404)
    assert_openai_error(http.get(COMPLETIONS), 405)


def test_nulls_mean_the_defaults(http: httpx.Client) -> None:
    body = {"prompt": "Once upon a time", "temperature": 0, "n": None, "max_tokens": None, "stop": None}
    response = http.post(COMPLETIONS, json={**body, "stream": None, "logprobs": None, "user": None})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 16  # the completions default
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]}
    assert http.post(CHAT, json={**chat, "max_tokens": 4, "top_logprobs": None}).status_code == 200


def test_serving_goes_on_and_nothing_leaks(http: httpx.Client, served: Served) -> None:
    response = http.post(COMPLETIONS, json={"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
    assert response.status_code == 200 and response.json()["choices"][0]["text"].startswith(", there was")
    check = served.integrity(expect_idle=True)
    assert check.ok, check.message
    assert all(e.num_requests == 0 and e.num_free_blocks == e.num_blocks for e in check.executors)
    assert served.metric("vllm:num_requests_running") == 0
    assert "status=\x1b[35m500" not in "".join(served.log) and "unhandled error" not in "".join(served.log)


def test_a_gateway_without_its_scheduler_answers_503(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "npuserve.deploy.cli", "gateway", "--scheduler", "127.0.0.1:1"]
    command += ["--port", "0", "--log-format", "json", "--ready-file", str(tmp_path / "ready.json")]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stderr is not None
        url = ""
        deadline = time.monotonic() + 60
        while not url and time.monotonic() < deadline:
            line = process.stderr.readline()
            if line.startswith("{") and json.loads(line).get("event") == "gateway serving":
                url = json.loads(line)["url"]
        assert url, "the gateway did not start"
        with httpx.Client(base_url=url, timeout=30) as http:
            assert_openai_error(http.get("/health"), 503)
            response = http.post(COMPLETIONS, json={"prompt": "hi"})
            assert_openai_error(response, 503)
            assert response.headers["retry-after"]
            assert_openai_error(http.post(CHAT, json={"messages": USER, "stream": True}), 503)
            assert_openai_error(http.get("/v1/models"), 503)
            assert http.get("/metrics").status_code == 200
        process.terminate()
        assert process.wait(15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
