"""How far one scheduler scales: simulated executors, a real scheduler process, thousands of streams.

For each executor count (16, 32, 64 by default) it starts that many simulated executors in one
process (`simulated_fleet --count N`, at nice 19: they stand in for devices on other hosts,
`--executor-nice`) and a real `npuserve scheduler` over
them, then for each concurrency (256, 1024, 4096) keeps that many generations running from a
`grpc.aio` client in this process (closed loop: a finished request is replaced at once; random
token-id prompts of 128-512 tokens, 64-128 output tokens, ``ignore_eos``), over one
`GenerateMany` call per 256 of them, as the gateway sends them (`--client-call generate`: a
`Generate` call each). After a warm-up it
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

    npuserve bench-scale --output-json scale.json --plot scale.png --profile

(or ``python -m npuserve.deploy.bench.scale``). The load is `scale_load`, the measurement
`scale_measure`, the profile `scale_profile`; the table, JSON and plot are `report`'s.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from npuserve.deploy.bench import machine, report
from npuserve.deploy.bench.scale_config import (
    SATURATED_GAIN,
    START_TIMEOUT_S,
    TTFT_EXPLODED,
    ScaleConfig,
)
from npuserve.deploy.bench.scale_measure import Result, run_load
from npuserve.deploy.bench.scale_profile import format_profile
from npuserve.deploy.bench.targets import CLIENT_CALLS
from npuserve.deploy.flags import add_logging_flags
from npuserve.deploy.launcher import Launcher, LaunchError, python_module
from npuserve.deploy.scheduler_flags import BENCH_FIELDS, SCHEDULER

SIMULATED_FLEET = "npuserve.deploy.bench.simulated_fleet"
STOP_GRACE_S = 30.0

# -- processes --------------------------------------------------------------------------------


def simulated_args(config: ScaleConfig, count: int, stats_file: Path) -> list[str]:
    return [
        "--port", "0", "--count", str(count), "--stats-file", str(stats_file), "--stats-interval", "0.25",
        "--base-ms", str(config.base_ms), "--per-token-ms", str(config.per_token_ms),
        "--per-seq-ms", str(config.per_seq_ms), "--block-size", str(config.block_size),
        "--num-blocks", str(config.blocks_per_executor), "--max-num-seqs", str(config.max_num_seqs),
        "--max-model-len", str(config.prompt_len[1] + config.output_len[1]), "--log-level", "warning",
    ]  # fmt: skip


def scheduler_command(config: ScaleConfig) -> list[str]:
    """The scheduler's Python: `npuserve`, or with ``--switch-interval-ms`` a GIL switch interval."""
    if config.switch_interval_ms is None:
        return python_module()
    # NOTE: an experiment, not a setting of the scheduler: how long a thread of the scheduler
    # (gRPC's own, tokenization's) waits for the GIL while the event loop holds it.
    return [sys.executable, "-c", f"import sys; sys.setswitchinterval({config.switch_interval_ms / 1e3}); "
            "sys.argv[0] = 'npuserve'; from npuserve.deploy.cli import main; main()"]  # fmt: skip


def scheduler_args(config: ScaleConfig, addresses: Sequence[str]) -> list[str]:
    scheduler = SCHEDULER.default(
        model=str(config.model),
        executors=list(addresses),
        routing=config.routing,
        routing_prefill_weight=config.routing_prefill_weight,
        scheduler_workers=config.scheduler_workers,
        api_server_count=config.api_server_count,
        async_scheduling=config.async_scheduling,
        stream_interval=config.stream_interval,
        num_scheduler_steps=config.num_scheduler_steps,
    )
    return [
        "scheduler",
        *SCHEDULER.to_flags(scheduler),
        "--port",
        "0",
        "--log-level",
        config.scheduler_log_level,
    ]


@contextmanager
def started_cluster(config: ScaleConfig, num_executors: int, run_dir: Path) -> Iterator[tuple[Any, ...]]:
    """The simulated executors and a scheduler over them; yields (scheduler pid, its ready file,
    executors pid, theirs, their stats file). Stops both after."""
    launcher = Launcher(run_dir)
    stats_file = run_dir / "executor-stats.json"
    try:
        executors = launcher.start(
            "executors",
            simulated_args(config, num_executors, stats_file),
            command=python_module(SIMULATED_FLEET),
            log_path=run_dir / "executors.log",
            nice=config.executor_nice,
        )
        (sim_ready,) = launcher.wait_ready([executors], START_TIMEOUT_S)
        scheduler = launcher.start(
            "scheduler",
            scheduler_args(config, sim_ready["addresses"]),
            command=scheduler_command(config),
            log_path=run_dir / "scheduler.log",
        )
        (sched_ready,) = launcher.wait_ready([scheduler], START_TIMEOUT_S)
        yield scheduler.pid, sched_ready, executors.pid, sim_ready, stats_file
    finally:
        launcher.stop(STOP_GRACE_S)


# -- the sweep ----------------------------------------------------------------------------------


def run_sweep(config: ScaleConfig, progress: bool = True) -> list[Result]:
    workdir = config.workdir or Path(tempfile.mkdtemp(prefix="npuserve-scale-"))
    profile_at = config.profile_at or (max(config.executors), max(config.concurrency))
    results = []
    for num_executors in config.executors:
        run_dir = workdir / f"n{num_executors}"
        run_dir.mkdir(parents=True, exist_ok=True)
        with started_cluster(config, num_executors, run_dir) as (
            sched_pid,
            sched_ready,
            sim_pid,
            sim_ready,
            stats,
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
                        stats,
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


# -- what the numbers say -----------------------------------------------------------------------


def _saturated(runs: list[Result], along: str) -> Iterator[tuple[Result, Result, float]]:
    """Neighbouring runs (sorted by ``along``) where the larger one raises tokens/s too little."""
    runs.sort(key=lambda r: getattr(r, along))
    for low, high in itertools.pairwise(runs):
        gain = high.output_tokens_per_s / max(low.output_tokens_per_s, 1e-9)
        if gain < SATURATED_GAIN:
            yield low, high, gain


def saturation_notes(results: Sequence[Result]) -> list[str]:
    """Where adding executors or load stops raising throughput, or TTFT explodes."""
    notes = []
    by_n: dict[int, list[Result]] = {}
    by_c: dict[int, list[Result]] = {}
    for r in results:
        by_n.setdefault(r.executors, []).append(r)
        by_c.setdefault(r.concurrency, []).append(r)
    for n, runs in sorted(by_n.items()):
        for low, high, gain in _saturated(runs, "concurrency"):
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
        for low, high, gain in _saturated(runs, "executors"):
            notes.append(
                f"{c} streams: {low.executors} -> {high.executors} executors raises tokens/s only x{gain:.2f}"
            )
    fit = cost_model(results)
    if fit is not None:
        per_step_ms, per_token_us = fit
        notes.append(
            f"scheduler CPU per step ~ {per_step_ms:.2f} ms + {per_token_us:.0f} us x tokens sampled in the "
            f"step (least squares over these runs, every scheduler process summed): one core's worth drives "
            f"at most ~{1e3 / per_step_ms:,.0f} steps/s, ~{1e6 / per_token_us:,.0f} tokens/s"
            if per_step_ms > 0 and per_token_us > 0
            else f"scheduler CPU per step fit: {per_step_ms:.2f} ms + {per_token_us:.0f} us x tokens sampled"
        )
    notes += short_window_notes(results)
    peak = max(results, key=lambda r: r.output_tokens_per_s)
    notes.append(
        f"peak {peak.output_tokens_per_s:,.0f} tok/s at {peak.executors} executors x {peak.concurrency} streams: "
        f"scheduler at {peak.scheduler_cores:.2f} cores, {peak.scheduler_cpu_ms_per_step:.2f} ms CPU/step, "
        f"executors busy {peak.executor_busy:.0%} (ideal {peak.ideal_output_tokens_per_s:,.0f} tok/s)"
    )
    return notes


def short_window_notes(results: Sequence[Result]) -> list[str]:
    """Configurations whose window is shorter than a request's mean life (streams over the
    sustained requests/s): their requests/s, TTFT and end-to-end times come from the few
    requests that began or ended in the window (at 64 executors x 4,096 streams on 2 cores a
    request lives about 27 s: a 10 s window saw no first token at all)."""
    notes = []
    for r in results:
        if r.sustained_requests_per_s <= 0:
            continue
        life_s = r.concurrency / r.sustained_requests_per_s
        if life_s > r.window_s:
            notes.append(
                f"{r.executors} executors x {r.concurrency} streams: a request lives ~{life_s:.0f} s, longer "
                f"than the {r.window_s:.0f} s window: its req/s, TTFT and e2e come from the few requests "
                f"that began or ended in it (--duration {math.ceil(2 * life_s)} or more sees whole lives)"
            )
    return notes


def cost_model(results: Sequence[Result]) -> tuple[float, float] | None:
    """(ms per step, us per token): the line through scheduler CPU per step against the output
    tokens sampled per step (one per sequence, or up to `--num-scheduler-steps`), by least
    squares; None when the runs do not spread enough to fit."""
    points = [
        (r.output_tokens_per_s / r.steps_per_s, r.scheduler_cpu_ms_per_step)
        for r in results
        if r.steps_per_s > 0
    ]
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


def add_scale_bench_flags(p: argparse.ArgumentParser) -> None:
    d = ScaleConfig()
    p.description = __doc__
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
    p.add_argument(
        "--executor-nice",
        type=int,
        default=d.executor_nice,
        help="the simulated executors' niceness: they stand in for devices on other hosts (0: as the scheduler)",
    )
    SCHEDULER.add(p, only=["routing", "routing_prefill_weight", *BENCH_FIELDS])
    p.add_argument(
        "--client-call",
        default=d.client_call,
        choices=CLIENT_CALLS,
        help="the load's streams as GenerateMany calls (one per channel, as the gateway) or a Generate call each",
    )
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
    p.add_argument("--output-json", type=Path, help="default: ./bench-results/")
    p.add_argument("--plot", type=Path)
    add_logging_flags(p, level="warning")


def run_scale_bench(args: argparse.Namespace) -> int:
    """`npuserve bench-scale`: the sweep, its table and notes, the JSON and the plot."""
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
            routing=args.routing,
            routing_prefill_weight=args.routing_prefill_weight,
            executor_nice=args.executor_nice,
            scheduler_workers=args.scheduler_workers,
            api_server_count=args.api_server_count,
            async_scheduling=args.async_scheduling,
            stream_interval=args.stream_interval,
            num_scheduler_steps=args.num_scheduler_steps,
            client_call=args.client_call,
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
        print(f"npuserve bench-scale: error: {exc}", file=sys.stderr)
        return 2
    started_at = time.monotonic()
    host = machine.describe()  # NOTE: before the sweep starts its processes
    try:
        results = run_sweep(config)
    except LaunchError as exc:
        print(f"npuserve bench-scale: error: {exc}", file=sys.stderr)
        return 1
    notes = saturation_notes(results)
    print(report.format_scale_table(results))
    print()
    print(
        f"machine: {host.summary()}; shared by the client, the scheduler and the simulated executors "
        f"(at nice {config.executor_nice})"
    )
    for note in notes:
        print(f"- {note}")
    for result in results:
        if result.profile:
            print()
            print(format_profile(result))
    print(f"\n({time.monotonic() - started_at:.0f} s)")
    written = report.write_json(
        report.output_path(args.output_json, "bench-scale"), report.scale_json(config, results, notes, host)
    )
    print(f"results: {written}", file=sys.stderr)
    if args.plot:
        report.plot_scale(results, args.plot)
    return 0


def main(argv: list[str] | None = None) -> None:
    from npuserve.deploy.grpc_env import set_grpc_environment
    from npuserve.deploy.runtime.logs import configure_logging

    set_grpc_environment()  # NOTE: first, as `npuserve bench-scale` does: its children inherit it
    parser = argparse.ArgumentParser(
        prog="python -m npuserve.deploy.bench.scale", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_scale_bench_flags(parser)
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format == "json")
    sys.exit(run_scale_bench(args))


if __name__ == "__main__":
    main()
