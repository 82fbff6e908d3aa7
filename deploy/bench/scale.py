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
  machine used (they all share it: on a small machine that bounds every number here);
* the streams' ITL p50/p99 (gaps between their tokens).

Prefill/decode disaggregation: ``--prefill-executors 0,1`` runs each executor count all mixed,
then with one prefill executor and the rest decode (their pulls go over the real `ReadBlocks`
path, each taking its bytes over ``--pull-gb-per-s``); ``--long-prompt-rate 0,4`` measures each
configuration without, then with 4 long prompts/s (``--long-prompt-len`` tokens) arriving beside
the streams, which `--max-local-prefill-length` (default: the streams' longest prompt) sends to
the prefill executors. The notes say how far the long prompts move the streams' ITL p99.

`--profile` samples the scheduler with py-spy (``--gil``: whoever holds the GIL) during one
configuration and names the top costs. It prints a table and where throughput saturates, and
writes `--output-json` and a `--plot`.

    npuserve bench-scale --output-json scale.json --plot scale.png --profile

(or ``python -m npuserve.deploy.bench.scale``). The load is `scale_load`, the measurement
`scale_measure`, the profile `scale_profile`, the notes `scale_notes`; the table, JSON and plot
are `report`'s (`disaggregation_report`'s plot for the prefill/decode runs).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from npuserve.deploy.bench import machine, report
from npuserve.deploy.bench.disaggregation_report import plot_points, scale_points
from npuserve.deploy.bench.scale_config import START_TIMEOUT_S, ScaleConfig
from npuserve.deploy.bench.scale_measure import Cluster, Result, run_load
from npuserve.deploy.bench.scale_notes import saturation_notes
from npuserve.deploy.bench.scale_profile import format_profile
from npuserve.deploy.bench.targets import CLIENT_CALLS
from npuserve.deploy.flag_table import csv, same_named
from npuserve.deploy.flags import add_logging_flags, command_error
from npuserve.deploy.launcher import Launcher, LaunchError, python_module
from npuserve.deploy.scheduler_flags import BENCH_FIELDS, SCHEDULER

SIMULATED_FLEET = "npuserve.deploy.bench.simulated_fleet"
# The scheduler's flags the bench takes, as the `ScaleConfig` fields of the same names.
SCHEDULER_FIELDS = ("routing", "routing_prefill_weight", *BENCH_FIELDS)
STOP_GRACE_S = 30.0

# -- processes --------------------------------------------------------------------------------


def simulated_args(config: ScaleConfig, count: int, stats_file: Path, num_prefill: int = 0) -> list[str]:
    return [
        "--port", "0", "--count", str(count), "--stats-file", str(stats_file), "--stats-interval", "0.25",
        "--base-ms", str(config.base_ms), "--per-token-ms", str(config.per_token_ms),
        "--per-seq-ms", str(config.per_seq_ms), "--block-size", str(config.block_size),
        "--num-blocks", str(config.blocks_per_executor), "--max-num-seqs", str(config.max_num_seqs),
        "--max-model-len", str(config.max_model_len), "--prefill-executors", str(num_prefill),
        "--kv-bytes-per-token", str(config.kv_bytes_per_token), "--pull-gb-per-s", str(config.pull_gb_per_s),
        "--log-level", "warning",
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
    passed_on = {name: getattr(config, name) for name in SCHEDULER_FIELDS}
    scheduler = SCHEDULER.default(
        model=str(config.model),
        executors=list(addresses),
        max_local_prefill_length=config.local_prefill,
        **passed_on,
    )
    flags = SCHEDULER.to_flags(scheduler)
    return ["scheduler", *flags, "--port", "0", "--log-level", config.scheduler_log_level]


@contextmanager
def started_cluster(
    config: ScaleConfig, num_executors: int, run_dir: Path, num_prefill: int = 0
) -> Iterator[Cluster]:
    """The simulated executors (the first ``num_prefill`` prefill, the rest decode; 0: all mixed)
    and a scheduler over them, until the block ends."""
    launcher = Launcher(run_dir)
    stats_file = run_dir / "executor-stats.json"
    try:
        executors = launcher.start(
            "executors",
            simulated_args(config, num_executors, stats_file, num_prefill),
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
        vocab_size = sim_ready["info"]["vocab_size"]
        address = str(sched_ready["address"])
        yield Cluster(
            address, scheduler.pid, executors.pid, stats_file, vocab_size, num_executors, num_prefill
        )
    finally:
        launcher.stop(STOP_GRACE_S)


# -- the sweep ----------------------------------------------------------------------------------


def run_sweep(config: ScaleConfig) -> list[Result]:
    """Per round, executor count and prefill executors, a cluster; in it a window per concurrency
    and long-prompt rate."""
    workdir = config.workdir or Path(tempfile.mkdtemp(prefix="npuserve-scale-"))
    profile_at = config.profile_at or (max(config.executors), max(config.concurrency))
    first_roles_and_rate = (config.prefill_executors[0], config.long_prompt_rate[0])  # profiled there
    results = []
    clusters = itertools.product(range(1, config.repeat + 1), config.executors, config.prefill_executors)
    for round_number, num_executors, num_prefill in clusters:
        name = f"n{num_executors}-p{num_prefill}" if num_prefill else f"n{num_executors}"
        run_dir = workdir / (f"{name}-round{round_number}" if config.repeat > 1 else name)
        run_dir.mkdir(parents=True, exist_ok=True)
        with started_cluster(config, num_executors, run_dir, num_prefill) as cluster:
            for concurrency, rate in itertools.product(config.concurrency, config.long_prompt_rate):
                first_load = round_number == 1 and (num_prefill, rate) == first_roles_and_rate
                profiled = config.profile and (num_executors, concurrency) == profile_at and first_load
                profile_path = run_dir / f"profile-c{concurrency}-r{rate:g}.txt" if profiled else None
                result = asyncio.run(run_load(config, cluster, concurrency, rate, round_number, profile_path))
                results.append(result)
                print(_progress_line(result), file=sys.stderr, flush=True)
    return results


def _progress_line(r: Result) -> str:
    roles = f", {r.prefill_executors} prefill" if r.prefill_executors else ""
    long = f" + {r.long_prompt_rate:g} long prompts/s" if r.long_prompt_rate else ""
    return (
        f"[round {r.round}: {r.executors} executors{roles} x {r.concurrency} streams{long}] "
        f"{r.output_tokens_per_s:,.0f} tok/s, "
        f"{r.steps_per_s:,.0f} steps/s, scheduler {r.scheduler_cpu_ms_per_step:.2f} ms CPU/step, "
        f"ITL p99 {r.itl_p99_ms or 0:,.1f} ms"
    )


# -- command line -------------------------------------------------------------------------------


def _range(text: str) -> tuple[int, int]:
    values = csv(int)(text.replace("-", ","))
    if len(values) != 2:
        raise argparse.ArgumentTypeError(f"give a range as LOW-HIGH, got {text!r}")
    return values[0], values[1]


def add_scale_bench_flags(p: argparse.ArgumentParser) -> None:
    d = ScaleConfig()
    p.description = __doc__
    p.add_argument("--executors", type=csv(int), default=d.executors, help="comma list of executor counts")
    p.add_argument("--concurrency", type=csv(int), default=d.concurrency, help="comma list of stream counts")
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
    pd = p.add_argument_group("prefill/decode disaggregation")
    pd.add_argument(
        "--prefill-executors",
        type=csv(int),
        default=d.prefill_executors,
        help="comma list: of each executor count, this many prefill and the rest decode (0: all mixed)",
    )
    pd.add_argument(
        "--long-prompt-rate",
        type=csv(float),
        default=d.long_prompt_rate,
        help="comma list: long prompts per second arriving beside the streams (0: none)",
    )
    pd.add_argument("--long-prompt-len", type=int, default=d.long_prompt_len, help="tokens each")
    pd.add_argument("--long-output-len", type=int, default=d.long_output_len, help="output tokens each")
    SCHEDULER.add(
        pd,
        only=["max_local_prefill_length"],
        overrides={"max_local_prefill_length": {"default": None, "help": "a longer prompt prefills "
                   "on a prefill executor (default: the streams' longest, --prompt-len's HIGH)"}},
    )  # fmt: skip
    pd.add_argument(
        "--kv-bytes-per-token", type=int, default=d.kv_bytes_per_token, help="the modelled KV a pull moves"
    )
    pd.add_argument(
        "--pull-gb-per-s",
        type=float,
        default=d.pull_gb_per_s,
        help="the modelled rate of a pull (1e9 bytes/s)",
    )
    p.add_argument("--model", type=Path, default=d.model, help="the tokenizer's model directory")
    p.add_argument(
        "--executor-nice",
        type=int,
        default=d.executor_nice,
        help="the simulated executors' niceness: they stand in for devices on other hosts (0: as the scheduler)",
    )
    SCHEDULER.add(p, only=SCHEDULER_FIELDS)
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
    p.add_argument(
        "--repeat", type=int, default=d.repeat, help="run the whole sweep this many rounds, one after another"
    )
    p.add_argument("--workdir", type=Path, help="logs, ready files and profiles (default: a temp dir)")
    p.add_argument("--output-json", type=Path, help="default: ./bench-results/")
    p.add_argument("--plot", type=Path)
    add_logging_flags(p, level="warning")


def run_scale_bench(args: argparse.Namespace) -> int:
    """`npuserve bench-scale`: the sweep, its table and notes, the JSON and the plot."""
    try:
        config = ScaleConfig(
            **same_named(ScaleConfig, args),
            warmup_s=args.warmup,
            duration_s=args.duration,
            profile_s=args.profile_seconds,
        )
    except ValueError as exc:
        return command_error("bench-scale", exc)
    started_at = time.monotonic()
    host = machine.describe()  # NOTE: before the sweep starts its processes
    try:
        results = run_sweep(config)
    except LaunchError as exc:
        return command_error("bench-scale", exc, 1)
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
    payload = {"config": asdict(config), "results": [asdict(r) for r in results], "notes": notes}
    report.save_json(args.output_json, "bench-scale", {**payload, "machine": host.row()})
    if args.plot:
        points = scale_points(results)
        if points:
            plot_points(points, args.plot, "simulated executors: the streams' ITL, long prompts' TTFT")
        else:
            report.plot_scale(results, args.plot)
    return 0


def main(argv: list[str] | None = None) -> None:
    """`python -m npuserve.deploy.bench.scale`: `npuserve bench-scale`."""
    from npuserve.deploy.cli import main as cli_main

    cli_main(["bench-scale", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
