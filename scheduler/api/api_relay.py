"""The core's side of the API server processes (`--api-server-count N`, see `api_process`).

`ApiProcessPool` starts the N processes on the scheduler's port (the first binds it, the others
share it) and restarts one that dies (serve's restart policy); the requests of a dead one are
aborted, as their clients' connections went with it. Each `ApiProcessHandle` turns its process's
submissions into engine requests whose outputs go back through a `RelayedOutputs` sink: one
batch per turn of the event loop, whatever the number of streams.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import multiprocessing
from dataclasses import replace
from multiprocessing.process import BaseProcess
from typing import Any

import grpc
import structlog
from google.protobuf.message import Message

from npuserve.deploy.runtime.restart_policy import RestartHistory
from npuserve.deploy.runtime.unknown_message import unknown_message
from npuserve.scheduler.api import api_messages as msg
from npuserve.scheduler.api.api_messages import StreamUpdates  # NOTE: by name: looked up per token
from npuserve.scheduler.api.api_process import ApiProcessSettings, run_api_process
from npuserve.scheduler.api.api_status import relayed
from npuserve.scheduler.core.request import Request, StreamRelay
from npuserve.scheduler.engine.engine import Engine
from npuserve.scheduler.engine.outputs import SequenceUpdate
from npuserve.scheduler.lanes.background import BackgroundTasks
from npuserve.scheduler.lanes.pipe_link import PipeLink, join_or_kill
from npuserve.scheduler.lanes.step_frames import RelayedPack

log = structlog.get_logger(__name__)

CorePipe = PipeLink[msg.CoreToApi, msg.ApiToCore]  # the core's end of an API process's pipe

START_TIMEOUT_S = 120.0
# Items (a token each, or a `--stream-interval` group) relayed to one API process and not yet
# applied there. NOTE: what waits here is latency for every stream of the process, new ones'
# first tokens included. 128 is about 7 ms of an API process's work under load. At 16 x 1024
# streams (scale bench, 3 interleaved runs each) 512 held the clients' TTFT p99 at 412-581 ms and
# 5.6-7.6% of the streams without a first token, 128 at 249-283 ms and 3.7-4.6%, for the same
# CPU per token; 16384 let the streams fall up to 1.6 s behind the engine.
MAX_UNACKED_ITEMS = 128
EXIT_TIMEOUT_S = 10.0
DELIVERED_TIMEOUT_S = 30.0  # for an API process to say what its streams hold (a worker died)


class Relay:
    """Messages for one API process, gathered over a turn of the event loop and sent as one batch.

    Its stream updates are items (a token each, or a `--stream-interval` group): each run of the
    core's own goes as one `StreamUpdates`, each pack of a worker's as it came. The API process
    acknowledges the items it has applied; while `MAX_UNACKED_ITEMS` wait for that, it is
    `behind` and the scheduler workers' steps wait (the engine holds their reports'
    acknowledgements), so a slow API process slows the steps down instead of letting tokens pile
    up between the processes."""

    def __init__(self, pipe: CorePipe, loop: asyncio.AbstractEventLoop) -> None:
        self.pipe = pipe
        self.loop = loop
        self.pending: list[msg.CoreToApi] = []
        self.pending_count = 0
        self.unacked = 0

    @property
    def behind(self) -> bool:
        return self.unacked >= MAX_UNACKED_ITEMS

    def put(self, message: msg.CoreToApi, count: int = 1) -> None:
        """``count``: the items ``message`` stands for (a worker's pack: `ApiProcessPool.forward`)."""
        if not self.pending:
            self.loop.call_soon(self._flush)
        self.pending.append(message)
        self.pending_count += count

    def put_update(self, item: msg.PackedUpdate) -> None:
        """One update of a stream: it joins the core's updates put just before it."""
        pending = self.pending
        if pending and isinstance(last := pending[-1], StreamUpdates):
            last.items.append(item)
            self.pending_count += 1
        else:
            self.put(StreamUpdates([item]))

    def _flush(self) -> None:
        items, self.pending = self.pending, []
        self.unacked += self.pending_count
        self.pending_count = 0
        self.pipe.send_many(items)

    def acked(self, count: int) -> None:
        self.unacked = max(0, self.unacked - count)


class RelayedOutputs:
    """An `OutputSink` whose stream lives in an API process: updates go there as they are."""

    __slots__ = ("handle", "relay")

    def __init__(self, relay: Relay, handle: int) -> None:
        self.relay, self.handle = relay, handle

    def add(self, update: SequenceUpdate) -> str | None:
        self.relay.put_update((self.handle, *update))  # NOTE: a plain tuple (`PackedUpdate`)
        return None  # NOTE: the API process finds stop strings and reports them (`stopped_by_string`)

    def end(self, update: SequenceUpdate) -> None:
        self.relay.put(msg.EndStream(self.handle, update))

    def refuse(self, refusal: Exception) -> None:
        self.relay.put(msg.RefuseStream(self.handle, relayed(refusal)))


class CallContext:
    """What a forwarded call sees as its gRPC context: an abort becomes a `RelayedStatus`."""

    class Aborted(Exception):
        def __init__(self, status: msg.RelayedStatus) -> None:
            self.status = status

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        raise CallContext.Aborted(msg.RelayedStatus(code.name, details, tuple(trailing_metadata or ())))


class ApiProcessHandle:
    def __init__(self, index: int, pool: ApiProcessPool) -> None:
        self.index = index
        self.pool = pool
        self.process: BaseProcess | None = None
        self.pipe: CorePipe | None = None
        self.relay: Relay | None = None
        self.requests: dict[int, str] = {}  # stream handle -> request id
        self.incarnation = 0  # counts its starts: a stream handle means nothing in another one
        self._queries: dict[int, asyncio.Future[list[list[int] | None]]] = {}
        self._query_ids = itertools.count()
        self.ready: asyncio.Future[int] | None = None
        self.closing = False
        self.history = RestartHistory()

    def start(self, port: int) -> asyncio.Future[int]:
        """Starts the process on ``port``; the future is its bound port once it serves."""
        loop = self.pool.loop
        ctx = multiprocessing.get_context("spawn")
        core_end, api_end = ctx.Pipe(duplex=True)
        settings = replace(self.pool.settings, index=self.index, port=port)
        # NOTE: not a daemon, so it can start its render processes; it exits once this end of
        # its pipe closes (the core stopped or died).
        process = ctx.Process(
            target=run_api_process, args=(api_end, settings), name=f"npuserve-api-{self.index}"
        )
        process.start()
        api_end.close()
        pipe: CorePipe = PipeLink(
            core_end, lambda batch: self._apply(pipe, batch), lambda: self._lost(pipe), loop
        )
        self.process, self.pipe, self.requests = process, pipe, {}
        self.incarnation += 1
        self.relay = Relay(pipe, loop)
        self.ready = loop.create_future()
        pipe.start()
        log.info("api server process started", index=self.index, pid=process.pid)
        return self.ready

    def send(self, message: msg.CoreToApi) -> None:
        if self.pipe is not None:
            self.pipe.send(message)

    def _apply(self, pipe: CorePipe, batch: list[msg.ApiToCore]) -> None:
        if pipe is not self.pipe:
            return  # an earlier incarnation's
        engine = self.pool.engine
        for message in batch:
            match message:
                case msg.UpdatesApplied(count=count):
                    if self.relay is not None:
                        self.relay.acked(count)
                        self.pool.check_caught_up()
                case msg.SubmitStream():
                    self.requests[message.handle] = message.request_id
                    self.pool.background.spawn(self._submit(message))
                case msg.StopStringFound(handle=handle, choice=choice, stop=stop):
                    if (request_id := self.requests.get(handle)) is not None:
                        engine.stopped_by_string(request_id, choice, stop)
                case msg.StreamClosed(handle=handle, aborted=aborted):
                    request_id = self.requests.pop(handle, None)
                    if request_id is not None and aborted:
                        engine.drop(request_id)
                case msg.ForwardCall():
                    self.pool.background.spawn(self._call(pipe, message))
                case msg.DeliveredTokens(query_id=query_id, outputs=outputs):
                    future = self._queries.pop(query_id, None)
                    if future is not None and not future.done():
                        future.set_result(outputs)
                case msg.ApiReady(port=port):
                    if self.ready is not None and not self.ready.done():
                        self.ready.set_result(port)
                case _:
                    unknown_message("the scheduler core", message)

    async def _submit(self, submitted: msg.SubmitStream) -> None:
        relay = self.relay
        assert relay is not None
        handle, request_id = submitted.handle, submitted.request_id
        outputs = RelayedOutputs(relay, handle)
        stream_at = (self.index, self.incarnation, handle)
        try:
            await self.pool.engine.add_tokenized(
                request_id,
                submitted.prompt_token_ids,
                submitted.params,
                outputs,
                stream_at,
                submitted.continuation,
            )
        except Exception as exc:
            self.requests.pop(handle, None)
            outputs.refuse(exc)
            return
        if self.requests.get(handle) != request_id:  # its client left while it was compiled
            self.pool.engine.drop(request_id)

    async def delivered(self, incarnation: int, sequences: list[tuple[int, int]]) -> list[list[int] | None]:
        """The output token ids the streams ``sequences`` (handle, choice) hold in this process,
        if it is still ``incarnation`` (None for a stream it no longer has)."""
        if self.pipe is None or incarnation != self.incarnation:
            return [None] * len(sequences)
        query_id = next(self._query_ids)
        future: asyncio.Future[list[list[int] | None]] = self.pool.loop.create_future()
        self._queries[query_id] = future
        self.pipe.send(msg.QueryDelivered(query_id, sequences))
        try:
            answer = await asyncio.wait_for(future, DELIVERED_TIMEOUT_S)
        except asyncio.TimeoutError:
            self._queries.pop(query_id, None)
            answer = []
        return answer if len(answer) == len(sequences) else [None] * len(sequences)

    async def _call(self, pipe: CorePipe, call: msg.ForwardCall) -> None:
        servicer_method = getattr(self.pool.servicer, call.method)
        try:
            answer: Message | msg.RelayedStatus = await servicer_method(call.request, CallContext())
        except CallContext.Aborted as aborted:
            answer = aborted.status
        except Exception as exc:
            log.exception("forwarded call failed", method=call.method)
            answer = msg.RelayedStatus("INTERNAL", str(exc))
        pipe.send(msg.CallAnswer(call.call_id, answer))

    def _lost(self, pipe: CorePipe) -> None:
        if pipe is not self.pipe or self.closing:
            return
        self.pipe = None
        code = self.process.exitcode if self.process is not None else None
        log.error("api server process died", index=self.index, exit_code=code, streams=len(self.requests))
        for request_id in self.requests.values():
            self.pool.engine.drop(request_id)  # NOTE: their clients' connections went with it
        self.requests = {}
        self.relay = None
        queries, self._queries = self._queries, {}
        for future in queries.values():
            if not future.done():
                future.set_result([])  # NOTE: read as "none of them" (`delivered`)
        self.pool.check_caught_up()
        if self.ready is not None and not self.ready.done():
            self.ready.set_exception(RuntimeError(f"api server process {self.index} exited before serving"))
        self.pool.background.spawn(self.pool.restart(self))

    def close(self) -> None:
        self.closing = True
        self.send(msg.ExitApi())
        if self.pipe is not None:
            self.pipe.close()
        join_or_kill(self.process, EXIT_TIMEOUT_S)


class ApiProcessPool:
    """The N API server processes serving the public API for one engine (event loop thread)."""

    def __init__(self, engine: Engine, servicer: Any, settings: ApiProcessSettings) -> None:
        """``settings``: every process's (each with its own index and port)."""
        if settings.count < 1:
            raise ValueError(f"an API process pool needs at least one process, got {settings.count}")
        self.engine = engine
        self.servicer = servicer  # the core's own servicer answers the forwarded calls
        self.settings = settings
        self.processes = [ApiProcessHandle(i, self) for i in range(settings.count)]
        self.port = 0
        self.background = BackgroundTasks()  # restarts, submissions, forwarded calls
        self.loop = asyncio.get_event_loop()
        engine.stream_processes = self
        # NOTE: the processes are not daemons: if this one exits without `close` (a crash),
        # they are killed rather than waited for (they would wait on their pipes forever).
        atexit.register(self._kill_all)

    def _kill_all(self) -> None:
        for handle in self.processes:
            handle.closing = True
            if handle.process is not None and handle.process.is_alive():
                handle.process.kill()

    def behind(self) -> bool:
        """Whether an API process is behind on the tokens relayed to it."""
        return any(h.relay is not None and h.relay.behind for h in self.processes)

    def forward(self, key: tuple[int, int], pack: RelayedPack) -> None:
        index, incarnation = key
        handle = self.processes[index]
        if handle.incarnation == incarnation and handle.relay is not None:
            count, payload = pack
            handle.relay.put(msg.RelayedUpdates(payload), count)

    async def delivered(self, requests: list[Request]) -> dict[str, list[int]]:
        groups: dict[tuple[int, int], list[tuple[str, StreamRelay]]] = {}
        for request in requests:
            relay = request.relay
            assert relay is not None
            groups.setdefault((relay.process, relay.incarnation), []).append((request.req_id, relay))
        answers = await asyncio.gather(
            *(
                self.processes[index].delivered(incarnation, [(r.handle, r.choice) for _, r in group])
                for (index, incarnation), group in groups.items()
            )
        )
        outputs: dict[str, list[int]] = {}
        for group, answer in zip(groups.values(), answers, strict=True):
            for (req_id, _), output in zip(group, answer, strict=True):
                if output is not None:
                    outputs[req_id] = output
        return outputs

    def check_caught_up(self) -> None:
        if not self.behind():
            self.engine.streams_caught_up()

    async def start(self, port: int) -> int:
        """Starts every process; returns the port they share (the first binds ``port``, 0: any)."""
        self.loop = asyncio.get_running_loop()
        first, *others = self.processes
        self.port = await asyncio.wait_for(first.start(port), START_TIMEOUT_S)
        await asyncio.wait_for(asyncio.gather(*(p.start(self.port) for p in others)), START_TIMEOUT_S)
        return self.port

    async def restart(self, handle: ApiProcessHandle) -> None:
        delay_s = handle.history.died()
        if delay_s is None:
            log.error("api server process crash-looping; given up", index=handle.index)
            return
        await asyncio.sleep(delay_s)
        if handle.closing:
            return
        if handle.process is not None:
            await asyncio.to_thread(handle.process.join, EXIT_TIMEOUT_S)
        try:
            await asyncio.wait_for(handle.start(self.port), START_TIMEOUT_S)
            handle.history.started()
        except Exception:
            log.exception("api server process restart failed", index=handle.index)

    def drain(self) -> None:
        for handle in self.processes:
            handle.send(msg.DrainApi())

    async def close(self) -> None:
        await asyncio.gather(*(asyncio.to_thread(handle.close) for handle in self.processes))
        atexit.unregister(self._kill_all)
