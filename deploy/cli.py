"""The `npuserve` command line. Flag names follow vLLM's where they mean the same thing."""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
from pathlib import Path

from npuserve.deploy.logs import configure_logging


def _csv(kind: type) -> object:
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(part) for part in text.split(",") if part)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _add_logging_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--log-format", default="console", choices=["console", "json"])


def _add_scheduler_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--served-model-name",
        help="the name clients use (default: --model as given; stories260K for the demo model)",
    )
    parser.add_argument("--chat-template", help="a Jinja chat template, or a file holding one")
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render chat templates that clients send (off: such requests are refused)",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share KV blocks of equal prefixes",
    )
    parser.add_argument("--routing", default="prefix-aware", choices=["prefix-aware", "least-load"])
    parser.add_argument(
        "--max-queued-requests", type=int, help="refuse new requests beyond this many waiting"
    )
    parser.add_argument("--step-transport", default="unary", choices=["unary", "stream"])
    parser.add_argument(
        "--step-timeout", type=float, default=60.0, help="seconds an executor may take per step"
    )


def _scheduler_config(args: argparse.Namespace, executors: list[str]):
    from npuserve.deploy.flags import cluster_token
    from npuserve.scheduler.server import SchedulerConfig

    return SchedulerConfig(
        model=args.model,
        executors=executors,
        served_model_name=args.served_model_name,
        chat_template=args.chat_template,
        trust_request_chat_template=args.trust_request_chat_template,
        enable_prefix_caching=args.enable_prefix_caching,
        routing=args.routing,
        max_queued_requests=args.max_queued_requests,
        step_transport=args.step_transport,
        step_timeout_s=args.step_timeout,
        connect_timeout_s=args.connect_timeout,
        registry=args.registry,
        registry_prefix=args.registry_prefix,
        cluster_token=cluster_token(args),
        tls_ca=args.tls_ca.read_bytes() if args.tls_ca else None,
    )


def build_parser() -> argparse.ArgumentParser:
    from npuserve.deploy.demo_model import DEMO_MODEL_DIR
    from npuserve.deploy.flags import (
        add_cluster_token_flag,
        add_executor_cluster_flags,
        add_executor_flags,
        add_gateway_flags,
    )

    parser = argparse.ArgumentParser(prog="npuserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="executors, scheduler and the OpenAI-compatible gateway")
    add_executor_flags(serve)
    serve.set_defaults(port=8000, host="127.0.0.1")
    _add_scheduler_flags(serve)
    serve.add_argument(
        "--scheduler-port", type=int, default=0, help="the scheduler's gRPC port (0: a free one)"
    )
    add_gateway_flags(serve, standalone=False)
    serve.add_argument("--num-executors", type=int, default=1, help="executor processes (one per device)")
    serve.add_argument("--startup-timeout", type=float, default=600.0)
    _add_logging_flags(serve)

    executor = commands.add_parser("executor", help="one executor: a model on one device, over gRPC")
    add_executor_flags(executor)
    add_executor_cluster_flags(executor)
    _add_logging_flags(executor)

    scheduler = commands.add_parser("scheduler", help="the scheduler, driving running executors")
    scheduler.add_argument(
        "--model",
        default=str(DEMO_MODEL_DIR),
        help="model directory (tokenizer and chat template; default: the bundled stories260K demo model)",
    )
    scheduler.add_argument("--executors", type=_csv(str), help="comma list of HOST:PORT (or --registry)")
    scheduler.add_argument("--registry", help="redis://HOST:PORT/DB: discover the executors registered there")
    scheduler.add_argument("--registry-prefix", default="npuserve", help="prefix of the registry keys")
    scheduler.add_argument(
        "--connect-timeout", type=float, default=600.0, help="seconds to wait for the first executor(s)"
    )
    scheduler.add_argument("--tls-ca", type=Path, help="PEM CA certificates: reach executors over TLS")
    add_cluster_token_flag(scheduler)
    scheduler.add_argument("--host", default="127.0.0.1")
    scheduler.add_argument("--port", type=int, default=50051)
    scheduler.add_argument("--ready-file", type=Path)
    _add_scheduler_flags(scheduler)
    _add_logging_flags(scheduler)

    gateway = commands.add_parser("gateway", help="the OpenAI-compatible REST gateway of a running scheduler")
    gateway.add_argument("--scheduler", required=True, help="the scheduler's gRPC address, HOST:PORT")
    gateway.add_argument("--host", default="127.0.0.1")
    gateway.add_argument("--port", type=int, default=8000)
    gateway.add_argument("--ready-file", type=Path)
    add_gateway_flags(gateway, standalone=True)
    _add_logging_flags(gateway)

    doctor = commands.add_parser("doctor", help="check the driver, CANN, versions, NPUs and a model")
    from npuserve.deploy.doctor.command import add_doctor_flags

    add_doctor_flags(doctor)
    _add_logging_flags(doctor)

    serving_bench = commands.add_parser(
        "bench", help="serving throughput, TTFT and inter-token latency, offline or over gRPC"
    )
    from npuserve.scheduler.benchmark import add_bench_flags

    add_bench_flags(serving_bench)

    bench = commands.add_parser(
        "bench-runner",
        help="decode throughput of the ModelRunner, against transformers on the same weights",
    )
    bench.add_argument("--model", help="a local model directory (default: a random-weight preset)")
    bench.add_argument("--preset", default="llama-150m", help="random-weight model preset")
    bench.add_argument("--dtype", type=_csv(str), default=("float32", "bfloat16"), help="comma list")
    bench.add_argument("--batch-sizes", type=_csv(int), default=(1, 8, 32), help="comma list")
    bench.add_argument("--prompt-len", type=int, default=128)
    bench.add_argument("--output-len", type=int, default=128)
    bench.add_argument("--kv-cache-memory", type=float, default=2.0, help="GiB")
    bench.add_argument("--no-compare", action="store_true", help="skip transformers")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--output-json", type=Path, help="write every case as JSON here")
    bench.add_argument("--plot", type=Path, help="write a PNG of tokens/s against batch size")
    _add_logging_flags(bench)
    return parser


def run_serve(args: argparse.Namespace) -> int:
    from npuserve.deploy.flags import CLUSTER_TOKEN_ENV, cluster_token
    from npuserve.deploy.launcher import Launcher, LaunchError

    executor_args = _forwarded(args, exclude={"port", "host", "ready_file", "executor_id"})
    executor_args += ["--no-warmup"] if args.no_warmup else []
    # NOTE: a token even on loopback (other local users can reach the ports), made up when none
    # is given; it travels in the environment, not in argv where `ps` shows it.
    token_env = {CLUSTER_TOKEN_ENV: cluster_token(args) or secrets.token_urlsafe(32)}
    launcher = Launcher()
    try:
        executors = []
        for index in range(args.num_executors):
            env = {
                **_device_env(args.device, index, args.num_executors, args.tensor_parallel_size),
                **token_env,
            }
            executors.append(
                launcher.start(f"executor-{index}", ["executor", *executor_args, "--port", "0"], env)
            )
        ready = launcher.wait_ready(executors, args.startup_timeout)
        addresses = ",".join(str(r["address"]) for r in ready)
        scheduler_args = [
            "scheduler",
            "--model",
            args.model,
            "--executors",
            addresses,
            "--port",
            str(args.scheduler_port),
        ]
        scheduler_args += _forwarded_scheduler_flags(args)
        scheduler = launcher.start("scheduler", scheduler_args, token_env)
        (info,) = launcher.wait_ready([scheduler], args.startup_timeout)
        gateway_args = ["gateway", "--scheduler", str(info["address"]), "--host", args.host]
        gateway_args += ["--port", str(args.port), *_flags(args, _GATEWAY_FLAGS)]
        # NOTE: the API key travels in the environment, not in argv where `ps` shows it.
        gateway_env = {"NPUSERVE_API_KEY": args.api_key} if args.api_key else None
        gateway = launcher.start("gateway", gateway_args, gateway_env)
        (url_info,) = launcher.wait_ready([gateway], args.startup_timeout)
        print(
            f"npuserve ready: scheduler gRPC at {info['address']}, OpenAI API at {url_info['url']}, "
            f"model {info['model']}",
            flush=True,
        )
        return launcher.supervise()
    except LaunchError as exc:
        print(f"npuserve serve: error: {exc}", file=sys.stderr)
        return 1
    finally:
        launcher.stop()


def _device_env(device: str, index: int, count: int, tp_size: int = 1) -> dict[str, str]:
    """Pins executor ``index`` to its ``tp_size`` devices when several share the machine."""
    if count == 1 or device not in ("npu", "cuda"):
        return {}
    devices = ",".join(str(index * tp_size + rank) for rank in range(tp_size))
    return {"ASCEND_RT_VISIBLE_DEVICES" if device == "npu" else "CUDA_VISIBLE_DEVICES": devices}


_EXECUTOR_FLAGS = [
    "model",
    "device",
    "dtype",
    "block_size",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_cache_memory",
    "gpu_memory_utilization",
    "load_format",
    "seed",
    "tensor_parallel_size",
    "tp_connect_timeout",
    "profile_dir",
    "log_level",
    "log_format",
]
_SCHEDULER_FLAGS = [
    "served_model_name",
    "chat_template",
    "routing",
    "max_queued_requests",
    "step_transport",
    "step_timeout",
    "log_level",
    "log_format",
]

_GATEWAY_FLAGS = ["max_request_bytes", "log_level", "log_format"]


def _flags(args: argparse.Namespace, names: list[str]) -> list[str]:
    out: list[str] = []
    for name in names:
        value = getattr(args, name)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out


def _forwarded(args: argparse.Namespace, exclude: set[str]) -> list[str]:
    return _flags(args, [n for n in _EXECUTOR_FLAGS if n not in exclude])


def _forwarded_scheduler_flags(args: argparse.Namespace) -> list[str]:
    flags = _flags(args, _SCHEDULER_FLAGS)
    flags += ["--trust-request-chat-template"] if args.trust_request_chat_template else []
    return [*flags, "--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching"]


def run_gateway(args: argparse.Namespace) -> int:
    from npuserve.gateway.server import run_gateway

    return run_gateway(args)


def run_executor(args: argparse.Namespace) -> int:
    from npuserve.executor.server import run_from_args

    return run_from_args(args)


def run_scheduler(args: argparse.Namespace) -> int:
    from npuserve.scheduler.server import serve_scheduler

    if bool(args.executors) == bool(args.registry):
        print("npuserve scheduler: error: give --executors or --registry (one of them)", file=sys.stderr)
        return 2
    try:
        config = _scheduler_config(args, list(args.executors or ()))
    except OSError as exc:
        print(f"npuserve scheduler: error: cannot read --tls-ca: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve_scheduler(config, args.host, args.port, args.ready_file))
    return 0


def run_bench_runner(args: argparse.Namespace) -> int:
    from npuserve.executor import benchmark
    from npuserve.executor.config import ConfigError
    from npuserve.executor.platform import PlatformError

    config = benchmark.BenchmarkConfig(
        preset=args.preset,
        model=args.model,
        dtypes=args.dtype,
        batch_sizes=args.batch_sizes,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        compare_transformers=not args.no_compare,
        seed=args.seed,
        kv_cache_memory_gib=args.kv_cache_memory,
    )
    try:
        results = benchmark.run_benchmark(config)
    except (ConfigError, PlatformError) as exc:
        print(f"npuserve bench-runner: error: {exc}", file=sys.stderr)
        return 2
    print(benchmark.report_table(results))
    if args.output_json:
        args.output_json.write_text(json.dumps([r.row() for r in results], indent=2))
    if args.plot:
        benchmark.plot(results, args.plot)
    return 0


def run_doctor(args: argparse.Namespace) -> int:
    from npuserve.deploy.doctor.command import run_doctor

    return run_doctor(args)


def run_serving_bench(args: argparse.Namespace) -> int:
    from npuserve.scheduler.benchmark import run_bench

    return run_bench(args)


COMMANDS = {
    "bench": run_serving_bench,
    "serve": run_serve,
    "executor": run_executor,
    "scheduler": run_scheduler,
    "gateway": run_gateway,
    "bench-runner": run_bench_runner,
    "doctor": run_doctor,
}


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format == "json")
    sys.exit(COMMANDS[args.command](args))


if __name__ == "__main__":
    main()
