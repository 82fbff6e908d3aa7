"""The `npuserve` command line. Flag names follow vLLM's where they mean the same thing.

The executor's and the scheduler's flags come from their config tables (`executor_flags`,
`scheduler_flags`), which also write the command lines of the processes `serve` starts.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from npuserve.deploy.flag_table import imported
from npuserve.deploy.runtime.logs import configure_logging


def add_serve_flags(serve: argparse.ArgumentParser) -> None:
    from npuserve.deploy.executor_flags import add_executor_flags
    from npuserve.deploy.flags import add_allow_unauthenticated_flag, add_logging_flags
    from npuserve.deploy.gateway_flags import add_serve_gateway_flags
    from npuserve.deploy.runtime.shutdown import add_shutdown_timeout_flag
    from npuserve.deploy.scheduler_flags import GATEWAY_NAMED_FIELDS, SCHEDULER, SERVING_FIELDS

    add_executor_flags(serve, exclude=["role"])
    serve.set_defaults(port=8000, host="127.0.0.1")
    SCHEDULER.add(serve, only=SERVING_FIELDS, exclude=GATEWAY_NAMED_FIELDS)
    serve.add_argument(
        "--scheduler-port", type=int, default=0, help="the scheduler's gRPC port (0: a free one)"
    )
    add_serve_gateway_flags(serve)
    add_allow_unauthenticated_flag(serve)
    serve.add_argument(
        "--num-executors",
        type=int,
        help="executor processes, one per device (default: one per visible NPU with --device npu, else 1)",
    )
    serve.add_argument(
        "--prefill-executors",
        type=int,
        default=0,
        metavar="N",
        help="of the executors, N prefill the long prompts (--max-local-prefill-length) and the "
        "others decode (default: 0, every executor does both)",
    )
    serve.add_argument("--startup-timeout", type=float, default=600.0)
    add_shutdown_timeout_flag(serve)
    add_logging_flags(serve)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every command with its flags; with ``only``, the other commands without theirs.

    NOTE: a command's flags import what the command runs (the bench flags import the engine), so
    `main` builds only the command it runs: each of the processes `serve` starts parses faster.
    """
    parser = argparse.ArgumentParser(prog="npuserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        subparser = commands.add_parser(name, help=command.help, formatter_class=command.formatter_class)
        if only is None or only == name:
            command.add_flags(subparser)
    return parser


def run_serve(args: argparse.Namespace) -> int:
    """Starts the executors, the scheduler and the gateway, keeps them up (`supervisor`), and
    drains them in order at SIGTERM/SIGINT."""
    from npuserve.deploy.executor_flags import EXECUTOR, PARALLEL, serve_executor_roles
    from npuserve.deploy.flags import command_error, logging_flags, resolve_api_key, resolve_cluster_token
    from npuserve.deploy.gateway_flags import chat_parser_settings, gateway_flags
    from npuserve.deploy.launcher import STOP_GRACE_S, Launcher, LaunchError, device_env
    from npuserve.deploy.runtime.cpu_priority import control_plane_nice
    from npuserve.deploy.runtime.shutdown import Shutdown
    from npuserve.deploy.scheduler_flags import SCHEDULER, serve_scheduler_config
    from npuserve.deploy.supervisor import Supervisor
    from npuserve.proto.auth import API_KEY, CLUSTER_TOKEN, GATEWAY_API_KEY, exposure_problem
    from npuserve.proto.ready_file import write_ready_file

    has_key = bool(resolve_api_key(args.api_key))
    if problem := exposure_problem(args.host, GATEWAY_API_KEY, has_key, args.allow_unauthenticated):
        return command_error("serve", problem)

    # NOTE: a token even on loopback (other local users can reach the ports), made up when none
    # is given; it travels in the environment, not in argv where `ps` shows it.
    token_env = {CLUSTER_TOKEN.env: resolve_cluster_token(args.cluster_token) or secrets.token_urlsafe(32)}
    # NOTE: the API key travels in the environment, not in argv where `ps` shows it.
    key_env = {API_KEY.env: args.api_key} if args.api_key else {}
    num_executors = _num_executors(args)
    try:
        roles = serve_executor_roles(num_executors, args.prefill_executors)
    except ValueError as exc:
        return command_error("serve", exc)
    common = [*logging_flags(args), f"--shutdown-timeout={args.shutdown_timeout:g}"]
    launcher = Launcher()
    supervisor = Supervisor(launcher)
    shutdown = Shutdown()
    address_of: dict[str, str] = {}  # executor name -> its address (kept across restarts)

    # NOTE: a child restarts on the port it first got: the scheduler reconnects to executors at
    # their address, and the gateway to the scheduler; clients find the gateway where it was.
    # Children run in sessions of their own, so a terminal's Ctrl-C reaches only serve, which
    # drains them in order.
    # NOTE: forwarded as given (each executor validates them): serve itself never imports torch.
    # Each executor is rank 0 of a tensor-parallel group of its own on this node.
    parallel = PARALLEL.forward(args, only=["size", "connect_timeout_s", "collective_timeout_s"])
    executor_flags = [*EXECUTOR.forward(args, exclude=["role"]), *parallel, *common]
    if args.cpu_threads is None:  # NOTE: a core for the scheduler and the gateway, if it costs little
        executor_flags += ["--cpu-threads", "auto"]

    def executor_args(role: str, port: int) -> list[str]:
        return ["executor", *executor_flags, "--role", role, "--port", str(port)]

    def scheduler_args(port: int) -> list[str]:
        executors = [address_of[s.child.name] for s in supervisor.live_executors()]
        config = serve_scheduler_config(args, executors=executors)
        return ["scheduler", *SCHEDULER.to_flags(config), *common, "--port", str(port)]

    def gateway_args(scheduler: str, port: int) -> list[str]:
        where = ["--scheduler", scheduler, "--host", args.host, "--port", str(port)]
        allowed = ["--allow-unauthenticated"] if args.allow_unauthenticated else []
        return ["gateway", *where, *allowed, *common, *gateway_flags(args)]

    try:
        chat_parser_settings(args)  # the gateway's flags that cannot work, refused before any start
        executors = []
        for index in range(num_executors):
            env = {**device_env(args.device, index, num_executors, args.tensor_parallel_size), **token_env}
            name = f"executor-{index}"
            executors.append(
                launcher.start(name, executor_args(roles[index], 0), env, own_process_group=True)
            )
        ready = launcher.wait_ready(executors, args.startup_timeout)
        for index, (child, info) in enumerate(zip(executors, ready, strict=True)):
            address_of[child.name] = str(info["address"])
            restart = partial(executor_args, roles[index], _port(address_of[child.name]))
            supervisor.watch(child, "executor", restart)
        nice = control_plane_nice(ready)
        scheduler = launcher.start(
            "scheduler",
            scheduler_args(args.scheduler_port),
            {**token_env, **key_env},
            own_process_group=True,
            nice=nice,
        )
        (info,) = launcher.wait_ready([scheduler], args.startup_timeout)
        supervisor.watch(scheduler, "scheduler", partial(scheduler_args, _port(str(info["address"]))))
        gateway = launcher.start(
            "gateway",
            gateway_args(str(info["address"]), args.port),
            key_env or None,
            own_process_group=True,
            nice=nice,
        )
        (url_info,) = launcher.wait_ready([gateway], args.startup_timeout)
        url_port = urllib.parse.urlsplit(str(url_info["url"])).port or args.port
        supervisor.watch(gateway, "gateway", partial(gateway_args, str(info["address"]), url_port))
        print(
            f"npuserve ready: scheduler gRPC at {info['address']}, OpenAI API at {url_info['url']}, "
            f"model {info['model']}",
            flush=True,
        )
        if args.ready_file is not None:
            write_ready_file(
                args.ready_file, {"address": info["address"], "url": url_info["url"], "model": info["model"]}
            )
        shutdown.install()
        code = supervisor.run(shutdown)
        if code == 0:
            supervisor.drain(shutdown, args.shutdown_timeout)
        return code
    except (LaunchError, ValueError) as exc:
        return command_error("serve", exc, 1)
    finally:
        launcher.stop(0.5 if shutdown.now.is_set() else STOP_GRACE_S)


def _port(address: str) -> int:
    """The port of HOST:PORT."""
    return int(address.rsplit(":", 1)[1])


def _num_executors(args: argparse.Namespace) -> int:
    """--num-executors, or on npu one executor per ``--tensor-parallel-size`` visible NPUs."""
    if args.num_executors is not None:
        return args.num_executors
    if args.device != "npu":  # npu:N names one device
        return 1
    from npuserve.executor.npu_devices import visible_npu_ids

    return max(1, len(visible_npu_ids()) // args.tensor_parallel_size)


def run_gateway(args: argparse.Namespace) -> int:
    from npuserve.deploy.flags import command_error
    from npuserve.deploy.gateway_flags import gateway_config_from_args
    from npuserve.gateway.server import run_gateway
    from npuserve.proto.auth import GATEWAY_API_KEY, exposure_problem

    try:
        config = gateway_config_from_args(args)
    except ValueError as exc:
        return command_error("gateway", exc)
    if problem := exposure_problem(
        args.host, GATEWAY_API_KEY, bool(config.api_key), args.allow_unauthenticated
    ):
        return command_error("gateway", problem)
    return run_gateway(config)


def run_executor(args: argparse.Namespace) -> int:
    """`npuserve executor`: serves with these flags; 2 (and the message) on a user error. Rank 0
    of a single-node tensor-parallel group starts the other ranks as `LocalRanks`."""
    from npuserve.deploy.executor_flags import EXECUTOR, cluster_from_args, parallel_config_from_args
    from npuserve.deploy.flags import command_error, resolve_cluster_token
    from npuserve.deploy.local_ranks import LocalRanks
    from npuserve.deploy.runtime.shutdown import DEFAULT_SHUTDOWN_TIMEOUT_S
    from npuserve.executor.config import ConfigError
    from npuserve.executor.platform import PlatformError
    from npuserve.executor.server import serve_executor
    from npuserve.proto.auth import CLUSTER_TOKEN, exposure_problem

    try:
        token = resolve_cluster_token(args.cluster_token)
        allowed = getattr(args, "allow_unauthenticated", False)
        if problem := exposure_problem(args.host, CLUSTER_TOKEN, bool(token), allowed):
            raise ConfigError(problem)
        tls, registry = cluster_from_args(args)
        serve_executor(
            EXECUTOR.from_args(args),
            args.host,
            args.port,
            args.ready_file,
            args.executor_id,
            cluster_token=token,
            tls=tls,
            registry=registry,
            parallel=parallel_config_from_args(args),
            start_ranks=LocalRanks,
            shutdown_timeout_s=getattr(args, "shutdown_timeout", DEFAULT_SHUTDOWN_TIMEOUT_S),
        )
    except (ConfigError, PlatformError) as exc:
        return command_error("executor", exc)
    return 0


def run_scheduler(args: argparse.Namespace) -> int:
    from npuserve.deploy.flags import command_error
    from npuserve.deploy.runtime import event_loop
    from npuserve.deploy.scheduler_flags import SCHEDULER
    from npuserve.proto.auth import API_KEY, exposure_problem
    from npuserve.scheduler.server import serve_scheduler

    if bool(args.executors) == bool(args.registry):
        return command_error("scheduler", "give --executors or --registry (one of them)")
    try:
        config = SCHEDULER.from_args(args)
    except OSError as exc:
        return command_error("scheduler", f"cannot read --tls-ca: {exc}")
    except ValueError as exc:
        return command_error("scheduler", exc)
    if problem := exposure_problem(args.host, API_KEY, bool(config.api_key), args.allow_unauthenticated):
        return command_error("scheduler", problem)
    event_loop.run(
        serve_scheduler(
            config,
            args.host,
            args.port,
            args.ready_file,
            args.log_level,
            args.log_format == "json",
            shutdown_timeout_s=args.shutdown_timeout,
        )
    )
    return 0


@dataclass(frozen=True)
class Command:
    """One `npuserve` command: its help line, what adds its flags (importing what they need) and
    what runs it."""

    help: str
    add_flags: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    formatter_class: type[argparse.HelpFormatter] = argparse.HelpFormatter


COMMANDS = {
    "serve": Command("executors, scheduler and the OpenAI-compatible gateway", add_serve_flags, run_serve),
    "executor": Command(
        "one executor: a model on one device, over gRPC",
        imported("npuserve.deploy.executor_flags", "add_executor_command_flags"),
        run_executor,
    ),
    "scheduler": Command(
        "the scheduler, driving running executors",
        imported("npuserve.deploy.scheduler_flags", "add_scheduler_flags"),
        run_scheduler,
    ),
    "gateway": Command(
        "the OpenAI-compatible REST gateway of a running scheduler",
        imported("npuserve.deploy.gateway_flags", "add_gateway_command_flags"),
        run_gateway,
    ),
    "doctor": Command(
        "check the driver, CANN, versions, NPUs and a model",
        imported("npuserve.deploy.doctor.command", "add_doctor_flags"),
        imported("npuserve.deploy.doctor.command", "run_doctor"),
    ),
    "bench": Command(
        "serving throughput, TTFT and inter-token latency, offline or over gRPC",
        imported("npuserve.deploy.bench.serving", "add_bench_flags"),
        imported("npuserve.deploy.bench.serving", "run_bench"),
    ),
    "bench-runner": Command(
        "decode throughput of the ModelRunner, against transformers on the same weights",
        imported("npuserve.deploy.bench.runner_flags", "add_runner_bench_flags"),
        imported("npuserve.deploy.bench.runner", "run_runner_bench"),
    ),
    "bench-scale": Command(
        "how far one scheduler scales over many simulated executors",
        imported("npuserve.deploy.bench.scale", "add_scale_bench_flags"),
        imported("npuserve.deploy.bench.scale", "run_scale_bench"),
        argparse.RawDescriptionHelpFormatter,
    ),
}


def main(argv: list[str] | None = None) -> None:
    from npuserve.deploy.grpc_env import set_grpc_environment

    set_grpc_environment()  # NOTE: first: no command has started gRPC yet
    arguments = sys.argv[1:] if argv is None else argv
    named = arguments[0] if arguments and arguments[0] in COMMANDS else None
    args = build_parser(only=named).parse_args(arguments)
    configure_logging(args.log_level, args.log_format == "json")
    sys.exit(COMMANDS[args.command].run(args))


if __name__ == "__main__":
    main()
