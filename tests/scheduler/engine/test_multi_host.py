"""Several hosts on one machine: the scheduler and a Redis in the root network namespace, two
executors each in a namespace of its own (a veth link to the root namespace, real TCP), found
through the registry. One executor host's link is cut under 16 streams: all complete with the
tokens of an undisturbed run. Restored, the executor registers again, is discovered, serves, and
the scheduler's metrics count its return as a restart."""

from __future__ import annotations

import secrets
import uuid
from pathlib import Path

import grpc
import pytest
import torch
from harness.cluster import Processes, Registry, events, private_redis, processes, wait_until
from harness.netns import Host, hosts
from harness.pools import busiest, idle_pools, pools, random_ids
from harness.serve import complete_streams, greedy_request, labelled_metric

from npuserve.proto import scheduler_pb2_grpc as pb_grpc
from npuserve.proto.auth import CLUSTER_TOKEN

NUM_STREAMS = 16
NUM_NEW = 32
EXECUTOR_PORT = 50061  # each host has its own ports
TTL_S = 2.0  # the registration's lease: a cut host's key is gone this long after its last beat
# How long a step to the cut host may hang before its requests move. Longer than the lease by
# more than a second, as in production (10 s and 60 s by default): the scheduler drops the cut
# executor while its lane still waits in that step, and the lane's requests still move.
STEP_TIMEOUT_S = 4.0


def start_executor(procs: Processes, host: Host, name: str, registry: Registry, token: str) -> None:
    procs.start(
        name, "executor", "--host", host.address, "--port", str(EXECUTOR_PORT),
        "--advertise-address", f"{host.address}:{EXECUTOR_PORT}", "--executor-id", name,
        "--registry", registry.url.replace("127.0.0.1", host.gateway), "--registry-prefix", registry.prefix,
        "--registry-ttl", str(TTL_S), "--kv-cache-memory", "0.02", "--no-warmup",
        env={CLUSTER_TOKEN.env: token}, prefix=host.command_prefix,
    )  # fmt: skip


@pytest.mark.slow
def test_a_cut_host_link_loses_no_stream_and_the_host_rejoins(stories_dir: Path, tmp_path: Path) -> None:
    with hosts(2) as (host_a, host_b):
        bind = ["127.0.0.1", host_a.gateway, host_b.gateway]
        with (
            private_redis(tmp_path, bind, secrets.token_hex(16)) as redis_server,
            processes(tmp_path) as procs,
        ):
            client = redis_server.client()
            registry = Registry(redis_server.url, f"npuserve-test-{uuid.uuid4().hex}", client)
            try:
                run_scenario(procs, registry, {"host-a": host_a, "host-b": host_b}, stories_dir)
            finally:
                keys = list(client.scan_iter(match=f"{registry.prefix}:*"))
                if keys:
                    client.delete(*keys)
                client.close()


def run_scenario(procs: Processes, registry: Registry, hosts_by_name: dict[str, Host], model: Path) -> None:
    token = secrets.token_hex(16)
    scheduler = procs.start(
        "scheduler", "scheduler", "--model", str(model), "--port", "0", "--registry", registry.url,
        "--registry-prefix", registry.prefix, "--step-timeout", str(STEP_TIMEOUT_S), "--connect-timeout", "60",
        "--log-format", "json", env={CLUSTER_TOKEN.env: token},
    )  # fmt: skip
    for name, host in hosts_by_name.items():
        start_executor(procs, host, name, registry, token)
    stub = pb_grpc.SchedulerStub(grpc.insecure_channel(scheduler.wait_ready()["address"]))
    wait_until(lambda: set(pools(stub)) == set(hosts_by_name), 60, "both executors to be discovered")
    generator = torch.Generator().manual_seed(7)
    requests = [
        greedy_request([1, *random_ids(int(n), generator)], NUM_NEW)
        for n in torch.randint(4, 40, (NUM_STREAMS,), generator=generator)
    ]
    undisturbed, _ = complete_streams(stub, requests)
    cut = ""

    def cut_the_busiest() -> None:
        nonlocal cut
        cut = busiest(stub)
        hosts_by_name[cut].cut()

    outputs, reasons = complete_streams(stub, requests, cut_the_busiest)
    assert reasons == ["length"] * NUM_STREAMS
    assert outputs == undisturbed  # nothing repeated, nothing skipped, same tokens
    # Its lease runs out and the scheduler drops it.
    wait_until(lambda: registry.record(cut) is None, TTL_S + 5, "the cut executor's key to expire")

    def drops() -> list[dict]:
        return [e for e in events(scheduler, "executor left") if e["executor"] == cut]

    wait_until(drops, 5, "the scheduler to drop the cut executor")
    assert labelled_metric(stub, "npuserve:executor_up")[cut] == 0

    hosts_by_name[cut].restore()
    wait_until(lambda: registry.record(cut) is not None, 10, "the executor to register again")
    wait_until(lambda: cut in pools(stub), 10, "the executor to be discovered again")
    assert len(drops()) == 1  # nothing dropped it again meanwhile
    # It serves: the streams again, which the other host no longer takes all of, though it holds
    # their prefixes (routing counts the blocks queued there too).
    before = pools(stub)[cut].prefix_cache_queries
    outputs, reasons = complete_streams(stub, requests)
    assert outputs == undisturbed and reasons == ["length"] * NUM_STREAMS
    assert pools(stub)[cut].prefix_cache_queries > before
    assert labelled_metric(stub, "npuserve:executor_up") == dict.fromkeys(hosts_by_name, 1.0)
    restarts = labelled_metric(stub, "npuserve:executor_restarts_total")
    assert restarts == {name: 1.0 if name == cut else 0.0 for name in hosts_by_name}
    final = idle_pools(stub)
    assert set(final) == set(hosts_by_name)
    assert all(p.num_free_blocks == p.num_blocks for p in final.values())
