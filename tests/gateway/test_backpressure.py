"""Clients that open a stream and never read it: the gateway of a real `npuserve serve` cuts each
off once it has taken no byte for `--stream-stall-timeout`, which aborts its request in the
scheduler, so their output is neither generated nor buffered on.

10 streaming completions, n=128 each, up to the end of the context, sent from raw sockets with a
small receive buffer that never read: the gateway's memory grows less than 100 MB over what it
held before them (with no timeout it buffered their whole output: +700 MB for 20 of them),
every request ends long before its output could have been generated, each connection ends
without `[DONE]`, and then a normal request is served and every block pool is whole and idle.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, closing

import httpx
import pytest
from harness.serve import Served, open_completion_stream, rss_mb, serve_checked, serve_child
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow  # starts npuserve processes

STALL_TIMEOUT_S = 2
NUM_CLIENTS = 10
N = 128
MAX_TOKENS = 480  # the demo model's context is 512 tokens
# NOTE: logprobs make each chunk larger: the socket buffers fill, and the clock starts, sooner.
UNREAD = {"prompt": "Once upon a time", "n": N, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
          "logprobs": 5}  # fmt: skip
RECEIVE_BUFFER_BYTES = 4096
MAX_GROWTH_MB = 100
GIVE_UP_S = 300  # far beyond what cutting the clients off takes: only guards against a hang
IN_PROGRESS = "npuserve:gateway_requests_in_progress"


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    flags = ["--kv-cache-memory", "0.05", "--stream-stall-timeout", str(STALL_TIMEOUT_S)]
    with serve_checked(None, *flags) as served:
        yield served


def open_unread_stream(served: Served) -> socket.socket:
    """A client that sends a streaming request and never reads the answer; its small receive
    buffer fills at once, so the gateway's writes soon wait on it."""
    return open_completion_stream(served.url, UNREAD, RECEIVE_BUFFER_BYTES, GIVE_UP_S)


def read_until_closed(sock: socket.socket) -> bytes:
    """What the gateway sent, up to its closing the connection (a socket timeout fails)."""
    data = b""
    try:
        while chunk := sock.recv(1 << 20):
            data += chunk
    except ConnectionResetError:  # closed with what the client never took
        pass
    return data


def completions_in_progress(served: Served) -> float:
    """The completions the gateway is answering now (its `/metrics`)."""
    text = httpx.get(f"{served.url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == IN_PROGRESS and sample.labels.get("route") == "/v1/completions"
    )


def wait_for_in_progress(served: Served, count: float, gateway_pid: int) -> float:
    """Waits until ``count`` completions are in progress at the gateway; the gateway's highest
    resident memory meanwhile (MB)."""
    peak, deadline = 0.0, time.monotonic() + GIVE_UP_S
    while (in_progress := completions_in_progress(served)) != count:
        assert time.monotonic() < deadline, f"{in_progress} completions in progress, not {count}"
        peak = max(peak, rss_mb(gateway_pid))
        time.sleep(0.1)
    return max(peak, rss_mb(gateway_pid))


def test_clients_that_never_read_are_cut_off_and_their_requests_aborted(served: Served) -> None:
    child = serve_child(served.process.pid, "gateway")  # type: ignore[union-attr]
    assert child is not None
    gateway_pid = child[0]
    with httpx.Client(base_url=served.url, timeout=60) as http:  # the gateway warmed up
        warm = http.post("/v1/completions", json={**UNREAD, "stream": False, "n": 2, "max_tokens": 32})
        assert warm.status_code == 200
    baseline = rss_mb(gateway_pid)
    tokens_before = served.metric("vllm:generation_tokens_total")

    with ExitStack() as stack:
        clients = [stack.enter_context(closing(open_unread_stream(served))) for _ in range(NUM_CLIENTS)]
        started = time.monotonic()
        peak = wait_for_in_progress(served, NUM_CLIENTS, gateway_pid)
        peak = max(peak, wait_for_in_progress(served, 0, gateway_pid))
        seconds = time.monotonic() - started
        answers = [read_until_closed(sock) for sock in clients]

    generated = served.metric("vllm:generation_tokens_total") - tokens_before
    print(f"gateway +{peak - baseline:.1f} MB over {baseline:.1f} MB; all cut off after {seconds:.1f} s; "
          f"{generated:.0f} of {NUM_CLIENTS * N * MAX_TOKENS} tokens generated")  # fmt: skip
    assert peak - baseline < MAX_GROWTH_MB
    assert generated < NUM_CLIENTS * N * MAX_TOKENS, "the requests ran on instead of being aborted"
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in answer
    check = served.integrity(expect_idle=True)
    assert check.ok, check.message
    with httpx.Client(base_url=served.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={**UNREAD, "n": 2, "max_tokens": 16}) as response:
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert response.status_code == 200 and events[-1] == "data: [DONE]"
