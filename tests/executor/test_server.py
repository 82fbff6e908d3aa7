"""A real executor process, driven over real gRPC, gives the tokens an in-process ModelRunner gives."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from harness.blocking_client import BlockingClient
from harness.faulty_runner import FaultyRunner
from harness.step_driver import DrivenRequest, StepDriver

from npuserve.deploy.launcher import Child, Launcher, LaunchError
from npuserve.executor.config import ExecutorConfig
from npuserve.executor.model_runner import ModelRunner
from npuserve.executor.server import start_executor_server
from npuserve.proto.step_plan import ExecutorInfo, SamplingOptions, StepPlan, StepResult
from npuserve.scheduler.lanes.executor_client import ExecutorError

PROMPT_IDS = [1, 403, 407, 261, 378]  # "Once upon a time"
KV_CACHE_GIB = 0.01
START_TIMEOUT_S = 60.0


@dataclass
class ExecutorProcess:
    child: Child
    address: str
    ready: dict

    def log(self) -> str:
        return self.child.log()


def _start_executor(model_dir: Path, tmp: Path) -> ExecutorProcess:
    launcher = Launcher(tmp)
    flags = [
        "--model",
        str(model_dir),
        "--port",
        "0",
        "--kv-cache-memory",
        str(KV_CACHE_GIB),
        "--device",
        "cpu",
    ]
    child = launcher.start(
        "executor",
        ["executor", *flags, "--log-level", "debug"],
        log_path=tmp / "executor.log",
        own_process_group=True,
    )
    try:
        (ready,) = launcher.wait_ready([child], START_TIMEOUT_S)
    except LaunchError as exc:
        launcher.stop()
        pytest.fail(f"executor did not start: {exc}")
    return ExecutorProcess(child, ready["address"], ready)


def _stop(executor: ExecutorProcess) -> int:
    return executor.child.stop(grace_s=15)


@pytest.fixture(scope="module")
def executor(stories_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExecutorProcess]:
    running = _start_executor(stories_dir, tmp_path_factory.mktemp("executor"))
    yield running
    _stop(running)


@pytest.fixture(scope="module")
def local_runner(stories_dir: Path) -> ModelRunner:
    return ModelRunner(ExecutorConfig(model=str(stories_dir), kv_cache_memory_gib=KV_CACHE_GIB, device="cpu"))


# NOTE: the runner treats a repeated step id as a retry, so every driver gets fresh step ids.
_step_ids = itertools.count(1_000_000, 10_000)


class RemoteRunner:
    """What StepDriver needs of a runner (`execute`, `block_size`, `num_blocks`), over gRPC."""

    def __init__(self, client: BlockingClient, info: ExecutorInfo) -> None:
        self.client = client
        self.block_size = info.block_size
        self.num_blocks = info.num_blocks
        self.base_step_id = next(_step_ids)

    def execute(self, plan: StepPlan) -> StepResult:
        plan.step_id += self.base_step_id
        return self.client.step(plan)


def _requests(tag: str) -> list[DrivenRequest]:
    return [
        DrivenRequest(f"{tag}-story", PROMPT_IDS, 60, SamplingOptions(temperature=0)),
        DrivenRequest(f"{tag}-logprobs", PROMPT_IDS[:3], 12, SamplingOptions(temperature=0, num_logprobs=3)),
    ]


def _drive(runner: object, tag: str) -> list[DrivenRequest]:
    return StepDriver(runner, token_budget=4).run(_requests(tag))  # chunked prefill, then decode


@pytest.fixture(scope="module")
def expected(local_runner: ModelRunner) -> list[DrivenRequest]:
    return _drive(local_runner, "local")


@pytest.mark.slow
def test_info_handshake(executor: ExecutorProcess, local_runner: ModelRunner) -> None:
    with BlockingClient(executor.address, timeout_s=10) as client:
        info = client.info()
        assert info == local_runner.info()
        assert info.model == "stories260K" and info.block_size == 16 and info.device == "cpu"
        assert client.executor_id and client.executor_id.endswith(executor.address.rsplit(":", 1)[1])
        assert client.version
    assert executor.ready["pid"] == executor.child.pid
    assert executor.ready["info"]["num_blocks"] == info.num_blocks
    assert executor.ready["executor_id"] == client.executor_id


@pytest.mark.slow
def test_greedy_generation_matches_in_process_runner(
    executor: ExecutorProcess, expected: list[DrivenRequest]
) -> None:
    with BlockingClient(executor.address, timeout_s=30) as client:
        got = _drive(RemoteRunner(client, client.info()), "stream")
    assert [r.output for r in got] == [r.output for r in expected]
    assert len(got[0].output) == 60
    assert got[0].logprobs == [None] * 60
    assert got[1].logprobs == expected[1].logprobs  # float32 values travel exactly
    assert all(lp is not None and len(lp.top_token_ids) == 3 for lp in got[1].logprobs)


@pytest.mark.slow
def test_bad_plan_is_invalid_argument_and_serving_goes_on(
    executor: ExecutorProcess, expected: list[DrivenRequest]
) -> None:
    with BlockingClient(executor.address, timeout_s=30) as client:
        remote = RemoteRunner(client, client.info())
        with pytest.raises(ExecutorError) as failure:
            remote.execute(StepPlan(step_id=0, num_scheduled_tokens={"ghost": 1}))
        assert failure.value.code == "INVALID_ARGUMENT"
        assert "ghost" in failure.value.message
        assert client.health()
        request = DrivenRequest("after-error", PROMPT_IDS, 8, SamplingOptions(temperature=0))
        StepDriver(remote, token_budget=4).run([request])
    assert request.output == expected[0].output[:8]


@pytest.mark.slow
def test_health(executor: ExecutorProcess) -> None:
    with BlockingClient(executor.address, timeout_s=5) as client:
        assert client.health()
    with BlockingClient("127.0.0.1:1", timeout_s=2) as nobody:
        assert not nobody.health()
        with pytest.raises(ExecutorError) as failure:
            nobody.step(StepPlan(step_id=0))
        assert failure.value.code == "UNAVAILABLE"


@pytest.fixture
def faulty_executor(local_runner: ModelRunner) -> Iterator[str]:
    running = start_executor_server(FaultyRunner(local_runner.info()), "127.0.0.1", 0, "faulty")
    yield running.address
    running.stop(grace_s=0)


def test_other_failures_are_internal(faulty_executor: str) -> None:
    with BlockingClient(faulty_executor, timeout_s=10) as client:
        with pytest.raises(ExecutorError) as failure:
            client.step(StepPlan(step_id=0))
        assert (failure.value.code, failure.value.message) == ("INTERNAL", "RuntimeError: device lost")
        assert client.step(StepPlan(step_id=2)) == StepResult(step_id=2)


def test_a_step_past_its_timeout_is_deadline_exceeded(faulty_executor: str) -> None:
    with BlockingClient(faulty_executor, timeout_s=0.1) as client:
        with pytest.raises(ExecutorError) as failure:
            client.step(StepPlan(step_id=1))
        assert failure.value.code == "DEADLINE_EXCEEDED"
        client.timeout_s = 5
        assert client.step(StepPlan(step_id=3)) == StepResult(step_id=3)


def test_an_ipv6_host_is_reached_at_its_bracketed_address(local_runner: ModelRunner) -> None:
    running = start_executor_server(FaultyRunner(local_runner.info()), "::1", 0, "v6")
    try:
        assert running.address == f"[::1]:{running.port}"
        with BlockingClient(running.address, timeout_s=10) as client:
            assert client.health()
    finally:
        running.stop(grace_s=0)


@pytest.mark.slow
def test_sigterm_stops_cleanly(stories_dir: Path, tmp_path: Path) -> None:
    running = _start_executor(stories_dir, tmp_path)
    with BlockingClient(running.address, timeout_s=10) as client:
        client.info()
        client.step(StepPlan(step_id=0))  # an open stream must not hold the shutdown
        assert _stop(running) == 0, running.log()
        assert not client.health()
    with pytest.raises(ProcessLookupError):
        os.killpg(running.child.pid, 0)  # no process of its group is left
    log = running.log()
    assert "executor stopped" in log and "Traceback" not in log


def test_rpc_error_without_status_is_unknown() -> None:
    assert ExecutorError.from_rpc_error(grpc.RpcError()).code == "UNKNOWN"
