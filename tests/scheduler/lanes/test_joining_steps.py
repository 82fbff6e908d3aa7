"""Requests that come while an executor runs a multi-pass step start in a step that joins its
next pass (`StepPlan.joins_running`), over real processes: a real executor on stories260K, a
scheduler with one worker process and eight passes a step. Every stream, those that were running
and those that joined, equals transformers; the pools end idle and whole."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from harness.cluster import processes, wait_until
from harness.pools import idle_pools, pools
from harness.serve import complete_over, greedy_workload, labelled_metric, start_executors, start_scheduler

from npuserve.proto import scheduler_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow  # an executor and a scheduler in processes of their own

NUM_RUNNING = 4
NUM_JOINING = 8
NUM_NEW = 96  # the running streams go on through every wave of arrivals
MAX_WAVES = 4  # waves of arrivals until one joined a step (each is checked whole either way)


def test_requests_that_come_mid_step_join_its_pass_and_every_stream_equals_transformers(
    stories_dir: Path, tmp_path: Path
) -> None:
    """Four streams run; once each has its first tokens, waves of eight more come while they
    run (up to four waves, until a step has joined one: a wave that comes between steps starts
    in the next, as any request does). Every wave equals transformers, and so do the four."""
    _, running, expected_running = greedy_workload(stories_dir, 21, NUM_RUNNING, NUM_NEW)
    _, joining, expected_joining = greedy_workload(stories_dir, 22, NUM_JOINING, 16)
    with processes(tmp_path) as procs:
        address = start_executors(procs, stories_dir, ["e0"])
        scheduler = start_scheduler(
            procs, stories_dir, address, "--scheduler-workers", "1", "--num-scheduler-steps", "8",
            "--async-scheduling",
        )  # fmt: skip
        served = scheduler.wait_ready()["address"]
        stub = pb_grpc.SchedulerStub(grpc.insecure_channel(served))
        waves: list[tuple[list[list[int]], list[str]]] = []

        def joined_steps() -> float:
            return labelled_metric(stub, "npuserve:executor_joined_steps_total").get("e0", 0.0)

        def arrive_in_waves() -> None:
            while len(waves) < MAX_WAVES and not joined_steps():
                assert pools(stub)["e0"].num_requests >= NUM_RUNNING  # the four still run
                waves.append(complete_over("generate", served, joining))

        outputs, reasons = complete_over("generate-many", served, running, arrive_in_waves)
        assert reasons == ["length"] * NUM_RUNNING
        assert outputs == expected_running
        assert waves and all(wave == (expected_joining, ["length"] * NUM_JOINING) for wave in waves)
        assert joined_steps() >= 1, f"no step joined one in {len(waves)} waves"
        events = scheduler.events()
        assert not [e for e in events if e.get("level") == "error" or e["event"] == "step failed"]
        wait_until(lambda: set(pools(stub)) == {"e0"}, 30, "the executor to be served")
        final = idle_pools(stub)
        assert all(p.num_free_blocks == p.num_blocks for p in final.values())
