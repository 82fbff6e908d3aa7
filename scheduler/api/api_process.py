"""An API server process (`--api-server-count N`): one of N processes serving the public gRPC API
on the scheduler's port (SO_REUSEPORT), so that the per-token work of client streams spreads over
cores (docs/architecture.md, "API server processes").

For its clients it checks the API key, validates requests, renders chat templates and tokenizes
(`prompts`), hands each request as token ids to the engine's process (the core), and serves the
client's stream from the token batches the core relays back: detokenization, stop strings (one
found here is sent to the core, which stops computing the sequence), usage and the writes. It
answers `Tokenize` and `Detokenize` itself and passes every other call to the core, which answers
it as it would in one process. The core keeps what must be one: the block tables (in its
scheduler workers), routing, the failover copies of every request, and the metrics.

The core and the process talk over one `multiprocessing` pipe (`pipe_link`), in batches of the
messages of `api_messages`: `ApiToCore` one way, `CoreToApi` the other.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import grpc
import structlog
from google.protobuf.message import Message

from npuserve.deploy.runtime.gc_heap import IdleHeapRelease, settle_heap_for_serving
from npuserve.deploy.runtime.unknown_message import unknown_message
from npuserve.scheduler.api import api_messages as msg
from npuserve.scheduler.api.api_servers import serve_public_api, stop_api_servers
from npuserve.scheduler.api.api_servicer import PublicApiServicer
from npuserve.scheduler.core.request import SamplingParams
from npuserve.scheduler.engine.continuation import Continuation, resume_stream
from npuserve.scheduler.engine.engine_config import new_request_id
from npuserve.scheduler.engine.outputs import OpenStream, RequestStream, SequenceUpdate
from npuserve.scheduler.lanes.pipe_link import PipeLink
from npuserve.scheduler.service_config import ServiceConfig
from npuserve.scheduler.text.prompts import ModelLimits, PromptInput, PromptProcessor
from npuserve.scheduler.text.tokenizer import Tokenizer

log = structlog.get_logger(__name__)

STOP_GRACE_S = 1.0  # for the answers of calls in flight when the core says exit


@dataclass(frozen=True, slots=True)
class ApiProcessSettings:
    index: int
    count: int  # API server processes in all
    # The scheduler's: the model (tokenizer, chat template), the streams' settings, TLS, API key.
    config: ServiceConfig
    limits: ModelLimits
    host: str
    port: int  # 0: any free port (the first process); the others take the port it got
    log_level: str
    json_logs: bool


# Calls the core answers (every one but Generate, Tokenize and Detokenize).
FORWARDED_CALLS = (
    "Abort",
    "ListModels",
    "Health",
    "CheckIntegrity",
    "StartProfile",
    "StopProfile",
    "GetMetrics",
)


class CoreLink:
    """The API process's side of its pipe to the core (on the event loop), and the front of its
    requests: checks and tokenizes them here, streams what the core relays."""

    def __init__(
        self,
        conn: Connection,
        loop: asyncio.AbstractEventLoop,
        prompts: PromptProcessor,
        stream_interval: int,
    ) -> None:
        self.loop = loop
        self.prompts = prompts
        self.stream_interval = stream_interval
        self.streams: dict[int, RequestStream] = {}
        self._handles = itertools.count()
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self.on_drain: Callable[[], None] = lambda: None  # the scheduler drains (the servicer's)
        self.gone = asyncio.Event()  # the core said exit, or is no more
        self.heap = IdleHeapRelease(lambda: not self.streams)
        self.pipe: PipeLink[msg.ApiToCore, msg.CoreToApi] = PipeLink(conn, self._apply, self.gone.set, loop)

    def _apply(self, batch: list[msg.CoreToApi]) -> None:
        applied = 0  # the stream updates of the batch, acknowledged once it is applied
        for message in batch:
            match message:
                case msg.StreamUpdates(items=items):
                    applied += self._add(items)
                case msg.RelayedUpdates(payload=payload):  # a worker's, passed on by the core as it was
                    applied += self._add(pickle.loads(payload))
                case msg.EndStream(handle=handle, update=update):
                    applied += 1
                    if (stream := self.streams.get(handle)) is not None:
                        stream.end(update)
                case msg.RefuseStream(handle=handle, error=error):
                    applied += 1
                    if (stream := self.streams.get(handle)) is not None and not stream.started:
                        stream.refuse(error)
                case msg.QueryDelivered(query_id=query_id, sequences=sequences):
                    outputs = [self._delivered(*sequence) for sequence in sequences]
                    self.pipe.send(msg.DeliveredTokens(query_id, outputs))
                case msg.CallAnswer(call_id=call_id, answer=answer):
                    future = self._calls.pop(call_id, None)
                    if future is not None and not future.done():
                        future.set_result(answer)
                case msg.DrainApi():
                    self.on_drain()
                case msg.ExitApi():
                    self.gone.set()
                case _:
                    unknown_message("an API server process", message)
        if applied:
            self.pipe.send(msg.UpdatesApplied(applied))

    def _delivered(self, handle: int, choice: int) -> list[int] | None:
        """A sequence's tokens as this process received them (its worker died: it resumes from
        them); None for a stream that is over."""
        stream = self.streams.get(handle)
        return None if stream is None else stream.sequences[choice].token_ids

    def _add(self, items: list[msg.PackedUpdate]) -> int:
        """Applies stream updates; returns how many there were."""
        streams = self.streams
        for item in items:  # NOTE: once per token
            handle = item[0]
            stream = streams.get(handle)
            if stream is not None:
                update = SequenceUpdate._make(item[1:])
                stop = stream.add(update)
                if stop is not None:
                    self.pipe.send(msg.StopStringFound(handle, update.choice, stop))
        return len(items)

    async def open(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        request_id: str | None,
        model: str | None,
        continuation: Continuation | None = None,
    ) -> OpenStream:
        prompts = self.prompts
        with self.heap.working():
            prompts.check_request(model, params)
            prompt_ids = await prompts.prompt_token_ids(prompt)
            prompts.check_lengths(prompt_ids, params)
            stream = RequestStream(
                request_id or new_request_id(), prompts.tokenizer, params, prompt_ids, self.stream_interval
            )
            resume_stream(stream, continuation, params, prompts.limits)
            handle = next(self._handles)
            self.streams[handle] = stream
            self.pipe.send(msg.SubmitStream(handle, stream.request_id, prompt_ids, params, continuation))
        return OpenStream(stream, lambda: self.close(handle))

    def close(self, handle: int) -> None:
        """The client's stream is over: the core aborts what is left of the request."""
        stream = self.streams.pop(handle)
        self.pipe.send(msg.StreamClosed(handle, not stream.finished))
        self.heap.work_ended()

    async def call(self, method: str, request: Message) -> Any:
        """The core's answer to a forwarded call: its response, or the status it ended with."""
        if self.gone.is_set():
            return msg.RelayedStatus("UNAVAILABLE", "the scheduler is restarting; retry")
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = self.loop.create_future()
        self._calls[call_id] = future
        self.pipe.send(msg.ForwardCall(call_id, method, request))
        return await future


class ApiProcessServicer(PublicApiServicer):
    """Generate, Tokenize, Detokenize here; every other call answered by the core."""

    def __init__(self, link: CoreLink, settings: ApiProcessSettings) -> None:
        stall_timeout_s = settings.config.stream_stall_timeout_s
        super().__init__(link, link.prompts, (settings.index, settings.count), stall_timeout_s)
        self.link = link
        link.on_drain = self.drain


def _forwarding(method: str) -> Any:
    """The servicer's ``method``: the core answers it, and its answer (or status) is replayed."""

    async def forward(self: ApiProcessServicer, request: Message, context: grpc.aio.ServicerContext) -> Any:
        answer = await self.link.call(method, request)
        if isinstance(answer, msg.RelayedStatus):
            await context.abort(grpc.StatusCode[answer.code], answer.details, answer.trailing_metadata)
        return answer

    forward.__name__ = method
    return forward


for _method in FORWARDED_CALLS:
    setattr(ApiProcessServicer, _method, _forwarding(_method))


async def serve_api_process(conn: Connection, settings: ApiProcessSettings) -> None:
    config = settings.config
    tokenizer = Tokenizer.from_pretrained(config.model, chat_template=config.chat_template)
    prompts = PromptProcessor(tokenizer, settings.limits, config.trust_request_chat_template)
    prompts.start()
    link = CoreLink(conn, asyncio.get_running_loop(), prompts, config.stream_interval)
    servicer = ApiProcessServicer(link, settings)
    servers, port = await serve_public_api(servicer, config, settings.host, settings.port)
    link.pipe.start()
    await prompts.wait_started()  # NOTE: their imports would take the CPU of the first requests' steps
    settle_heap_for_serving()
    link.pipe.send(msg.ApiReady(port))
    log.info("api server process serving", index=settings.index, pid=os.getpid(), port=port)
    await link.gone.wait()
    await stop_api_servers(servers, STOP_GRACE_S)
    link.pipe.close()
    prompts.close()


def run_api_process(conn: Connection, settings: ApiProcessSettings) -> None:
    """The API process's entry point (spawned by `api_relay.ApiProcessPool`)."""
    from npuserve.deploy.runtime.event_loop import run as run_loop
    from npuserve.deploy.runtime.logs import configure_logging
    from npuserve.deploy.runtime.process_name import API_SERVER, set_process_name

    set_process_name(API_SERVER)
    configure_logging(settings.log_level, settings.json_logs)
    structlog.contextvars.bind_contextvars(api_server=settings.index)
    run_loop(serve_api_process(conn, settings))
