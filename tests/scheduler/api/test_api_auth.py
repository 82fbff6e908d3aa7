"""The scheduler's public gRPC API behind ``--api-key`` (or NPUSERVE_API_KEY): every call but
Health must present ``authorization: Bearer KEY``; with ``--tls-cert``/``--tls-key`` it serves
TLS only, and the gateway reaches it with ``--scheduler-tls-ca``. A scheduler or executor bound
to a non-loopback address without its secret refuses to start unless told
``--allow-unauthenticated``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from harness.cluster import processes
from harness.serve import collect, greedy_request
from harness.tls import self_signed_cert

from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc
from npuserve.proto.auth import bearer_metadata, with_bearer

pytestmark = pytest.mark.slow  # starts npuserve processes

KEY = "sk-scheduler-test-key"
TOKEN = "cluster-token-for-the-api-tests"
PROMPT_IDS = [1, 403, 407, 261, 378]  # "Once upon a time"
openai = pytest.importorskip("openai")


@dataclass
class Setup:
    executor: str  # an executor that requires TOKEN
    plain: str  # a scheduler that requires KEY
    workdir: Path
    stories_dir: Path


@pytest.fixture(scope="module")
def setup(stories_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    workdir = tmp_path_factory.mktemp("api-auth")
    with processes(workdir) as procs:
        executor = procs.start("executor", "executor", "--model", str(stories_dir), "--port", "0",
                               "--kv-cache-memory", "0.02", env={"NPUSERVE_CLUSTER_TOKEN": TOKEN})  # fmt: skip
        address = executor.wait_ready()["address"]
        scheduler = procs.start("scheduler", "scheduler", *scheduler_flags(stories_dir, address),
                                env={"NPUSERVE_CLUSTER_TOKEN": TOKEN, "NPUSERVE_API_KEY": KEY})  # fmt: skip
        yield Setup(address, scheduler.wait_ready()["address"], workdir, stories_dir)


def scheduler_flags(stories_dir: Path, executor: str, *flags: str) -> list[str]:
    return ["--model", str(stories_dir), "--executors", executor, "--port", "0", *flags]


def refusal(call: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()  # type: ignore[operator]
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, caught.value
    return caught.value


def test_calls_without_the_key_are_unauthenticated_and_health_is_open(setup: Setup) -> None:
    stub = pb_grpc.SchedulerStub(grpc.insecure_channel(setup.plain))
    missing = refusal(lambda: stub.ListModels(pb.ListModelsRequest(), timeout=10))
    assert "requires the API key" in missing.details() and "--api-key" in missing.details()
    refusal(lambda: collect(stub, greedy_request(PROMPT_IDS, 4)))  # a stream is refused too
    refusal(lambda: stub.GetMetrics(pb.GetMetricsRequest(), timeout=10))
    wrong = bearer_metadata("not-the-key")
    assert (
        "does not match"
        in refusal(
            lambda: stub.Tokenize(pb.TokenizeRequest(text="Once"), timeout=10, metadata=wrong)
        ).details()
    )
    health = stub.Health(pb.HealthRequest(), timeout=10)
    assert health.serving and health.ready_executors == 1


def test_calls_with_the_key_are_served(setup: Setup) -> None:
    stub = pb_grpc.SchedulerStub(with_bearer(grpc.insecure_channel(setup.plain), KEY))
    tokens, _, last = collect(stub, greedy_request(PROMPT_IDS, 8))
    assert len(tokens) == 8 and last.completions[0].finish_reason == "length"
    assert stub.ListModels(pb.ListModelsRequest(), timeout=10).models[0].id == "stories260K"
    reply = stub.Tokenize(pb.TokenizeRequest(text="Once upon a time"), timeout=10)
    assert list(reply.token_ids) == PROMPT_IDS


def test_tls_scheduler_serves_the_key_holder_and_the_gateway_through_it(setup: Setup) -> None:
    cert_and_key = self_signed_cert(setup.workdir)
    if cert_and_key is None:
        pytest.skip("TLS tests need the cryptography package")
    cert, key = cert_and_key
    with processes(setup.workdir) as procs:
        scheduler = procs.start("scheduler-tls", "scheduler", *scheduler_flags(setup.stories_dir, setup.executor),
                                "--api-key", KEY, "--tls-cert", str(cert), "--tls-key", str(key),
                                env={"NPUSERVE_CLUSTER_TOKEN": TOKEN})  # fmt: skip
        address = scheduler.wait_ready()["address"]
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        stub = pb_grpc.SchedulerStub(with_bearer(grpc.secure_channel(address, credentials), KEY))
        tokens, _, _ = collect(stub, greedy_request(PROMPT_IDS, 8))
        assert len(tokens) == 8
        plaintext = pb_grpc.SchedulerStub(with_bearer(grpc.insecure_channel(address), KEY))
        with pytest.raises(grpc.RpcError) as caught:
            plaintext.ListModels(pb.ListModelsRequest(), timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE

        # The gateway presents the same key to the scheduler over TLS; the openai client uses it.
        gateway = procs.start("gateway-tls", "gateway", "--scheduler", address, "--port", "0",
                              "--scheduler-tls-ca", str(cert), env={"NPUSERVE_API_KEY": KEY})  # fmt: skip
        client = openai.OpenAI(base_url=gateway.wait_ready()["url"] + "/v1", api_key=KEY, max_retries=0)
        completion = client.completions.create(
            model="stories260K", prompt="Once upon a time", temperature=0, max_tokens=8
        )
        assert completion.usage.completion_tokens == 8
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0).models.list()


def test_a_gateway_without_the_schedulers_key_says_so(setup: Setup) -> None:
    command = [sys.executable, "-m", "npuserve.deploy.cli", "gateway", "--scheduler", setup.plain,
               "--port", "0", "--scheduler-api-key", "wrong"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "refuses this gateway" in result.stderr and "does not match" in result.stderr


def npuserve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "npuserve.deploy.cli", *args]
    environment = {
        k: v for k, v in os.environ.items() if k not in ("NPUSERVE_API_KEY", "NPUSERVE_CLUSTER_TOKEN")
    }
    return subprocess.run(
        command, capture_output=True, text=True, timeout=120, env={**environment, **(env or {})}
    )


def test_a_scheduler_on_a_public_address_without_a_key_refuses_to_start(setup: Setup) -> None:
    flags = scheduler_flags(setup.stories_dir, setup.executor, "--host", "0.0.0.0")
    result = npuserve("scheduler", *flags, env={"NPUSERVE_CLUSTER_TOKEN": TOKEN})
    assert result.returncode == 2
    assert "refusing to serve the scheduler on 0.0.0.0 with no API key" in result.stderr
    for fix in ("--api-key", "NPUSERVE_API_KEY", "--host 127.0.0.1", "--allow-unauthenticated"):
        assert fix in result.stderr, result.stderr


def test_a_scheduler_on_a_public_address_starts_with_a_key_or_when_allowed(setup: Setup) -> None:
    with processes(setup.workdir) as procs:
        keyed = procs.start("scheduler-public-key", "scheduler",
                            *scheduler_flags(setup.stories_dir, setup.executor, "--host", "0.0.0.0"),
                            env={"NPUSERVE_CLUSTER_TOKEN": TOKEN, "NPUSERVE_API_KEY": KEY})  # fmt: skip
        allowed = procs.start("scheduler-public-open", "scheduler",
                              *scheduler_flags(setup.stories_dir, setup.executor, "--host", "0.0.0.0",
                                               "--allow-unauthenticated"),
                              env={"NPUSERVE_CLUSTER_TOKEN": TOKEN})  # fmt: skip
        keyed.wait_ready()
        address = allowed.wait_ready()["address"]
        stub = pb_grpc.SchedulerStub(grpc.insecure_channel(address))
        assert stub.ListModels(pb.ListModelsRequest(), timeout=10).models


def test_bench_presents_the_key_to_a_running_scheduler(setup: Setup, tmp_path: Path) -> None:
    workload = ["bench", "--address", setup.plain, "--model", str(setup.stories_dir), "--num-requests", "4",
                "--prompt-len-min", "4", "--prompt-len-max", "8", "--output-len", "4", "--disable-tqdm"]  # fmt: skip
    report = tmp_path / "bench.json"
    served = npuserve(*workload, "--output-json", str(report), env={"NPUSERVE_API_KEY": KEY})
    assert served.returncode == 0, served.stderr[-2000:]
    (summary,) = json.loads(report.read_text())["variants"]
    assert summary["num_failed"] == 0 and summary["output_tokens"] == 16, summary
    refused = npuserve(*workload, "--api-key", "wrong")
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr + refused.stdout
