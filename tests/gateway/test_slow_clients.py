"""Clients that hold connections without finishing a request, too many connections, and HTTP/1.0:
the gateway of a real `npuserve serve`, over raw sockets.

A client that stalls in its headers or its body gets a 408 and the connection is closed, so
stalled sockets cannot pile up; beyond ``--max-connections`` a new connection gets a 503 at
once; an HTTP/1.0 client is never sent a chunked stream.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
import pytest
from harness.serve import Served, serve

pytestmark = pytest.mark.slow  # starts npuserve processes

HEADER_TIMEOUT_S = 2
BODY_TIMEOUT_S = 2
MAX_CONNECTIONS = 4
# Far beyond the limits above: a socket still open then was never going to be closed.
GIVE_UP_S = 60
COMPLETION = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    flags = ["--kv-cache-memory", "0.02", "--request-header-timeout", str(HEADER_TIMEOUT_S),
             "--request-body-timeout", str(BODY_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS)]  # fmt: skip
    with serve(None, *flags) as served:
        yield served


@dataclass
class Reply:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)


def connect(served: Served) -> socket.socket:
    url = urlsplit(served.url)
    sock = socket.create_connection((url.hostname, url.port), timeout=GIVE_UP_S)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a socket timeout fails)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def parse(raw: bytes) -> Reply:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return Reply(int(status_line.split()[1]), headers, body)


def post(path: str, body: bytes, version: str = "1.1", extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/{version}\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n"
    ).encode() + body


def test_stalled_headers_get_408_and_the_connection_closed(served: Served) -> None:
    with closing(connect(served)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\n")  # and nothing more
        reply = parse(read_until_closed(sock))
    assert reply.status == 408 and reply.headers["connection"] == "close"
    assert reply.json()["error"]["code"] == "request_timeout"
    with closing(connect(served)) as idle:  # a connection that never sends a byte
        assert parse(read_until_closed(idle)).status == 408


def test_a_stalled_body_gets_408_and_the_connection_closed(served: Served) -> None:
    body = json.dumps(COMPLETION).encode()
    with closing(connect(served)) as sock:
        sock.sendall(post("/v1/completions", body)[: -len(body) // 2])  # half the body
        reply = parse(read_until_closed(sock))
    assert reply.status == 408 and reply.headers["connection"] == "close"
    error = reply.json()["error"]
    assert error["code"] == "request_timeout" and "body" in error["message"]


def test_a_prompt_client_is_served_on_a_kept_alive_connection(served: Served) -> None:
    with httpx.Client(base_url=served.url, timeout=GIVE_UP_S) as http:
        for _ in range(3):
            assert http.post("/v1/completions", json=COMPLETION).status_code == 200


def test_connections_beyond_the_cap_get_503_until_some_close(served: Served) -> None:
    held = [connect(served) for _ in range(MAX_CONNECTIONS)]
    try:
        with closing(connect(served)) as extra:
            reply = parse(read_until_closed(extra))
        assert reply.status == 503 and reply.headers["retry-after"]
        assert "--max-connections=4" in reply.json()["error"]["message"]
    finally:
        for sock in held:
            sock.close()
    # Once those are closed the gateway serves again (probe until the server noticed).
    with httpx.Client(base_url=served.url, timeout=GIVE_UP_S) as http:
        for _ in range(100):
            if http.get("/health").status_code == 200:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the gateway did not serve after the held connections closed")


def test_http_1_0_streams_are_refused_and_plain_answers_are_not_chunked(served: Served) -> None:
    stream = json.dumps({**COMPLETION, "stream": True}).encode()
    with closing(connect(served)) as sock:
        sock.sendall(post("/v1/completions", stream, version="1.0"))
        reply = parse(read_until_closed(sock))
    assert reply.status == 400 and "transfer-encoding" not in reply.headers
    error = reply.json()["error"]
    assert error["param"] == "stream" and "HTTP/1.1" in error["message"]

    with closing(connect(served)) as sock:
        sock.sendall(post("/v1/completions", json.dumps(COMPLETION).encode(), version="1.0"))
        reply = parse(read_until_closed(sock))
    assert reply.status == 200 and "transfer-encoding" not in reply.headers
    assert int(reply.headers["content-length"]) == len(reply.body)
    assert reply.json()["usage"]["completion_tokens"] == 4
