"""Runs `npuserve serve` (or its parts) as real processes for end-to-end tests."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import grpc
from prometheus_client.parser import text_string_to_metric_families

from npuserve.deploy.launcher import Child, Launcher, LaunchError
from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc
from npuserve.proto.auth import with_bearer
from npuserve.proto.generate_many import GenerateManyClient

if TYPE_CHECKING:
    from harness.cluster import Proc, Processes


def child_pids(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def open_completion_stream(
    url: str, body: dict, receive_buffer_bytes: int, timeout_s: float
) -> socket.socket:
    """A raw-socket client that has sent a streaming completion to the gateway at ``url``, with a
    receive buffer of ``receive_buffer_bytes`` (small: the gateway's writes soon wait on it)."""
    where = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer_bytes)
    sock.settimeout(timeout_s)
    sock.connect((where.hostname, where.port))
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def rss_mb(pid: int) -> float:
    """The resident memory of process ``pid``, in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def serve_child(serve_pid: int, name: str) -> tuple[int, Path] | None:
    """The pid of `npuserve serve`'s living child ``name`` (executor-0, scheduler, gateway) and
    its ready file, found by the ready file the launcher named after it; None while it is down."""
    for pid in child_pids(serve_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        ready = next((a for a in argv if a.endswith(f"/{name}.ready.json")), None)
        if ready is not None and alive(pid):
            return pid, Path(ready)
    return None


@dataclass
class Served:
    address: str  # the scheduler's gRPC address
    process: subprocess.Popen[bytes] | None
    url: str = ""  # the OpenAI-compatible gateway, e.g. http://127.0.0.1:PORT
    log_path: Path | None = None  # every process's output
    api_key: str | None = None  # `serve --api-key`: the scheduler's gRPC API requires it too

    @property
    def log(self) -> list[str]:
        if self.log_path is None or not self.log_path.exists():
            return []
        return self.log_path.read_text(errors="replace").splitlines(keepends=True)

    def stub(self) -> pb_grpc.SchedulerStub:
        """A stub of the scheduler's API that presents the API key, if there is one."""
        return pb_grpc.SchedulerStub(with_bearer(grpc.insecure_channel(self.address), self.api_key))

    def integrity(self, expect_idle: bool = True, timeout_s: float = 5.0) -> pb.CheckIntegrityResponse:
        """The pools' integrity check, retried until it passes or ``timeout_s`` runs out
        (a finished request's blocks come back on the scheduling thread, a moment later)."""
        stub = self.stub()
        deadline = time.monotonic() + timeout_s
        while True:
            response = stub.CheckIntegrity(pb.CheckIntegrityRequest(expect_idle=expect_idle), timeout=10)
            if response.ok or time.monotonic() > deadline:
                return response
            time.sleep(0.05)

    def metric(self, name: str) -> float:
        """Sum of a metric's samples in the scheduler's Prometheus text."""
        return metric_total(self.stub().GetMetrics(pb.GetMetricsRequest(), timeout=10).text, name)


@contextmanager
def serve_checked(model: Path | str | None, *flags: str) -> Iterator[Served]:
    """`serve`, then the block pools' integrity check (idle, every block back) once the caller is
    done with it."""
    with serve(model, *flags) as served:
        yield served
        check = served.integrity(expect_idle=True)
        assert check.ok, check.message


def openai_client(served: Served) -> Any:
    """The official client on the gateway of `served`, presenting its API key."""
    import openai

    key = served.api_key or "none"
    return openai.OpenAI(base_url=served.url + "/v1", api_key=key, max_retries=0, timeout=60)


def streamed_chat_with_logprobs(
    client: Any, model: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[list[Any], str, list[Any]]:
    """A greedy chat streamed through the official `openai` ``client`` with 2 top logprobs and
    the usage: (its chunks, its text, its logprob entries in order)."""
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            temperature=0,
            max_tokens=max_tokens,
            logprobs=True,
            top_logprobs=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    entries = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    return chunks, text, entries


def labelled_metric(stub: pb_grpc.SchedulerStub, name: str, label: str = "executor") -> dict[str, float]:
    """One series of the scheduler's metrics (``name`` as exported, e.g. with ``_total``), by the
    value of its label ``label``."""
    text = stub.GetMetrics(pb.GetMetricsRequest(), timeout=10).text
    return {
        sample.labels[label]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


@contextmanager
def serve(model: Path | str | None, *flags: str, timeout_s: float = 120.0) -> Iterator[Served]:
    """`npuserve serve --model MODEL FLAGS` on free ports (no `--model` when MODEL is None: the
    bundled demo model); on exit, SIGTERM and no orphan left."""
    model_flags = [] if model is None else ["--model", str(model)]
    launcher = Launcher(Path(tempfile.mkdtemp(prefix="npuserve-test-")))
    log_path = launcher.workdir / "serve.log"  # type: ignore[operator]
    child = launcher.start("serve", ["serve", *model_flags, "--port", "0", *flags], log_path=log_path)
    served = Served("", child.process, log_path=log_path, api_key=flag_value(flags, "--api-key"))
    try:
        try:
            (ready,) = launcher.wait_ready([child], timeout_s)
        except LaunchError as exc:
            raise RuntimeError(f"npuserve serve did not become ready: {exc}") from None
        served.address, served.url = ready["address"], ready["url"]
        yield served
    finally:
        children = child_pids(child.pid)
        code = child.stop(grace_s=30)
        assert code == 0, f"npuserve serve exited with {code}:\n" + "".join(served.log[-40:])
        deadline = time.monotonic() + 5
        while any(alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        orphans = [pid for pid in children if alive(pid)]
        for pid in orphans:
            os.kill(pid, signal.SIGKILL)
        assert not orphans, f"processes left behind: {orphans}"


def flag_value(flags: Sequence[str], name: str) -> str | None:
    """The value given to flag ``name`` in ``flags`` (``--name V`` or ``--name=V``), if any."""
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            return flags[i + 1]
        if flag.startswith(name + "="):
            return flag.split("=", 1)[1]
    return None


def greedy_request(prompt_ids: Sequence[int], max_tokens: int, **sampling: object) -> pb.GenerateRequest:
    params = pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **sampling)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(prompt_ids)), sampling=params)


def collect(
    stub: pb_grpc.SchedulerStub, request: pb.GenerateRequest
) -> tuple[list[int], str, pb.GenerateResponse]:
    """Streams one request to the end: (token ids, text, last response)."""
    token_ids: list[int] = []
    text = ""
    last = None
    for response in stub.Generate(request, timeout=120):
        for completion in response.completions:
            token_ids += completion.token_ids
            text += completion.text
        last = response
    assert last is not None
    return token_ids, text, last


def generate_concurrently(
    stub: pb_grpc.SchedulerStub, requests: Sequence[pb.GenerateRequest]
) -> list[tuple[list[int], str, pb.GenerateResponse]]:
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        return list(pool.map(lambda r: collect(stub, r), requests))


@contextmanager
def npuserve_process(command: str, *args: str, timeout_s: float = 120.0) -> Iterator[tuple[Child, dict]]:
    """One `npuserve COMMAND ARGS --ready-file ...` process; yields it with its ready-file JSON."""
    launcher = Launcher(Path(tempfile.mkdtemp(prefix="npuserve-test-")))
    log_path = launcher.workdir / f"{command}.log"  # type: ignore[operator]
    child = launcher.start(command, [command, *args], log_path=log_path)
    try:
        try:
            (ready,) = launcher.wait_ready([child], timeout_s)
        except LaunchError as exc:
            raise RuntimeError(f"npuserve {command} did not start: {exc}") from None
        yield child, ready
    finally:
        child.stop(grace_s=15)


def run_streams(
    stub: pb_grpc.SchedulerStub, requests: list[pb.GenerateRequest], started: threading.Barrier | None
) -> tuple[list[threading.Thread], list[list[int]], list[str]]:
    """One thread per request; with ``started``, each waits there once it has streamed 4 tokens."""
    outputs: list[list[int]] = [[] for _ in requests]
    reasons = ["" for _ in requests]

    def stream(index: int) -> None:
        waited = started is None
        for response in stub.Generate(requests[index], timeout=120):
            for completion in response.completions:
                outputs[index] += completion.token_ids
                reasons[index] = completion.finish_reason or reasons[index]
                if not waited and len(outputs[index]) >= 4:
                    waited = True
                    started.wait(60)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    if started is not None:
        started.wait(60)
    return threads, outputs, reasons


def complete_streams(
    stub: pb_grpc.SchedulerStub,
    requests: list[pb.GenerateRequest],
    disturb: Callable[[], object] | None = None,
) -> tuple[list[list[int]], list[str]]:
    """Streams every request to its end, concurrently: (token ids, finish reason) of each.
    ``disturb`` runs once every stream has its first 4 tokens."""
    started = None if disturb is None else threading.Barrier(len(requests) + 1)
    threads, outputs, reasons = run_streams(stub, requests, started)
    if disturb is not None:
        disturb()
    for thread in threads:
        thread.join(120)
    return outputs, reasons


def complete_many(
    address: str, requests: list[pb.GenerateRequest], disturb: Callable[[], object] | None = None
) -> tuple[list[list[int]], list[str]]:
    """`complete_streams` over one `GenerateMany` call: every request to its end, concurrently;
    ``disturb`` runs (on a thread) once every generation has its first 4 tokens."""

    async def run() -> tuple[list[list[int]], list[str]]:
        channel = grpc.aio.insecure_channel(address)
        client = GenerateManyClient(pb_grpc.SchedulerStub(channel))
        outputs: list[list[int]] = [[] for _ in requests]
        reasons = ["" for _ in requests]
        started: list[int] = []
        all_started = asyncio.Event()

        async def stream(index: int) -> None:
            async for response in client.generate(requests[index]):
                for completion in response.completions:
                    outputs[index] += completion.token_ids
                    reasons[index] = completion.finish_reason or reasons[index]
                if len(outputs[index]) >= 4 and index not in started:
                    started.append(index)
                    if len(started) == len(requests):
                        all_started.set()

        try:
            streams = [asyncio.create_task(stream(i)) for i in range(len(requests))]
            if disturb is not None:
                await asyncio.wait_for(all_started.wait(), 60)
                await asyncio.to_thread(disturb)
            await asyncio.wait_for(asyncio.gather(*streams), 120)
        finally:
            await client.close()
            await channel.close()
        return outputs, reasons

    return asyncio.run(run())


def complete_over(
    client_call: str,
    address: str,
    requests: list[pb.GenerateRequest],
    disturb: Callable[[], object] | None = None,
) -> tuple[list[list[int]], list[str]]:
    """Every request to its end as ``client_call`` sends it: a `Generate` call each
    (`complete_streams`) or over one `GenerateMany` call (`complete_many`, as the gateway)."""
    if client_call == "generate-many":
        return complete_many(address, requests, disturb)
    with grpc.insecure_channel(address) as channel:
        return complete_streams(pb_grpc.SchedulerStub(channel), requests, disturb)


def start_executors(
    procs: Processes,
    model: Path,
    names: Sequence[str],
    roles: dict[str, str] | None = None,
    flags: dict[str, Sequence[str]] | None = None,
) -> str:
    """Small-cache executors of ``model``, one per name (of its role in ``roles``, else mixed,
    with its ``flags`` added); their addresses, comma-separated."""
    roles, flags = roles or {}, flags or {}
    executors = [
        procs.start(name, "executor", "--model", str(model), "--port", "0",
                    "--kv-cache-memory", "0.02", "--executor-id", name,
                    *(("--role", roles[name]) if name in roles else ()), *flags.get(name, ()))
        for name in names
    ]  # fmt: skip
    return ",".join(e.wait_ready()["address"] for e in executors)


def greedy_workload(
    model: Path, seed: int, num_streams: int, num_new: int
) -> tuple[list[list[int]], list[pb.GenerateRequest], list[list[int]]]:
    """Random prompts of 5-40 tokens: (prompts, greedy requests, transformers' tokens for each)."""
    import torch

    from harness.pools import random_ids
    from harness.reference import transformers_greedy

    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 40, (num_streams,), generator=generator)
    prompts = [[1, *random_ids(int(n), generator)] for n in lengths]
    return (
        prompts,
        [greedy_request(p, num_new) for p in prompts],
        transformers_greedy(model, prompts, num_new),
    )


def metric_total(text: str, name: str) -> float:
    """Sum of a metric's samples in Prometheus text (``name`` as exported, e.g. with ``_total``)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def start_scheduler(procs: Processes, model: Path, addresses: str, *flags: str) -> Proc:
    """A scheduler of ``model`` over the executors at ``addresses`` on a free port, logging JSON
    (its events are read back), with ``flags``."""
    return procs.start("scheduler", "scheduler", "--model", str(model), "--executors", addresses,
                       "--port", "0", "--log-format", "json", *flags)  # fmt: skip


def started_pids(scheduler: Proc, event: str, index_key: str) -> dict[int, int]:
    """Index -> pid of the latest start of each of the scheduler's child processes that it logs
    as ``event`` (with their index under ``index_key``)."""
    return {e[index_key]: e["pid"] for e in scheduler.events() if e["event"] == event}


def worker_pids(scheduler: Proc) -> dict[int, int]:
    return started_pids(scheduler, "scheduler worker started", "worker")


def api_pids(scheduler: Proc) -> dict[int, int]:
    return started_pids(scheduler, "api server process started", "index")


def metric_by_role(text: str, name: str, **labels: str) -> dict[str, float]:
    """A per-executor series of the scheduler's metrics ``text`` (the samples of ``name`` with
    ``labels``), by the executor's role (`npuserve:executor_info`)."""
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    role_of = {s.labels["executor"]: s.labels["role"] for s in samples if s.name == "npuserve:executor_info"}
    return {
        role_of[s.labels["executor"]]: s.value
        for s in samples
        if s.name == name and labels.items() <= s.labels.items()
    }
