"""The public API served by API server processes (`--api-server-count`).

Units: a forwarded call's abort becomes a status the API process replays, and errors cross
processes with their status and field. Then one scenario over real processes: two executors,
a scheduler with two API processes sharing its port; 32 greedy streams over 16 connections
equal transformers and are served by both processes; stop strings found in an API process stop
the sequence in the core; calls the core answers (Abort, Health, CheckIntegrity, ListModels,
metrics) work from any process; an API process SIGKILLed under 32 streams is restarted, the
streams of the other complete unchanged, and every pool is intact and idle afterwards. And when
the core itself is SIGKILLed, its API processes and workers exit: none is left on the port.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pickle
import signal
import threading
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from harness.cluster import processes, wait_until
from harness.pools import idle_pools
from harness.serve import (
    alive,
    api_pids,
    child_pids,
    greedy_request,
    greedy_workload,
    metric_total,
    start_executors,
    start_scheduler,
    worker_pids,
)

from npuserve.deploy.runtime.process_name import API_SERVER, CHAT_RENDER, STEP_WORKER, process_name
from npuserve.deploy.runtime.unknown_message import UnknownMessage
from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc
from npuserve.proto.channel import CONNECTION_INDEX_OPTION
from npuserve.scheduler.api.api_messages import (
    ApiToCore,
    CoreToApi,
    EndStream,
    PackedUpdate,
    RelayedStatus,
    RelayedUpdates,
    StreamUpdates,
)
from npuserve.scheduler.api.api_process import CoreLink
from npuserve.scheduler.api.api_relay import MAX_UNACKED_ITEMS, ApiProcessHandle, CallContext, Relay
from npuserve.scheduler.api.api_status import field_of, relayed, status_of
from npuserve.scheduler.core.request import InvalidRequestError
from npuserve.scheduler.engine.engine_config import QueueFullError
from npuserve.scheduler.engine.outputs import SequenceUpdate
from npuserve.scheduler.lanes.pipe_link import PipeLink

NUM_STREAMS = 32
NUM_CONNECTIONS = 16
NUM_NEW = 40


# -- units --------------------------------------------------------------------------------------


def test_an_error_crosses_processes_with_its_status_and_field() -> None:
    crossed = relayed(InvalidRequestError("temperature must be >= 0", "temperature"))
    assert (status_of(crossed), field_of(crossed), str(crossed)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "temperature",
        "temperature must be >= 0",
    )
    full = relayed(QueueFullError("the queue is full"))
    assert status_of(full) == grpc.StatusCode.RESOURCE_EXHAUSTED and field_of(full) is None


def test_a_forwarded_calls_abort_becomes_a_status() -> None:
    async def abort() -> RelayedStatus:
        try:
            await CallContext().abort(grpc.StatusCode.NOT_FOUND, "no such model", (("k", b"v"),))
        except CallContext.Aborted as aborted:
            return aborted.status
        raise AssertionError("abort must raise")

    assert asyncio.run(abort()) == RelayedStatus("NOT_FOUND", "no such model", (("k", b"v"),))


def update(handle: int, token: int) -> PackedUpdate:
    return (handle, 0, [token], [None], None, None, None, 1, -1)


def test_a_relay_sends_a_turns_items_as_one_and_is_behind_until_acknowledged() -> None:
    """A run of the core's own updates goes as one `StreamUpdates`; a worker's pack, and an end,
    as they are, in the order they were put. Every item counts until acknowledged."""
    core_end, api_end = multiprocessing.Pipe()
    end = SequenceUpdate(0, [], [], "abort", None, None, 1, -1)
    pack = [update(9, 5)]

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        pipe: PipeLink[CoreToApi, ApiToCore] = PipeLink(core_end, lambda batch: None, lambda: None, loop)
        pipe.start()
        relay = Relay(pipe, loop)
        half = MAX_UNACKED_ITEMS // 2
        for i in range(half):
            relay.put_update(update(i, i))
        relay.put(RelayedUpdates(pickle.dumps(pack)), len(pack))
        relay.put(EndStream(3, end))
        for i in range(half, MAX_UNACKED_ITEMS - 2):
            relay.put_update(update(i, i))
        assert not api_end.poll(0.2) and not relay.behind  # sent at the end of the loop's turn
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        received = await asyncio.to_thread(api_end.recv)  # one message, however many items
        assert received == [
            StreamUpdates([update(i, i) for i in range(half)]),
            RelayedUpdates(pickle.dumps(pack)),
            EndStream(3, end),
            StreamUpdates([update(i, i) for i in range(half, MAX_UNACKED_ITEMS - 2)]),
        ]
        assert relay.behind
        relay.acked(1)
        assert not relay.behind
        pipe.close()

    try:
        asyncio.run(scenario())
    finally:
        api_end.close()


def test_a_message_of_no_class_a_side_handles_is_refused_by_name() -> None:
    """The core and an API process each match what they receive against their family of
    messages (`api_messages`): anything else (a tuple, as the messages once were) raises,
    naming it."""
    ours, theirs = multiprocessing.Pipe()
    loop = asyncio.new_event_loop()
    try:
        link = CoreLink(ours, loop, None, 1)  # type: ignore[arg-type]
        with pytest.raises(
            UnknownMessage, match=r"an API server process has no handler for tuple: \('drain',\)"
        ):
            link._apply([("drain",)])  # type: ignore[list-item]
        handle = ApiProcessHandle(0, SimpleNamespace(engine=None))  # type: ignore[arg-type]
        handle.pipe = link.pipe  # type: ignore[assignment]
        with pytest.raises(
            UnknownMessage, match=r"the scheduler core has no handler for tuple: \('ready', 1\)"
        ):
            handle._apply(link.pipe, [("ready", 1)])  # type: ignore[arg-type, list-item]
    finally:
        loop.close()
        ours.close()
        theirs.close()


# -- the scheduler over API processes -----------------------------------------------------------


def stubs(address: str) -> list[pb_grpc.SchedulerStub]:
    """One stub per connection (the kernel spreads connections over the API processes)."""
    return [
        pb_grpc.SchedulerStub(grpc.insecure_channel(address, options=[(CONNECTION_INDEX_OPTION, i)]))
        for i in range(NUM_CONNECTIONS)
    ]


def stream_all(
    connections: list[pb_grpc.SchedulerStub],
    requests: list[pb.GenerateRequest],
    started: threading.Barrier | None = None,
) -> tuple[list[threading.Thread], list[list[int]], list[str], list[grpc.StatusCode | None]]:
    """One thread per request over the connections in turn; with ``started``, each waits there
    once it has 4 tokens. A stream that breaks keeps its status code."""
    outputs: list[list[int]] = [[] for _ in requests]
    reasons = ["" for _ in requests]
    codes: list[grpc.StatusCode | None] = [None for _ in requests]

    def stream(index: int) -> None:
        waited = started is None
        try:
            for response in connections[index % len(connections)].Generate(requests[index], timeout=120):
                for completion in response.completions:
                    outputs[index] += completion.token_ids
                    reasons[index] = completion.finish_reason or reasons[index]
                if not waited and len(outputs[index]) >= 4:
                    waited = True
                    started.wait(60)  # type: ignore[union-attr]
        except grpc.RpcError as exc:
            codes[index] = exc.code()
            if not waited:
                started.wait(60)  # type: ignore[union-attr]

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    if started is not None:
        started.wait(60)
    return threads, outputs, reasons, codes


@pytest.mark.slow
def test_api_processes_serve_exactly_and_survive_a_kill(stories_dir: Path, tmp_path: Path) -> None:
    prompts, requests, expected = greedy_workload(stories_dir, 5, NUM_STREAMS, NUM_NEW)
    with processes(tmp_path) as procs:
        addresses = start_executors(procs, stories_dir, ["e0", "e1"])
        scheduler = start_scheduler(
            procs, stories_dir, addresses, "--api-server-count", "2", "--scheduler-workers", "1"
        )
        address = scheduler.wait_ready()["address"]
        connections = stubs(address)
        stub = connections[0]
        first_pids = api_pids(scheduler)
        assert len(first_pids) == 2

        # 32 greedy streams over 16 connections equal transformers, served by both processes.
        threads, outputs, reasons, codes = stream_all(connections, requests)
        for thread in threads:
            thread.join(120)
        assert codes == [None] * NUM_STREAMS
        assert reasons == ["length"] * NUM_STREAMS
        assert outputs == expected
        served_by = {e.get("api_server") for e in scheduler.events() if e["event"] == "request done"}
        assert served_by == {0, 1}

        # Every token counts once in the metrics, those relayed on the per-token path included
        # (counted as the front handles its workers' reports, which may land after the streams end).
        def generated() -> float:
            return metric_total(stub.GetMetrics(pb.GetMetricsRequest()).text, "vllm:generation_tokens_total")

        wait_until(lambda: generated() >= NUM_STREAMS * NUM_NEW, 10, "every token counted")
        assert generated() == NUM_STREAMS * NUM_NEW

        # A stop string found in an API process ends the sequence there and in the core.
        text = "".join(
            c.text
            for r in connections[1].Generate(greedy_request(prompts[0], NUM_NEW))
            for c in r.completions
        )
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        for connection in connections[:4]:
            (last, *_) = reversed(list(connection.Generate(greedy_request(prompts[0], NUM_NEW, stop=[stop]))))
            assert (last.completions[0].finish_reason, last.completions[0].stop_string) == ("stop", stop)
            assert last.usage.completion_tokens < NUM_NEW

        # Chat prompts render in the API processes' template workers.
        chat = pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="Tell me a story.")])
        for connection in connections[:4]:
            chat_request = pb.GenerateRequest(
                chat=chat, sampling=pb.SamplingParams(temperature=0, max_tokens=8)
            )
            (last, *_) = reversed(list(connection.Generate(chat_request, timeout=60)))
            assert last.usage.completion_tokens > 0 and last.usage.prompt_tokens > 5

        # Calls the core answers work from every connection; errors keep their status.
        for connection in connections[:4]:
            assert connection.Health(pb.HealthRequest()).serving
            assert connection.ListModels(pb.ListModelsRequest()).models[0].max_model_len > 0
            assert not connection.Abort(pb.AbortRequest(request_id="nobody")).found
            assert "vllm:num_requests_running" in connection.GetMetrics(pb.GetMetricsRequest()).text
            with pytest.raises(grpc.RpcError) as refused:
                list(connection.Generate(greedy_request([1, 10**6], 4)))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        waiting = threading.Event()
        held = greedy_request(prompts[1], 400)
        held.request_id = "held"

        held_reasons: list[str] = []

        def hold() -> None:
            for response in connections[2].Generate(held, timeout=120):
                held_reasons.extend(c.finish_reason for c in response.completions if c.finish_reason)
                waiting.set()

        holder = threading.Thread(target=hold)
        holder.start()
        assert waiting.wait(60)
        with pytest.raises(grpc.RpcError) as duplicate:  # the core refuses it, relayed with its field
            list(connections[3].Generate(held))
        assert duplicate.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "already in use" in (duplicate.value.details() or "")
        assert stub.Abort(pb.AbortRequest(request_id="held")).found
        holder.join(60)
        assert held_reasons == ["abort"]

        # An API process SIGKILLed under 32 streams: the other's streams complete unchanged; it
        # restarts and serves; what its streams held is freed.
        started = threading.Barrier(NUM_STREAMS + 1)
        threads, outputs, reasons, codes = stream_all(connections, requests, started)
        os.kill(first_pids[0], signal.SIGKILL)
        for thread in threads:
            thread.join(120)
        survived = [i for i, code in enumerate(codes) if code is None]
        assert all(codes[i] == grpc.StatusCode.UNAVAILABLE for i in range(NUM_STREAMS) if i not in survived)
        assert [outputs[i] for i in survived] == [expected[i] for i in survived]
        assert all(reasons[i] == "length" for i in survived)
        wait_until(lambda: api_pids(scheduler)[0] != first_pids[0], 30, "the API process to restart")
        wait_until(
            lambda: sum(e["event"] == "api server process serving" for e in scheduler.events()) == 3,
            60,
            "the restarted API process to serve",
        )
        # Every connection serves again (a broken one reconnects, to either process).
        for index, connection in enumerate(connections):
            tokens = [
                t
                for r in connection.Generate(requests[index], timeout=120)
                for c in r.completions
                for t in c.token_ids
            ]
            assert tokens == expected[index]
        final = idle_pools(stub)
        assert set(final) == {"e0", "e1"}
        assert all(p.num_free_blocks == p.num_blocks for p in final.values())

        # SIGTERM drains and stops the scheduler and its API processes.
        latest = api_pids(scheduler)
        assert scheduler.stop() == 0
        assert not any(alive(pid) for pid in latest.values())
        assert any(e["event"] == "scheduler drained; block pools intact and idle" for e in scheduler.events())


@pytest.mark.slow
def test_a_stream_interval_sends_fewer_messages_with_the_same_tokens(
    stories_dir: Path, tmp_path: Path
) -> None:
    """`--stream-interval 4` with API processes and a worker: 32 greedy streams equal transformers
    in at most 1 + ceil((40 - 1) / 4) messages each (the first token alone, then groups of 4,
    the rest with the end); a stop string still ends its sequence at the token it appears in;
    siblings are grouped apart, each token with its logprobs."""
    interval = 4
    prompts, requests, expected = greedy_workload(stories_dir, 7, NUM_STREAMS, NUM_NEW)
    with processes(tmp_path) as procs:
        addresses = start_executors(procs, stories_dir, ["e0", "e1"])
        scheduler = start_scheduler(
            procs, stories_dir, addresses, "--api-server-count", "2", "--scheduler-workers", "1",
            "--stream-interval", str(interval),
        )  # fmt: skip
        connections = stubs(scheduler.wait_ready()["address"])
        messages = [0] * NUM_STREAMS
        outputs: list[list[int]] = [[] for _ in requests]

        def stream(index: int) -> None:
            for response in connections[index % NUM_CONNECTIONS].Generate(requests[index], timeout=120):
                messages[index] += 1
                outputs[index] += [t for c in response.completions for t in c.token_ids]

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(NUM_STREAMS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert outputs == expected
        assert max(messages) <= 1 + -(-(NUM_NEW - 1) // interval) and min(messages) >= 2

        # Stop strings are looked for at every token: the sequence ends where the one-by-one
        # stream of the same request ends, counting the same tokens.
        text = "".join(
            c.text
            for r in connections[0].Generate(greedy_request(prompts[0], NUM_NEW))
            for c in r.completions
        )
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        (last, *_) = reversed(list(connections[1].Generate(greedy_request(prompts[0], NUM_NEW, stop=[stop]))))
        assert (last.completions[0].finish_reason, last.completions[0].stop_string) == ("stop", stop)
        stopped = [
            t
            for r in connections[2].Generate(greedy_request(prompts[0], NUM_NEW, stop=[stop]))
            for c in r.completions
            for t in c.token_ids
        ]
        assert stopped == expected[0][: len(stopped)] and len(stopped) == last.usage.completion_tokens

        # Siblings are grouped apart, each token with its logprobs.
        tokens: dict[int, list[int]] = {0: [], 1: []}
        logprobs: dict[int, list[int]] = {0: [], 1: []}
        for response in connections[3].Generate(greedy_request(prompts[0], NUM_NEW, n=2, logprobs=1)):
            for c in response.completions:
                tokens[c.index] += c.token_ids
                logprobs[c.index] += [lp.token_id for lp in c.logprobs]
        assert tokens == logprobs == {0: expected[0], 1: expected[0]}
        final = idle_pools(connections[0])
        assert all(p.num_free_blocks == p.num_blocks for p in final.values())


@pytest.mark.slow
def test_when_the_core_dies_its_api_processes_and_workers_go_too(stories_dir: Path, tmp_path: Path) -> None:
    """No orphan keeps the port (SO_REUSEPORT would hand it clients no core serves) or an
    executor: each child sees its pipe to the core close and exits, so a restarted scheduler
    starts clean."""
    with processes(tmp_path) as procs:
        addresses = start_executors(procs, stories_dir, ["e0"])
        scheduler = start_scheduler(
            procs, stories_dir, addresses, "--api-server-count", "2", "--scheduler-workers", "1"
        )
        address = scheduler.wait_ready()["address"]
        started = set(api_pids(scheduler).values()) | set(worker_pids(scheduler).values())
        children = set(child_pids(scheduler.pid))  # render processes too
        assert len(started) == 3 and started <= children and all(alive(pid) for pid in children)
        # Each child's name says its role (`ps`, `top`; the scale bench splits CPU by it).
        names = {pid: process_name(pid) for pid in children}
        assert {names[pid] for pid in api_pids(scheduler).values()} == {API_SERVER}
        assert {names[pid] for pid in worker_pids(scheduler).values()} == {STEP_WORKER}
        assert CHAT_RENDER in {names[pid] for pid in children - started}  # and multiprocessing's tracker
        os.kill(scheduler.pid, signal.SIGKILL)
        wait_until(lambda: not any(alive(pid) for pid in children), 30, "the core's children to exit")
        with pytest.raises(grpc.RpcError) as gone:
            stubs(address)[0].Health(pb.HealthRequest(), timeout=5)
        assert gone.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
