"""`npuserve serve` through faults and SIGTERM, with real processes.

A SIGKILLed executor is restarted on its port after the policy's first backoff while the other
serves on: the streams in flight complete with the outputs of an undisturbed run (measured first,
same prompts), and the restarted executor serves again. A SIGKILLed gateway comes back on its port
and serves the clients that retry; a SIGKILLed scheduler comes back on its port, the executors
rejoin it and the gateway reconnects. SIGTERM drains: the streams in flight complete in full, a new
request gets 503 with Retry-After, and every process exits within --shutdown-timeout.

One `serve` (two executors) is shared by the module; the SIGTERM test ends it, so it comes last.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import openai
import pytest
from harness.serve import (
    Served,
    alive,
    child_pids,
    collect,
    generate_concurrently,
    greedy_request,
    labelled_metric,
    run_streams,
    serve,
    serve_child,
)

from npuserve.deploy.runtime.cpu_priority import CONTROL_PLANE_NICE
from npuserve.deploy.runtime.restart_policy import DEFAULT_RESTART_POLICY
from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow  # `npuserve serve` in processes of its own

T = TypeVar("T")
NUM_STREAMS = 32
MAX_TOKENS = 64
DRAIN_STREAMS = 16
DRAIN_TOKENS = 160
SHUTDOWN_TIMEOUT_S = 20
WAIT_S = 60.0  # the most any wait for a process to come back may take before the test fails
STORY_STARTS = [
    "Once upon a time",
    "One day",
    "There was a little",
    "Tom and Lily",
    "The sun was",
    "A big dog",
]
NEIGHBOUR_S = 60.0  # the most a CPU-bound neighbour of serve runs (stopped once measured)
# How much slower a request may get beside CPU-bound neighbours than alone: a fair share of the
# cores makes it 2-3x; a control plane that yields to them altogether (SCHED_IDLE) made it ~100x.
STARVED = 30
ANSI = re.compile(r"\x1b\[[0-9;]*m")


FLAGS = ("--num-executors", "2", "--kv-cache-memory", "0.02", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S))


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve(None, *FLAGS) as served:
        yield served


@pytest.fixture
def draining() -> Iterator[Served]:
    """A serve of its own for the test that ends it (so that a rerun gets a live one too)."""
    with serve(None, *FLAGS) as served:
        yield served


def wait_for(condition: Callable[[], T | None], what: str) -> T:
    deadline = time.monotonic() + WAIT_S
    while not (value := condition()):
        assert time.monotonic() < deadline, f"not within {WAIT_S:g} s: {what}"
        time.sleep(0.1)
    return value


def log_lines(served: Served, event: str) -> list[str]:
    """The lines of every process's log that carry ``event`` (colours stripped)."""
    return [plain for line in served.log if event in (plain := ANSI.sub("", line))]


def random_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(3, 40))] for _ in range(count)]


def ready_child(
    served: Served, name: str, not_pid: int | None = None
) -> Callable[[], tuple[int, Path] | None]:
    """A check for serve's child ``name`` (other than ``not_pid``) running with its ready file
    written: (pid, ready file), or None until then."""

    def check() -> tuple[int, Path] | None:
        child = serve_child(served.process.pid, name)  # type: ignore[union-attr]
        return child if child is not None and child[0] != not_pid and child[1].exists() else None

    return check


def thread_priorities(pid: int) -> set[tuple[int, int]]:
    """The (niceness, scheduling policy) of each thread of process ``pid`` (Linux sets them per
    thread)."""
    priorities = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            priorities.add((int(fields[16]), int(fields[38])))
    return priorities


def test_the_control_plane_yields_the_cores_to_executors_computing_on_them(served: Served) -> None:
    """Executors on the CPU: the scheduler (every process and thread of it) and the gateway run
    `CONTROL_PLANE_NICE` lower, with serve's policy, the executors at serve's own priority;
    all in serve's session, where those priorities count against each other."""
    serve_pid = served.process.pid  # type: ignore[union-attr]
    own = thread_priorities(serve_pid)
    lower = {(min(n + CONTROL_PLANE_NICE, 19), policy) for n, policy in own}
    scheduler, _ = wait_for(lambda: serve_child(serve_pid, "scheduler"), "the scheduler runs")
    gateway, _ = wait_for(lambda: serve_child(serve_pid, "gateway"), "the gateway runs")
    executor, _ = wait_for(lambda: serve_child(serve_pid, "executor-0"), "an executor runs")
    scheduler_processes = [scheduler, *child_pids(scheduler)]
    assert len(scheduler_processes) >= 2, "the front and at least one step worker"
    for pid in (*scheduler_processes, gateway):
        assert thread_priorities(pid) == lower, pid
    assert thread_priorities(executor) == own
    assert {os.getsid(pid) for pid in (scheduler, gateway, executor)} == {os.getsid(serve_pid)}
    # ... and a core, where the model can spare it (`cpu_threads`).
    argv = Path(f"/proc/{executor}/cmdline").read_bytes().decode().split("\0")
    assert argv[argv.index("--cpu-threads") + 1] == "auto"


def test_cpu_bound_neighbours_slow_requests_by_a_share_of_the_cores_not_to_a_halt(served: Served) -> None:
    """A busy loop per core in serve's session (a load generator, a build beside it): the control
    plane's lower priority costs it a share of the cores, never all of them. Compared with the
    same request alone, in this test."""
    stub = served.stub()
    request = greedy_request(random_prompts(1, seed=5)[0], 32)

    def median_latency_s() -> float:
        latencies = []
        for _ in range(3):
            start = time.monotonic()
            collect(stub, request)
            latencies.append(time.monotonic() - start)
        return sorted(latencies)[1]

    alone = median_latency_s()
    loop = f"import time\nend = time.monotonic() + {NEIGHBOUR_S}\nwhile time.monotonic() < end: pass"
    neighbours = [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(os.cpu_count() or 1)]
    try:
        beside = median_latency_s()
    finally:
        for neighbour in neighbours:
            neighbour.kill()
            neighbour.wait()
    assert beside < STARVED * alone, f"{beside:.2f} s beside busy loops against {alone:.2f} s alone"
    assert_idle_and_intact(served)


def both_executors_ready(stub: pb_grpc.SchedulerStub) -> Callable[[], pb.HealthResponse | None]:
    """A check that the scheduler reports both of serve's executors ready: its Health, or None."""

    def check() -> pb.HealthResponse | None:
        health = stub.Health(pb.HealthRequest(), timeout=10)
        return health if health.ready_executors == 2 else None

    return check


def assert_idle_and_intact(served: Served) -> None:
    check = served.integrity(expect_idle=True)
    assert check.ok, check.message
    assert all(e.num_requests == 0 and e.num_free_blocks == e.num_blocks for e in check.executors)


def test_a_killed_executor_restarts_and_its_streams_complete_unchanged(served: Served) -> None:
    stub = served.stub()
    requests = [greedy_request(p, MAX_TOKENS) for p in random_prompts(NUM_STREAMS, seed=11)]
    # Both executors serve before the kill (a rerun of this test finds executor-0 coming back).
    pid, ready_file = wait_for(ready_child(served, "executor-0"), "executor-0 ready")
    wait_for(both_executors_ready(stub), "2 ready executors")
    executor_id = json.loads(ready_file.read_text())["executor_id"]
    deaths_before = len(log_lines(served, "process died; restarting it"))
    undisturbed = [tokens for tokens, _, _ in generate_concurrently(stub, requests)]

    threads, outputs, reasons = run_streams(stub, requests, threading.Barrier(NUM_STREAMS + 1))
    os.kill(pid, signal.SIGKILL)
    for thread in threads:
        thread.join(120)
    assert outputs == undisturbed
    assert reasons == ["length"] * NUM_STREAMS
    assert log_lines(served, "requests moved"), "no stream was on the killed executor"

    # Back on its port after the first backoff, and serving again.
    wait_for(ready_child(served, "executor-0", not_pid=pid), "executor-0 restarted")
    deaths = log_lines(served, "process died; restarting it")
    (death,) = deaths[deaths_before:]
    # The policy's first backoff; a rerun's kill comes within its stable time of the first: twice it.
    backoff_s = DEFAULT_RESTART_POLICY.backoff_s(sum("name=executor-0" in line for line in deaths))
    assert "name=executor-0" in death and f"restart_in_s={backoff_s}" in death
    health = wait_for(both_executors_ready(stub), "2 ready executors")
    assert health.serving and health.total_executors == 2 and not health.degraded

    seeds = itertools.count(100)

    def served_there() -> bool:
        more = [greedy_request(p, 8) for p in random_prompts(8, seed=next(seeds))]
        generate_concurrently(stub, more)
        states = {e.executor_id: e for e in served.integrity(expect_idle=True).executors}
        return states[executor_id].prefix_cache_queries > 0

    wait_for(served_there, "a request served by the restarted executor")
    assert_idle_and_intact(served)
    # The scheduler's metrics count its return as a restart of that executor, and only of it.
    restarts = labelled_metric(stub, "npuserve:executor_restarts_total")
    assert restarts[executor_id] >= 1 and sum(restarts.values()) == restarts[executor_id]
    assert set(labelled_metric(stub, "npuserve:executor_up").values()) == {1.0}


def served_metrics(served: Served) -> str:
    """The gateway's `/metrics` text (its own series, then the scheduler's)."""
    return httpx.get(served.url + "/metrics", timeout=30).text


def completion_text(client: openai.OpenAI, prompt: str) -> str:
    reply = client.completions.create(model="stories260K", prompt=prompt, max_tokens=24, temperature=0)
    return reply.choices[0].text


def test_a_killed_gateway_restarts_on_its_port_and_serves(served: Served) -> None:
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=60)
    undisturbed = [completion_text(client, prompt) for prompt in STORY_STARTS]
    pid, _ = wait_for(ready_child(served, "gateway"), "the gateway ready")
    in_flight = [
        client.completions.create(model="stories260K", prompt=p, max_tokens=400, temperature=0, stream=True)
        for p in STORY_STARTS
    ]
    for stream in in_flight:
        next(iter(stream))  # each one has started
    os.kill(pid, signal.SIGKILL)
    for stream in in_flight:  # lost with the gateway: the client sees the connection end
        with contextlib.suppress(httpx.HTTPError, openai.APIError):
            for _ in stream:
                pass
        stream.close()

    failures = 0

    def retried(prompt: str) -> str:
        nonlocal failures
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                return completion_text(client, prompt)
            except (openai.APIConnectionError, openai.InternalServerError):
                failures += 1
                assert time.monotonic() < deadline, "the gateway did not come back"
                time.sleep(0.2)

    assert [retried(prompt) for prompt in STORY_STARTS] == undisturbed
    assert failures > 0, "the gateway never refused a connection: was it killed?"
    wait_for(ready_child(served, "gateway", not_pid=pid), "the gateway restarted")
    assert httpx.get(served.url + "/health", timeout=10).status_code == 200
    assert_idle_and_intact(served)  # the streams the dead gateway held were aborted


def test_a_killed_scheduler_restarts_on_its_port_and_the_gateway_reconnects(served: Served) -> None:
    """... and a request sent while it is down waits for it instead of failing: the gateway
    sends it again once the scheduler is back (nothing of it had reached the client)."""
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=60)
    undisturbed = completion_text(client, STORY_STARTS[0])
    pid, _ = wait_for(ready_child(served, "scheduler"), "the scheduler ready")
    resent_before = len(log_lines(served, "generation sent again"))
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not alive(pid), "the scheduler dead")  # serve restarts it a second later
    assert completion_text(client, STORY_STARTS[0]) == undisturbed  # sent while it was down
    assert len(log_lines(served, "generation sent again")) > resent_before
    resent = re.search(
        r"^npuserve:gateway_generations_resent_total (\S+)$", served_metrics(served), re.MULTILINE
    )
    assert resent is not None and float(resent.group(1)) >= 1
    wait_for(ready_child(served, "scheduler", not_pid=pid), "the scheduler restarted")
    with httpx.Client(base_url=served.url, timeout=10) as http:
        health = wait_for(
            lambda: (r := http.get("/health")).status_code == 200 and r.json(), "the gateway serving"
        )
    assert health["status"] == "ok" and health["total_executors"] == 2
    assert completion_text(client, STORY_STARTS[0]) == undisturbed  # executors rejoined afresh
    assert_idle_and_intact(served)


def test_sigterm_drains_streams_refuses_new_requests_and_every_process_exits(draining: Served) -> None:
    served = draining
    assert served.process is not None
    pids = [served.process.pid, *child_pids(served.process.pid)]
    deaths = len(log_lines(served, "process died"))
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=120)
    started = threading.Barrier(DRAIN_STREAMS + 1)
    finished = [False] * DRAIN_STREAMS
    results: list[tuple[int, str | None]] = [(0, None)] * DRAIN_STREAMS

    def stream(index: int) -> None:
        chunks = client.completions.create(
            model="stories260K",
            prompt=STORY_STARTS[index % len(STORY_STARTS)],
            max_tokens=DRAIN_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        reason, tokens = None, 0
        for i, chunk in enumerate(chunks):
            if i == 0:
                started.wait(60)
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        results[index] = (tokens, reason)
        finished[index] = True

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(DRAIN_STREAMS)]
    for thread in threads:
        thread.start()
    started.wait(60)
    os.kill(served.process.pid, signal.SIGTERM)
    with httpx.Client(base_url=served.url, timeout=10) as http:
        wait_for(lambda: http.get("/health").status_code == 503, "readiness fails")
        refused = http.post(
            "/v1/completions", json={"model": "stories260K", "prompt": "Once", "max_tokens": 4}
        )
        still_streaming = finished.count(False)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
    assert refused.json()["error"]["code"] == "service_unavailable"
    assert still_streaming > 0, "every stream ended before the new request: nothing was drained"
    for thread in threads:
        thread.join(120)
    assert results == [(DRAIN_TOKENS, "length")] * DRAIN_STREAMS

    assert served.process.wait(SHUTDOWN_TIMEOUT_S) == 0
    assert not [pid for pid in pids if alive(pid)]
    assert log_lines(served, "scheduler drained; block pools intact and idle")
    assert len(log_lines(served, "process died")) == deaths, "a process died during the drain"
