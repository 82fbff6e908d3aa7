"""The connections between the scheduler and a live executor reset mid-run (a network blip,
done here with `ss -K`, which destroys the sockets as a reset would): every stream completes,
unchanged, and the pools end idle and whole."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from harness.cluster import processes, wait_until
from harness.pools import idle_pools, pools
from harness.serve import complete_over, greedy_workload, labelled_metric, start_executors, start_scheduler

from npuserve.proto import scheduler_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow  # an executor and a scheduler in processes of their own

NUM_STREAMS = 16
NUM_NEW = 48


def reset_connections_to(port: int) -> int:
    """Destroys every TCP socket on this host whose peer is loopback ``port`` (needs root and a
    kernel with SOCK_DESTROY); how many it named, or -1 when ss failed."""
    done = subprocess.run(
        ["ss", "-K", "-t", "-H", "dst", "127.0.0.1", "dport", "=", str(port)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return len(done.stdout.splitlines()) if done.returncode == 0 else -1


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
@pytest.mark.parametrize(
    ("client_call", "flags"),
    [("generate", ()), ("generate-many", ("--scheduler-workers", "1", "--num-scheduler-steps", "4"))],
)
def test_reset_connections_to_a_live_executor_change_no_stream(
    stories_dir: Path, tmp_path: Path, client_call: str, flags: tuple[str, ...]
) -> None:
    """The only executor's step stream breaks (UNAVAILABLE, or INTERNAL from gRPC's client):
    the executor still answers Health as the same process, so it stays in and the failed step's
    requests run again from their tokens on it. Two variants: the defaults with a Generate call
    per stream; one scheduler worker process with four passes a step, over one GenerateMany call."""
    _, requests, expected = greedy_workload(stories_dir, 5, NUM_STREAMS, NUM_NEW)
    with processes(tmp_path) as procs:
        address = start_executors(procs, stories_dir, ["e0"])
        port = int(address.rsplit(":", 1)[1])
        scheduler = start_scheduler(procs, stories_dir, address, "--async-scheduling", *flags)
        served = scheduler.wait_ready()["address"]
        stub = pb_grpc.SchedulerStub(grpc.insecure_channel(served))
        reset: list[int] = []

        def reset_mid_run() -> None:
            assert pools(stub)["e0"].num_requests > 0
            reset.append(reset_connections_to(port))

        outputs, reasons = complete_over(client_call, served, requests, reset_mid_run)
        assert reasons == ["length"] * NUM_STREAMS
        assert outputs == expected
        events = scheduler.events()
        failed = [e for e in events if e["event"] == "step failed"]
        if not failed and reset[0] <= 0:
            pytest.skip("ss -K destroyed no socket here (not root, or a kernel without SOCK_DESTROY)")
        assert failed and all(e["requests_failed"] == 0 for e in failed), failed
        assert sum(e["requests_run_again"] for e in failed) >= 1
        assert not [e for e in events if e["event"] == "executor down"]
        failed_steps = labelled_metric(stub, "npuserve:executor_failed_steps_total")
        assert failed_steps == {"e0": len(failed)}
        wait_until(lambda: set(pools(stub)) == {"e0"}, 30, "the executor to be served")
        final = idle_pools(stub)
        assert all(p.num_free_blocks == p.num_blocks for p in final.values())
