"""`npuserve bench`: a serving benchmark, in process or through the public gRPC API.

A workload (`workload`) runs against one or more targets (`targets`), one per variant
(`variants`): the offline engine, or a scheduler over gRPC: the one at ``--address``, or one this
bench launches with the offline engine's configuration (`launched_server`, as `npuserve serve`
does, without the gateway; for prefill/decode disaggregation, with executor roles) and stops
after. Every request asks for exactly its ``output_len`` tokens (``ignore_eos``), so variants do
equal work. The summary per variant is `serving_metrics`'; the table, JSON and plot `report`'s.
This module imports no torch; the offline target and presets load the executor lazily.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from npuserve.deploy.bench import disaggregation_report, machine, report
from npuserve.deploy.bench.serving_metrics import BenchSummary, RequestRecord, summarize
from npuserve.deploy.bench.targets import CLIENT_CALLS, BenchError, GrpcTarget, OfflineTarget, Target
from npuserve.deploy.bench.variants import VARIANT_KINDS, Variant, max_local_prefill_length, parse_variants
from npuserve.deploy.bench.workload import BenchRequest, WorkloadConfig, build_workload, warmup_requests
from npuserve.deploy.demo_model import DEMO_MODEL_DIR
from npuserve.deploy.executor_flags import EXECUTOR, serve_executor_roles
from npuserve.deploy.flag_table import same_named
from npuserve.deploy.flags import add_logging_flags, command_error, logging_flags, resolve_api_key
from npuserve.deploy.launcher import Launcher, LaunchError, device_env
from npuserve.deploy.runtime.cpu_priority import control_plane_nice
from npuserve.deploy.scheduler_flags import BENCH_FIELDS, SCHEDULER
from npuserve.executor.cpu_threads import AUTO_CPU_THREADS
from npuserve.proto.auth import API_KEY

# The engine flags, in `npuserve bench --help`'s order, and where the bench words them its own way.
ENGINE_FIELDS = (
    "device", "dtype", "load_format", "kv_cache_memory_gib", "kv_host_memory_gib", "max_model_len",
    "max_num_seqs", "max_num_batched_tokens", "block_size", "cpu_threads",
)  # fmt: skip
ENGINE_FLAG_WORDING: dict[str, dict[str, Any]] = {
    "kv_cache_memory_gib": {"help": "KV cache GiB per executor"},
    "load_format": {"choices": ["auto", "safetensors", "dummy"]},
    "cpu_threads": {
        "help": "torch threads on the CPU, in process and in the gRPC variants' executors (default: "
        "torch's in process, auto in the executors, as `npuserve serve` gives them)"
    },
}

# The workload's flags: one per `WorkloadConfig` field, with its default (the long prompts' in a
# group of their own); their help where the name needs it.
WORKLOAD_DEFAULTS = WorkloadConfig()
WORKLOAD_HELP = {
    "output_len": "tokens per request (EOS ignored)",
    "shared_prefix_len": "leading tokens every prompt shares",
    "num_prefixes": "shared prefixes the prompts take in turn (default: 1)",
    "request_rate": "requests/s, Poisson (default: all at once)",
    "long_prompts": "how many (default: none)",
    "long_prompt_len": "tokens each",
    "long_prompt_rate": "per second, evenly spaced",
    "long_output_len": "output tokens of each",
}


# -- measurement ------------------------------------------------------------------------------------


async def _run_one(
    target: Target, request: BenchRequest, config: WorkloadConfig, start: float
) -> RequestRecord:
    await asyncio.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
    record = RequestRecord(
        len(request.prompt_token_ids), time.perf_counter(), long_prompt=request.long_prompt
    )
    try:
        seed = config.seed + request.index
        async for chunk in target.stream(
            request.prompt_token_ids, request.output_len, config.temperature, seed
        ):
            now = time.perf_counter()
            record.token_times += [now] * chunk.num_tokens
            if chunk.cached_prompt_tokens is not None:
                record.cached_prompt_tokens = chunk.cached_prompt_tokens
        record.end_time = time.perf_counter()
    except Exception as exc:  # one failed request must not end the run: it is counted
        record.error = str(exc) or type(exc).__name__
    return record


async def _measure(
    target: Target,
    config: WorkloadConfig,
    requests: Sequence[BenchRequest],
    warmup: Sequence[BenchRequest],
    progress: bool,
) -> BenchSummary:
    try:
        await target.open()
        longest = max(requests, key=lambda r: len(r.prompt_token_ids) + r.output_len)
        if len(longest.prompt_token_ids) + longest.output_len > target.max_model_len:
            raise ValueError(
                f"prompts of {len(longest.prompt_token_ids)} tokens plus {longest.output_len} output "
                f"tokens exceed {target.name}'s max_model_len {target.max_model_len}"
            )
        if warmup:
            start = time.perf_counter()
            await asyncio.gather(*(_run_one(target, r, config, start) for r in warmup))
        with tqdm(
            total=len(requests), desc=target.name, unit="req", file=sys.stderr, disable=not progress
        ) as bar:
            start = time.perf_counter()

            async def tracked(request: BenchRequest) -> RequestRecord:
                record = await _run_one(target, request, config, start)
                bar.update(1)
                return record

            records = await asyncio.gather(*(tracked(r) for r in requests))
            duration = time.perf_counter() - start
    finally:
        await target.close()
    return summarize(target.name, records, duration)


def measure(
    target: Target,
    config: WorkloadConfig,
    requests: Sequence[BenchRequest],
    warmup: Sequence[BenchRequest] = (),
    progress: bool = False,
) -> BenchSummary:
    """Opens the target, warms it up, runs the workload, closes it, and summarises the run."""
    return asyncio.run(_measure(target, config, requests, warmup, progress))


@dataclass(slots=True, frozen=True)
class ServerSpec:
    """What `launched_server` starts: `npuserve executor` and `npuserve scheduler` flags, and
    each executor's ``--role`` (none: the executor's default, mixed)."""

    executor_args: list[str]
    scheduler_args: list[str]
    num_executors: int = 1
    device: str = "auto"
    roles: tuple[str, ...] = ()


@contextlib.contextmanager
def launched_server(spec: ServerSpec, timeout_s: float = 600.0) -> Iterator[str]:
    """Starts executors and a scheduler on loopback, as `npuserve serve` does (the scheduler at
    `cpu_priority`'s niceness next to executors on the CPU), and yields the scheduler's gRPC
    address; stops every process after.

    NOTE: the processes are launched here rather than through `npuserve serve`, which also
    starts the REST gateway: the benchmark measures the gRPC split alone.
    """
    launcher = Launcher()
    try:
        executors = []
        for i in range(spec.num_executors):
            role = ["--role", spec.roles[i]] if spec.roles else []
            args = ["executor", *spec.executor_args, *role, "--port", "0"]
            executors.append(
                launcher.start(f"executor-{i}", args, device_env(spec.device, i, spec.num_executors))
            )
        ready = launcher.wait_ready(executors, timeout_s)
        addresses = ",".join(str(r["address"]) for r in ready)
        scheduler_args = ["scheduler", *spec.scheduler_args, "--executors", addresses, "--port", "0"]
        nice = control_plane_nice(ready)
        (info,) = launcher.wait_ready([launcher.start("scheduler", scheduler_args, nice=nice)], timeout_s)
        yield str(info["address"])
    except LaunchError as exc:
        raise BenchError(f"the gRPC server did not start: {exc}") from None
    finally:
        launcher.stop()


# -- the command line -------------------------------------------------------------------------------


def add_bench_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of `npuserve bench` (engine flags keep `npuserve serve`'s names and defaults)."""
    model = parser.add_mutually_exclusive_group()
    model.add_argument(
        "--model",
        default=str(DEMO_MODEL_DIR),
        help="a local Hugging Face model directory (default: the bundled stories260K demo model)",
    )
    model.add_argument(
        "--preset", help="a random-weight model (e.g. llama-150m) with a synthetic tokenizer, loaded as dummy"
    )
    parser.add_argument(
        "--address", help="HOST:PORT of a running scheduler (default: launch one, or run offline)"
    )
    parser.add_argument(
        "--api-key",
        help=f"present `authorization: Bearer KEY` to the scheduler at --address (default: ${API_KEY.env})",
    )
    parser.add_argument("--tls-ca", type=Path, help="PEM CA certificates: reach --address over TLS")
    parser.add_argument(
        "--client-call",
        choices=CLIENT_CALLS,
        default=CLIENT_CALLS[0],
        help="gRPC variants: generations over one GenerateMany call (as the gateway) or a Generate call each",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--mode", choices=["offline", "grpc"], help="default: grpc with --address, else offline"
    )
    which.add_argument(
        "--compare", help=f"comma list of variants run on the same workload: {', '.join(VARIANT_KINDS)}"
    )
    workload = parser.add_argument_group("workload")
    mixed = parser.add_argument_group("mixed load: long prompts arriving while the others decode")
    for field in dataclasses.fields(WorkloadConfig):
        default = getattr(WORKLOAD_DEFAULTS, field.name)
        group = mixed if field.name.startswith("long_") else workload
        flag = f"--{field.name.replace('_', '-')}"
        group.add_argument(flag, type=type(default), default=default, help=WORKLOAD_HELP.get(field.name))
    engine = parser.add_argument_group("engine (offline, and the gRPC server when launched)")
    engine.add_argument("--num-executors", type=int, default=1)
    engine.add_argument(
        "--prefill-executors",
        type=int,
        default=1,
        help="--compare disaggregated: executors that prefill the long prompts (the rest decode)",
    )
    SCHEDULER.add(
        engine,
        only=["max_local_prefill_length"],
        overrides={"max_local_prefill_length": {"default": None, "help": "--compare disaggregated: a "
                   "longer prompt prefills on a prefill executor (default: --prompt-len-max)"}},
    )  # fmt: skip
    for name in ENGINE_FIELDS:
        EXECUTOR.add(engine, only=[name], overrides=ENGINE_FLAG_WORDING)
    SCHEDULER.add(engine, only=["enable_prefix_caching"], overrides={"enable_prefix_caching": {"help": None}})
    SCHEDULER.add(engine, only=BENCH_FIELDS)
    engine.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for a launched server")
    out = parser.add_argument_group("output")
    out.add_argument(
        "--output-json", type=Path, help="write the summaries and ratios here (default: ./bench-results/)"
    )
    out.add_argument("--plot", type=Path, help="write a PNG of throughput, TTFT and ITL per variant")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    out.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the variants this many rounds, interleaved; report each variant's median round "
        "and each round's ratios with their median",
    )
    add_logging_flags(out, level="warning")


def _server_spec(args: argparse.Namespace, model: str, load_format: str, variant: Variant) -> ServerSpec:
    """Executor and scheduler flags equal to the offline engine's configuration, and the
    variant's executor roles."""
    executor = EXECUTOR.from_args(args, model=model, load_format=load_format)
    if executor.cpu_threads is None:  # NOTE: as `npuserve serve` runs them
        executor.cpu_threads = AUTO_CPU_THREADS
    passed_on = {name: getattr(args, name) for name in BENCH_FIELDS}
    scheduler = SCHEDULER.default(
        model=model,
        enable_prefix_caching=variant.enable_prefix_caching,
        max_local_prefill_length=max_local_prefill_length(args),
        **passed_on,
    )
    roles = serve_executor_roles(args.num_executors, variant.prefill_executors)
    return ServerSpec(
        [*EXECUTOR.to_flags(executor), *logging_flags(args)],
        [*SCHEDULER.to_flags(scheduler), *logging_flags(args)],
        args.num_executors,
        args.device,
        tuple(roles) if variant.prefill_executors else (),
    )


def materialise_preset(name: str, directory: Path, seed: int) -> Path:
    """A random-weight preset's config.json plus a synthetic word-level tokenizer (one word per id)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from npuserve.deploy.bench import runner as runner_benchmark  # torch: only for presets

    if name not in runner_benchmark.PRESETS:
        raise ValueError(f"unknown --preset {name!r} (choose from {', '.join(runner_benchmark.PRESETS)})")
    runner_benchmark.materialise_preset(name, directory, with_weights=False, seed=seed)
    vocab_size = _vocab_size(str(directory))
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials)} | {
        f"t{i}": i for i in range(len(specials), vocab_size)
    }
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # NOTE: a decoder that the grammar compiler (llguidance) reads: without one the scheduler's
    # grammar worker fails to start, and is started again every few seconds, during the run.
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(directory / "tokenizer.json"))
    special_map = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(special_map))
    return directory


def _vocab_size(model: str) -> int:
    path = Path(model) / "config.json"
    try:
        return int(json.loads(path.read_text())["vocab_size"])
    except (OSError, KeyError, ValueError) as exc:
        raise ValueError(f"cannot read vocab_size from {path}: {exc}") from None


def _run_variant(
    variant: Variant,
    args: argparse.Namespace,
    model: str,
    load_format: str,
    workload: WorkloadConfig,
    requests: Sequence[BenchRequest],
) -> BenchSummary:
    warmup = warmup_requests(workload, _vocab_size(model), args.max_num_batched_tokens)
    if variant.decode_only:
        requests = [r for r in requests if not r.long_prompt]
    with contextlib.ExitStack() as stack:
        target: Target
        if variant.kind == "offline":
            config = EXECUTOR.from_args(args, model=model, load_format=load_format)
            if variant.kv_host_memory_gib is not None:
                config.kv_host_memory_gib = variant.kv_host_memory_gib
            target = OfflineTarget(config, args.num_executors, variant.enable_prefix_caching, variant.name)
        elif args.address:
            tls_ca = args.tls_ca.read_bytes() if args.tls_ca else None
            api_key = resolve_api_key(args.api_key)
            target = GrpcTarget(args.address, variant.name, api_key, tls_ca, args.client_call)
        else:
            spec = _server_spec(args, model, load_format, variant)
            address = stack.enter_context(launched_server(spec, args.startup_timeout))
            target = GrpcTarget(address, variant.name, client_call=args.client_call)
        return measure(target, workload, requests, warmup, progress=not args.disable_tqdm)


def run_bench(args: argparse.Namespace) -> int:
    """`npuserve bench`: runs every variant on one workload; prints, writes and plots the results.

    Returns 0, 1 when a variant failed or lost requests, 2 on a usage error.
    """
    try:
        workload = WorkloadConfig(**same_named(WorkloadConfig, args))
        variants = parse_variants(args)
        if args.repeat < 1:
            raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
    except ValueError as exc:
        return command_error("bench", exc)
    rounds: list[list[BenchSummary]] = []
    host = machine.describe()  # NOTE: before any variant starts its processes
    print(f"machine: {host.summary()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="npuserve-bench-model-") as scratch:
        try:
            if args.preset:
                model, load_format = str(materialise_preset(args.preset, Path(scratch), args.seed)), "dummy"
            else:
                model, load_format = args.model, args.load_format
            requests = build_workload(workload, _vocab_size(model))
            print(
                f"workload: {workload.num_requests} requests, prompts {workload.prompt_len_min}-"
                f"{workload.prompt_len_max} tokens (shared prefix {workload.shared_prefix_len} x {workload.num_prefixes}), output "
                f"{workload.output_len}, rate {workload.request_rate} req/s; model {args.preset or model}",
                flush=True,
            )
            if workload.long_prompts:
                print(
                    f"mixed load: {workload.long_prompts} long prompts of {workload.long_prompt_len} tokens, "
                    f"{workload.long_prompt_rate}/s, output {workload.long_output_len}",
                    flush=True,
                )
            for index in range(args.repeat):
                if args.repeat > 1:
                    print(f"round {index + 1} of {args.repeat}", flush=True)
                rounds.append(
                    [_run_variant(v, args, model, load_format, workload, requests) for v in variants]
                )
        except (BenchError, ValueError) as exc:
            return command_error("bench", exc, 1)
    summaries = report.median_round(rounds)
    print(report.format_serving_table(summaries))
    if len(rounds) > 1 and len(variants) > 1:
        print(report.format_round_ratios(rounds))
    effects = disaggregation_report.serving_effects(rounds)
    if effects:
        print(disaggregation_report.format_effects(effects))
    workload_row = {**asdict(workload), "model": args.preset or model}
    payload = report.serving_json(workload_row, rounds, host)
    if effects:
        payload["long_prompt_effects"] = effects
    report.save_json(args.output_json, "bench", payload)
    if args.plot:
        title = f"{args.preset or Path(model).name}: {workload.num_requests} requests"
        points = disaggregation_report.serving_points_by_round(rounds)
        if points:
            title += f" decoding, {workload.long_prompts} long prompts of {workload.long_prompt_len} tokens arriving"
            disaggregation_report.plot_points(points, args.plot, title)
        else:
            report.plot_serving(summaries, args.plot, title)
    failed = [s for r in rounds for s in r if s.num_failed]
    for s in failed:
        print(
            f"npuserve bench: {s.variant}: {s.num_failed} requests failed: {s.first_error}", file=sys.stderr
        )
    return 1 if failed else 0
