"""A client that reads its stream, but more slowly than it is generated: the gateway of a real
`npuserve serve` holds at most `--max-stream-buffer-bytes` of its output, then aborts its request
(its blocks freed) and ends its stream with an error event once the client has read what was
already sent, while the other streams on the same `GenerateMany` call are served as usual.

One streaming completion, n=128 with 20 logprobs a token, read from a raw socket with a small
receive buffer at 512 bytes every 100 ms; meanwhile a probe streams small completions one after
another (more of them than the gateway has channels to the scheduler, so some share the slow
stream's call). The slow request is aborted long before its output could have been generated,
its stream ends with the `stream_buffer_full` error event and `[DONE]`, the gateway's memory
grows by a few MB at most, every probe completes, and every block pool is idle.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import closing

import httpx
import pytest
from harness.serve import Served, open_completion_stream, rss_mb, serve_checked, serve_child

from npuserve.proto.channel import API_SERVERS

pytestmark = pytest.mark.slow  # starts npuserve processes

MAX_BUFFER_BYTES = 64 << 10
N = 128
MAX_TOKENS = 480  # the demo model's context is 512 tokens
SLOW = {"prompt": "Once upon a time", "n": N, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
        "logprobs": 20}  # fmt: skip
PROBE = {"prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True, "stream": True}
MIN_PROBES = 2 * API_SERVERS  # generations take turns over the channels: some share the slow call
RECEIVE_BUFFER_BYTES = 4096
SLOW_READ_BYTES = 512  # every SLOW_READ_PAUSE_S: far slower than the output is generated
SLOW_READ_PAUSE_S = 0.1
# NOTE: the bound counts the output as the scheduler sent it; the process also holds what is on
# its way to the client (the transport's buffer, one response being written) and heap slack.
# Without the bound the slow stream grows the gateway by 20 MB and more.
MAX_GROWTH_MB = 8
GIVE_UP_S = 300  # far beyond what reaching the bound takes: only guards against a hang


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    flags = ["--kv-cache-memory", "0.05", "--max-stream-buffer-bytes", str(MAX_BUFFER_BYTES)]
    with serve_checked(None, *flags) as served:
        yield served


class SlowReader:
    """Reads ``sock`` on a thread, `SLOW_READ_BYTES` every `SLOW_READ_PAUSE_S` until
    `catch_up`, then at full speed until the stream's `[DONE]` (or the connection's end)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.received = bytearray()
        self.catching_up = threading.Event()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        while not self.catching_up.is_set():
            self.received += self.sock.recv(SLOW_READ_BYTES)
            time.sleep(SLOW_READ_PAUSE_S)
        while b"data: [DONE]" not in self.received[-64:] and (chunk := self.sock.recv(1 << 20)):
            self.received += chunk

    def catch_up(self) -> bytes:
        self.catching_up.set()
        self.thread.join(GIVE_UP_S)
        return bytes(self.received)


def probe(http: httpx.Client) -> tuple[int, list[str]]:
    """A small streaming completion: its status and last two events."""
    with http.stream("POST", "/v1/completions", json=PROBE) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    return response.status_code, events[-2:]


def wait_until_idle(served: Served, gateway_pid: int) -> float:
    """Waits until no request runs and every block is back; the gateway's highest resident
    memory meanwhile (MB)."""
    peak, deadline = 0.0, time.monotonic() + GIVE_UP_S
    while True:
        peak = max(peak, rss_mb(gateway_pid))
        check = served.integrity(expect_idle=True, timeout_s=0)
        if check.ok and served.metric("vllm:num_requests_running") == 0:
            return peak
        assert time.monotonic() < deadline, check.message
        time.sleep(0.05)


def sse_events(raw: bytes) -> list[str]:
    """The events of an HTTP/1.1 response with a chunked SSE body, as `data: ...` lines."""
    parts, at = [], raw.index(b"\r\n\r\n") + 4
    while (line_end := raw.find(b"\r\n", at)) >= 0:
        size = int(raw[at:line_end], 16)
        parts.append(raw[line_end + 2 : line_end + 2 + size])
        at = line_end + 2 + size + 2
    return [event for event in b"".join(parts).decode().split("\n\n") if event]


def test_a_reader_slower_than_its_output_is_cut_off_at_the_bound(served: Served) -> None:
    child = serve_child(served.process.pid, "gateway")  # type: ignore[union-attr]
    assert child is not None
    gateway_pid = child[0]
    with httpx.Client(base_url=served.url, timeout=GIVE_UP_S) as http:
        warm = http.post("/v1/completions", json={**SLOW, "stream": False, "n": 2, "max_tokens": 32})
        assert warm.status_code == 200  # the gateway warmed up
        baseline = rss_mb(gateway_pid)
        tokens_before = served.metric("vllm:generation_tokens_total")
        with closing(open_completion_stream(served.url, SLOW, RECEIVE_BUFFER_BYTES, GIVE_UP_S)) as sock:
            reader = SlowReader(sock)
            probes = [probe(http) for _ in range(MIN_PROBES)]
            # With the probes done, the slow request is the only one: idle once it was aborted.
            peak = wait_until_idle(served, gateway_pid)
            generated = served.metric("vllm:generation_tokens_total") - tokens_before
            received = reader.catch_up()  # what was sent before the bound, then the error event
        peak = max(peak, rss_mb(gateway_pid))

    print(f"gateway +{peak - baseline:.1f} MB over {baseline:.1f} MB; client read {len(received)} B; "
          f"{generated:.0f} tokens generated (the slow one's {N * MAX_TOKENS} and the probes')")  # fmt: skip
    assert received.startswith(b"HTTP/1.1 200")
    *chunks, error, done = sse_events(received)
    assert done == "data: [DONE]" and chunks
    assert all("choices" in json.loads(chunk[len("data: ") :]) for chunk in chunks)
    last = json.loads(error[len("data: ") :])
    assert "error" in last, "the slow stream ran to its end"
    assert last["error"]["code"] == "stream_buffer_full"
    assert "--max-stream-buffer-bytes" in last["error"]["message"]
    assert generated < N * MAX_TOKENS, "the slow request ran on instead of being aborted"
    assert peak - baseline < MAX_GROWTH_MB
    for status, (last, end) in probes:
        assert status == 200 and end == "data: [DONE]" and '"error"' not in last
