"""Requests that arrive while the only executor hangs (SIGSTOP) until the step timeout gives it
up: each gets 503 with Retry-After (the scheduler's UNAVAILABLE), whether it was queued on the
executor before the timeout or came after, never a 500; once the executor resumes, it serves."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from harness.serve import Served, child_pids, serve

from npuserve.proto import scheduler_pb2 as pb

pytestmark = pytest.mark.slow  # starts npuserve processes

NUM_REQUESTS = 12
COMPLETION = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
GIVE_UP_S = 120


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve(None, "--kv-cache-memory", "0.02", "--step-timeout", "3") as served:
        yield served


def executor_pid(served: Served) -> int:
    for pid in child_pids(served.process.pid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"executor" in argv:
            return pid
    pytest.fail("no executor process under npuserve serve")


def failed_in_the_scheduler(served: Served) -> float:
    text = served.stub().GetMetrics(pb.GetMetricsRequest(), timeout=10).text
    samples = [line for line in text.splitlines() if line.startswith("vllm:request_success_total{")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in samples if 'finished_reason="error"' in line)


def send(url: str, index: int) -> httpx.Response:
    body = {**COMPLETION, "stream": index % 2 == 1}
    with httpx.Client(base_url=url, timeout=GIVE_UP_S) as http:
        response = http.post("/v1/completions", json=body)
        response.read()
        return response


def test_requests_while_the_executor_hangs_get_503_then_it_serves_again(served: Served) -> None:
    with httpx.Client(base_url=served.url, timeout=GIVE_UP_S) as http:
        assert http.post("/v1/completions", json=COMPLETION).status_code == 200
    pid = executor_pid(served)
    os.kill(pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(NUM_REQUESTS) as pool:
            responses = list(pool.map(lambda i: send(served.url, i), range(NUM_REQUESTS)))
    finally:
        os.kill(pid, signal.SIGCONT)
    statuses = [r.status_code for r in responses]
    assert statuses == [503] * NUM_REQUESTS, [(r.status_code, r.text[:200]) for r in responses]
    for response in responses:
        assert response.headers["retry-after"]
        error = response.json()["error"]
        assert error["code"] == "service_unavailable" and "no executor is available" in error["message"]
    # Some were queued on the hung executor and failed over to none (not only refused on arrival).
    assert failed_in_the_scheduler(served) > 0
    with httpx.Client(base_url=served.url, timeout=GIVE_UP_S) as http:
        deadline = time.monotonic() + GIVE_UP_S
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the executor did not rejoin"
            time.sleep(0.2)
        assert http.post("/v1/completions", json=COMPLETION).status_code == 200
    check = served.integrity(expect_idle=True)
    assert check.ok, check.message
