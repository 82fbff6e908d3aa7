"""The gateway's request limits (`gateway/limits.py`): a request over one, on any dimension, is
refused whole before the work it would cost: a 400 naming the parameter, or a 413 past the body's
bytes.

Against a real `npuserve serve` with the default limits, the measured attacks (300k prompts, 50k
tools, 15M token ids, 1.8M messages, 100k stop strings, 600 stop strings of 50 KB, and their
variants that fit in the body limit) are refused while a probe's small completions go on being
served. A gateway of its own on the same scheduler, with every limit lowered by its flag, refuses
one past each limit and serves the limit itself, which the default gateway serves too. Every
scenario ends with the block pools intact.
"""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from harness.serve import Served, npuserve_process, serve_checked

from npuserve.deploy.cli import build_parser
from npuserve.deploy.gateway_flags import GATEWAY, LIMIT_FIELDS, gateway_config_from_args, gateway_flags
from npuserve.gateway.limits import RequestLimits, flag_name

COMPLETIONS, CHAT, DETOKENIZE = "/v1/completions", "/v1/chat/completions", "/detokenize"
USER = {"role": "user", "content": "hi"}
PROBE = {"prompt": "Once upon a time", "max_tokens": 1, "temperature": 0}
GIVE_UP_S = 60  # far beyond any refusal: a request still unanswered then was never going to be
DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
LOWERED = RequestLimits(
    max_request_bytes=8192,
    max_prompts=4,
    max_token_ids=64,
    max_messages=4,
    max_tools=2,
    max_tools_bytes=400,
    max_stop=2,
    max_stop_chars=8,
    max_output_tokens=100,
)
DEFAULTS = RequestLimits()


def compact(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def tool(name: str, description: str = "") -> dict[str, Any]:
    function = {"name": name, "description": description, "parameters": {"type": "object"}}
    return {"type": "function", "function": function}


def tool_of_bytes(size: int) -> dict[str, Any]:
    """A tool whose JSON (as a one-tool list) is ``size`` bytes."""
    return tool("f", "x" * (size - len(compact([tool("f")]))))


def call(i: int) -> dict[str, Any]:
    return {"id": f"call-{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def with_calls(num_calls: int) -> list[dict[str, Any]]:
    """A user message, then an assistant message calling ``num_calls`` tools."""
    return [USER, {"role": "assistant", "content": None, "tool_calls": [call(i) for i in range(num_calls)]}]


def padded(body: dict[str, Any], size: int) -> dict[str, Any]:
    """``body`` with its (ignored) `user` field padded so its compact JSON is ``size`` bytes."""
    return {**body, "user": "x" * (size - len(compact({**body, "user": ""})))}


def assert_openai_error(response: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    return error


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve_checked(None, "--kv-cache-memory", "0.02") as served:
        yield served


@pytest.fixture(scope="module")
def lowered(served: Served) -> Iterator[str]:
    """The URL of a gateway of its own on the same scheduler, with every limit lowered by its flag."""
    flags = GATEWAY.to_flags(LOWERED, only=LIMIT_FIELDS)
    with npuserve_process("gateway", "--scheduler", served.address, "--port", "0", *flags) as (_, ready):
        yield str(ready["url"])


@pytest.fixture(autouse=True)
def pools_intact(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each scenario that started `npuserve serve`: every block back, the pools intact."""
    yield
    if "served" in request.fixturenames:
        check = request.getfixturevalue("served").integrity(expect_idle=True)
        assert check.ok, check.message


# -- one past each limit -------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """`within` is the lowered limit itself (served); `over` one past it, refused naming `param`
    by the lowered gateway (413 and no param past the body's bytes) and served by the default."""

    name: str
    limit: str  # the `RequestLimits` field
    path: str
    within: dict[str, Any]
    over: dict[str, Any]
    param: str | None


def _completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "Once", "max_tokens": 1, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [USER], "max_tokens": 1, **fields}


CASES = [
    Case(
        "bytes",
        "max_request_bytes",
        COMPLETIONS,
        padded(_completion(), 8192),
        padded(_completion(), 8193),
        None,
    ),
    Case(
        "prompts",
        "max_prompts",
        COMPLETIONS,
        _completion(prompt=["a"] * 4),
        _completion(prompt=["a"] * 5),
        "prompt",
    ),
    Case(
        "ids",
        "max_token_ids",
        COMPLETIONS,
        _completion(prompt=[5] * 64),
        _completion(prompt=[5] * 65),
        "prompt",
    ),
    Case(
        "ids of prompts",
        "max_token_ids",
        COMPLETIONS,
        _completion(prompt=[[5] * 32, [5] * 32]),
        _completion(prompt=[[5] * 32, [5] * 33]),
        "prompt",
    ),
    Case("detokenize", "max_token_ids", DETOKENIZE, {"tokens": [5] * 64}, {"tokens": [5] * 65}, "tokens"),
    Case(
        "messages", "max_messages", CHAT, _chat(messages=[USER] * 4), _chat(messages=[USER] * 5), "messages"
    ),
    Case(
        "tools",
        "max_tools",
        CHAT,
        _chat(tools=[tool("a"), tool("b")], tool_choice="none"),
        _chat(tools=[tool("a"), tool("b"), tool("c")], tool_choice="none"),
        "tools",
    ),
    Case(
        "tools bytes",
        "max_tools_bytes",
        CHAT,
        _chat(tools=[tool_of_bytes(400)], tool_choice="none"),
        _chat(tools=[tool_of_bytes(401)], tool_choice="none"),
        "tools",
    ),
    Case(
        "tool calls",
        "max_tools",
        CHAT,
        _chat(messages=with_calls(2)),
        _chat(messages=with_calls(3)),
        "messages[1].tool_calls",
    ),
    Case(
        "stop",
        "max_stop",
        COMPLETIONS,
        _completion(stop=["a", "b"]),
        _completion(stop=["a", "b", "c"]),
        "stop",
    ),
    Case(
        "stop ids",
        "max_stop",
        COMPLETIONS,
        _completion(stop_token_ids=[1, 2]),
        _completion(stop_token_ids=[1, 2, 3]),
        "stop_token_ids",
    ),
    Case(
        "stop chars",
        "max_stop_chars",
        COMPLETIONS,
        _completion(stop="8" * 8),
        _completion(stop="9" * 9),
        "stop",
    ),
    Case(
        "n x max_tokens",
        "max_output_tokens",
        COMPLETIONS,
        _completion(n=2, max_tokens=50),
        _completion(n=2, max_tokens=51),
        "n",
    ),
    Case(
        "prompts x max_tokens",
        "max_output_tokens",
        COMPLETIONS,
        _completion(prompt=["a", "b"], max_tokens=50),
        _completion(prompt=["a", "b"], max_tokens=51),
        "max_tokens",
    ),
    Case(
        "n x max_completion_tokens",
        "max_output_tokens",
        CHAT,
        _chat(n=2, max_completion_tokens=50),
        _chat(n=3, max_completion_tokens=34),
        "n",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_one_past_each_lowered_limit_is_refused_naming_its_param(
    served: Served, lowered: str, case: Case
) -> None:
    with httpx.Client(base_url=lowered, timeout=GIVE_UP_S) as http:
        within = http.post(case.path, content=compact(case.within))
        assert within.status_code == 200, within.text
        over = http.post(case.path, content=compact(case.over))
    error = assert_openai_error(over, 400 if case.param else 413, case.param)
    assert flag_name(case.limit) in error["message"]
    with httpx.Client(base_url=served.url, timeout=GIVE_UP_S) as default:
        assert default.post(case.path, content=compact(case.over)).status_code == 200  # the flag moved it


@pytest.mark.slow
def test_n_without_max_tokens_counts_the_context_length(served: Served, lowered: str) -> None:
    with httpx.Client(base_url=lowered, timeout=GIVE_UP_S) as http:
        error = assert_openai_error(http.post(CHAT, content=compact({"messages": [USER], "n": 2})), 400, "n")
    assert "2 sequences of up to 512" in error["message"]  # the demo model's context


# -- the measured attacks, on the default limits ------------------------------------------------


@dataclass(frozen=True)
class Attack:
    """A body whose ``key`` is an array of ``count`` times ``item`` (JSON text) beside ``head``."""

    name: str
    path: str
    head: dict[str, Any]
    key: str
    item: bytes
    count: int
    param: str | None  # None: over the body's bytes (413)

    def body(self) -> bytes:
        """The body as bytes, without building its objects (made when the test runs)."""
        items = b"[" + (self.item + b",") * (self.count - 1) + self.item + b"]"
        return compact(self.head)[:-1] + b',"' + self.key.encode() + b'":' + items + b"}"


TOOL = compact({"type": "function", "function": {"name": "f", "parameters": {}}})
STOP_50_KB = b'"' + b"a" * 50_000 + b'"'
ATTACKS = [
    Attack("300k prompts", COMPLETIONS, {"max_tokens": 1}, "prompt", b'"a"', 300_000, "prompt"),
    Attack("50k tools", CHAT, _chat(tool_choice="none"), "tools", TOOL, 50_000, "tools"),
    Attack("15M token ids", COMPLETIONS, {"max_tokens": 1}, "prompt", b"1", 15_000_000, None),
    Attack("1.5M token ids", COMPLETIONS, {"max_tokens": 1}, "prompt", b"1", 1_500_000, "prompt"),
    Attack("1.8M messages", CHAT, {"max_tokens": 1}, "messages", b'{"role":"user"}', 1_800_000, None),
    Attack("200k messages", CHAT, {"max_tokens": 1}, "messages", b'{"role":"user"}', 200_000, "messages"),
    Attack("100k stop", CHAT, _chat(), "stop", b'"ab"', 100_000, "stop"),
    Attack("600 stop x 50 KB", CHAT, _chat(), "stop", STOP_50_KB, 600, None),
    Attack("60 stop x 50 KB", CHAT, _chat(), "stop", STOP_50_KB, 60, "stop"),
]


@dataclass
class Probe:
    """Small completions, one after another on a thread of its own: (start, seconds, status) each."""

    url: str
    samples: list[tuple[float, float, int]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Probe:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(GIVE_UP_S)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=GIVE_UP_S) as http:
            while not self._stop.is_set():
                start = time.monotonic()
                status = http.post(COMPLETIONS, json=PROBE).status_code
                self.samples.append((start, time.monotonic() - start, status))
                time.sleep(0.01)

    def seconds(self, since: float, until: float) -> list[float]:
        """How long each probe that overlapped [since, until] took."""
        return [took for start, took, _ in self.samples if start < until and start + took > since]


def post_raw(url: str, path: str, content: bytes) -> tuple[int, dict[str, Any]]:
    """POSTs ``content`` as a refused attacker would: past the body limit only the headers go
    (the gateway answers from Content-Length, before any body arrives); (status, error)."""
    if len(content) <= DEFAULTS.max_request_bytes:
        response = httpx.post(url + path, content=content, timeout=GIVE_UP_S)
        return response.status_code, response.json().get("error") or {}
    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port or 80), timeout=GIVE_UP_S) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(content)}\r\nConnection: close\r\n\r\n".encode()
        )
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, payload = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)["error"]


@pytest.mark.slow
@pytest.mark.parametrize("attack", ATTACKS, ids=lambda attack: attack.name)
def test_measured_attacks_are_refused_while_others_are_served(served: Served, attack: Attack) -> None:
    content = attack.body()
    with Probe(served.url) as probe:
        time.sleep(0.5)
        idle_until = time.monotonic()
        status, error = post_raw(served.url, attack.path, content)
        attacked_until = time.monotonic()
        time.sleep(0.2)
    assert (status, error.get("param")) == (400 if attack.param else 413, attack.param), error
    assert all(code == 200 for _, _, code in probe.samples)
    idle = probe.seconds(0, idle_until)
    during = probe.seconds(idle_until, attacked_until)
    print(
        f"\n{attack.name}: {len(content) / 1e6:.1f} MB refused {status} in "
        f"{(attacked_until - idle_until) * 1000:.0f} ms; probes idle median {statistics.median(idle) * 1000:.0f} "
        f"ms max {max(idle) * 1000:.0f} ms, during the attack max {max(during, default=0) * 1000:.0f} ms"
    )


# -- the flags -----------------------------------------------------------------------------------


def test_serve_forwards_the_limit_flags_to_its_gateway() -> None:
    parser = build_parser()
    serve = parser.parse_args(["serve", "--max-tools", "3", "--max-request-bytes", "1000"])
    gateway = parser.parse_args(["gateway", "--scheduler", "127.0.0.1:1", *gateway_flags(serve)])
    limits = gateway_config_from_args(gateway).limits
    assert limits == RequestLimits(max_tools=3, max_request_bytes=1000)
    assert gateway_config_from_args(parser.parse_args(["gateway", "--scheduler", "x:1"])).limits == DEFAULTS


@pytest.mark.parametrize("limit", LIMIT_FIELDS)
def test_a_limit_is_positive_and_documented(limit: str) -> None:
    with pytest.raises(ValueError, match=flag_name(limit)):
        RequestLimits(**{limit: 0})
    assert f"`{flag_name(limit)}" in DOCS.read_text()
