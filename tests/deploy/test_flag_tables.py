"""One table per config: the flags a config becomes parse back into the same config, and every
command's --help still lists every flag of its tables."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from npuserve.deploy.cli import build_parser
from npuserve.deploy.executor_flags import EXECUTOR, PARALLEL, REGISTRY, parallel_config_from_args
from npuserve.deploy.flags import CLUSTER_TOKEN_ENV
from npuserve.deploy.scheduler_flags import SCHEDULER, SERVING_FIELDS
from npuserve.executor.config import ExecutorConfig
from npuserve.executor.cpu_threads import AUTO_CPU_THREADS
from npuserve.executor.parallel_config import ParallelConfig
from npuserve.executor.registration import RegistryConfig
from npuserve.proto.auth import API_KEY
from npuserve.scheduler.core.step_passes import AUTO_SCHEDULER_STEPS
from npuserve.scheduler.service_config import ServiceConfig


def parse(command: str, *flags: str):
    return build_parser().parse_args([command, *flags])


@pytest.mark.parametrize(
    "config",
    [
        ExecutorConfig(model="/models/m"),
        ExecutorConfig(model="/models/m", cpu_threads=AUTO_CPU_THREADS),
        ExecutorConfig(
            model="/models/with space",
            device="cpu",
            dtype="bfloat16",
            block_size=32,
            max_model_len=1024,
            max_num_seqs=7,
            max_num_batched_tokens=999,
            kv_cache_memory_gib=0.25,
            gpu_memory_utilization=0.5,
            load_format="dummy",
            seed=3,
            cpu_threads=2,
        ),
        ExecutorConfig(model="/models/m", device="npu", enforce_eager=True),
        ExecutorConfig(model="/models/m", device="npu", graph_capture_sizes=(1, 4, 16)),
    ],
)
def test_executor_config_round_trips(config: ExecutorConfig) -> None:
    flags = EXECUTOR.to_flags(config)
    assert EXECUTOR.from_args(parse("executor", *flags)) == config
    # NOTE: serve gives each executor its role (--prefill-executors), not one for all.
    assert EXECUTOR.from_args(parse("serve", *EXECUTOR.to_flags(config, exclude=["role"]))) == config


def test_scheduler_config_round_trips(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CLUSTER_TOKEN_ENV, raising=False)
    config = ServiceConfig(
        model="/models/m",
        executors=["10.0.0.1:50061", "10.0.0.2:50061"],
        served_model_name="mine",
        chat_template="{{ messages }}",
        enable_prefix_caching=False,
        routing="least-load",
        routing_prefill_weight=2.5,
        max_queued_requests=5,
        stream_interval=4,
        num_scheduler_steps=8,
        step_timeout_s=9.5,
        connect_timeout_s=7.0,
        registry="redis://redis:6379/1",
        registry_prefix="other",
    )
    flags = SCHEDULER.to_flags(config)
    assert SCHEDULER.from_args(parse("scheduler", *flags)) == config
    default = SCHEDULER.default(model="/models/m", executors=["h:1"])
    assert SCHEDULER.from_args(parse("scheduler", *SCHEDULER.to_flags(default))) == default
    auto = SCHEDULER.from_args(
        parse("scheduler", "--model", "m", "--executors", "h:1", "--num-scheduler-steps", "auto")
    )
    assert auto.num_scheduler_steps == AUTO_SCHEDULER_STEPS
    assert SCHEDULER.from_args(parse("scheduler", *SCHEDULER.to_flags(auto))) == auto


@pytest.mark.parametrize(("flags", "async_scheduling"), [((), True), (("--async-scheduling",), True), (("--no-async-scheduling",), False)])  # fmt: skip
def test_async_scheduling_is_on_unless_turned_off(flags: tuple[str, ...], async_scheduling: bool) -> None:
    config = SCHEDULER.from_args(parse("scheduler", "--model", "m", "--executors", "h:1", *flags))
    assert config.async_scheduling is async_scheduling
    assert SCHEDULER.from_args(parse("scheduler", *SCHEDULER.to_flags(config))) == config


def test_secrets_stay_out_of_the_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_bytes(b"PEM")
    args = parse(
        "scheduler", "--model", "m", "--executors", "h:1", "--cluster-token", "s3cret", "--tls-ca", str(ca)
    )
    config = SCHEDULER.from_args(args)
    assert (config.cluster_token, config.tls_ca) == ("s3cret", b"PEM")
    flags = SCHEDULER.to_flags(config)
    assert not any("s3cret" in flag or "tls-ca" in flag for flag in flags)
    monkeypatch.setenv(CLUSTER_TOKEN_ENV, "from-env")
    assert SCHEDULER.from_args(parse("scheduler", *flags)).cluster_token == "from-env"


def test_parallel_and_registry_configs_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("NPUSERVE_TP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    parallel = ParallelConfig(
        size=2, rank=1, master_addr="10.0.0.1", master_port=29500, connect_timeout_s=3.0,
        collective_timeout_s=600.0, worker_flags=("--log-level=debug", "--log-format=json"),
    )  # fmt: skip
    args = parse("executor", "--model", "m", *PARALLEL.to_flags(parallel), *parallel.worker_flags)
    assert parallel_config_from_args(args) == parallel
    registry = RegistryConfig("redis://r:6379/2", "pre", 3.0, "node-3:50061")
    assert REGISTRY.from_args(parse("executor", "--model", "m", *REGISTRY.to_flags(registry))) == registry


def _help(command: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parse(command, "--help")
    return out.getvalue()


def test_help_lists_every_flag_of_the_tables() -> None:
    executor, scheduler, serve = _help("executor"), _help("scheduler"), _help("serve")
    for flag in [*EXECUTOR.flags, *PARALLEL.flags]:
        assert flag.name in executor and flag.name in serve
    for flag in REGISTRY.flags:
        assert flag.name in executor
    for flag in SCHEDULER.flags:
        assert flag.name in scheduler
        if flag.field in SERVING_FIELDS:
            assert flag.name in serve
    assert "KV cache size in GiB" in executor and "share KV blocks of equal prefixes" in serve
    assert "KV cache GiB per executor" in _help("bench")


def test_gateway_config_round_trips(monkeypatch: pytest.MonkeyPatch) -> None:
    from npuserve.deploy.gateway_flags import GATEWAY, gateway_config_from_args
    from npuserve.gateway.tool_parsers import TOOL_PARSERS

    monkeypatch.delenv(API_KEY.env, raising=False)
    where = ["--scheduler", "10.0.0.1:50051", "--host", "0.0.0.0", "--port", "8080"]
    given = [
        "--max-request-bytes=4096",
        "--request-header-timeout=2.5",
        "--keep-alive-timeout=1",
        "--max-connections=7",
        "--max-stream-buffer-bytes=65536",
        "--enable-auto-tool-choice",
        "--tool-call-parser=hermes",
        "--served-model-name=mine",
    ]
    args = parse("gateway", *where, *given)
    config = gateway_config_from_args(args)
    assert (config.limits.max_request_bytes, config.max_connections, config.served_model_name) == (
        4096,
        7,
        "mine",
    )
    assert (config.request_header_timeout_s, config.request_body_timeout_s) == (2.5, 30.0)
    assert config.max_stream_buffer_bytes == 65536
    assert config.parsers.auto_tool_parser is TOOL_PARSERS["hermes"] and config.parsers.reasoning is None
    assert gateway_config_from_args(parse("gateway", *where, *GATEWAY.forward(args))) == config
    assert "--api-key" in _help("gateway") and "--max-connections" in _help("serve")
    with pytest.raises(ValueError, match="--max-stream-buffer-bytes"):
        gateway_config_from_args(parse("gateway", *where, "--max-stream-buffer-bytes=-1"))


def test_serve_forwards_the_gateways_parser_flags_switches_included() -> None:
    from npuserve.deploy.gateway_flags import chat_parser_settings, gateway_flags
    from npuserve.gateway.reasoning import REASONING_PARSERS
    from npuserve.gateway.tool_parsers import TOOL_PARSERS

    parser = build_parser()
    given = ["--enable-auto-tool-choice", "--tool-call-parser", "mistral", "--reasoning-parser", "qwen3"]
    serve = parser.parse_args(["serve", *given])
    forwarded = gateway_flags(serve)
    assert "--enable-auto-tool-choice" in forwarded  # a bare switch, not "=True"
    gateway = parser.parse_args(["gateway", "--scheduler", "127.0.0.1:1", *forwarded])
    settings = chat_parser_settings(gateway)
    assert settings.auto_tool_parser is TOOL_PARSERS["mistral"]
    assert settings.reasoning is REASONING_PARSERS["qwen3"]
    plain = gateway_flags(parser.parse_args(["serve"]))
    assert not any("tool" in flag or "reasoning" in flag for flag in plain)


@pytest.mark.parametrize(
    ("flags", "steps", "threads"),
    [
        (["--num-scheduler-steps", "auto", "--cpu-threads", "AUTO"], AUTO_SCHEDULER_STEPS, AUTO_CPU_THREADS),
        (["--num-scheduler-steps", "8", "--cpu-threads", "3"], 8, 3),
    ],
)
def test_counts_that_may_be_auto(flags: list[str], steps: int, threads: int) -> None:
    args = parse("serve", *flags)
    assert (args.num_scheduler_steps, args.cpu_threads) == (steps, threads)


@pytest.mark.parametrize("flag", ["--num-scheduler-steps", "--cpu-threads"])
def test_counts_that_may_be_auto_refuse_anything_else(flag: str) -> None:
    with contextlib.redirect_stderr(io.StringIO()) as err, pytest.raises(SystemExit):
        parse("serve", flag, "many")
    assert "or 'auto', got 'many'" in err.getvalue()


def test_serves_stall_timeout_is_the_gateways_and_the_scheduler_keeps_its_own() -> None:
    from npuserve.deploy.gateway_flags import gateway_flags
    from npuserve.deploy.scheduler_flags import serve_scheduler_config

    serve = parse("serve", "--stream-stall-timeout", "2")
    assert "--stream-stall-timeout=2.0" in gateway_flags(serve)
    default = SCHEDULER.defaults()["stream_stall_timeout_s"]
    assert serve_scheduler_config(serve, executors=["h:1"]).stream_stall_timeout_s == default != 2.0
    scheduler = parse("scheduler", "--model", "m", "--executors", "h:1", "--stream-stall-timeout", "5")
    assert SCHEDULER.from_args(scheduler).stream_stall_timeout_s == 5.0
    with pytest.raises(ValueError, match="--stream-stall-timeout"):
        SCHEDULER.from_args(
            parse("scheduler", "--model", "m", "--executors", "h:1", "--stream-stall-timeout", "-1")
        )


def test_an_executors_role_is_its_own_flag_and_serves_prefill_executors_set_the_roles() -> None:
    from npuserve.deploy.executor_flags import serve_executor_roles

    config = ExecutorConfig(model="/models/m", role="prefill")
    assert EXECUTOR.from_args(parse("executor", *EXECUTOR.to_flags(config))) == config
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit):
        parse("serve", "--role", "prefill")  # NOTE: serve sets each executor's
    assert parse("serve", "--num-executors", "3", "--prefill-executors", "1").prefill_executors == 1
    assert serve_executor_roles(3, 1) == ["prefill", "decode", "decode"]
    assert serve_executor_roles(2, 0) == ["mixed", "mixed"]
    for num_executors, num_prefill in [(2, 2), (1, 1), (2, -1)]:
        with pytest.raises(ValueError, match="--prefill-executors"):
            serve_executor_roles(num_executors, num_prefill)
    with pytest.raises(ValueError, match="--role"):
        ExecutorConfig(model="/models/m", role="both")
