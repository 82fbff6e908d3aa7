"""How far one scheduler scales: simulated executors, a real scheduler process, thousands of streams.

For each executor count (16, 32, 64 by default) it starts that many simulated executors in one
process (`python -m npuserve.executor.simulated --count N`) and a real `npuserve scheduler` over
them, then for each concurrency (256, 1024, 4096) keeps that many `Generate` streams running from
a `grpc.aio` client in this process (closed loop: a finished request is replaced at once; random
token-id prompts of 128-512 tokens, 64-128 output tokens, ``ignore_eos``). After a warm-up it
measures one window and reports:

* requests/s (completed in the window, and sustained: output tokens/s over the mean output
  length) and output tokens/s, as the client saw them;
* scheduler steps/s (the `npuserve:step_seconds` histogram's count) against the ideal, the steps/s
  the simulated executors would run if they never waited for the scheduler (N over the mean
  modelled step time), and the executors' busy share (modelled step time over N x window);
* the scheduler process's CPU time per step (utime + stime from /proc/PID/stat over the window);
* TTFT p50/p99 of the first tokens that arrived in the window, next to the engine's own mean TTFT
  (from queueing the request, `vllm:time_to_first_token_seconds`): the gap is the public gRPC
  path; and how many requests the engine holds against how many streams are open;
* the CPU cores the scheduler, the simulated executors, this client and everything else on the
  machine used (they all share it: on a small machine that bounds every number here).

`--profile` samples the scheduler with py-spy (``--gil``: whoever holds the GIL) during one
configuration and names the top costs. It prints a table and where throughput saturates, and
writes `--output-json` and a `--plot`.

    python -m npuserve.deploy.scale_bench --output-json scale.json --plot scale.png --profile
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from npuserve.deploy.demo_model import DEMO_MODEL_DIR
from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc
from npuserve.scheduler.bench_report import percentile

FIRST_TOKEN_ID = 3  # prompts avoid the unk/bos/eos ids
START_TIMEOUT_S = 180.0
DRAIN_TIMEOUT_S = 60.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# Streams per client channel: one HTTP/2 connection carrying thousands of streams queues them.
STREAMS_PER_CHANNEL = 256
SATURATED_GAIN = 1.10  # a step up that raises tokens/s by less than this is saturated
TTFT_EXPLODED = 10.0  # TTFT p99 this many times its value at the lowest load has exploded


@dataclass(slots=True)
class ScaleConfig:
    executors: tuple[int, ...] = (16, 32, 64)
    concurrency: tuple[int, ...] = (256, 1024, 4096)
    warmup_s: float = 8.0
    duration_s: float = 15.0
    prompt_len: tuple[int, int] = (128, 512)
    output_len: tuple[int, int] = (64, 128)
    base_ms: float = 5.0
    per_token_ms: float = 0.02
    per_seq_ms: float = 0.01
    block_size: int = 128
    num_blocks: int = 0  # per executor; 0: 4x what an even share of the largest concurrency needs
    max_num_seqs: int = 512
    model: Path = DEMO_MODEL_DIR
    step_transport: str = "unary"
    routing: str = "prefix-aware"
    scheduler_log_level: str = "warning"
    seed: int = 0
    profile: bool = False
    profile_at: tuple[int, int] | None = None  # (executors, concurrency); None: the largest
    profile_s: float = 10.0
    profile_native: bool = False  # py-spy --native: C frames too (gRPC's Cython, protobuf's upb)
    switch_interval_ms: float | None = None  # the scheduler's sys.setswitchinterval; None: Python's 5 ms
    workdir: Path | None = None

    def __post_init__(self) -> None:
        if not self.executors or min(self.executors) < 1:
            raise ValueError(f"--executors must be positive counts, got {self.executors}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"--concurrency must be positive counts, got {self.concurrency}")
        if not 1 <= self.prompt_len[0] <= self.prompt_len[1]:
            raise ValueError(f"bad --prompt-len range {self.prompt_len}")
        if not 1 <= self.output_len[0] <= self.output_len[1]:
            raise ValueError(f"bad --output-len range {self.output_len}")
        if self.duration_s <= 0 or self.warmup_s < 0:
            raise ValueError("--duration must be > 0 and --warmup >= 0")
        if self.max_num_seqs < -(-max(self.concurrency) // min(self.executors)):
            raise ValueError(
                f"{max(self.concurrency)} streams over {min(self.executors)} executors exceed "
                f"--max-num-seqs {self.max_num_seqs} per executor; raise it"
            )

    @property
    def blocks_per_executor(self) -> int:
        if self.num_blocks:
            return self.num_blocks
        # NOTE: 4x an even share, so a lane that routing overloads queues on max_num_seqs and
        # its step time rather than on blocks (a real NPU holds tens of thousands of blocks).
        per_request = -(-(self.prompt_len[1] + self.output_len[1]) // self.block_size)
        per_executor = -(-max(self.concurrency) // min(self.executors))
        return max(1024, 4 * per_executor * per_request) + 1


@dataclass(slots=True)
class Snapshot:
    """Counters at one moment: CPU seconds, the scheduler's metrics, the executors' totals."""

    time: float
    scheduler_cpu_s: float
    executors_cpu_s: float
    client_cpu_s: float
    machine_busy_s: float  # every CPU of the machine, every process (from /proc/stat)
    metrics: dict[str, float]  # the scheduler's, summed over labels
    sim_time: float
    sim: dict[str, float]  # the simulated executors' totals, summed over executors

    def delta(self, earlier: Snapshot, metric: str) -> float:
        return self.metrics.get(metric, 0.0) - earlier.metrics.get(metric, 0.0)

    def mean_ms(self, earlier: Snapshot, histogram: str) -> float | None:
        """The mean of a histogram's observations between two snapshots, in ms."""
        count = self.delta(earlier, f"{histogram}_count")
        return 1e3 * self.delta(earlier, f"{histogram}_sum") / count if count else None


@dataclass(slots=True)
class Result:
    executors: int
    concurrency: int
    window_s: float
    requests_per_s: float  # completed in the window
    sustained_requests_per_s: float  # output tokens/s over the mean output length
    output_tokens_per_s: float
    steps_per_s: float
    ideal_steps_per_s: float
    executor_busy: float  # modelled step time / (executors x window)
    ideal_output_tokens_per_s: float  # executors never waiting, at the observed batch sizes
    scheduler_cpu_ms_per_step: float
    scheduler_cpu_us_per_token: float
    scheduler_cores: float
    executors_cores: float
    client_cores: float
    mean_step_wall_ms: float  # the scheduler's view: plan sent to result back
    mean_modelled_step_ms: float
    seqs_per_step: float
    tokens_per_step: float
    executor_overruns: float  # share of steps whose bookkeeping outran the latency model
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    # Inside the engine (request queued -> first token / last token) against the client's view:
    # the difference is the public gRPC path (accepting the call, streaming the tokens out).
    engine_ttft_mean_ms: float | None
    client_ttft_mean_ms: float | None
    engine_e2e_mean_ms: float | None
    client_e2e_mean_ms: float | None
    engine_requests: float  # running + waiting in the engine at the window's end (streams open: concurrency)
    awaiting_first_token: int  # streams open at the window's end without a token yet
    other_cores: float  # CPU the rest of the machine used meanwhile (other processes)
    num_first_tokens: int
    num_completed: int
    num_errors: int
    errors: dict[str, int]  # by status code
    preemptions: float
    profile: dict[str, Any] | None = None


# -- processes --------------------------------------------------------------------------------


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, every thread included (from /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


@contextlib.contextmanager
def started(name: str, command: list[str], ready_file: Path, log_file: Path) -> Iterator[tuple[int, dict]]:
    """A child process that writes ``ready_file`` when it serves; SIGTERM (then SIGKILL) on exit."""
    ready_file.unlink(missing_ok=True)  # from an earlier run in the same workdir
    with log_file.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                tail = log_file.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} did not start (exit {process.poll()}):\n{tail}")
            time.sleep(0.05)
        yield process.pid, json.loads(ready_file.read_text())
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def simulated_command(config: ScaleConfig, count: int, ready_file: Path, stats_file: Path) -> list[str]:
    return [
        sys.executable, "-m", "npuserve.executor.simulated", "--port", "0", "--count", str(count),
        "--ready-file", str(ready_file), "--stats-file", str(stats_file), "--stats-interval", "0.25",
        "--base-ms", str(config.base_ms), "--per-token-ms", str(config.per_token_ms),
        "--per-seq-ms", str(config.per_seq_ms), "--block-size", str(config.block_size),
        "--num-blocks", str(config.blocks_per_executor), "--max-num-seqs", str(config.max_num_seqs),
        "--max-model-len", str(config.prompt_len[1] + config.output_len[1]), "--log-level", "warning",
    ]  # fmt: skip


def scheduler_command(config: ScaleConfig, addresses: Sequence[str], ready_file: Path) -> list[str]:
    python = [sys.executable, "-m", "npuserve.deploy.cli"]
    if config.switch_interval_ms is not None:
        # NOTE: an experiment, not a setting of the scheduler: how long a lane thread back from
        # its executor waits for the GIL while the event loop holds it.
        python = [sys.executable, "-c", f"import sys; sys.setswitchinterval({config.switch_interval_ms / 1e3}); "
                  "sys.argv[0] = 'npuserve'; from npuserve.deploy.cli import main; main()"]  # fmt: skip
    return [
        *python, "scheduler", "--model", str(config.model),
        "--executors", ",".join(addresses), "--port", "0", "--ready-file", str(ready_file),
        "--step-transport", config.step_transport, "--routing", config.routing,
        "--log-level", config.scheduler_log_level,
    ]  # fmt: skip


# -- the load -----------------------------------------------------------------------------------


def metric_values(text: str) -> dict[str, float]:
    """Prometheus text to {name: value}, summed over labels."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = re.split(r"[{ ]", line, maxsplit=1)[0]
        values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


@dataclass
class LoadState:
    """What the streams record; times are `time.perf_counter()`."""

    window: tuple[float, float] = (math.inf, math.inf)
    stopping: bool = False
    tokens_in_window: int = 0
    awaiting_first_token: int = 0  # streams sent that have no token yet
    awaiting_at_window_end: int = 0
    first_tokens: list[tuple[float, float]] = field(default_factory=list)  # (arrival, ttft)
    completions: list[tuple[float, float]] = field(default_factory=list)  # (end, e2e)
    errors: Counter[str] = field(default_factory=Counter)

    def in_window(self, t: float) -> bool:
        return self.window[0] <= t < self.window[1]


class Load:
    """Keeps ``concurrency`` Generate streams running against one scheduler."""

    def __init__(self, config: ScaleConfig, address: str, vocab_size: int, concurrency: int) -> None:
        self.config = config
        self.address = address
        self.vocab_size = vocab_size
        self.concurrency = concurrency
        self.state = LoadState()
        self._rng = random.Random(f"scale-bench-{config.seed}-{concurrency}")
        options = [("grpc.max_receive_message_length", 64 << 20)]
        num_channels = max(1, -(-concurrency // STREAMS_PER_CHANNEL))
        # NOTE: a distinct channel argument per channel keeps gRPC from sharing one connection.
        self.channels = [
            grpc.aio.insecure_channel(address, options=[*options, ("npuserve.bench.channel", i)])
            for i in range(num_channels)
        ]
        self.stubs = [pb_grpc.SchedulerStub(channel) for channel in self.channels]

    def _request(self) -> pb.GenerateRequest:
        rng, c = self._rng, self.config
        prompt = rng.choices(range(FIRST_TOKEN_ID, self.vocab_size), k=rng.randint(*c.prompt_len))
        sampling = pb.SamplingParams(max_tokens=rng.randint(*c.output_len), temperature=0, ignore_eos=True)
        return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)

    async def _stream(self, index: int, delay_s: float) -> None:
        state, stub = self.state, self.stubs[index % len(self.stubs)]
        await asyncio.sleep(delay_s)
        while not state.stopping:
            request = self._request()
            sent = time.perf_counter()
            first = True
            state.awaiting_first_token += 1
            try:
                async for response in stub.Generate(request):
                    now = time.perf_counter()
                    num_new = sum(len(c.token_ids) for c in response.completions)
                    if num_new and first:
                        first = False
                        state.awaiting_first_token -= 1
                        state.first_tokens.append((now, now - sent))
                    if state.in_window(now):
                        state.tokens_in_window += num_new
                end = time.perf_counter()
                state.completions.append((end, end - sent))
            except grpc.aio.AioRpcError as exc:
                if state.stopping:
                    return
                state.awaiting_first_token -= first
                state.errors[exc.code().name] += 1
                await asyncio.sleep(0.1)

    def start(self, ramp_s: float) -> list[asyncio.Task[None]]:
        """Starts every stream, spread over ``ramp_s`` so they do not arrive in one burst."""
        return [
            asyncio.create_task(self._stream(i, ramp_s * i / self.concurrency))
            for i in range(self.concurrency)
        ]

    async def close(self, tasks: list[asyncio.Task[None]]) -> None:
        self.state.stopping = True
        for task in tasks:
            task.cancel()  # cancels the RPC: the scheduler aborts the request
        await asyncio.gather(*tasks, return_exceptions=True)
        for channel in self.channels:
            await channel.close()


def machine_busy_seconds() -> float:
    """CPU seconds every CPU of the machine spent busy since boot (/proc/stat: all but idle, iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / CLOCK_TICKS


async def take_snapshot(
    stub: pb_grpc.SchedulerStub, scheduler_pid: int, executors_pid: int, stats_file: Path
) -> Snapshot:
    for attempt in range(3):  # NOTE: a saturated server may cancel calls it has not accepted
        try:
            text = (await stub.GetMetrics(pb.GetMetricsRequest(), timeout=30)).text
            break
        except grpc.aio.AioRpcError:
            if attempt == 2:
                raise
    stats = json.loads(stats_file.read_text())
    sim: dict[str, float] = {}
    for executor in stats["executors"]:
        for key, value in executor.items():
            if key != "executor_id":
                sim[key] = sim.get(key, 0.0) + value
    return Snapshot(
        time=time.perf_counter(),
        scheduler_cpu_s=proc_cpu_seconds(scheduler_pid),
        executors_cpu_s=proc_cpu_seconds(executors_pid),
        client_cpu_s=time.process_time(),
        machine_busy_s=machine_busy_seconds(),
        metrics=metric_values(text),
        sim_time=stats["time"],
        sim=sim,
    )


async def wait_idle(stub: pb_grpc.SchedulerStub, timeout_s: float) -> None:
    """Until every block pool is idle and consistent (the aborted streams have drained)."""
    deadline = time.monotonic() + timeout_s
    while True:
        check = await stub.CheckIntegrity(pb.CheckIntegrityRequest(expect_idle=True), timeout=30)
        if check.ok:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the scheduler did not drain: {check.message}")
        await asyncio.sleep(0.2)


async def run_load(
    config: ScaleConfig,
    address: str,
    executors: int,
    concurrency: int,
    pids: tuple[int, int],
    stats_file: Path,
    vocab_size: int,
    profile_path: Path | None,
) -> Result:
    """One configuration: warm up, measure one window, stop every stream, wait for the drain."""
    control = grpc.aio.insecure_channel(address)
    stub = pb_grpc.SchedulerStub(control)
    load = Load(config, address, vocab_size, concurrency)
    tasks = load.start(ramp_s=min(2.0, config.warmup_s / 2))
    profile = None
    try:
        await asyncio.sleep(config.warmup_s)
        before = await take_snapshot(stub, *pids, stats_file)
        load.state.window = (before.time, before.time + config.duration_s)
        await asyncio.sleep(max(0.0, load.state.window[1] - time.perf_counter()))
        await asyncio.sleep(0.3)  # the executors' stats file is rewritten every 0.25 s
        after = await take_snapshot(stub, *pids, stats_file)
        load.state.awaiting_at_window_end = load.state.awaiting_first_token
        if profile_path is not None:
            # NOTE: after the window, under the same load: sampling slows the scheduler down.
            profile = await profile_scheduler(pids[0], config, profile_path)
    finally:
        await load.close(tasks)
    await wait_idle(stub, DRAIN_TIMEOUT_S)
    await control.close()
    result = summarize(config, executors, concurrency, before, after, load.state)
    result.profile = profile
    return result


def summarize(
    config: ScaleConfig, executors: int, concurrency: int, before: Snapshot, after: Snapshot, state: LoadState
) -> Result:
    window = state.window[1] - state.window[0]
    elapsed = after.time - before.time  # a little longer: the last snapshot waits for the stats
    steps = after.delta(before, "npuserve:step_seconds_count")
    sim = {key: after.sim[key] - before.sim.get(key, 0.0) for key in after.sim}
    sim_window = after.sim_time - before.sim_time
    sim_steps = max(sim["num_steps"], 1.0)
    modelled = sim["modeled_s"] / sim_steps
    sampled_per_step = sim["num_sampled"] / sim_steps
    ttfts = [ttft for arrival, ttft in state.first_tokens if state.in_window(arrival)]
    e2es = [e2e for end, e2e in state.completions if state.in_window(end)]
    cores = {
        name: (getattr(after, f"{name}_cpu_s") - getattr(before, f"{name}_cpu_s")) / elapsed
        for name in ("scheduler", "executors", "client")
    }
    machine = (after.machine_busy_s - before.machine_busy_s) / elapsed
    generated = after.delta(before, "vllm:generation_tokens_total")
    scheduler_cpu = cores["scheduler"] * elapsed
    tokens_per_s = state.tokens_in_window / window
    return Result(
        executors=executors,
        concurrency=concurrency,
        window_s=window,
        requests_per_s=len(e2es) / window,
        sustained_requests_per_s=tokens_per_s / (sum(config.output_len) / 2),
        output_tokens_per_s=tokens_per_s,
        steps_per_s=steps / elapsed,
        ideal_steps_per_s=executors / modelled if modelled else 0.0,
        executor_busy=sim["modeled_s"] / (executors * sim_window) if sim_window else 0.0,
        ideal_output_tokens_per_s=executors * sampled_per_step / modelled if modelled else 0.0,
        scheduler_cpu_ms_per_step=1e3 * scheduler_cpu / steps if steps else math.nan,
        scheduler_cpu_us_per_token=1e6 * scheduler_cpu / generated if generated else math.nan,
        scheduler_cores=cores["scheduler"],
        executors_cores=cores["executors"],
        client_cores=cores["client"],
        mean_step_wall_ms=after.mean_ms(before, "npuserve:step_seconds") or 0.0,
        mean_modelled_step_ms=1e3 * modelled,
        seqs_per_step=sim["num_seqs"] / sim_steps,
        tokens_per_step=sim["num_tokens"] / sim_steps,
        executor_overruns=sim["num_overruns"] / sim_steps,
        ttft_p50_ms=1e3 * percentile(ttfts, 50) if ttfts else None,
        ttft_p99_ms=1e3 * percentile(ttfts, 99) if ttfts else None,
        engine_ttft_mean_ms=after.mean_ms(before, "vllm:time_to_first_token_seconds"),
        client_ttft_mean_ms=1e3 * sum(ttfts) / len(ttfts) if ttfts else None,
        engine_e2e_mean_ms=after.mean_ms(before, "vllm:e2e_request_latency_seconds"),
        client_e2e_mean_ms=1e3 * sum(e2es) / len(e2es) if e2es else None,
        engine_requests=after.metrics.get("vllm:num_requests_running", 0.0)
        + after.metrics.get("vllm:num_requests_waiting", 0.0),
        awaiting_first_token=state.awaiting_at_window_end,
        other_cores=max(0.0, machine - sum(cores.values())),
        num_first_tokens=len(ttfts),
        num_completed=len(e2es),
        num_errors=sum(state.errors.values()),
        errors=dict(state.errors),
        preemptions=after.delta(before, "vllm:num_preemptions_total"),
    )


# -- profiling ----------------------------------------------------------------------------------

# Where a sample's time goes: the innermost frame whose file matches names the cost.
PROFILE_CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("metrics: per-step gauges over all lanes, histograms",
     ("Engine._record_step", "Engine._record_finish", "prometheus_client/", "scheduler/metrics.py")),
    ("detokenize (tokenizers)", ("detokenizer.py", "scheduler/tokenizer.py", "tokenizers/")),
    ("scheduling loop (scheduler, KV blocks, requests)",
     ("scheduler/scheduler.py", "kv_cache_manager.py", "block_pool.py", "block_hash.py", "scheduler/request.py")),
    ("routing (choose_lane)", ("scheduler/router.py",)),
    ("step plan/result <-> protobuf", ("step_codec.py", "executor_pb2")),
    ("executor gRPC client (sync, lane threads)", ("scheduler/executor_client.py", "grpc/_channel.py", "grpc/_common.py",
                                                 "grpc/_interceptor.py")),
    ("Generate response encode", ("api_codec.py", "scheduler_pb2")),
    ("public gRPC server (grpc.aio Python parts)", ("grpc/aio/", "grpc/_cython", "cygrpc")),
    ("logging (structlog)", ("structlog/", "logging/")),
    ("request streams (outputs)", ("scheduler/outputs.py",)),
    ("engine: admission, dispatch, Generate handler", ("scheduler/engine.py", "scheduler/server.py")),
    ("lane thread (commands, events)", ("scheduler/lane.py",)),
    ("asyncio event loop", ("asyncio/",)),
    ("threads, queues, locks", ("threading.py", "queue.py", "concurrent/futures")),
]  # fmt: skip


async def profile_scheduler(pid: int, config: ScaleConfig, output: Path) -> dict[str, Any] | None:
    """py-spy on ``pid`` for ``profile_s``, sampling the thread that holds the GIL; summarised."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        print("scale_bench: py-spy is not installed (pip install py-spy); no profile", file=sys.stderr)
        return None
    seconds = str(max(1, round(config.profile_s)))
    command = [py_spy, "record", "--pid", str(pid), "--duration", seconds, "--rate", "250",
               "--format", "raw", "--gil", "--output", str(output)]  # fmt: skip
    # NOTE: --native must pause the process to unwind C stacks; without it sampling never pauses.
    command.append("--native" if config.profile_native else "--nonblocking")
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    _, stderr = await process.communicate()
    if not output.exists():
        print(f"scale_bench: py-spy failed: {stderr.decode(errors='replace')[-500:]}", file=sys.stderr)
        return None
    return summarize_profile(output.read_text())


def _frame_name(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (file.py)``."""
    match = re.match(r"(.*) \((.*?)(?::\d+)?\)$", frame)
    if match is None:
        return frame
    return f"{match.group(1)} ({match.group(2).rsplit('/', 2)[-2:][-1]})"


def _category(frames: list[str]) -> str:
    """The first category, in `PROFILE_CATEGORIES` order, that any frame of the stack falls in:
    specific costs come before the loops that call them (engine, lane, asyncio, threads)."""
    if frames[-1].startswith("Handle._run "):
        # NOTE: C and Cython code has no Python frame: grpc.aio's internals (Cython coroutines:
        # accepting calls, sending messages, completion-queue events) and asyncio's C Task steps.
        return "grpc.aio Cython internals + asyncio C tasks (no Python frame)"
    for name, patterns in PROFILE_CATEGORIES:
        if any(p in frame for frame in frames for p in patterns):
            return name
    return "other"


# Frames nearly every sample passes through: left out of the inclusive ranking.
_GENERIC_FRAMES = ("<frozen runpy>", "deploy/cli.py", "asyncio/runners.py", "asyncio/base_events.py",
                   "asyncio/events.py", "threading.py", "scheduler/lane.py")  # fmt: skip


def summarize_profile(raw: str, top: int = 15) -> dict[str, Any]:
    """Shares of GIL-holding samples by category and by function (self and inclusive)."""
    by_category: Counter[str] = Counter()
    by_self: Counter[str] = Counter()
    by_total: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [f for f in stack.split(";") if f]
        total += count
        by_category[_category(frames)] += count
        by_self[_frame_name(frames[-1])] += count
        for name in {_frame_name(f) for f in frames if not any(g in f for g in _GENERIC_FRAMES)}:
            by_total[name] += count
    if not total:
        return {"samples": 0}

    def shares(counter: Counter[str], n: int) -> list[tuple[str, float]]:
        return [(name, round(100 * count / total, 1)) for name, count in counter.most_common(n)]

    return {
        "samples": total,
        "categories": shares(by_category, len(by_category)),
        "self": shares(by_self, top),
        "inclusive": shares(by_total, top),
    }


# -- the sweep ----------------------------------------------------------------------------------


def run_sweep(config: ScaleConfig, progress: bool = True) -> list[Result]:
    workdir = config.workdir or Path(tempfile.mkdtemp(prefix="npuserve-scale-"))
    profile_at = config.profile_at or (max(config.executors), max(config.concurrency))
    results = []
    for num_executors in config.executors:
        run_dir = workdir / f"n{num_executors}"
        run_dir.mkdir(parents=True, exist_ok=True)
        stats_file = run_dir / "executor-stats.json"
        sim_command = simulated_command(config, num_executors, run_dir / "executors.json", stats_file)
        with started(
            "simulated executors", sim_command, run_dir / "executors.json", run_dir / "executors.log"
        ) as (
            sim_pid,
            sim_ready,
        ):
            command = scheduler_command(config, sim_ready["addresses"], run_dir / "scheduler.json")
            with started("scheduler", command, run_dir / "scheduler.json", run_dir / "scheduler.log") as (
                sched_pid,
                sched_ready,
            ):
                for concurrency in config.concurrency:
                    profile_path = None
                    if config.profile and (num_executors, concurrency) == profile_at:
                        profile_path = run_dir / f"profile-c{concurrency}.txt"
                    result = asyncio.run(
                        run_load(
                            config,
                            sched_ready["address"],
                            num_executors,
                            concurrency,
                            (sched_pid, sim_pid),
                            stats_file,
                            sim_ready["info"]["vocab_size"],
                            profile_path,
                        )
                    )
                    results.append(result)
                    if progress:
                        print(_progress_line(result), file=sys.stderr, flush=True)
    return results


def _progress_line(r: Result) -> str:
    return (
        f"[{r.executors} executors x {r.concurrency} streams] {r.output_tokens_per_s:,.0f} tok/s, "
        f"{r.steps_per_s:,.0f} steps/s, scheduler {r.scheduler_cpu_ms_per_step:.2f} ms CPU/step"
    )


# -- reporting ----------------------------------------------------------------------------------

COLUMNS: list[tuple[str, str, str]] = [
    ("exec", "executors", "d"),
    ("streams", "concurrency", "d"),
    ("req/s", "requests_per_s", ",.1f"),
    ("req/s sust.", "sustained_requests_per_s", ",.1f"),
    ("out tok/s", "output_tokens_per_s", ",.0f"),
    ("steps/s", "steps_per_s", ",.0f"),
    ("ideal steps/s", "ideal_steps_per_s", ",.0f"),
    ("exec busy", "executor_busy", ".1%"),
    ("sched ms CPU/step", "scheduler_cpu_ms_per_step", ".3f"),
    ("sched us CPU/tok", "scheduler_cpu_us_per_token", ".1f"),
    ("seqs/step", "seqs_per_step", ".1f"),
    ("step wall ms", "mean_step_wall_ms", ".1f"),
    ("TTFT p50 ms", "ttft_p50_ms", ",.0f"),
    ("TTFT p99 ms", "ttft_p99_ms", ",.0f"),
    ("engine TTFT ms", "engine_ttft_mean_ms", ",.0f"),
    ("in engine", "engine_requests", ",.0f"),
    ("no token yet", "awaiting_first_token", ",d"),
    ("cores sched/exec/client/other", "", ""),
    ("errors", "num_errors", "d"),
]


def _cells(r: Result) -> list[str]:
    cells = []
    for _, attr, fmt in COLUMNS:
        if not attr:
            cores = (r.scheduler_cores, r.executors_cores, r.client_cores, r.other_cores)
            cells.append("/".join(f"{c:.2f}" for c in cores))
            continue
        value = getattr(r, attr)
        cells.append(
            "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)
        )
    return cells


def format_table(results: Sequence[Result]) -> str:
    rows = [[title for title, _, _ in COLUMNS], *(_cells(r) for r in results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def saturation_notes(results: Sequence[Result]) -> list[str]:
    """Where adding executors or load stops raising throughput, or TTFT explodes."""
    notes = []
    by_n: dict[int, list[Result]] = {}
    by_c: dict[int, list[Result]] = {}
    for r in results:
        by_n.setdefault(r.executors, []).append(r)
        by_c.setdefault(r.concurrency, []).append(r)
    for n, runs in sorted(by_n.items()):
        runs.sort(key=lambda r: r.concurrency)
        for low, high in itertools.pairwise(runs):
            gain = high.output_tokens_per_s / max(low.output_tokens_per_s, 1e-9)
            if gain < SATURATED_GAIN:
                notes.append(
                    f"{n} executors: {low.concurrency} -> {high.concurrency} streams raises tokens/s only "
                    f"x{gain:.2f} ({low.output_tokens_per_s:,.0f} -> {high.output_tokens_per_s:,.0f})"
                )
        base = runs[0].ttft_p99_ms
        for r in runs[1:]:
            if base and r.ttft_p99_ms and r.ttft_p99_ms > TTFT_EXPLODED * base:
                notes.append(
                    f"{n} executors: TTFT p99 at {r.concurrency} streams is {r.ttft_p99_ms:,.0f} ms, "
                    f"x{r.ttft_p99_ms / base:.0f} its {base:,.0f} ms at {runs[0].concurrency}"
                )
    for c, runs in sorted(by_c.items()):
        runs.sort(key=lambda r: r.executors)
        for low, high in itertools.pairwise(runs):
            gain = high.output_tokens_per_s / max(low.output_tokens_per_s, 1e-9)
            if gain < SATURATED_GAIN:
                notes.append(
                    f"{c} streams: {low.executors} -> {high.executors} executors raises tokens/s only x{gain:.2f}"
                )
    fit = cost_model(results)
    if fit is not None:
        per_step_ms, per_seq_us = fit
        notes.append(
            f"scheduler CPU per step ~ {per_step_ms:.2f} ms + {per_seq_us:.0f} us x sequences in the step "
            f"(least squares over these runs): one core drives at most ~{1e3 / per_step_ms:,.0f} steps/s, "
            f"~{1e6 / per_seq_us:,.0f} tokens/s"
            if per_step_ms > 0 and per_seq_us > 0
            else f"scheduler CPU per step fit: {per_step_ms:.2f} ms + {per_seq_us:.0f} us x sequences"
        )
    peak = max(results, key=lambda r: r.output_tokens_per_s)
    notes.append(
        f"peak {peak.output_tokens_per_s:,.0f} tok/s at {peak.executors} executors x {peak.concurrency} streams: "
        f"scheduler at {peak.scheduler_cores:.2f} cores, {peak.scheduler_cpu_ms_per_step:.2f} ms CPU/step, "
        f"executors busy {peak.executor_busy:.0%} (ideal {peak.ideal_output_tokens_per_s:,.0f} tok/s)"
    )
    return notes


def cost_model(results: Sequence[Result]) -> tuple[float, float] | None:
    """(ms per step, us per sequence): the line through scheduler CPU per step against
    sequences per step, by least squares; None when the runs do not spread enough to fit."""
    points = [(r.seqs_per_step, r.scheduler_cpu_ms_per_step) for r in results]
    points = [(x, y) for x, y in points if not math.isnan(y)]
    if len(points) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    if max(x for x, _ in points) - min(x for x, _ in points) < 4:
        return None
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    return mean_y - slope * mean_x, 1e3 * slope


def format_profile(result: Result) -> str:
    profile = result.profile or {}
    if not profile.get("samples"):
        return "no profile samples"
    lines = [
        f"scheduler profile (py-spy --gil, {profile['samples']} samples) at {result.executors} executors x "
        f"{result.concurrency} streams",
        "  by cost:",
        *(f"    {share:5.1f}%  {name}" for name, share in profile["categories"]),
        "  top functions, self:",
        *(f"    {share:5.1f}%  {name}" for name, share in profile["self"]),
        "  top functions, inclusive:",
        *(f"    {share:5.1f}%  {name}" for name, share in profile["inclusive"]),
    ]
    return "\n".join(lines)


def plot(results: Sequence[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("output tokens/s", "output_tokens_per_s"),
        ("steps/s (dashed: ideal)", "steps_per_s"),
        ("scheduler CPU ms per step", "scheduler_cpu_ms_per_step"),
        ("TTFT p99 (ms)", "ttft_p99_ms"),
    ]
    fig, grid = plt.subplots(2, 2, figsize=(11, 8))
    axes = list(grid.flat)
    for ax, (title, attr) in zip(axes, panels, strict=True):
        for n in sorted({r.executors for r in results}):
            runs = sorted((r for r in results if r.executors == n), key=lambda r: r.concurrency)
            xs = [r.concurrency for r in runs]
            line = ax.plot(
                xs, [getattr(r, attr) or math.nan for r in runs], marker="o", label=f"{n} executors"
            )
            if attr == "steps_per_s":
                ax.plot(xs, [r.ideal_steps_per_s for r in runs], ls="--", color=line[0].get_color())
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if attr in ("steps_per_s", "ttft_p99_ms"):
            ax.set_yscale("log")
    axes[0].legend()
    fig.suptitle(
        "one scheduler over simulated executors\n(client, scheduler and executors share the machine)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- command line -------------------------------------------------------------------------------


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _range(text: str) -> tuple[int, int]:
    values = _ints(text.replace("-", ","))
    if len(values) != 2:
        raise argparse.ArgumentTypeError(f"give a range as LOW-HIGH, got {text!r}")
    return values[0], values[1]


def build_parser() -> argparse.ArgumentParser:
    d = ScaleConfig()
    p = argparse.ArgumentParser(
        prog="python -m npuserve.deploy.scale_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--executors", type=_ints, default=d.executors, help="comma list of executor counts")
    p.add_argument("--concurrency", type=_ints, default=d.concurrency, help="comma list of stream counts")
    p.add_argument("--warmup", type=float, default=d.warmup_s, help="seconds before each window")
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds each window lasts")
    p.add_argument("--prompt-len", type=_range, default=d.prompt_len, help="LOW-HIGH tokens")
    p.add_argument("--output-len", type=_range, default=d.output_len, help="LOW-HIGH tokens")
    p.add_argument("--base-ms", type=float, default=d.base_ms)
    p.add_argument("--per-token-ms", type=float, default=d.per_token_ms)
    p.add_argument("--per-seq-ms", type=float, default=d.per_seq_ms)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--num-blocks", type=int, default=d.num_blocks, help="per executor (0: sized to the load)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--model", type=Path, default=d.model, help="the tokenizer's model directory")
    p.add_argument("--step-transport", default=d.step_transport, choices=["unary", "stream"])
    p.add_argument("--routing", default=d.routing, choices=["prefix-aware", "least-load"])
    p.add_argument(
        "--scheduler-log-level", default=d.scheduler_log_level, choices=["debug", "info", "warning"]
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--profile", action="store_true", help="py-spy the scheduler during one configuration")
    p.add_argument("--profile-at", type=_range, help="EXECUTORS-STREAMS to profile (default: the largest)")
    p.add_argument("--profile-seconds", type=float, default=d.profile_s)
    p.add_argument("--profile-native", action="store_true", help="with C frames (pauses the scheduler)")
    p.add_argument(
        "--switch-interval-ms", type=float, help="experiment: the scheduler's GIL switch interval (Python: 5)"
    )
    p.add_argument("--workdir", type=Path, help="logs, ready files and profiles (default: a temp dir)")
    p.add_argument("--output-json", type=Path)
    p.add_argument("--plot", type=Path)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        config = ScaleConfig(
            executors=args.executors,
            concurrency=args.concurrency,
            warmup_s=args.warmup,
            duration_s=args.duration,
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            base_ms=args.base_ms,
            per_token_ms=args.per_token_ms,
            per_seq_ms=args.per_seq_ms,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            max_num_seqs=args.max_num_seqs,
            model=args.model,
            step_transport=args.step_transport,
            routing=args.routing,
            scheduler_log_level=args.scheduler_log_level,
            seed=args.seed,
            profile=args.profile,
            profile_at=args.profile_at,
            profile_s=args.profile_seconds,
            profile_native=args.profile_native,
            switch_interval_ms=args.switch_interval_ms,
            workdir=args.workdir,
        )
    except ValueError as exc:
        print(f"scale_bench: error: {exc}", file=sys.stderr)
        sys.exit(2)
    started_at = time.monotonic()
    results = run_sweep(config)
    print(format_table(results))
    print()
    print(f"machine: {os.cpu_count()} CPUs shared by the client, the scheduler and the simulated executors")
    for note in saturation_notes(results):
        print(f"- {note}")
    for result in results:
        if result.profile:
            print()
            print(format_profile(result))
    print(f"\n({time.monotonic() - started_at:.0f} s)")
    if args.output_json:
        payload = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
                   "results": [asdict(r) for r in results], "notes": saturation_notes(results)}  # fmt: skip
        args.output_json.write_text(json.dumps(payload, indent=2))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
