"""`GenerateMany`: many generations over one call, served by API processes (the gateway's tests
run it served by the front alone: `npuserve serve` starts one API process below 8 cores).

Over real processes (two executors, a scheduler with two API processes): the client's two
channels, spread by `api_spread`, reach one API process each; 32 greedy
generations over two calls equal transformers and arrive in fewer messages than events; a
refused request fails alone with Generate's status and field, the others go on; a cancelled
generation and a cancelled call abort their requests; a stop string stops its sequence in the
core; a duplicate stream id and an empty request are refused; a half-closed call ends once its
generations have; every pool is intact and idle afterwards. Then SIGTERM while a call holds a
generation: it finishes, new ones are refused (UNAVAILABLE), the call ends OK, and the scheduler
exits drained.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from harness.cluster import processes
from harness.pools import idle_pools
from harness.serve import greedy_request, greedy_workload, start_executors, start_scheduler

from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc
from npuserve.proto.api_spread import probe_api_server, spread_channels
from npuserve.proto.generate_many import GenerateFailed, GenerateManyClient, GenerateStream

pytestmark = pytest.mark.slow  # starts npuserve processes

NUM_STREAMS = 32
NUM_NEW = 24


async def tokens_of(stream: GenerateStream) -> tuple[list[int], str]:
    tokens, reason = [], ""
    async for response in stream:
        for completion in response.completions:
            tokens += completion.token_ids
            reason = completion.finish_reason or reason
    return tokens, reason


async def requests_of(*requests: pb.GenerateManyRequest) -> AsyncIterator[pb.GenerateManyRequest]:
    for request in requests:
        yield request


def test_generations_over_one_call(stories_dir: Path, tmp_path: Path) -> None:
    prompts, requests, expected = greedy_workload(stories_dir, 11, NUM_STREAMS, NUM_NEW)
    with processes(tmp_path) as procs:
        addresses = start_executors(procs, stories_dir, ["e0", "e1"])
        scheduler = start_scheduler(
            procs, stories_dir, addresses, "--api-server-count", "2", "--scheduler-workers", "1"
        )
        address = scheduler.wait_ready()["address"]

        async def scenario() -> None:
            # The two calls' channels reach one API process each, as the gateway's do.
            channels = await spread_channels(address, 2)
            assert sorted([await probe_api_server(channel) for channel in channels]) == [(0, 2), (1, 2)]
            stubs = [pb_grpc.SchedulerStub(channel) for channel in channels]
            clients = [GenerateManyClient(stub) for stub in stubs]

            # 32 greedy generations over two calls equal transformers; one refused fails alone.
            streams = [clients[i % 2].generate(request) for i, request in enumerate(requests)]
            refused = clients[0].generate(greedy_request([1, 10**6], 4))
            with pytest.raises(GenerateFailed) as failed:
                await refused.read()
            assert (failed.value.code, failed.value.field) == (grpc.StatusCode.INVALID_ARGUMENT, "prompt")
            with pytest.raises(GenerateFailed):  # an end is read again
                await refused.read()
            outputs = await asyncio.gather(*(tokens_of(stream) for stream in streams))
            assert [tokens for tokens, _ in outputs] == expected
            assert {reason for _, reason in outputs} == {"length"}
            assert await streams[0].read() is None  # done stays done

            # A cancelled generation is aborted; the call goes on serving.
            held = clients[1].generate(greedy_request(prompts[1], 400))
            first = await held.read()
            assert first is not None and first.request_id
            held.cancel()
            assert (await tokens_of(clients[1].generate(requests[2])))[0] == expected[2]

            # A stop string ends the generation here and its sequence in the core at once (the
            # core hears of the stop before the stream's close: it no longer holds the request).
            text = "".join(
                [
                    c.text
                    async for r in clients[0].generate(greedy_request(prompts[0], NUM_NEW))
                    for c in r.completions
                ]
            )
            stop = text[len(text) // 2 : len(text) // 2 + 3]
            stopped = greedy_request(prompts[0], 200, stop=[stop])
            stopped.request_id = "stopped"
            (*_, last) = [r async for r in clients[0].generate(stopped)]
            assert (last.completions[0].finish_reason, last.completions[0].stop_string) == ("stop", stop)
            assert not (await stubs[0].Abort(pb.AbortRequest(request_id="stopped"))).found

            # One raw call: events outnumber messages; a reused stream id and an empty request are
            # refused; half-closing lets the generation finish, then the call ends OK.
            raw = stubs[0].GenerateMany(
                requests_of(
                    pb.GenerateManyRequest(
                        actions=[pb.GenerateManyAction(stream_id=i, generate=requests[i]) for i in range(6)]
                    ),
                    *(
                        pb.GenerateManyRequest(
                            actions=[pb.GenerateManyAction(stream_id=i, generate=requests[i])]
                        )
                        for i in (6, 7)
                    ),
                    pb.GenerateManyRequest(
                        actions=[
                            pb.GenerateManyAction(stream_id=3, generate=requests[3]),
                            pb.GenerateManyAction(stream_id=99),
                        ]
                    ),
                )
            )
            messages, tokens, errors, done = 0, {i: [] for i in (*range(8), 99)}, [], set()
            async for response in raw:
                messages += 1
                for event in response.events:
                    tokens[event.stream_id] += [t for c in event.response.completions for t in c.token_ids]
                    if event.HasField("error"):
                        errors.append((event.stream_id, event.error.code))
                    done |= {event.stream_id} if event.done else set()
            assert await raw.code() == grpc.StatusCode.OK
            assert sorted(errors) == [(3, "INVALID_ARGUMENT"), (99, "INVALID_ARGUMENT")]
            assert done == set(range(8)) and [tokens[i] for i in range(8)] == expected[:8]
            assert messages < 8 * NUM_NEW

            # A cancelled call aborts what it held.
            open_streams = [clients[0].generate(greedy_request(p, 400)) for p in prompts[:4]]
            await asyncio.gather(*(stream.read() for stream in open_streams))
            await clients[0].close()
            for stream in open_streams:
                with pytest.raises(GenerateFailed) as cancelled:
                    await tokens_of(stream)
                assert cancelled.value.code == grpc.StatusCode.CANCELLED
            for client in clients:
                await client.close()
            for channel in channels:
                await channel.close()

        asyncio.run(scenario())
        final = idle_pools(pb_grpc.SchedulerStub(grpc.insecure_channel(address)))
        assert set(final) == {"e0", "e1"}
        assert all(p.num_free_blocks == p.num_blocks for p in final.values())

        async def drain() -> None:
            """SIGTERM while a call holds a generation: it finishes, new ones are refused with
            UNAVAILABLE, then the call ends OK and the scheduler exits drained."""
            channel = grpc.aio.insecure_channel(address)
            actions: asyncio.Queue[pb.GenerateManyAction] = asyncio.Queue()

            async def requests() -> AsyncIterator[pb.GenerateManyRequest]:
                while True:
                    yield pb.GenerateManyRequest(actions=[await actions.get()])

            call = pb_grpc.SchedulerStub(channel).GenerateMany(requests())
            held_tokens, ends = 0, {}  # tokens of stream 0; how each stream ended

            async def read() -> bool:
                nonlocal held_tokens
                response = await call.read()
                if response is grpc.aio.EOF:
                    return False
                for event in response.events:
                    if event.stream_id == 0:
                        held_tokens += sum(len(c.token_ids) for c in event.response.completions)
                    if event.done or event.HasField("error"):
                        ends[event.stream_id] = event.error.code or "done"
                return True

            actions.put_nowait(pb.GenerateManyAction(stream_id=0, generate=greedy_request(prompts[0], 400)))
            while not held_tokens:
                await read()
            stopped = asyncio.create_task(asyncio.to_thread(scheduler.stop, 60))
            for stream_id in range(1, 200):  # until the drain refuses one (a few may slip in first)
                short = greedy_request(prompts[1], 2)
                actions.put_nowait(pb.GenerateManyAction(stream_id=stream_id, generate=short))
                while stream_id not in ends:
                    await read()
                if ends[stream_id] != "done":
                    break
            assert ends[stream_id] == "UNAVAILABLE"
            while await read():  # the call ends once the generation in flight has
                pass
            assert await call.code() == grpc.StatusCode.OK
            assert ends[0] == "done" and held_tokens == 400
            assert await stopped == 0
            await channel.close()

        asyncio.run(drain())
        assert any(e["event"] == "scheduler drained; block pools intact and idle" for e in scheduler.events())
