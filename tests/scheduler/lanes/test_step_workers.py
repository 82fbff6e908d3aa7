"""The scheduler with its step loops in worker processes (`--scheduler-workers`).

Unit tests of the report codec and the front's mirror of a worker's prefix cache, then one
scenario over real processes: two executors on two scheduler workers, with async scheduling
(each step sent while the one before runs); 32 concurrent greedy streams
equal transformers; prefix-aware routing stays exact; a worker SIGKILLed under 32 streams is
restarted and every stream completes unchanged; every pool is intact and idle afterwards.
"""

from __future__ import annotations

import os
import pickle
import signal
from pathlib import Path

import grpc
import pytest
import torch
from harness.cluster import processes, wait_until
from harness.pools import check_prefix_routing, idle_pools, pools
from harness.serve import (
    complete_over,
    greedy_workload,
    metric_total,
    start_executors,
    start_scheduler,
    worker_pids,
)

from npuserve.deploy.runtime.process_name import STEP_WORKER
from npuserve.deploy.runtime.unknown_message import UnknownMessage
from npuserve.executor.simulated import SimulatedRunner
from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc
from npuserve.proto.step_plan import ExecutorInfo
from npuserve.scheduler.core.block_pool import ON_DEVICE, BlockPool
from npuserve.scheduler.core.request import Request, RequestStatus, SamplingParams, StreamRelay
from npuserve.scheduler.core.scheduler import RequestUpdate, Scheduler, StepStats
from npuserve.scheduler.core.scheduler_config import SchedulerConfig
from npuserve.scheduler.lanes.async_lane import ExecutorLane, always_room
from npuserve.scheduler.lanes.executor_client import ClientSpec
from npuserve.scheduler.lanes.in_process_client import InProcessClient
from npuserve.scheduler.lanes.lane import LaneEvent
from npuserve.scheduler.lanes.step_frames import LaneReport, RelayProgress, apply_report, make_report
from npuserve.scheduler.lanes.step_worker import LaneSettings, StepWorker
from npuserve.scheduler.lanes.step_workers import RemoteLane, StepWorkerPool
from npuserve.scheduler.lanes.worker_messages import CallRaised, CallReturned

NUM_STREAMS = 32
NUM_NEW = 40


def request(req_id: str, prompt: list[int]) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=8)
    return Request(req_id, prompt, params, params.to_options((2,)), (2,), 512, 4)


def unstarted_lane(scheduler: Scheduler) -> ExecutorLane:
    """A worker's lane that takes no step: a report reads its scheduler."""
    client = InProcessClient(SimulatedRunner())
    return ExecutorLane("e0", client, scheduler, lambda lane, event: None, False, always_room)


# -- units --------------------------------------------------------------------------------------


def test_block_pool_reports_stored_and_removed_hashes_in_order() -> None:
    pool = BlockPool(4)
    pool.events = []
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"a", b"b"], 0, 2)
    pool.free_blocks(reversed(blocks))
    pool.get_new_blocks(3)  # reuses both cached blocks: their hashes leave the cache
    assert pool.events == [(True, b"a"), (True, b"b"), (False, b"b"), (False, b"a")]


def test_a_report_rebuilds_the_lane_event_on_the_fronts_copies() -> None:
    scheduler = Scheduler(SchedulerConfig(num_blocks=16, block_size=4))
    scheduler.kv.pool.events = []
    lane = unstarted_lane(scheduler)
    worker_copy, front_copy = request("r1", [1, 5, 6, 7, 8]), request("r1", [1, 5, 6, 7, 8])
    stopped_worker, stopped_front = request("r2", [1, 9]), request("r2", [1, 9])
    scheduler.add_request(worker_copy)
    scheduler.schedule()  # registers the prompt's full block
    worker_copy.append_output(42, None)
    event = LaneEvent(
        updates=[RequestUpdate(worker_copy, [42], [None], None)],
        ended=[stopped_worker],
        stats=StepStats(num_preemptions=1, num_scheduled_tokens=5, num_prompt_tokens=5),
        step_seconds=0.25,
    )
    stopped_worker.status = RequestStatus.FINISHED_ABORTED
    report = make_report("e0#0", lane, event, {})
    assert report.load.num_running == 1 and report.load.num_used_blocks == 2
    assert [tier for tier, _ in report.kv_events] == [ON_DEVICE]

    copies = {"r1": front_copy, "r2": stopped_front}
    rebuilt = apply_report(report, copies.get)
    assert front_copy.output_token_ids == [42] and front_copy.status == RequestStatus.RUNNING
    assert [(u.request, u.new_token_ids) for u in rebuilt.updates] == [(front_copy, [42])]
    assert rebuilt.ended == [stopped_front] and stopped_front.status == RequestStatus.FINISHED_ABORTED
    assert rebuilt.stats == StepStats(1, 5, 5) and rebuilt.step_seconds == 0.25
    # Requests the front forgot (a stream that ended meanwhile) are skipped.
    assert apply_report(report, lambda req_id: None).updates == []


def test_tokens_of_a_sequence_an_api_process_streams_skip_the_front() -> None:
    """Its first token in a placement goes to the front (TTFT, the stream's start); the next ones
    are packed per API process incarnation, as that process's items, and the front's copy only
    counts them. What the worker has sent is its lane's record, which forgets a sequence that
    ends. A move takes the worker's whole output back onto the front's copy."""
    scheduler = Scheduler(SchedulerConfig(num_blocks=16, block_size=4))
    lane = unstarted_lane(scheduler)
    worker_copy, front_copy = request("r1", [1, 5, 6]), request("r1", [1, 5, 6])
    plain_worker, plain_front = request("r2", [1, 9]), request("r2", [1, 9])
    worker_copy.relay = front_copy.relay = StreamRelay(1, 3, 7, 0)  # API process 1, 3rd start, stream 7
    copies = {"r1": front_copy, "r2": plain_front}
    progress: RelayProgress = {}

    def step(token: int) -> LaneReport:
        worker_copy.append_output(token, None)
        plain_worker.append_output(token, None)
        updates = [RequestUpdate(r, [token], [None], None) for r in (worker_copy, plain_worker)]
        return make_report("e0#0", lane, LaneEvent(updates=updates), progress)

    first = step(42)
    assert [u[0] for u in first.updates] == ["r1", "r2"] and not first.relayed
    assert progress == {"r1": 1}  # the first token counts as sent, and nothing of r2 is relayed
    apply_report(first, copies.get)
    second, third = step(43), step(44)
    for report, token in ((second, 43), (third, 44)):
        assert [u[0] for u in report.updates] == ["r2"]
        ((key, (count, pack)),) = report.relayed.items()
        assert key == (1, 3) and count == 1
        assert pickle.loads(pack) == [(7, 0, [token], [None], None, None, None, token - 41, -1)]
        apply_report(report, copies.get)
    assert front_copy.output_token_ids == [42] and plain_front.output_token_ids == [42, 43, 44]
    assert progress == {"r1": 3}
    # What the front does not hold, it counts from the next update it gets (a finish, an end).
    worker_copy.status = RequestStatus.FINISHED_ABORTED
    ended = make_report("e0#0", lane, LaneEvent(ended=[worker_copy]), dict(progress))
    assert apply_report(ended, copies.get).ended == [front_copy]
    assert front_copy.output_token_ids == [42] and front_copy.num_output_tokens == 3

    # Had the executor been lost instead, the request moves with the worker's output, whole.
    moved = make_report("e0#0", lane, LaneEvent(evacuated=[worker_copy], error="gone"), progress)
    assert [r.req_id for r in apply_report(moved, copies.get).evacuated] == ["r1"]
    assert front_copy.output_token_ids == [42, 43, 44] and front_copy.num_output_tokens == 3
    assert front_copy.status == RequestStatus.WAITING and progress == {}


def test_a_stream_interval_packs_a_sequences_tokens_in_groups_and_the_rest_at_its_end() -> None:
    """With `--stream-interval 3` the worker holds a started sequence's tokens until it has 3, then
    packs them as one item; what it holds goes out before its finish (which goes to the front),
    and before it ends outside a step or moves. The step's token count stays exact."""
    scheduler = Scheduler(SchedulerConfig(num_blocks=16, block_size=4))
    lane = unstarted_lane(scheduler)
    finishing, aborted, moved = (request(f"r{i}", [1, 5, 6]) for i in range(3))
    for i, sequence in enumerate((finishing, aborted, moved)):
        sequence.relay = StreamRelay(0, 1, i, 0, every=3)
    progress: RelayProgress = {}

    def step(token: int, finished: RequestStatus | None = None) -> LaneReport:
        for sequence in (finishing, aborted, moved):
            sequence.append_output(token, None)
        updates = [RequestUpdate(finishing, [token], [None], finished)] + [
            RequestUpdate(r, [token], [None], None) for r in (aborted, moved)
        ]
        return make_report("e0#0", lane, LaneEvent(updates=updates), progress)

    def items(report: LaneReport) -> list[tuple[int, list[int], int]]:
        """(stream handle, its tokens, the output count) per packed item."""
        packs = [pickle.loads(pack) for _, pack in report.relayed.values()]
        return [(item[0], item[2], item[7]) for pack in packs for item in pack]

    reports = [step(token) for token in (10, 11, 12, 13, 14)]
    assert [len(r.updates) for r in reports] == [3, 0, 0, 0, 0]  # the first tokens go to the front
    assert [items(r) for r in reports] == [
        [],
        [],
        [],
        [(0, [11, 12, 13], 4), (1, [11, 12, 13], 4), (2, [11, 12, 13], 4)],
        [],
    ]
    assert [r.num_relayed_tokens for r in reports] == [0, 3, 3, 3, 3]
    last = step(15, RequestStatus.FINISHED_LENGTH)
    assert items(last) == [(0, [14], 6)]  # held, then the finish with its own token via the front
    assert [(u[0], u[1], u[3]) for u in last.updates] == [("r0", [15], "length")]
    assert last.num_relayed_tokens == 2 and "r0" not in progress  # its record ends with it
    aborted.status = RequestStatus.FINISHED_ABORTED
    moving = make_report("e0#0", lane, LaneEvent(ended=[aborted], evacuated=[moved], error="gone"), progress)
    assert items(moving) == [(1, [14, 15], 6), (2, [14, 15], 6)] and moving.num_relayed_tokens == 0
    assert progress == {}
    assert moving.evacuated[0][1] == [10, 11, 12, 13, 14, 15]  # the move takes the whole output


def test_a_remote_lane_mirrors_the_workers_prefix_cache() -> None:
    info = ExecutorInfo(
        model="m", architecture="LlamaForCausalLM", block_size=4, num_blocks=16, max_model_len=64,
        max_num_seqs=4, max_num_batched_tokens=64, vocab_size=512, eos_token_ids=[2], dtype="float32",
        device="cpu",
    )  # fmt: skip
    pool = StepWorkerPool(1, ClientSpec())
    with pytest.raises(ValueError, match="no scheduler worker is running"):
        pool.open_lane("e0", None, info)  # type: ignore[arg-type]
    pool.workers[0].alive = True  # as if started (no process is needed to mirror reports)
    lane = pool.open_lane("e0", None, info)  # type: ignore[arg-type]
    assert isinstance(lane, RemoteLane) and lane.key.startswith("e0#")
    scheduler = Scheduler(SchedulerConfig(num_blocks=16, block_size=4))
    scheduler.kv.pool.events = []
    worker_lane = unstarted_lane(scheduler)
    scheduler.add_request(request("r1", [1, 5, 6, 7, 8, 9, 10, 11, 12]))
    scheduler.schedule()
    lane.absorb(make_report(lane.key, worker_lane, LaneEvent(), {}))
    hashes = scheduler.requests["r1"].block_hashes
    assert all(lane.cached_tier(h) == ON_DEVICE for h in hashes) and lane.num_used_blocks == 3
    scheduler.finish_requests(["r1"], RequestStatus.FINISHED_ABORTED)
    scheduler.kv.pool.get_new_blocks(15)  # every cached block handed out again
    lane.absorb(make_report(lane.key, worker_lane, LaneEvent(), {}))
    assert not any(lane.cached_tier(h) for h in hashes)


def test_a_message_of_no_class_a_side_handles_is_refused_by_name() -> None:
    """The worker and the front each match what they receive against their family of messages
    (`worker_messages`): anything else (a tuple, as the messages once were) raises, naming it.
    A call's answer resolves the front's future as the worker's call ended."""
    worker = StepWorker(None, ClientSpec(), LaneSettings())  # type: ignore[arg-type]
    with pytest.raises(UnknownMessage, match=r"a scheduler worker has no handler for tuple: \('ack',\)"):
        worker._received([("ack",)])  # type: ignore[list-item]
    front = StepWorkerPool(1, ClientSpec()).workers[0]
    with pytest.raises(UnknownMessage, match=r"the scheduler front has no handler for tuple: \('started',\)"):
        front._handle(("started",))  # type: ignore[arg-type]
    returned, failed = front.call("e0#0", len), front.call("e0#0", len)  # type: ignore[arg-type]
    front._handle(CallReturned(0, 7))
    front._handle(CallRaised(1, "a block is leaked", assertion=True))
    assert returned.result(0) == 7
    with pytest.raises(AssertionError, match="a block is leaked"):
        failed.result(0)


# -- the scheduler over worker processes --------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("api_server_count", "stream_interval", "client_call", "num_scheduler_steps"),
    [(1, 1, "generate", 1), (2, 4, "generate-many", 4)],
)
def test_scheduler_workers_serve_exactly_and_survive_a_worker_kill(
    stories_dir: Path,
    tmp_path: Path,
    api_server_count: int,
    stream_interval: int,
    client_call: str,
    num_scheduler_steps: int,
) -> None:
    """With API server processes, a worker sends the tokens of sequences that go on straight to
    them, so the front's copies lack those: a killed worker's sequences resume from what the API
    processes streamed. With `--stream-interval` the tokens the dead worker held back are
    computed again, and the streams still equal transformers. Two variants: the defaults over
    a Generate call per stream; and 2 API processes, `--stream-interval 4` and
    `--num-scheduler-steps 4` (with async scheduling) over one GenerateMany call, as the gateway
    sends them."""
    _, requests, expected = greedy_workload(stories_dir, 11, NUM_STREAMS, NUM_NEW)
    with processes(tmp_path) as procs:
        addresses = start_executors(procs, stories_dir, ["e0", "e1"])
        scheduler = start_scheduler(
            procs,
            stories_dir,
            addresses,
            "--scheduler-workers",
            "2",
            "--async-scheduling",
            "--api-server-count",
            str(api_server_count),
            "--stream-interval",
            str(stream_interval),
            "--num-scheduler-steps",
            str(num_scheduler_steps),
        )
        address = scheduler.wait_ready()["address"]
        stub = pb_grpc.SchedulerStub(grpc.insecure_channel(address))
        first_pids = worker_pids(scheduler)
        assert len(first_pids) == 2, "one worker process per executor here"
        # Ready means its processes have started: each worker runs under its role's name, which
        # it takes once its imports are done (they would take the first steps' CPU).
        assert {Path(f"/proc/{pid}/comm").read_text().strip() for pid in first_pids.values()} == {STEP_WORKER}

        # 32 concurrent greedy streams over both workers equal transformers.
        outputs, reasons = complete_over(client_call, address, requests)
        assert reasons == ["length"] * NUM_STREAMS
        assert outputs == expected
        # Both executors' streams need NUM_NEW steps each of one pass, a quarter of them of four.
        metrics = stub.GetMetrics(pb.GetMetricsRequest(), timeout=10).text
        num_steps = metric_total(metrics, "npuserve:step_seconds_count")
        assert (num_steps < 2 * NUM_NEW) == (num_scheduler_steps > 1), num_steps
        assert metric_total(metrics, "vllm:generation_tokens_total") == NUM_STREAMS * NUM_NEW

        # Routing sees each worker's prefix cache exactly.
        check_prefix_routing(stub, ["e0", "e1"], torch.Generator().manual_seed(11))

        # A worker SIGKILLed mid-run: it restarts; its streams resume and complete unchanged.
        def kill_a_busy_worker() -> None:
            busy = pools(stub)
            assert all(p.num_requests > 0 for p in busy.values())
            os.kill(first_pids[0], signal.SIGKILL)

        outputs, reasons = complete_over(client_call, address, requests, kill_a_busy_worker)
        assert reasons == ["length"] * NUM_STREAMS
        assert outputs == expected
        taken = [e for e in scheduler.events() if e["event"] == "outputs taken from the API processes"]
        assert bool(taken) == (api_server_count > 1) and all(e["lost"] == 0 for e in taken)
        wait_until(lambda: worker_pids(scheduler)[0] != first_pids[0], 30, "the worker to restart")
        wait_until(lambda: set(pools(stub)) == {"e0", "e1"}, 30, "both executors to be served again")
        final = idle_pools(stub)
        assert all(p.num_free_blocks == p.num_blocks for p in final.values())
        assert not [e for e in scheduler.events() if e.get("level") == "error" and "worker" not in e["event"]]
