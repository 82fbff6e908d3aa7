"""One request must never stall the others: while an attacker sends a template bomb (request templates
trusted), a template that loops for ever, a 24 MB prompt, or a constraint that crashes the grammar
compiler, over HTTP and over gRPC, a normal request completes within its usual latency, every
attack gets a clear 400 / INVALID_ARGUMENT, and no process of the service dies of it."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
from harness.hostile_grammars import chained_refs, chained_rules
from harness.serve import Served, collect, greedy_request, serve, serve_child

from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc
from npuserve.proto.auth import with_bearer
from npuserve.proto.channel import MAX_API_MESSAGE_BYTES, message_size_options
from npuserve.proto.error_details import error_field

API_KEY = "sk-no-stall"
USER = [{"role": "user", "content": "x"}]
BOMB = '{{ "ab " * 10000000 }}'
FOREVER = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
BIG_PROMPT = "ab " * 8_000_000  # 24 MB, 16M tokens
# Under the gateway's 4 MiB body limit (a larger body is a 413 before it is read), 2.4M tokens.
BIG_BODY_PROMPT = "ab " * 1_200_000
MANY_IDS = list(range(3, 512)) * 4000  # 2M token ids to detokenize


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    flags = ("--kv-cache-memory", "0.02", "--api-key", API_KEY, "--trust-request-chat-template")
    with serve(None, *flags) as served:
        yield served


@pytest.fixture(scope="module")
def http(served: Served) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=served.url, headers=headers, timeout=120) as client:
        yield client


def normal_latency(served: Served) -> float:
    stub = served.stub()
    started = time.monotonic()
    token_ids, _, _ = collect(stub, greedy_request([1, 400, 300, 200], 8))
    assert len(token_ids) == 8
    return time.monotonic() - started


def while_attacked(
    served: Served, attack: Callable[[], None], normal_requests: int = 6
) -> tuple[float, list[float], int]:
    """(idle median latency, latencies of normal requests sent while `attack` runs in a loop, attacks
    made). Each attack checks its own answer."""
    for _ in range(2):
        normal_latency(served)  # warm
    baseline = statistics.median(normal_latency(served) for _ in range(5))
    stop = threading.Event()
    attacks: list[BaseException | None] = []

    def attacker() -> None:
        while not stop.is_set():
            try:
                attack()
                attacks.append(None)
            except BaseException as exc:  # reported by the test thread
                attacks.append(exc)
                return

    thread = threading.Thread(target=attacker)
    thread.start()
    try:
        time.sleep(0.2)  # the first attack is under way
        latencies = [normal_latency(served) for _ in range(normal_requests)]
    finally:
        stop.set()
        thread.join(120)
    errors = [exc for exc in attacks if exc is not None]
    if errors:
        raise errors[0]
    return baseline, latencies, len(attacks)


def assert_unstalled(baseline: float, latencies: list[float]) -> None:
    # NOTE: relative to the idle baseline of the same test; the slack absorbs this shared machine's noise.
    allowed = max(5 * baseline, baseline + 1.0)
    assert max(latencies) < allowed, f"baseline {baseline:.3f}s, under attack {latencies}"


def assert_refused(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text[:300]
    assert response.json()["error"]["param"] == param, response.text[:300]


def test_template_bomb_is_refused_and_stalls_nothing(served: Served, http: httpx.Client) -> None:
    def attack() -> None:
        response = http.post("/tokenize", json={"messages": USER, "chat_template": BOMB})
        assert_refused(response, "chat_template")

    baseline, latencies, attacks = while_attacked(served, attack)
    assert attacks >= 1
    assert_unstalled(baseline, latencies)


def test_endless_template_is_stopped_and_stalls_nothing(served: Served, http: httpx.Client) -> None:
    def attack() -> None:
        body = {"messages": USER, "chat_template": FOREVER, "max_tokens": 4}
        response = http.post("/v1/chat/completions", json=body)
        assert_refused(response, "chat_template")
        assert "longer than" in response.json()["error"]["message"]

    baseline, latencies, attacks = while_attacked(served, attack, normal_requests=4)
    assert attacks >= 1
    assert_unstalled(baseline, latencies)
    # The killed render worker was replaced: templates render again.
    ok = http.post("/tokenize", json={"messages": USER, "chat_template": "{{ messages[0].content }}!"})
    assert ok.status_code == 200, ok.text
    assert ok.json()["count"] > 0


def test_huge_prompt_is_refused_from_its_size_and_stalls_nothing(served: Served, http: httpx.Client) -> None:
    def attack() -> None:
        response = http.post("/v1/completions", json={"prompt": BIG_BODY_PROMPT, "max_tokens": 4})
        assert_refused(response, "prompt")
        assert "512" in response.json()["error"]["message"]

    baseline, latencies, attacks = while_attacked(served, attack)
    assert attacks >= 1
    assert_unstalled(baseline, latencies)


def assert_invalid(call: Callable[[], object], field: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert error_field(caught.value) == field


def test_attacks_over_grpc_are_invalid_argument_and_stall_nothing(served: Served) -> None:
    channel = with_bearer(
        grpc.insecure_channel(served.address, options=message_size_options(MAX_API_MESSAGE_BYTES)), API_KEY
    )
    stub = pb_grpc.SchedulerStub(channel)
    bomb = pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="x")], chat_template=BOMB)
    big = pb.GenerateRequest(text=BIG_PROMPT, sampling=pb.SamplingParams(max_tokens=4))

    def attack() -> None:
        assert_invalid(lambda: stub.Tokenize(pb.TokenizeRequest(chat=bomb), timeout=60), "chat_template")
        assert_invalid(lambda: list(stub.Generate(big, timeout=60)), "prompt")
        assert_invalid(lambda: stub.Tokenize(pb.TokenizeRequest(text=BIG_PROMPT), timeout=60), "prompt")
        text = stub.Detokenize(
            pb.DetokenizeRequest(token_ids=MANY_IDS), timeout=60
        ).text  # allowed, off the loop
        assert len(text) > len(MANY_IDS)

    baseline, latencies, attacks = while_attacked(served, attack)
    assert attacks >= 1
    assert_unstalled(baseline, latencies)
    assert served.integrity().ok


def test_grammars_that_crash_the_compiler_are_400_and_kill_nothing(
    served: Served, http: httpx.Client
) -> None:
    """Each attack a different schema (no cached refusal helps): its grammar worker dies and is
    replaced, the scheduler lives on, and other requests do not wait."""
    assert served.process is not None
    scheduler_before = serve_child(served.process.pid, "scheduler")
    sent = [0]

    def attack() -> None:
        sent[0] += 1
        schema = {"name": "x", "schema": chained_refs(1_000 + sent[0])}
        body = {
            "messages": USER,
            "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": schema},
        }
        response = http.post("/v1/chat/completions", json=body)
        assert_refused(response, "response_format.json_schema.schema")
        assert "crashed the grammar compiler" in response.json()["error"]["message"]

    baseline, latencies, attacks = while_attacked(served, attack)
    assert attacks >= 1
    assert_unstalled(baseline, latencies)
    lark = {"messages": USER, "max_tokens": 4, "guided_grammar": chained_rules(3_000)}
    for _ in range(2):
        refused = http.post("/v1/chat/completions", json=lark)
        assert_refused(refused, "guided_grammar")
        assert "3002 rules" in refused.json()["error"]["message"]
    assert serve_child(served.process.pid, "scheduler") == scheduler_before
    assert served.integrity().ok


def test_grammars_past_the_bounds_are_refused_at_once_and_json_object_goes_on(
    served: Served, http: httpx.Client
) -> None:
    gbnf = {"messages": USER, "max_tokens": 4, "guided_grammar": chained_rules(20_000, gbnf=True)}
    with ThreadPoolExecutor(2) as pool:
        refusals = list(pool.map(lambda _: http.post("/v1/chat/completions", json=gbnf), range(2)))
    for refused in refusals:
        assert_refused(refused, "guided_grammar")
        assert "bytes long" in refused.json()["error"]["message"]
    body = {"messages": USER, "max_tokens": 24, "response_format": {"type": "json_object"}}
    answer = http.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"].startswith("{")
