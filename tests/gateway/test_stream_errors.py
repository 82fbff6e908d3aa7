"""The gateway app against a fake scheduler: how scheduler failures reach HTTP clients, before and
during a stream. In process (app factory + an in-loop gRPC server), no model. The fake answers
`Generate` only, as a scheduler older than `GenerateMany` would: the gateway's first generation
finds that call UNIMPLEMENTED and it, and every later one, goes over `Generate` calls instead."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest

from npuserve.gateway.app import create_app
from npuserve.gateway.limits import RequestLimits
from npuserve.gateway.scheduler_client import SchedulerClient
from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc
from npuserve.proto.error_details import field_status
from npuserve.proto.generate_many import LOST_STATUS_DETAILS

LOGPROBS_REFUSAL = "logprobs must be in [0, 20], got 21"


def token(index: int, text: str, finish: str = "", error: str = "") -> pb.GenerateResponse:
    completion = pb.Completion(
        index=index, text=text, token_ids=[5], finish_reason=finish, error_message=error
    )
    return pb.GenerateResponse(completions=[completion])


class FakeScheduler(pb_grpc.SchedulerServicer):
    """Generate behaves as the prompt text says (and keeps what each call asked for)."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        what = "chat" if request.WhichOneof("prompt") == "chat" else request.text
        self.asked.append(what)
        if what in ("chat", "bad-logprobs"):  # the scheduler's refusal of logprobs=21
            status = field_status(grpc.StatusCode.INVALID_ARGUMENT, LOGPROBS_REFUSAL, "logprobs")
            await context.abort(status.code, status.details, status.trailing_metadata)
        if what == "bad-unnamed":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the request is refused")
        if what == "bad-contradicting":  # a details trailer whose status is not the call's
            status = field_status(grpc.StatusCode.INVALID_ARGUMENT, "another message", "n")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a message", status.trailing_metadata)
        if what == "queue-full":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the queue is full; retry later")
        if what == "internal":
            await context.abort(grpc.StatusCode.INTERNAL, "boom")
        if what == "refused-unavailable":  # a scheduler that is there and says it cannot serve
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no executor is available")
        if what == "fails-at-once":
            yield token(0, "", finish="error", error="executor vm:1 failed")
            return
        yield token(0, "Hello")
        yield token(0, " world")
        if what == "dies-midstream":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is stopping")
        if what == "fails-midstream":
            yield token(0, "", finish="error", error="executor vm:1 failed")
            return
        final = token(0, "!", finish="length")
        final.usage.prompt_tokens, final.usage.completion_tokens = 3, 3
        yield final

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[pb.Model(id="fake", max_model_len=512, root="/fake")])


async def exchange(
    requests: list[tuple[str, dict]],
    max_request_bytes: int = 1 << 20,
    scheduler: pb_grpc.SchedulerServicer | None = None,
) -> list[httpx.Response]:
    server = grpc.aio.server()
    pb_grpc.add_SchedulerServicer_to_server(scheduler or FakeScheduler(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    app = create_app(f"127.0.0.1:{port}", limits=RequestLimits(max_request_bytes=max_request_bytes))
    client = app.state.gateway.client
    await client.open()  # NOTE: ASGITransport runs no lifespan
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            return [await http.post(path, json=body) for path, body in requests]
    finally:
        await client.close()
        await server.stop(None)


def run(*requests: tuple[str, dict], max_request_bytes: int = 1 << 20) -> list[httpx.Response]:
    return asyncio.run(exchange(list(requests), max_request_bytes))


def events(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]


def completion(prompt: str, stream: bool = True) -> tuple[str, dict]:
    return "/v1/completions", {"prompt": prompt, "stream": stream}


def test_a_clean_stream_and_a_whole_response() -> None:
    streamed, whole = run(completion("ok"), completion("ok", stream=False))
    assert streamed.headers["content-type"].startswith("text/event-stream")
    chunks = events(streamed)
    assert chunks[-1] == "[DONE]"
    texts = [json.loads(c)["choices"][0]["text"] for c in chunks[:-1]]
    assert texts == ["Hello", " world", "!"]
    body = whole.json()
    assert body["choices"][0]["text"] == "Hello world!" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert body["model"] == "fake" and body["id"].startswith("cmpl-")


class LostStatusScheduler(FakeScheduler):
    """Ends each GenerateMany call as grpc's client reports a call whose status it lost (a call
    that ended while one of its requests was being written: `LOST_STATUS_DETAILS`)."""

    async def GenerateMany(
        self, request_iterator: AsyncIterator[pb.GenerateManyRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateManyResponse]:
        await context.abort(grpc.StatusCode.INTERNAL, LOST_STATUS_DETAILS)
        yield pb.GenerateManyResponse()  # NOTE: never reached; it makes this a stream handler


def test_a_generation_whose_call_lost_its_status_goes_over_a_generate_call() -> None:
    streamed, whole = asyncio.run(
        exchange([completion("ok"), completion("ok", stream=False)], scheduler=LostStatusScheduler())
    )
    assert streamed.status_code == 200, streamed.text
    assert [json.loads(c)["choices"][0]["text"] for c in events(streamed)[:-1]] == ["Hello", " world", "!"]
    assert whole.status_code == 200 and whole.json()["choices"][0]["text"] == "Hello world!"


class CallBreakingScheduler(FakeScheduler):
    """Serves GenerateMany calls, one generation at a time, but ends the first call that is
    asked for "drop-call" UNAVAILABLE, as a call ends whose API server process died; answers
    Health throughout (the scheduler itself is there)."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = False
        self.health_checks = 0

    async def GenerateMany(
        self, request_iterator: AsyncIterator[pb.GenerateManyRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateManyResponse]:
        async for request in request_iterator:
            for action in request.actions:
                if not action.HasField("generate"):
                    continue
                if action.generate.text == "drop-call" and not self.dropped:
                    self.dropped = True
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
                async for response in self.Generate(action.generate, context):
                    yield pb.GenerateManyResponse(
                        events=[pb.GenerateManyEvent(stream_id=action.stream_id, response=response)]
                    )
                yield pb.GenerateManyResponse(
                    events=[pb.GenerateManyEvent(stream_id=action.stream_id, done=True)]
                )

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        self.health_checks += 1
        await asyncio.sleep(0.05)  # NOTE: so that the checks asked together overlap
        return pb.HealthResponse(serving=True, ready_executors=1, total_executors=1)


def test_a_generation_whose_call_broke_while_the_scheduler_answers_is_sent_again() -> None:
    """A `GenerateMany` call never ends to refuse one generation (a refusal is an event), so a
    call that ends UNAVAILABLE while the scheduler answers broke (an API server process died,
    say): its generations that had nothing yet are sent again at once, on a new call."""
    scheduler = CallBreakingScheduler()
    ok, dropped = asyncio.run(
        exchange([completion("ok", stream=False), completion("drop-call", stream=False)], scheduler=scheduler)
    )
    assert ok.status_code == 200
    assert dropped.status_code == 200, dropped.text
    assert dropped.json()["choices"][0]["text"] == "Hello world!"
    assert scheduler.dropped and scheduler.asked == ["ok", "drop-call"]


def test_generations_that_ask_at_once_whether_the_scheduler_is_there_share_one_check() -> None:
    """A scheduler's death ends every generation of a call together, and each asks whether the
    scheduler is there: over one channel they share one health check (not one each), and a
    later question gets a check of its own."""
    scheduler = CallBreakingScheduler()

    async def ask() -> tuple[list[bool], bool]:
        server = grpc.aio.server()
        pb_grpc.add_SchedulerServicer_to_server(scheduler, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = SchedulerClient(f"127.0.0.1:{port}")
        await client.open()
        try:
            together = await asyncio.gather(*(client.answers(0) for _ in range(8)))
            return together, await client.answers(0)
        finally:
            await client.close()
            await server.stop(None)

    together, later = asyncio.run(ask())
    assert together == [True] * 8 and later
    assert scheduler.health_checks == 2


@pytest.mark.parametrize("prompt", ["dies-midstream", "fails-midstream"])
def test_an_error_after_the_stream_started_is_an_error_event_then_done(prompt: str) -> None:
    (response,) = run(completion(prompt))
    assert response.status_code == 200
    chunks = events(response)
    assert [json.loads(c)["choices"][0]["text"] for c in chunks[:2]] == ["Hello", " world"]
    error = json.loads(chunks[2])["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "server_error"
    assert chunks[3:] == ["[DONE]"]
    (whole,) = run(completion(prompt, stream=False))
    assert whole.status_code in (500, 503) and whole.json()["error"]["message"]


def test_errors_before_the_stream_are_plain_http_errors() -> None:
    full, full_stream, internal, failed = run(
        completion("queue-full", stream=False),
        completion("queue-full"),
        completion("internal"),
        completion("fails-at-once"),
    )
    for response in (full, full_stream):
        assert response.status_code == 429 and response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "rate_limit_exceeded"
    assert internal.status_code == 500 and internal.json()["error"]["type"] == "server_error"
    assert failed.status_code == 500 and "executor vm:1 failed" in failed.json()["error"]["message"]


def test_a_scheduler_that_answers_unavailable_itself_gets_its_503_passed_on_at_once() -> None:
    """The gateway sends a generation again only when its call ended because the scheduler went
    away (it then answers no health check). One that refused it with UNAVAILABLE answers, here
    UNIMPLEMENTED for Health: its refusal reaches the client as a 503, with no wait and no second
    send, even right after it served (when a scheduler that went away would be waited for)."""
    scheduler = FakeScheduler()
    ok, refused = asyncio.run(
        exchange(
            [completion("ok", stream=False), completion("refused-unavailable", stream=False)],
            scheduler=scheduler,
        )
    )
    assert ok.status_code == 200 and scheduler.asked.count("refused-unavailable") == 1
    assert refused.status_code == 503 and refused.json()["error"]["message"].endswith(
        "no executor is available"
    )
    assert refused.headers["retry-after"]


def test_the_body_limit_holds_in_the_app() -> None:
    (response,) = run(("/v1/completions", {"prompt": "x" * 2000}), max_request_bytes=1000)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_the_field_the_scheduler_names_is_the_param_the_client_sent() -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 5}
    completion_error, chat_error, unnamed, contradicting = run(
        completion("bad-logprobs", stream=False),
        ("/v1/chat/completions", {**chat, "stream": True}),
        completion("bad-unnamed"),
        completion("bad-contradicting"),
    )
    assert completion_error.status_code == 400 and completion_error.json()["error"]["param"] == "logprobs"
    assert completion_error.json()["error"]["message"] == LOGPROBS_REFUSAL
    # Chat sends top_logprobs as the scheduler's logprobs: the error names top_logprobs.
    assert chat_error.status_code == 400, chat_error.text
    error = chat_error.json()["error"]
    assert error["param"] == "top_logprobs" and error["message"] == "top_logprobs must be in [0, 20], got 21"
    for response in (unnamed, contradicting):
        assert response.status_code == 400 and response.json()["error"]["param"] is None
