"""The gateway against a fake scheduler whose `GenerateMany` calls break mid-stream (as one
breaks when the scheduler or the API server process serving it dies; the fake answers `Health`,
so each generation is sent again at once): a generation that had tokens is resumed from them,
once (`gateway/delivered.py`, `scheduler_client.GenerateCall`). In process, no model."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest

from npuserve.gateway.app import create_app
from npuserve.gateway.delivered import RESUMED_ID_SUFFIX
from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc


def response(*completions: pb.Completion, resumed_tokens: int = 0) -> pb.GenerateResponse:
    return pb.GenerateResponse(completions=completions, resumed_tokens=resumed_tokens)


def token(token_id: int, text: str, index: int = 0, finish: str = "") -> pb.Completion:
    return pb.Completion(index=index, text=text, token_ids=[token_id], finish_reason=finish)


def last(completion: pb.Completion, num_tokens: int) -> pb.GenerateResponse:
    final = response(completion)
    final.usage.prompt_tokens, final.usage.completion_tokens = 3, num_tokens
    return final


class BreakingScheduler(pb_grpc.SchedulerServicer):
    """Serves GenerateMany calls one generation at a time, as its prompt text says; keeps every
    request it was sent. "once" breaks its call after two tokens, and its continuation ends
    the generation after one more; "twice" breaks the continuation's call too; "old" goes on
    as a scheduler that predates continuations (it starts over); "n2" is an n = 2 request that
    breaks once its first choice has finished; "dies-at-once" breaks its call before any token."""

    def __init__(self) -> None:
        self.sent: list[pb.GenerateRequest] = []

    def responses(self, request: pb.GenerateRequest) -> list[pb.GenerateResponse | None]:
        """What the generation of ``request`` streams; None: its call breaks there."""
        resumed = len(request.continuations) > 0
        if request.text == "dies-at-once":
            return [None]
        if request.text == "n2":
            return [response(token(10, "A", 0, "stop"), token(11, "B", 1)), None]
        if not resumed or request.text == "old":
            return [response(token(10, "Hel")), response(token(11, "lo")), None]
        then = [response(token(12, " world"), resumed_tokens=2)]
        return [*then, None] if request.text == "twice" else [*then, last(token(13, "!", finish="length"), 4)]

    async def GenerateMany(
        self, request_iterator: AsyncIterator[pb.GenerateManyRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateManyResponse]:
        async for request in request_iterator:
            for action in request.actions:
                if not action.HasField("generate"):
                    continue
                self.sent.append(action.generate)
                for item in self.responses(action.generate):
                    if item is None:
                        await context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
                    event = pb.GenerateManyEvent(stream_id=action.stream_id, response=item)
                    event.done = item.HasField("usage")
                    yield pb.GenerateManyResponse(events=[event])

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        return pb.HealthResponse(serving=True, ready_executors=1, total_executors=1)

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[pb.Model(id="fake", max_model_len=512, root="/fake")])


async def exchange(scheduler: BreakingScheduler, bodies: list[dict]) -> list[httpx.Response]:
    server = grpc.aio.server()
    pb_grpc.add_SchedulerServicer_to_server(scheduler, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    app = create_app(f"127.0.0.1:{port}")
    client = app.state.gateway.client
    await client.open()  # NOTE: ASGITransport runs no lifespan
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            return [await http.post("/v1/completions", json=body) for body in bodies]
    finally:
        await client.close()
        await server.stop(None)


def run(*bodies: dict) -> tuple[BreakingScheduler, list[httpx.Response]]:
    scheduler = BreakingScheduler()
    return scheduler, asyncio.run(exchange(scheduler, list(bodies)))


def events(reply: httpx.Response) -> list[dict]:
    return [json.loads(e.removeprefix("data: ")) for e in reply.text.split("\n\n") if e and "[DONE]" not in e]


def streamed(prompt: str, **more: object) -> dict:
    return {"prompt": prompt, "stream": True, "stream_options": {"include_usage": True}, **more}


def test_a_generation_whose_call_broke_mid_stream_resumes_from_its_tokens() -> None:
    scheduler, (stream, whole) = run(streamed("once"), {"prompt": "once", "stream": False})
    chunks = events(stream)
    assert [c["choices"][0]["text"] for c in chunks if c["choices"]] == ["Hel", "lo", " world", "!"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    body = whole.json()
    assert body["choices"][0]["text"] == "Hello world!" and body["usage"]["completion_tokens"] == 4
    first, resumed = scheduler.sent[:2]
    assert [list(c.token_ids) for c in resumed.continuations] == [[10, 11]]
    assert resumed.request_id == first.request_id + RESUMED_ID_SUFFIX
    assert not resumed.sampling.return_prompt and resumed.text == first.text
    assert len(scheduler.sent) == 4  # each sent twice, no more


def test_a_resumed_generation_whose_call_breaks_again_ends_with_an_error() -> None:
    """It is not sent a third time: a request that brings its scheduler down would bring it
    down at each resend. Mid-stream the error is an event; before the response, a 500."""
    scheduler, (stream, whole) = run(streamed("twice"), {"prompt": "twice", "stream": False})
    chunks = events(stream)
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["Hel", "lo", " world"]
    assert chunks[-1]["error"]["code"] == "scheduler_lost_twice"
    assert "went down twice" in chunks[-1]["error"]["message"]
    assert whole.status_code == 500 and whole.json()["error"]["code"] == "scheduler_lost_twice"
    assert [len(r.continuations) for r in scheduler.sent] == [0, 1, 0, 1]


def test_a_generation_whose_call_breaks_twice_before_any_token_is_not_sent_a_third_time() -> None:
    """Sent over a connected channel (the first request connected it), it reached the
    scheduler each time: in flight at both breaks."""
    scheduler, (_, whole) = run(streamed("once"), {"prompt": "dies-at-once", "stream": False})
    assert whole.status_code == 500 and whole.json()["error"]["code"] == "scheduler_lost_twice"
    assert [r.text for r in scheduler.sent].count("dies-at-once") == 2


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (streamed("old"), "generation_not_resumed"),  # its text would start over: never passed on
        (streamed("n2", n=2), "service_unavailable"),  # a finished choice cannot be left out
    ],
)
def test_a_generation_that_cannot_resume_ends_with_an_error(body: dict, code: str) -> None:
    scheduler, (stream,) = run(body)
    chunks = events(stream)
    assert chunks[-1]["error"]["code"] == code
    texts = [choice["text"] for c in chunks[:-1] for choice in c["choices"]]
    assert texts == (["Hel", "lo"] if body["prompt"] == "old" else ["A", "B"])
    assert len(scheduler.sent) == (2 if body["prompt"] == "old" else 1)
