"""Executors found through the Redis registry, as real processes: discovery (the scheduler up
before any executor), prefix-aware routing across them, a Redis outage (paused, then killed and
restarted empty) under load that loses no request and drops no executor, an executor that joins
afterwards, and an executor SIGKILLed mid-run (every stream completes unchanged; its key expires
and the scheduler drops it). `RedisMembership` on its own, against fake executors: a restarted
executor (new instance id) is removed and added back, an expired one removed, a lost lane
rejoined, a draining one drained and never admitted again."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch
from harness.cluster import (
    PrivateRedis,
    Proc,
    Processes,
    Registry,
    events,
    private_redis,
    processes,
    shared_registry,
    wait_until,
)
from harness.pools import busiest, check_prefix_routing, idle_pools, pools, random_ids
from harness.serve import collect, complete_streams, greedy_request

from npuserve.proto import scheduler_pb2_grpc as pb_grpc
from npuserve.proto.step_plan import ExecutorInfo
from npuserve.scheduler.engine.registry import RedisMembership

TTL_S = 3.0
NUM_STREAMS = 32
NUM_NEW = 48


def start_executor(procs: Processes, model: Path, registry: list[str], name: str) -> Proc:
    return procs.start(name, "executor", "--model", str(model), "--port", "0", "--kv-cache-memory", "0.02",
                       "--executor-id", name, *registry, "--registry-ttl", str(TTL_S))  # fmt: skip


class Load:
    """Clients that send greedy requests back to back until stopped; every output is checked
    against the first one seen for the same prompt (greedy: the executor must not matter)."""

    def __init__(self, stub: pb_grpc.SchedulerStub, prompts: list[list[int]], num_new: int) -> None:
        self.stub, self.prompts, self.num_new = stub, prompts, num_new
        self.expected: dict[int, list[int]] = {}
        self.completed: list[float] = []  # when each request completed
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,)) for i in range(len(prompts))]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _client(self, index: int) -> None:
        while not self._stop.is_set():
            try:
                tokens, _, last = collect(self.stub, greedy_request(self.prompts[index], self.num_new))
            except grpc.RpcError as exc:
                self.failures.append(f"{exc.code()}: {exc.details()}")
                continue
            reason = last.completions[0].finish_reason
            expected = self.expected.setdefault(index, tokens)
            if reason != "length" or tokens != expected:
                self.failures.append(f"prompt {index}: {reason}, {tokens} != {expected}")
            self.completed.append(time.monotonic())


def ride_out_registry_outage(
    stub: pb_grpc.SchedulerStub,
    redis_server: PrivateRedis,
    scheduler: Proc,
    registry: Registry,
    generator: torch.Generator,
) -> None:
    """Redis paused for 3 s, then killed and restarted empty, under load: no request fails."""
    known = registry.executor_ids()
    load = Load(stub, [[1, *random_ids(8 + 4 * i, generator)] for i in range(4)], 16)
    load.start()
    try:
        wait_until(lambda: len(load.completed) >= 4, 30, "the load to run")
        outage_start = time.monotonic()
        redis_server.pause(3000)
        wait_until(lambda: events(scheduler, "registry unreachable"), 5, "the scheduler to see the pause")
        wait_until(lambda: events(scheduler, "registry reachable again"), 10, "the pause to end")
        redis_server.kill()
        wait_until(lambda: len(events(scheduler, "registry unreachable")) == 2, 5, "the second outage")
        redis_server.start()  # empty: every registration is gone until its executor writes it again
        wait_until(lambda: registry.executor_ids() == known, 10, "the executors to register again")
        wait_until(
            lambda: len(events(scheduler, "registry reachable again")) == 2, 5, "the scheduler to reconnect"
        )
        outage_end = time.monotonic()
        wait_until(lambda: any(t > outage_end for t in load.completed), 10, "requests after the outage")
    finally:
        load.stop()
    assert not load.failures, load.failures[:5]
    assert any(outage_start < t < outage_end for t in load.completed), "requests flowed during the outage"


def survive_sigkill(
    stub: pb_grpc.SchedulerStub, executors: dict[str, Proc], generator: torch.Generator
) -> str:
    """SIGKILL the busiest executor while 32 greedy streams run: all complete, all unchanged."""
    requests = [greedy_request([1, *random_ids(int(n), generator)], NUM_NEW)
                for n in torch.randint(4, 40, (NUM_STREAMS,), generator=generator)]  # fmt: skip
    undisturbed, _ = complete_streams(stub, requests)
    victim = ""

    def kill_the_busiest() -> None:
        nonlocal victim
        victim = busiest(stub)
        executors[victim].process.kill()

    outputs, reasons = complete_streams(stub, requests, kill_the_busiest)
    assert reasons == ["length"] * NUM_STREAMS
    assert outputs == undisturbed  # nothing repeated, nothing skipped, same tokens
    return victim


@pytest.mark.slow
def test_cluster_through_the_registry(stories_dir: Path, tmp_path: Path) -> None:
    """One scenario (processes are slow to start): discovery with the scheduler up first, prefix
    routing, a Redis outage under load, a late executor, an executor SIGKILLed mid-run, then
    one drained by SIGTERM under load.

    A private Redis, since this test pauses and kills it."""
    with private_redis(tmp_path) as redis_server, processes(tmp_path) as procs:
        registry = Registry(redis_server.url, f"npuserve-test-{uuid.uuid4().hex}", redis_server.client())
        flags = ["--registry", registry.url, "--registry-prefix", registry.prefix]
        scheduler = procs.start("scheduler", "scheduler", "--model", str(stories_dir), "--port", "0", *flags,
                                "--connect-timeout", "60", "--log-format", "json")  # fmt: skip
        wait_until(
            lambda: events(scheduler, "waiting for executors"), 30, "the scheduler to wait for executors"
        )
        executors = {name: start_executor(procs, stories_dir, flags, name) for name in ("e0", "e1")}
        stub = pb_grpc.SchedulerStub(grpc.insecure_channel(scheduler.wait_ready()["address"]))
        wait_until(lambda: set(pools(stub)) == {"e0", "e1"}, 60, "both executors to be discovered")
        assert registry.executor_ids() == {"e0", "e1"}
        generator = torch.Generator().manual_seed(5)

        check_prefix_routing(stub, ["e0", "e1"], generator)

        ride_out_registry_outage(stub, redis_server, scheduler, registry, generator)
        # An executor started after Redis returned is discovered; nobody was dropped meanwhile.
        executors["e2"] = start_executor(procs, stories_dir, flags, "e2")
        wait_until(lambda: set(pools(stub)) == {"e0", "e1", "e2"}, 60, "the new executor to be discovered")
        assert not events(scheduler, "executor left"), "no executor may be dropped for a Redis outage"

        victim = survive_sigkill(stub, executors, generator)
        # Its key expires, and the scheduler drops it for that reason.
        wait_until(lambda: victim not in registry.executor_ids(), TTL_S + 5, "the key to expire")
        wait_until(
            lambda: [e for e in events(scheduler, "executor left") if e["executor"] == victim],
            5,
            "the scheduler to drop the executor",
        )
        survivors = {"e0", "e1", "e2"} - {victim}
        assert set(idle_pools(stub)) == survivors

        drained = drain_under_load(stub, executors, scheduler, registry, generator)
        final = idle_pools(stub)
        assert set(final) == survivors - {drained}
        assert all(p.num_free_blocks == p.num_blocks for p in final.values())


def drain_under_load(
    stub: pb_grpc.SchedulerStub,
    executors: dict[str, Proc],
    scheduler: Proc,
    registry: Registry,
    generator: torch.Generator,
) -> str:
    """SIGTERM the busiest executor under 16 streams: it deregisters at once (not by its key
    expiring), the scheduler routes nothing new to it and lets its requests finish there (none
    moves), every stream completes unchanged, and the executor exits 0."""
    requests = [greedy_request([1, *random_ids(int(n), generator)], NUM_NEW)
                for n in torch.randint(4, 40, (16,), generator=generator)]  # fmt: skip
    undisturbed, _ = complete_streams(stub, requests)
    moved_before = len(events(scheduler, "requests moved"))
    drained: list[str] = []

    def sigterm_busiest() -> None:
        drained.append(busiest(stub))
        executors[drained[0]].process.terminate()

    outputs, reasons = complete_streams(stub, requests, sigterm_busiest)
    assert reasons == ["length"] * 16
    assert outputs == undisturbed
    assert executors[drained[0]].process.wait(30) == 0
    assert drained[0] not in registry.executor_ids()
    assert [e for e in events(scheduler, "executor draining") if e["executor"] == drained[0]]
    assert len(events(scheduler, "requests moved")) == moved_before, "a draining executor finishes its own"
    return drained[0]


# -- RedisMembership in-process, against fake executors -------------------------------------------


class FakeClient:
    """What `handshake` needs of an executor client."""

    def __init__(self, address: str) -> None:
        self.address, self.closed = address, False
        self.executor_id = address.split("/", 1)[0]  # "<executor id>/<instance>"

    async def info(self, timeout_s: float | None = None) -> ExecutorInfo:
        return ExecutorInfo(
            model="m", architecture="LlamaForCausalLM", block_size=16, num_blocks=64, max_model_len=512,
            max_num_seqs=8, max_num_batched_tokens=512, vocab_size=512, eos_token_ids=[2], dtype="float32",
            device="cpu",
        )  # fmt: skip

    async def close(self) -> None:
        self.closed = True


class FakeEngine:
    def __init__(self) -> None:
        self.lanes: dict[str, FakeClient] = {}
        self.calls: list[tuple[str, str]] = []

    def add_executor(self, executor_id: str, client: FakeClient, info: ExecutorInfo) -> None:
        self.lanes[executor_id] = client
        self.calls.append(("add", client.address))

    def remove_executor(self, executor_id: str, reason: str) -> None:
        self.lanes.pop(executor_id, None)
        self.calls.append(("remove", executor_id))

    def drain_executor(self, executor_id: str, reason: str) -> None:
        self.calls.append(("drain", executor_id))


def test_membership_follows_restarts_expiry_and_lost_lanes() -> None:
    with shared_registry() as registry:

        def register(executor_id: str, instance: str, draining: bool = False) -> None:
            record = {"address": f"{executor_id}/{instance}", "executor_id": executor_id,
                      "instance_id": instance, "ttl_s": 0.3} | ({"draining": True} if draining else {})  # fmt: skip
            registry.client.set(registry.key(executor_id), json.dumps(record), ex=30)

        async def scenario() -> None:
            membership = RedisMembership(FakeClient, registry.url, registry.prefix, poll_interval_s=0.05)
            engine = FakeEngine()
            register("a", "a1")
            register("b", "b1")
            for executor_id, client, info in await membership.wait_for_executors(5):
                engine.add_executor(executor_id, client, info)
            assert sorted(engine.lanes) == ["a", "b"]
            engine.calls.clear()
            follow = asyncio.create_task(membership.run(engine))  # type: ignore[arg-type]

            async def until(condition: Callable[[], bool], what: str) -> None:
                deadline = time.monotonic() + 5
                while not condition():
                    assert time.monotonic() < deadline, f"timed out waiting for {what}: {engine.calls}"
                    await asyncio.sleep(0.02)

            register("a", "a2")  # a restarted: removed, then added back on a fresh pool
            await until(lambda: ("add", "a/a2") in engine.calls, "the restarted executor")
            assert engine.calls[:2] == [("remove", "a"), ("add", "a/a2")]
            registry.client.delete(registry.key("b"))  # b's key expired: removed
            await until(lambda: ("remove", "b") in engine.calls, "the expired executor")
            engine.lanes.pop("a")  # a's lane went down, but it is still registered: probed again
            await until(lambda: "a" in engine.lanes, "the lost lane to rejoin")
            assert engine.calls[-1] == ("add", "a/a2") and set(membership.members) == {"a"}
            register("a", "a2", draining=True)  # a got SIGTERM: its requests finish, no new ones
            await until(lambda: ("drain", "a") in engine.calls, "the draining executor")
            engine.lanes.pop("a")  # drained: the engine removed it, and it is not taken back
            register("c", "c1", draining=True)  # nor is an executor that drains before it joins
            await asyncio.sleep(0.3)
            assert not engine.lanes and not [c for c in engine.calls if c[0] == "add" and c[1] != "a/a2"]
            assert membership.num_known() == 2  # still registered: a and c
            follow.cancel()

        asyncio.run(scenario())
