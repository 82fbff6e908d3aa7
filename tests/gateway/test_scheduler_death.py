"""`npuserve serve` on the demo model, its scheduler SIGKILLed while streams are in flight: the
gateway resumes each stream on the restarted scheduler from the tokens it had, so its client
sees a pause and then exactly what an undisturbed run streams (text, tokens, finish reason,
usage), greedy or seeded, completions or chat, one choice or two, one prompt or a batch (every
generation goes over the gateway's `GenerateMany` calls). A stream in flight at two deaths is
not resumed twice: it ends with an error event, and serve stays up.

Each test has a `serve` of its own: serve gives a crash-looping scheduler up after 5 deaths."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import openai
import pytest
from harness.serve import Served, alive, openai_client, serve_checked, serve_child

pytestmark = pytest.mark.slow  # `npuserve serve` in processes of its own

T = TypeVar("T")
MODEL = "stories260K"
NUM_GREEDY = 32
MAX_TOKENS = 128
STARTED_CHUNKS = 3  # a stream with this many chunks has tokens: the scheduler may die
WAIT_S = 60.0  # the most a wait for a process (or a stream) may take before the test fails
STARTS = ["Once upon a time", "One day", "There was a little", "Tom and Lily", "The sun was", "A big dog"]
ENDS = ["", " and", " in the park", " who", " with a red ball"]
RESUMED = re.compile(r"^npuserve:gateway_generations_resumed_total (\S+)$", re.MULTILINE)


@pytest.fixture
def served() -> Iterator[Served]:
    with serve_checked(None) as served:
        yield served


@dataclass
class Received:
    """One request's stream as its client put it together."""

    texts: dict[int, str] = field(default_factory=dict)  # per choice
    tokens: dict[int, list[str]] = field(default_factory=dict)  # per choice, with logprobs
    finish_reasons: dict[int, str | None] = field(default_factory=dict)
    usage: tuple[int, int] | None = None  # (prompt, completion) tokens
    # NOTE: not compared: a resumed stream's first chunk after the pause may carry more.
    num_chunks: int = field(default=0, compare=False)

    @property
    def finished(self) -> bool:
        return bool(self.finish_reasons) and all(self.finish_reasons.values())

    def add(self, index: int, text: str, finish_reason: str | None, tokens: list[str] | None) -> None:
        self.texts[index] = self.texts.get(index, "") + text
        self.tokens.setdefault(index, []).extend(tokens or [])
        self.finish_reasons[index] = finish_reason or self.finish_reasons.get(index)


def workload() -> list[dict[str, Any]]:
    """The requests, as `create` keyword arguments (each streamed, with its usage): greedy
    completions (some with logprobs, to compare tokens), seeded sampled ones, two chats, a
    seeded n = 2 and a batch of three prompts."""
    prompts = [f"{start}{end}" for end in ENDS for start in STARTS][:NUM_GREEDY]
    requests: list[dict[str, Any]] = [
        {"prompt": p, "temperature": 0, "logprobs": 1 if i % 4 == 0 else None} for i, p in enumerate(prompts)
    ]
    requests += [{"prompt": STARTS[i], "temperature": 1.0, "seed": 7 + i} for i in range(4)]
    requests += [
        {"messages": [{"role": "user", "content": "Tell me a story."}], "temperature": 0},
        {"messages": [{"role": "user", "content": "A story about a cat."}], "temperature": 1.0, "seed": 3},
        {"prompt": "Lily", "n": 2, "temperature": 1.0, "seed": 11, "extra_body": {"ignore_eos": True}},
        {"prompt": ["The dog", "The cat", "The bird"], "temperature": 0},
    ]
    return requests


async def stream_one(client: openai.AsyncOpenAI, request: dict[str, Any], received: Received) -> None:
    common = {
        "model": MODEL,
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if "messages" in request:
        chunks: Any = await client.chat.completions.create(**common, **request)
    else:
        chunks = await client.completions.create(**common, **request)
    async for chunk in chunks:
        received.num_chunks += 1
        for choice in chunk.choices:
            if "messages" in request:
                received.add(choice.index, choice.delta.content or "", choice.finish_reason, None)
            else:
                tokens = choice.logprobs.tokens if choice.logprobs else None
                received.add(choice.index, choice.text, choice.finish_reason, tokens)
        if chunk.usage is not None:
            received.usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)


def run_workload(served: Served, disturb: Callable[[list[Received]], None] | None = None) -> list[Received]:
    """Every request of `workload`, concurrently, each to its end; ``disturb`` runs (on a
    thread) once every stream has `STARTED_CHUNKS` chunks or has finished."""
    requests = workload()
    received = [Received() for _ in requests]

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=120)
        try:
            streams = [
                asyncio.ensure_future(stream_one(client, r, got))
                for r, got in zip(requests, received, strict=True)
            ]
            if disturb is not None:
                while not all(got.num_chunks >= STARTED_CHUNKS or got.finished for got in received):
                    assert not any(s.done() and s.exception() for s in streams), [
                        s.exception() for s in streams
                    ]
                    await asyncio.sleep(0.005)
                await asyncio.to_thread(disturb, received)
            await asyncio.wait_for(asyncio.gather(*streams), WAIT_S * 2)
        finally:
            await client.close()

    asyncio.run(run())
    return received


def wait_for(condition: Callable[[], T | None], what: str) -> T:
    deadline = time.monotonic() + WAIT_S
    while not (value := condition()):
        assert time.monotonic() < deadline, f"not within {WAIT_S:g} s: {what}"
        time.sleep(0.02)
    return value


def scheduler_pid(served: Served, not_pid: int | None = None) -> int:
    """The pid of serve's scheduler once it is up (other than ``not_pid``)."""

    def ready() -> int | None:
        child = serve_child(served.process.pid, "scheduler")  # type: ignore[union-attr]
        return child[0] if child is not None and child[0] != not_pid and child[1].exists() else None

    return wait_for(ready, "the scheduler ready")


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not alive(pid), "the scheduler dead")


def resumed_total(served: Served) -> float:
    """The gateway's count of the generations it resumed."""
    found = RESUMED.search(httpx.get(served.url + "/metrics", timeout=30).text)
    assert found is not None
    return float(found.group(1))


def assert_idle_and_intact(served: Served) -> None:
    check = served.integrity(expect_idle=True, timeout_s=30)
    assert check.ok, check.message
    assert all(e.num_requests == 0 and e.num_free_blocks == e.num_blocks for e in check.executors)


@pytest.mark.parametrize(
    "flags", [(), ("--api-server-count", "2", "--stream-interval", "4")], ids=["one-process", "api-processes"]
)
def test_streams_in_flight_when_the_scheduler_dies_complete_as_if_it_had_not(flags: tuple[str, ...]) -> None:
    """In the scheduler's own process, or in API server processes (which the scheduler's death
    ends too) that hold back up to 4 tokens a delta."""
    with serve_checked(None, *flags) as served:
        resumed_in_flight(served)


def resumed_in_flight(served: Served) -> None:
    undisturbed = run_workload(served)
    assert all(got.finished and got.usage for got in undisturbed)
    pid = scheduler_pid(served)
    in_flight: list[int] = []

    def kill_scheduler(received: list[Received]) -> None:
        in_flight.append(sum(not got.finished for got in received))
        kill(pid)

    disturbed = run_workload(served, kill_scheduler)
    assert in_flight[0] >= len(disturbed) // 2, "most streams had ended before the kill"
    assert disturbed == undisturbed
    assert resumed_total(served) >= 1
    scheduler_pid(served, not_pid=pid)
    assert_idle_and_intact(served)


def test_a_stream_in_flight_at_two_scheduler_deaths_ends_with_an_error_and_serve_stays_up(
    served: Served,
) -> None:
    """One request cannot bring the scheduler down more than twice: resumed once, it is not
    sent again after a second death while it runs."""
    client = openai_client(served)
    received = Received()
    errors: list[openai.APIError] = []

    def stream() -> None:
        chunks = client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=480, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        try:
            for chunk in chunks:
                received.num_chunks += 1
                received.add(0, chunk.choices[0].text, chunk.choices[0].finish_reason, None)
        except openai.APIError as exc:
            errors.append(exc)

    reader = threading.Thread(target=stream)
    reader.start()
    first = scheduler_pid(served)
    wait_for(lambda: received.num_chunks >= STARTED_CHUNKS, "the stream started")
    resumed_before = resumed_total(served)
    kill(first)
    wait_for(lambda: resumed_total(served) > resumed_before, "the stream resumed")
    chunks_then = received.num_chunks  # NOTE: what came before the kill was read long before now
    wait_for(lambda: received.num_chunks > chunks_then, "tokens of the resumed stream")
    second = scheduler_pid(served, not_pid=first)
    kill(second)
    reader.join(WAIT_S)
    assert not reader.is_alive() and not received.finished
    (error,) = errors
    assert "went down twice" in error.message and error.code == "scheduler_lost_twice"

    scheduler_pid(served, not_pid=second)
    reply = client.completions.create(model=MODEL, prompt="One day", max_tokens=16, temperature=0)
    assert reply.choices[0].finish_reason in ("length", "stop") and reply.choices[0].text
    assert_idle_and_intact(served)
