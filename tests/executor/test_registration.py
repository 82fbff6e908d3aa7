"""An executor registers in Redis once it serves, keeps the key alive, deletes it when it stops,
and rides out a Redis outage: it keeps serving, logs the outage once and registers again."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
from harness.blocking_client import BlockingClient
from harness.cluster import PrivateRedis, private_redis, processes, shared_registry, wait_until

from npuserve.executor.registration import ExecutorRegistration, RegistryConfig
from npuserve.proto.registry_record import registration_record
from npuserve.proto.step_plan import ExecutorInfo

TTL_S = 2.0
INFO = ExecutorInfo(
    model="m", architecture="LlamaForCausalLM", block_size=16, num_blocks=64, max_model_len=512,
    max_num_seqs=8, max_num_batched_tokens=512, vocab_size=512, eos_token_ids=[2], dtype="float32",
    device="cpu",
)  # fmt: skip


def executor_flags(model: Path, url: str, prefix: str, executor_id: str) -> list[str]:
    return ["--model", str(model), "--port", "0", "--kv-cache-memory", "0.02", "--executor-id", executor_id,
            "--registry", url, "--registry-prefix", prefix, "--registry-ttl", str(TTL_S),
            "--log-format", "json"]  # fmt: skip


@pytest.mark.slow
def test_registers_refreshes_and_deregisters(stories_dir: Path, tmp_path: Path) -> None:
    with shared_registry() as registry, processes(tmp_path) as procs:
        executor = procs.start(
            "executor", "executor", *executor_flags(stories_dir, registry.url, registry.prefix, "exec-a")
        )
        ready = executor.wait_ready()
        record = wait_until(lambda: registry.record("exec-a"), 10, "the registration")
        info = ready["info"]
        assert record["address"] == ready["address"]
        assert record["executor_id"] == "exec-a" and len(record["instance_id"]) == 32
        for field in ("model", "architecture", "device", "dtype", "block_size", "num_blocks",
                      "max_model_len", "tensor_parallel_size"):  # fmt: skip
            assert record[field] == info[field], field
        assert record["version"] == ready["version"] and record["started_at"]
        assert 0 < registry.client.pttl(registry.key("exec-a")) <= TTL_S * 1000
        # The executor behind the registration answers.
        with BlockingClient(record["address"], timeout_s=10) as client:
            assert client.info().num_blocks == record["num_blocks"]

        # Refreshed: the TTL goes back up, and the key outlives its first TTL.
        first_seen = time.monotonic()
        last_pttl, refreshed = registry.client.pttl(registry.key("exec-a")), False
        while time.monotonic() - first_seen < TTL_S + 0.3:
            pttl = registry.client.pttl(registry.key("exec-a"))
            assert pttl > 0, "the registration expired while the executor serves"
            refreshed |= pttl > last_pttl
            last_pttl = pttl
            time.sleep(0.05)
        assert refreshed
        assert registry.record("exec-a")["instance_id"] == record["instance_id"]

        assert executor.stop() == 0
        assert registry.record("exec-a") is None, "a graceful stop deletes the registration"


@pytest.mark.slow
def test_rides_out_a_redis_outage(stories_dir: Path, tmp_path: Path) -> None:
    prefix = f"npuserve-test-{uuid.uuid4().hex}"
    with private_redis(tmp_path) as redis_server, processes(tmp_path) as procs:
        client = redis_server.client()
        executor = procs.start(
            "executor", "executor", *executor_flags(stories_dir, redis_server.url, prefix, "exec-b")
        )
        ready = executor.wait_ready()
        key = f"{prefix}:executor:exec-b"
        before = wait_until(lambda: client.get(key), 10, "the registration")

        redis_server.kill()
        wait_until(
            lambda: any(e["event"].startswith("registry unreachable") for e in executor.events()),
            10,
            "the executor to notice the outage",
        )
        time.sleep(1.0)  # several failed heartbeats (backoff capped at TTL/3)
        assert executor.process.poll() is None, "the executor must keep running"
        with BlockingClient(ready["address"], timeout_s=10) as grpc_client:
            assert grpc_client.health(), "the executor keeps serving while Redis is down"

        redis_server.start()  # an empty Redis on the same port: the key is gone
        client = redis_server.client()
        after = wait_until(lambda: client.get(key), 5, "the executor to register again")
        assert after == before, "the same process registers the same record"
        assert executor.process.poll() is None

        assert executor.stop() == 0
        assert client.get(key) is None
        events = [e["event"] for e in executor.events()]
        assert sum(e.startswith("registry unreachable") for e in events) == 1, "logged once per outage"
        assert sum(e == "registered again" for e in events) == 1


@pytest.mark.slow
def test_retries_with_capped_backoff_without_spinning(tmp_path: Path) -> None:
    """In-process: Redis absent at start, then present; one outage, a handful of attempts."""
    redis_server = PrivateRedis(tmp_path)  # its port is free: nothing answers yet
    config = RegistryConfig(redis_server.url, f"npuserve-test-{uuid.uuid4().hex}", ttl_s=1.5)
    registration = ExecutorRegistration(config, registration_record("127.0.0.1:1", "exec-c", INFO, "t", 1.5))
    registration.start()
    try:
        time.sleep(1.5)
        assert registration.num_registrations == 0 and registration.num_outages == 1
        # Backoff 0.25 s, doubling up to TTL/3 = 0.5 s: about four attempts in 1.5 s, never a spin.
        assert 2 <= registration.num_failed_beats <= 8, registration.num_failed_beats
        redis_server.start()
        client = redis_server.client()
        wait_until(lambda: client.get(registration.key), 5, "the first registration")
        assert registration.num_outages == 1
    finally:
        registration.stop()
        redis_server.kill()


def test_stop_leaves_a_newer_instance_registered() -> None:
    with shared_registry() as registry:
        config = RegistryConfig(registry.url, registry.prefix, ttl_s=30.0)  # next beat in 10 s
        old = ExecutorRegistration(config, registration_record("127.0.0.1:1", "exec-d", INFO, "t", 30.0))
        old.start()
        wait_until(lambda: registry.record("exec-d"), 5, "the registration")
        # A restarted process registered under the same id before the old one stopped ...
        newer = {**registry.record("exec-d"), "instance_id": uuid.uuid4().hex}
        registry.client.set(registry.key("exec-d"), json.dumps(newer), ex=30)
        old.stop()  # ... so the old one's late stop must not delete the key.
        assert registry.record("exec-d") == newer


@pytest.mark.parametrize("url", ["http://x", "127.0.0.1:6379"])
def test_registry_url_is_checked(url: str) -> None:
    with pytest.raises(ValueError, match="redis://"):
        RegistryConfig(url)
