"""The engine: requests in, streams of completions out, over one lane per executor.

It validates and tokenizes requests, places each on an executor (`router`), hands it to that
executor's lane, and turns the lanes' step results into client streams (`outputs`) on the event
loop. It never touches tensors: executors are gRPC clients, or in-process runners for offline use.
The lanes run on the engine's event loop (`ExecutorLane`), or in scheduler worker processes
(`step_workers`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import structlog

from npuserve.deploy.runtime.gc_heap import IdleHeapRelease
from npuserve.proto.step_plan import ExecutorInfo
from npuserve.scheduler.core.request import (
    InvalidRequestError,
    Request,
    RequestStatus,
    SamplingParams,
    StreamRelay,
)
from npuserve.scheduler.core.router import uncached_blocks
from npuserve.scheduler.engine import engine_probes
from npuserve.scheduler.engine.client_entry import ClientEntryPoints
from npuserve.scheduler.engine.client_request import ClientRequest
from npuserve.scheduler.engine.continuation import Continuation
from npuserve.scheduler.engine.disaggregation import Disaggregation, RemotePrefill
from npuserve.scheduler.engine.engine_config import EngineConfig, NoExecutorError, QueueFullError
from npuserve.scheduler.engine.engine_metrics import MetricsRecorder
from npuserve.scheduler.engine.failover import FailOver
from npuserve.scheduler.engine.metrics import SchedulerMetrics
from npuserve.scheduler.engine.outputs import OutputSink
from npuserve.scheduler.lanes.aio_executor_client import AioExecutorClient
from npuserve.scheduler.lanes.async_lane import ExecutorLane, always_room
from npuserve.scheduler.lanes.background import BackgroundTasks
from npuserve.scheduler.lanes.lane import LANE_CLOSE_TIMEOUT_S, Lane, LaneEvent, StepClient
from npuserve.scheduler.lanes.step_worker import LaneSettings
from npuserve.scheduler.lanes.step_workers import WORKER_START_TIMEOUT_S, StepWorkerPool
from npuserve.scheduler.lanes.worker_relay import StreamProcesses, WorkerRelay
from npuserve.scheduler.structured.grammar_compiler import GrammarCompiler
from npuserve.scheduler.structured.matchers import Grammar
from npuserve.scheduler.text.prompts import ModelLimits, PromptProcessor
from npuserve.scheduler.text.tokenizer import Tokenizer

log = structlog.get_logger(__name__)

__all__ = ["Engine"]


RETIRE_AFTER_S = 1.0  # a lane that went down is closed this long after (its last reports come)


class Engine(ClientEntryPoints, FailOver, Disaggregation):
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer,
        executors: Sequence[tuple[str, StepClient, ExecutorInfo]],
        step_workers: StepWorkerPool | None = None,
    ) -> None:
        """``step_workers``: run the executors' step loops in these worker processes (their
        executors must be gRPC clients); None runs them on the engine's event loop."""
        if not executors:
            raise ValueError("an engine needs at least one executor")
        first = executors[0][2]
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = config.served_model_name
        self.block_size = first.block_size
        self.max_model_len = min(info.max_model_len for _, _, info in executors)
        self.vocab_size = first.vocab_size
        self.eos_token_ids = tuple(first.eos_token_ids) or tokenizer.eos_token_ids
        self.metrics = SchedulerMetrics(self.model_name)
        self.recorder = MetricsRecorder(self.metrics)
        self.lanes: dict[str, Lane] = {}
        self._clients: dict[str, ClientRequest] = {}
        self._client_of_seq: dict[str, ClientRequest] = {}  # req_id of a sequence -> its client request
        self._sequences: dict[str, Request] = {}  # req_id -> the sequence (one lookup per token)
        self._lane_of: dict[str, Lane] = {}
        self._remote: dict[str, RemotePrefill] = {}  # `disaggregation`
        self._held: dict[str, Lane] = {}
        self.step_workers = step_workers
        self._parked: list[Request] = []  # `failover`
        self._workers_restarting = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending = list(executors)
        # req_id -> (lane, prompt blocks, blocks to prefill there)
        self._unstarted: dict[str, tuple[Lane, int, int]] = {}
        # The API server processes serving client streams (`--api-server-count` above 1).
        self.stream_processes: StreamProcesses | None = None
        self._workers = WorkerRelay(self)
        self._retiring: set[Lane] = set()  # down, and closed once their last reports have come
        self._background = BackgroundTasks()
        self._heap = IdleHeapRelease(lambda: not self._clients)
        self._gauge_task: asyncio.Task[None] | None = None
        self.limits = ModelLimits(self.model_name, self.max_model_len, self.vocab_size)
        self.prompts = PromptProcessor(tokenizer, self.limits, config.trust_request_chat_template)
        self.grammars = GrammarCompiler(tokenizer.to_json(), self.vocab_size, self.eos_token_ids)

    def start(self, serve_prompts: bool = True) -> None:
        """``serve_prompts``: start the render processes for chat templates (not needed when
        API server processes take every request's prompt, and serve every client stream)."""
        self._loop = asyncio.get_running_loop()
        if self.step_workers is not None:
            settings = LaneSettings(
                self.config.enable_prefix_caching,
                self.config.async_scheduling,
                self.grammars.settings,
                self.config.num_scheduler_steps,
            )
            workers = self._workers
            self.step_workers.start(
                settings, workers.on_report, workers.on_reports_handled, workers.on_worker_lost
            )
        for executor_id, executor, info in self._pending:
            self.add_executor(executor_id, executor, info)
        self._pending = []
        self._gauge_task = asyncio.get_running_loop().create_task(self._refresh_gauges_forever())
        self.grammars.start()
        if serve_prompts:
            self.prompts.start()
        if self.tokenizer.size_bound is None:
            log.warning(
                "this tokenizer may turn any length of text into one token: long prompts are "
                "tokenized (off the event loop) before their length is checked"
            )

    async def wait_started(self, timeout_s: float = WORKER_START_TIMEOUT_S) -> None:
        """Waits, up to ``timeout_s``, for the processes `start` started (scheduler workers, render
        and grammar processes) to finish starting. Until then their imports take the CPU the steps would use,
        so a scheduler says it is ready only after this."""
        waits = [self.prompts.wait_started(), self.grammars.wait_started()]
        if self.step_workers is not None:
            waits.append(self.step_workers.wait_started())
        try:
            await asyncio.wait_for(asyncio.gather(*waits), timeout_s)
        except asyncio.TimeoutError:  # NOTE: not the builtin before Python 3.11
            log.warning("the scheduler's processes are still starting", waited_s=timeout_s)

    async def stop(self) -> None:
        if self._gauge_task is not None:
            self._gauge_task.cancel()
        self._heap.cancel()
        self.prompts.close()
        self.grammars.close()
        lanes = [*self.lanes.values(), *self._retiring]
        self._retiring.clear()
        await asyncio.gather(*(lane.aclose(LANE_CLOSE_TIMEOUT_S) for lane in lanes))
        if self.step_workers is not None:
            self.step_workers.close()

    # -- executors joining and leaving (event loop thread) ---------------------------------------

    @property
    def live_lanes(self) -> list[Lane]:
        return [lane for lane in self.lanes.values() if lane.alive]

    @property
    def routable_lanes(self) -> list[Lane]:
        """Live lanes that take new requests (a draining executor only finishes its own)."""
        return [lane for lane in self.lanes.values() if lane.alive and not lane.draining]

    def drain_executor(self, executor_id: str, reason: str) -> None:
        """Routes no new request to an executor; its requests finish there, then it is removed
        (a step that fails meanwhile moves them to the others, as for any lost executor)."""
        lane = self.lanes.get(executor_id)
        if lane is None or lane.draining:
            return
        lane.draining = True
        log.info("executor draining", executor=executor_id, reason=reason, requests=lane.load)
        self._remove_if_drained(lane)

    def _remove_if_drained(self, lane: Lane) -> None:
        # NOTE: a remote lane's work is as its worker last reported it, a hint: no new request
        # comes to a draining lane, so once nothing is queued, held or still to be dropped on the
        # executor, it stays so.
        if lane.draining and not lane.queued_requests and not lane.has_work:
            self.remove_executor(lane.executor_id, "drained")
            self.metrics.executors.left(lane.executor_id)

    def add_executor(self, executor_id: str, client: StepClient, info: ExecutorInfo) -> None:
        """Starts serving on an executor, with a fresh block pool; refuses a mismatched one."""
        if info.block_size != self.block_size or info.vocab_size != self.vocab_size:
            raise ValueError(
                f"executor {executor_id} serves block size {info.block_size} / vocab {info.vocab_size}, "
                f"the others {self.block_size} / {self.vocab_size}"
            )
        if info.max_model_len < self.max_model_len:
            raise ValueError(
                f"executor {executor_id} holds {info.max_model_len} tokens, fewer than {self.max_model_len}"
            )
        self.remove_executor(executor_id, "replaced by a new instance")  # if it had one
        lane: Lane
        if self.step_workers is not None:
            assert isinstance(client, AioExecutorClient), "worker processes drive remote executors"
            lane = self.step_workers.open_lane(executor_id, client, info)
        else:
            lane = ExecutorLane.for_executor(
                executor_id,
                client,
                info,
                self._dispatch,
                always_room,
                enable_prefix_caching=self.config.enable_prefix_caching,
                num_scheduler_steps=self.config.num_scheduler_steps,
                async_scheduling=self.config.async_scheduling,
            )
        self.lanes[executor_id] = lane
        lane.start()
        self.metrics.executors.joined(executor_id, client.address or None, info.role)
        log.info(
            "executor joined",
            executor=executor_id,
            num_blocks=info.num_blocks,
            executors=len(self.live_lanes),
        )
        self._place_parked("a scheduler worker restarted")

    def remove_executor(self, executor_id: str, reason: str) -> None:
        """Stops using an executor; its requests move to the others (the lane reports them)."""
        lane = self.lanes.pop(executor_id, None)
        if lane is None:
            return
        # NOTE: the lane is retired once it reports going down, with its requests: a lane busy in
        # a step reports only when the step ends (up to --step-timeout), and a scheduler worker
        # drops the reports of a lane already retired.
        lane.take_down(reason)

    def _retire(self, lane: Lane) -> None:
        if lane in self._retiring:  # NOTE: else the engine stopped meanwhile, and closed it
            self._retiring.discard(lane)
            self._background.spawn(lane.aclose(LANE_CLOSE_TIMEOUT_S))

    # -- requests --------------------------------------------------------------------------------

    def queue_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        grammar: Grammar | None,
        sink: OutputSink,
        stream_at: tuple[int, int, int] | None = None,
        continuation: Continuation | None = None,
    ) -> ClientRequest:
        """Places a checked, tokenized request on an executor; its outputs go to ``sink``
        (``stream_at``: in an API server process, see `add_tokenized`; ``continuation``: the
        output a resumed generation's choices already have)."""
        assert self._loop is not None, "Engine.start() was not called"
        if not self.routable_lanes:
            raise NoExecutorError("no executor is available; retry once one has joined")
        if request_id in self._clients:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        limit = self.config.max_queued_requests
        if limit is not None and sum(lane.num_waiting for lane in self.routable_lanes) >= limit:
            raise QueueFullError(f"the queue holds --max-queued-requests={limit} requests; retry later")
        children = [
            Request(
                req_id=request_id if params.n == 1 else f"{request_id}-{i}",
                prompt_token_ids=prompt_ids,
                params=child_params,
                options=child_params.to_options(self.eos_token_ids),
                eos_token_ids=self.eos_token_ids,
                max_model_len=self.max_model_len,
                block_size=self.block_size,
            )
            for i, child_params in enumerate(
                [params] if params.n == 1 else [params.for_sibling(i) for i in range(params.n)]
            )
        ]
        every = 1 if params.stop else self.config.stream_interval
        for choice, child in enumerate(children):
            if grammar is not None:
                child.grammar = grammar.new_state(child.max_output_tokens)
            if stream_at is not None:
                child.relay = StreamRelay(*stream_at, choice, every)
        if continuation is not None:
            continuation.resume(children)
        client = ClientRequest(request_id, children, sink)
        self._clients[request_id] = client
        for child in children:
            self._client_of_seq[child.req_id] = client
            self._sequences[child.req_id] = child
        lane = self._place(children)
        log.debug(
            "request queued",
            request_id=request_id,
            prompt_tokens=len(prompt_ids),
            n=params.n,
            executor=lane.executor_id,
        )
        return client

    def abort(self, request_id: str) -> bool:
        client = self._clients.get(request_id)
        if client is None:
            return False
        for index, child in enumerate(client.children):
            if not client.is_finished(index):
                self._lane_of[child.req_id].finish([child.req_id], RequestStatus.FINISHED_ABORTED)
        log.info("request aborted", request_id=request_id)
        return True

    def drop(self, request_id: str) -> None:
        """Aborts a request whose client has gone, and forgets it now (no one reads its end)."""
        client = self._clients.get(request_id)
        if client is None or not self.abort(request_id):
            return
        now = time.monotonic()
        for index, child in enumerate(client.children):
            if client.mark_finished(index):  # its lane's report will not find it
                self.recorder.record_finish(child, RequestStatus.FINISHED_ABORTED.value, now)
        self._forget_if_finished(client)

    def _place(self, siblings: list[Request]) -> Lane:
        """Routes requests of one client request (siblings stay together) to the live executor
        that decodes them; a long prompt prefills meanwhile on a prefill executor
        (`disaggregation`)."""
        first = siblings[0]
        num_blocks = len(first.block_hashes) + 1
        lane = self._choose_lane(self._decode_lanes(), first, num_blocks)
        # NOTE: siblings share the prompt's blocks: one prefill, counted with the first.
        elsewhere = self._prefill_elsewhere(siblings, lane, num_blocks)
        prefill = 0 if elsewhere else uncached_blocks(lane, first.block_hashes, num_blocks)
        for index, request in enumerate(siblings):
            self._lane_of[request.req_id] = lane
            self._unstarted[request.req_id] = (lane, num_blocks, prefill if index == 0 else 0)
        lane.queued_requests += len(siblings)
        lane.queued_blocks += num_blocks * len(siblings)
        lane.queued_prefill_blocks += prefill
        lane.submit(siblings)
        return lane

    def _started(self, req_id: str) -> None:
        """A request produced its first token or left its lane: it no longer counts as queued."""
        entry = self._unstarted.pop(req_id, None)
        if entry is not None:
            lane, num_blocks, prefill = entry
            lane.queued_requests -= 1
            lane.queued_blocks -= num_blocks
            lane.queued_prefill_blocks -= prefill

    def _forget_if_finished(self, client: ClientRequest) -> None:
        if not client.finished or self._clients.get(client.request_id) is not client:
            return
        del self._clients[client.request_id]
        for child in client.children:
            self._client_of_seq.pop(child.req_id, None)
            self._sequences.pop(child.req_id, None)
            self._lane_of.pop(child.req_id, None)
            self._forget_placement(child.req_id)
        self._heap.work_ended()  # with the last request, what they held goes if none come

    # -- lane events (on the event loop) --------------------------------------------------------

    def streams_caught_up(self) -> None:
        """The processes serving client streams caught up: the workers held back step again."""
        self._workers.streams_caught_up()

    def _dispatch(self, lane: Lane, event: LaneEvent, sampled: tuple[int, int] | None = None) -> None:
        """``sampled``: the sequences that sampled in the step and their tokens, when the event
        does not hold them all (a worker relayed some to the API processes); else counted here."""
        now = time.monotonic()
        client_of_seq, unstarted, held = self._client_of_seq, self._unstarted, self._held
        for update in event.updates:  # NOTE: once per token: the common case stays in this loop
            request = update.request
            req_id = request.req_id
            finished = update.finished
            prefilled = finished is RequestStatus.PREFILLED
            client = client_of_seq.get(req_id)
            if client is None:
                if prefilled:  # NOTE: dropped while its prefill ran: nothing pulls its blocks
                    lane.release_held([req_id])
                continue
            if req_id in unstarted:
                self._started(req_id)
            if held and held.get(req_id, lane) is not lane:  # the decode lane answered its pull
                self._release_held(req_id)
            if request.first_token_time is None:
                request.first_token_time = now
                self.metrics.time_to_first_token.observe(now - request.arrival_time)
            if prefilled:
                finished = None
            stop = client.deliver(request, update.new_token_ids, update.new_logprobs, finished)
            if prefilled:
                self._prefilled(lane, request, stop is not None)
            if stop is not None:
                self._stop_by_string(lane, request, stop, now)
            elif finished is not None:
                self.recorder.record_finish(request, finished.value, now)
            if client.finished:
                self._forget_if_finished(client)
        if event.lane_down:
            if self.lanes.get(lane.executor_id) is lane:  # not the executor's next lane
                del self.lanes[lane.executor_id]
            assert self._loop is not None
            self._retiring.add(lane)
            self._loop.call_later(RETIRE_AFTER_S, self._retire, lane)
        if event.evacuated:
            self._fail_over(self._evacuated(lane, event.evacuated), event.error or "executor lost")
        for request in event.ended:
            if not self._twin_ended(lane, request):
                self._end_outside_step(request, request.status, event.error)
        if sampled is None:
            sampled = len(event.updates), sum(len(update.new_token_ids) for update in event.updates)
        self.recorder.record_step(lane, event, *sampled)
        if event.failed_step:
            self.metrics.executors.step_failed(lane.executor_id)
        if event.joined_step:
            self.metrics.executors.step_joined(lane.executor_id)
        if event.executor_draining and self.lanes.get(lane.executor_id) is lane:
            self.drain_executor(lane.executor_id, "the executor is draining")
        if lane.draining and not event.lane_down:
            self._remove_if_drained(lane)

    def _end_outside_step(self, request: Request, status: RequestStatus, error: str | None) -> None:
        """A sequence ended outside a step (aborted, stopped from outside, or failed)."""
        request.status = status
        self._started(request.req_id)
        self._forget_placement(request.req_id)
        client = self._client_of_seq.get(request.req_id)
        if client is not None:
            client.end(request, status, error)
            self._forget_if_finished(client)
        if status != RequestStatus.FINISHED_STOPPED:
            self.recorder.record_finish(request, status.value, time.monotonic())

    def _stop_by_string(self, lane: Lane, request: Request, stop: str, now: float) -> None:
        """A stop string ended a sequence: the executor stops computing it."""
        request.stop_reason = stop
        lane.finish([request.req_id], RequestStatus.FINISHED_STOPPED)
        self.recorder.record_finish(request, "stop", now)

    def stopped_by_string(self, request_id: str, index: int, stop: str) -> None:
        """An API server process found a stop string in a sequence's text."""
        client = self._clients.get(request_id)
        if client is None or index >= len(client.children):
            return
        request = client.children[index]
        if client.mark_finished(index):
            self._stop_by_string(self._lane_of[request.req_id], request, stop, time.monotonic())
            self._forget_if_finished(client)

    def refresh_gauges(self) -> None:
        """Running, waiting and KV usage over every executor (O(executors): not once a step)."""
        self.recorder.refresh_gauges(self.live_lanes, len(self._parked))

    async def _refresh_gauges_forever(self, interval_s: float = 1.0) -> None:
        while True:  # NOTE: O(executors): once a second, not once a step
            self.refresh_gauges()
            await asyncio.sleep(interval_s)

    # -- introspection ---------------------------------------------------------------------------

    @property
    def num_active_requests(self) -> int:
        return len(self._clients)

    @property
    def lanes_settled(self) -> bool:
        """No live lane has a step to send, finished requests' drops included (a hint for remote
        lanes, from their workers' reports): the executors hold no request of this scheduler."""
        return not any(lane.has_work for lane in self.live_lanes)

    async def check_integrity(self, expect_idle: bool = False) -> list[engine_probes.PoolState]:
        """Each lane's pool state, checked between its steps (AssertionError: the first violation)."""
        return await engine_probes.check_integrity(list(self.lanes.values()), self.grammars, expect_idle)

    async def prefix_cache_stats(self) -> dict[str, tuple[int, int]]:
        """Per executor: (prompt tokens looked up, tokens found in the cache)."""
        return await engine_probes.prefix_cache_stats(list(self.lanes.values()))
