"""What the scale bench measures in one window: counters before and after (CPU seconds from
/proc, the scheduler's metrics, the simulated executors' totals), and the `Result` between them."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from npuserve.deploy.bench.report import percentile
from npuserve.deploy.bench.scale_config import AWAITING_SAMPLE_S, CLOCK_TICKS, DRAIN_TIMEOUT_S, ScaleConfig
from npuserve.deploy.bench.scale_load import Load, LoadState
from npuserve.deploy.bench.scale_profile import profile_scheduler
from npuserve.deploy.runtime.process_name import API_SERVER, STEP_WORKER, process_name
from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc


@dataclass(frozen=True, slots=True)
class Cluster:
    """A started cluster (`scale.started_cluster`): where a window's load goes, whose counters it
    reads."""

    address: str  # the scheduler's gRPC address
    scheduler_pid: int
    executors_pid: int  # the simulated executors' one process
    stats_file: Path  # their totals, rewritten every 0.25 s
    vocab_size: int
    executors: int
    prefill_executors: int  # of ``executors`` (the rest decode); 0: all mixed


@dataclass(slots=True)
class Snapshot:
    """Counters at one moment: CPU seconds, the scheduler's metrics, the executors' totals."""

    time: float
    scheduler_cpu_s: float  # every scheduler process: the front and its workers
    front_cpu_s: float  # the front alone (the public API, streams, routing)
    children_cpu_s: dict[str, float]  # the front's child processes, by name (role)
    executors_cpu_s: float
    executors_nice: int
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
    prefill_executors: int  # of ``executors`` (the rest decode); 0: all mixed
    long_prompt_rate: float  # long prompts arriving per second beside the streams (0: none)
    round: int  # of the sweep's rounds (`ScaleConfig.repeat`), from 1
    requests_per_s: float  # completed in the window
    sustained_requests_per_s: float  # output tokens/s over the mean output length
    output_tokens_per_s: float
    steps_per_s: float
    ideal_steps_per_s: float
    executor_busy: float  # modelled step time / (executors x window)
    ideal_output_tokens_per_s: float  # executors never waiting, at the observed batch sizes
    scheduler_cpu_ms_per_step: float
    scheduler_cpu_us_per_token: float
    front_cpu_us_per_token: float
    step_workers_cpu_us_per_token: float  # the step worker processes (0 with --scheduler-workers 0)
    api_servers_cpu_us_per_token: float  # the API processes (0 with --api-server-count 1)
    step_workers_cpu_us_per_step: float
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
    # The streams' gaps between tokens (the long prompts' left out): what long prompts disturb.
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    long_ttft_p50_ms: float | None  # the long prompts' whose first token came in the window
    long_ttft_p99_ms: float | None
    num_long_first_tokens: int
    kv_pulled_mb_per_s: float  # KV the executors pulled from each other (the scheduler's count)
    # Inside the engine (request queued -> first token / last token) against the client's view:
    # the difference is the public gRPC path (accepting the call, streaming the tokens out).
    engine_ttft_mean_ms: float | None
    client_ttft_mean_ms: float | None
    engine_e2e_mean_ms: float | None
    client_e2e_mean_ms: float | None
    engine_requests: float  # running + waiting in the engine at the window's end (streams open: concurrency)
    awaiting_first_token: int  # streams open at the window's end without a token yet
    # the same, averaged over the window (sampled every `AWAITING_SAMPLE_S`): the end's count
    # swings with waves of requests that finish together and come back at once
    awaiting_first_token_mean: float
    other_cores: float  # CPU the rest of the machine used meanwhile (other processes)
    executors_nice: int  # the simulated executors' process's niceness, as /proc says (`--executor-nice`)
    num_first_tokens: int
    num_completed: int
    num_errors: int
    errors: dict[str, int]  # by status code
    preemptions: float
    profile: dict[str, Any] | None = None


def _stat_fields(stat: Path) -> list[str]:
    """The fields of /proc/PID/stat after the command name (which may hold spaces)."""
    return stat.read_text().rsplit(")", 1)[1].split()


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, every thread included (from /proc/PID/stat)."""
    fields = _stat_fields(Path(f"/proc/{pid}/stat"))
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def children_cpu_by_name(pid: int) -> dict[str, float]:
    """CPU seconds of a process's live child processes (the scheduler's step workers, API
    processes and render workers), summed by process name (`process_name`: their role)."""
    totals: dict[str, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(_stat_fields(stat)[1]) != pid:
                continue
            child = int(stat.parent.name)
            name = process_name(child) or "gone"
            totals[name] = totals.get(name, 0.0) + proc_cpu_seconds(child)
        except OSError:
            continue  # gone meanwhile
    return totals


def metric_values(text: str) -> dict[str, float]:
    """Prometheus text to {name: value}, summed over labels."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = re.split(r"[{ ]", line, maxsplit=1)[0]
        values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def machine_busy_seconds() -> float:
    """CPU seconds every CPU of the machine spent busy since boot (/proc/stat: all but idle, iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / CLOCK_TICKS


async def take_snapshot(stub: pb_grpc.SchedulerStub, cluster: Cluster) -> Snapshot:
    for attempt in range(3):  # NOTE: a saturated server may cancel calls it has not accepted
        try:
            text = (await stub.GetMetrics(pb.GetMetricsRequest(), timeout=30)).text
            break
        except grpc.aio.AioRpcError:
            if attempt == 2:
                raise
    stats = json.loads(cluster.stats_file.read_text())
    pid = cluster.scheduler_pid
    front_cpu, children = proc_cpu_seconds(pid), children_cpu_by_name(pid)
    sim: dict[str, float] = {}
    for executor in stats["executors"]:
        for key, value in executor.items():
            if key != "executor_id":
                sim[key] = sim.get(key, 0.0) + value
    return Snapshot(
        time=time.perf_counter(),
        scheduler_cpu_s=front_cpu + sum(children.values()),
        front_cpu_s=front_cpu,
        children_cpu_s=children,
        executors_cpu_s=proc_cpu_seconds(cluster.executors_pid),
        executors_nice=int(_stat_fields(Path(f"/proc/{cluster.executors_pid}/stat"))[16]),
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


async def sample_awaiting(state: LoadState) -> None:
    """Until the window ends: how many open streams have no token yet, every `AWAITING_SAMPLE_S`."""
    while (left := state.window[1] - time.perf_counter()) > 0:
        state.awaiting_samples.append(state.awaiting_first_token)
        await asyncio.sleep(min(AWAITING_SAMPLE_S, left))


async def run_load(
    config: ScaleConfig,
    cluster: Cluster,
    concurrency: int,
    long_prompt_rate: float = 0.0,
    round_number: int = 1,
    profile_path: Path | None = None,
) -> Result:
    """One configuration: warm up, measure one window, stop every stream, wait for the drain."""
    control = grpc.aio.insecure_channel(cluster.address)
    stub = pb_grpc.SchedulerStub(control)
    load = Load(config, cluster.address, cluster.vocab_size, concurrency, long_prompt_rate)
    await load.connect()
    tasks = load.start(ramp_s=min(2.0, config.warmup_s / 2))
    profile = None
    try:
        await asyncio.sleep(config.warmup_s)
        before = await take_snapshot(stub, cluster)
        load.state.window = (before.time, before.time + config.duration_s)
        await sample_awaiting(load.state)
        await asyncio.sleep(0.3)  # the executors' stats file is rewritten every 0.25 s
        after = await take_snapshot(stub, cluster)
        load.state.awaiting_at_window_end = load.state.awaiting_first_token
        if profile_path is not None:
            # NOTE: after the window, under the same load: sampling slows the scheduler down.
            profile = await profile_scheduler(cluster.scheduler_pid, config, profile_path)
    finally:
        await load.close(tasks)
    await wait_idle(stub, DRAIN_TIMEOUT_S)
    await control.close()
    result = summarize(config, cluster, load, round_number, before, after)
    result.profile = profile
    return result


def _child_cpu(before: Snapshot, after: Snapshot, name: str) -> float:
    """CPU seconds the front's children named ``name`` spent between two snapshots (a child
    restarted meanwhile counts from zero)."""
    return max(0.0, after.children_cpu_s.get(name, 0.0) - before.children_cpu_s.get(name, 0.0))


def _per(amount: float, count: float) -> float:
    return amount / count if count else math.nan


def summarize(
    config: ScaleConfig, cluster: Cluster, load: Load, round_number: int, before: Snapshot, after: Snapshot
) -> Result:
    """The window between two snapshots of one load on one cluster."""
    state, executors = load.state, cluster.executors
    window = state.window[1] - state.window[0]
    elapsed = after.time - before.time  # a little longer: the last snapshot waits for the stats
    steps = after.delta(before, "npuserve:step_seconds_count")
    sim = {key: after.sim[key] - before.sim.get(key, 0.0) for key in after.sim}
    sim_window = after.sim_time - before.sim_time
    sim_steps = max(sim["num_steps"], 1.0)
    modelled = sim["modeled_s"] / sim_steps
    sampled_per_step = sim["num_sampled"] / sim_steps
    ttfts = [ttft for arrival, ttft in state.first_tokens if state.in_window(arrival)]
    long_ttfts = [ttft for arrival, ttft in state.long_first_tokens if state.in_window(arrival)]
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
        concurrency=load.concurrency,
        window_s=window,
        prefill_executors=cluster.prefill_executors,
        long_prompt_rate=load.long_prompt_rate,
        round=round_number,
        requests_per_s=len(e2es) / window,
        sustained_requests_per_s=tokens_per_s / (sum(config.output_len) / 2),
        output_tokens_per_s=tokens_per_s,
        steps_per_s=steps / elapsed,
        ideal_steps_per_s=executors / modelled if modelled else 0.0,
        executor_busy=sim["modeled_s"] / (executors * sim_window) if sim_window else 0.0,
        ideal_output_tokens_per_s=executors * sampled_per_step / modelled if modelled else 0.0,
        scheduler_cpu_ms_per_step=_per(1e3 * scheduler_cpu, steps),
        scheduler_cpu_us_per_token=_per(1e6 * scheduler_cpu, generated),
        front_cpu_us_per_token=_per(1e6 * (after.front_cpu_s - before.front_cpu_s), generated),
        step_workers_cpu_us_per_token=_per(1e6 * _child_cpu(before, after, STEP_WORKER), generated),
        api_servers_cpu_us_per_token=_per(1e6 * _child_cpu(before, after, API_SERVER), generated),
        step_workers_cpu_us_per_step=_per(1e6 * _child_cpu(before, after, STEP_WORKER), steps),
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
        itl_p50_ms=1e3 * percentile(state.itls, 50) if state.itls else None,
        itl_p99_ms=1e3 * percentile(state.itls, 99) if state.itls else None,
        long_ttft_p50_ms=1e3 * percentile(long_ttfts, 50) if long_ttfts else None,
        long_ttft_p99_ms=1e3 * percentile(long_ttfts, 99) if long_ttfts else None,
        num_long_first_tokens=len(long_ttfts),
        kv_pulled_mb_per_s=after.delta(before, "npuserve:kv_transfer_bytes_total") / elapsed / 1e6,
        engine_ttft_mean_ms=after.mean_ms(before, "vllm:time_to_first_token_seconds"),
        client_ttft_mean_ms=1e3 * sum(ttfts) / len(ttfts) if ttfts else None,
        engine_e2e_mean_ms=after.mean_ms(before, "vllm:e2e_request_latency_seconds"),
        client_e2e_mean_ms=1e3 * sum(e2es) / len(e2es) if e2es else None,
        engine_requests=after.metrics.get("vllm:num_requests_running", 0.0)
        + after.metrics.get("vllm:num_requests_waiting", 0.0),
        awaiting_first_token=state.awaiting_at_window_end,
        awaiting_first_token_mean=_per(sum(state.awaiting_samples), len(state.awaiting_samples)),
        other_cores=max(0.0, machine - sum(cores.values())),
        executors_nice=after.executors_nice,
        num_first_tokens=len(ttfts),
        num_completed=len(e2es),
        num_errors=sum(state.errors.values()),
        errors=dict(state.errors),
        preemptions=after.delta(before, "vllm:num_preemptions_total"),
    )
