"""A client that goes away mid-request: within a second the scheduler has dropped the request and
its blocks (the gateway cancels the gRPC call; the scheduler aborts on cancellation)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from harness.serve import Served, serve

pytestmark = pytest.mark.slow  # a scheduler, executor and gateway in processes of their own

LONG = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(stories_dir: Path) -> Iterator[Served]:
    with serve(stories_dir, "--kv-cache-memory", "0.02") as served:
        yield served


def assert_aborted(served: Served, tokens_before: float, body: dict) -> None:
    """The request is gone and its blocks are back before it could have run to its end: its
    sequences generated fewer tokens since ``tokens_before`` than their ``max_tokens`` (no
    wall-clock bound; the deadline only guards against a hang)."""
    deadline = time.monotonic() + 60
    while True:
        check = served.integrity(expect_idle=True, timeout_s=0)
        running = served.metric("vllm:num_requests_running")
        if check.ok and running == 0:
            break
        assert time.monotonic() < deadline, (check.message, running)
        time.sleep(0.02)
    assert all(e.num_requests == 0 and e.num_free_blocks == e.num_blocks for e in check.executors)
    generated = served.metric("vllm:generation_tokens_total") - tokens_before
    tokens_to_end = num_sequences(body) * body["max_tokens"]
    assert generated < tokens_to_end, f"{generated} tokens: the request ran on instead of being aborted"


def num_sequences(body: dict) -> int:
    """The sequences a completion or chat request runs: ``n`` for each of its prompts."""
    prompt = body.get("prompt")
    return (len(prompt) if isinstance(prompt, list) else 1) * body.get("n", 1)


def read_events(lines: Iterator[str], count: int) -> list[str]:
    """The next `count` SSE events, leaving the stream open."""
    events: list[str] = []
    while len(events) < count:
        line = next(lines)
        if line.startswith("data: "):
            events.append(line)
    return events


STREAMS = [
    ("/v1/completions", {**LONG, "stream": True}),
    ("/v1/completions", {**LONG, "stream": True, "n": 3, "prompt": ["Once upon a time", "The dog"]}),
    ("/v1/chat/completions", {**CHAT, "stream": True}),
]


@pytest.mark.parametrize(("path", "body"), STREAMS, ids=["completion", "batched-n3", "chat"])
def test_closing_a_stream_aborts_the_request(served: Served, path: str, body: dict) -> None:
    tokens_before = served.metric("vllm:generation_tokens_total")
    with (
        httpx.Client(base_url=served.url, timeout=30) as http,
        http.stream("POST", path, json=body) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()  # NOTE: held, since a collected iterator closes the stream
        events = read_events(lines, 3)
        assert all('"finish_reason":null' in event for event in events)
        assert served.integrity(expect_idle=False).executors[0].num_requests > 0
        assert served.metric("vllm:num_requests_running") > 0
    assert_aborted(served, tokens_before, body)


def test_a_non_streaming_client_that_times_out_aborts_the_request(served: Served) -> None:
    tokens_before = served.metric("vllm:generation_tokens_total")
    with httpx.Client(base_url=served.url, timeout=0.5) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=LONG)
    assert_aborted(served, tokens_before, LONG)


def test_serving_goes_on_after_disconnects(served: Served) -> None:
    with httpx.Client(base_url=served.url, timeout=30) as http:
        response = http.post("/v1/completions", json={**LONG, "max_tokens": 10})
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 10
    check = served.integrity(expect_idle=True)
    assert check.ok, check.message
