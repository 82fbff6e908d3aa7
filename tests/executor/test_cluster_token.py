"""Link security between the scheduler and its executors: an executor started with a cluster token
serves Step, StepStream and Info only to callers that present it (Health stays open), and with
``--tls-cert``/``--tls-key`` only over TLS, to clients that trust its certificate (``--tls-ca``)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from harness.blocking_client import BlockingClient
from harness.cluster import Proc, processes
from harness.serve import collect, greedy_request
from harness.step_driver import DrivenRequest, StepDriver
from harness.tls import self_signed_cert

from npuserve.proto import executor_pb2 as executor_pb
from npuserve.proto import executor_pb2_grpc as executor_pb_grpc
from npuserve.proto import scheduler_pb2_grpc as pb_grpc
from npuserve.proto.step_plan import SamplingOptions, StepPlan, StepResult
from npuserve.scheduler.lanes.executor_client import ExecutorError

pytestmark = pytest.mark.slow  # executors and schedulers in processes of their own

TOKEN = "s3cret-cluster-token"
PROMPT_IDS = [1, 403, 407, 261, 378]  # "Once upon a time"
_step_ids = itertools.count(7_000_000, 10_000)


@dataclass
class Cluster:
    plain: str  # a plaintext executor that requires TOKEN
    workdir: Path
    tls: str | None = None  # a TLS executor that requires TOKEN
    cert: Path | None = None  # the TLS executor's certificate, what a client trusts

    def tls_ca(self) -> bytes:
        if self.tls is None or self.cert is None:
            pytest.skip("TLS tests need the cryptography package")
        return self.cert.read_bytes()


@pytest.fixture(scope="module")
def cluster(stories_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("cluster-token")
    cert_and_key = self_signed_cert(workdir)
    flags = ["--model", str(stories_dir), "--port", "0", "--kv-cache-memory", "0.02"]
    with processes(workdir) as procs:
        # The plaintext executor takes the token from the environment, the TLS one from its flag.
        plain = procs.start("plain", "executor", *flags, env={"NPUSERVE_CLUSTER_TOKEN": TOKEN})
        tls = None
        if cert_and_key is not None:
            tls = procs.start("tls", "executor", *flags, "--cluster-token", TOKEN,
                              "--tls-cert", str(cert_and_key[0]), "--tls-key", str(cert_and_key[1]))  # fmt: skip
        cluster = Cluster(plain.wait_ready()["address"], workdir)
        if tls is not None and cert_and_key is not None:
            cluster.tls, cluster.cert = tls.wait_ready()["address"], cert_and_key[0]
        yield cluster


class RemoteRunner:
    """What StepDriver needs of a runner, over one client."""

    def __init__(self, client: BlockingClient) -> None:
        info = client.info()
        self.client, self.block_size, self.num_blocks = client, info.block_size, info.num_blocks
        self.base_step_id = next(_step_ids)

    def execute(self, plan: StepPlan) -> StepResult:
        plan.step_id += self.base_step_id
        return self.client.step(plan)


def drive(client: BlockingClient, tag: str) -> list[int]:
    request = DrivenRequest(f"{tag}-{next(_step_ids)}", PROMPT_IDS, 8, SamplingOptions(temperature=0))
    return StepDriver(RemoteRunner(client), token_budget=16).run([request])[0].output


def refused(call: object) -> ExecutorError:
    with pytest.raises(ExecutorError) as caught:
        call()  # type: ignore[operator]
    assert caught.value.code == "UNAUTHENTICATED", caught.value
    return caught.value


def test_calls_without_the_token_are_unauthenticated(cluster: Cluster) -> None:
    plan = StepPlan(step_id=next(_step_ids))
    with BlockingClient(cluster.plain, timeout_s=10) as client:
        assert "requires the cluster token" in refused(client.info).message
        assert "requires the cluster token" in refused(lambda: client.step(plan)).message
        assert client.health(), "Health stays open for probes"
    with BlockingClient(cluster.plain, timeout_s=10, token="wrong") as client:
        assert "does not match" in refused(client.info).message
        assert "does not match" in refused(lambda: client.step(plan)).message


def test_calls_with_the_token_are_served(cluster: Cluster) -> None:
    with BlockingClient(cluster.plain, timeout_s=10, token=TOKEN) as client:
        assert len(drive(client, "plain")) == 8


def test_the_token_header_is_accepted_too(cluster: Cluster) -> None:
    stub = executor_pb_grpc.ExecutorStub(grpc.insecure_channel(cluster.plain))
    info = stub.Info(executor_pb.InfoRequest(), timeout=10, metadata=[("x-npuserve-cluster-token", TOKEN)])
    assert info.block_size == 16


def test_tls_client_is_served_and_plaintext_client_is_not(cluster: Cluster) -> None:
    ca = cluster.tls_ca()
    assert cluster.tls is not None
    with BlockingClient(cluster.tls, timeout_s=10, token=TOKEN, tls_ca=ca) as client:
        assert len(drive(client, "tls")) == 8
    with BlockingClient(cluster.tls, timeout_s=10, tls_ca=ca) as client:
        refused(client.info)  # TLS is no substitute for the token
    with BlockingClient(cluster.tls, timeout_s=10, token=TOKEN) as client:  # plaintext to a TLS port
        with pytest.raises(ExecutorError) as caught:
            client.step(StepPlan(step_id=next(_step_ids)))
        assert caught.value.code == "UNAVAILABLE"
        assert not client.health()


def scheduler_args(stories_dir: Path, executor: str, *flags: str) -> list[str]:
    return ["--model", str(stories_dir), "--executors", executor, "--port", "0", *flags]


def serves(scheduler: Proc) -> bool:
    stub = pb_grpc.SchedulerStub(grpc.insecure_channel(scheduler.wait_ready()["address"]))
    tokens, _, last = collect(stub, greedy_request(PROMPT_IDS, 8))
    return len(tokens) == 8 and last.completions[0].finish_reason == "length"


def test_a_scheduler_with_the_token_serves_end_to_end(cluster: Cluster, stories_dir: Path) -> None:
    with processes(cluster.workdir) as procs:
        scheduler = procs.start("scheduler-plain", "scheduler", *scheduler_args(stories_dir, cluster.plain),
                                env={"NPUSERVE_CLUSTER_TOKEN": TOKEN})  # fmt: skip
        assert serves(scheduler)


def test_a_scheduler_with_tls_ca_serves_end_to_end(cluster: Cluster, stories_dir: Path) -> None:
    cluster.tls_ca()
    assert cluster.tls is not None
    with processes(cluster.workdir) as procs:
        scheduler = procs.start("scheduler-tls", "scheduler", *scheduler_args(stories_dir, cluster.tls),
                                "--cluster-token", TOKEN, "--tls-ca", str(cluster.cert))  # fmt: skip
        assert serves(scheduler)


def test_a_scheduler_with_a_wrong_token_says_so(cluster: Cluster, stories_dir: Path) -> None:
    command = [sys.executable, "-m", "npuserve.deploy.cli", "scheduler",
               *scheduler_args(stories_dir, cluster.plain, "--cluster-token", "wrong", "--connect-timeout", "1")]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "UNAUTHENTICATED" in result.stderr and "does not match" in result.stderr


def test_an_executor_on_a_public_address_without_a_token_refuses_to_start(stories_dir: Path) -> None:
    command = [sys.executable, "-m", "npuserve.deploy.cli", "executor", "--model", str(stories_dir),
               "--host", "0.0.0.0", "--port", "0"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "NPUSERVE_CLUSTER_TOKEN"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2
    assert "refusing to serve the executor on 0.0.0.0 with no cluster token" in result.stderr
    for fix in ("--cluster-token", "NPUSERVE_CLUSTER_TOKEN", "--allow-unauthenticated"):
        assert fix in result.stderr, result.stderr


def test_an_executor_on_a_public_address_starts_with_a_token(cluster: Cluster, stories_dir: Path) -> None:
    with processes(cluster.workdir) as procs:
        public = procs.start("public", "executor", "--model", str(stories_dir), "--host", "0.0.0.0",
                             "--port", "0", "--kv-cache-memory", "0.02", "--no-warmup",
                             env={"NPUSERVE_CLUSTER_TOKEN": TOKEN})  # fmt: skip
        with BlockingClient(public.wait_ready()["address"], timeout_s=10, token=TOKEN) as client:
            assert client.info().block_size == 16
