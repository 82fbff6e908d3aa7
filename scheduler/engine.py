"""The engine: requests in, streams of completions out, over one lane per executor.

It validates and tokenizes requests, places each on an executor (`router`), hands it to that
executor's lane, and turns the lanes' step results into client streams (`outputs`) on the event
loop. It never touches tensors: executors are gRPC clients, or in-process runners for offline use.
"""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import structlog

from npuserve.proto.step_plan import ExecutorInfo
from npuserve.scheduler.background import BackgroundTasks
from npuserve.scheduler.client_request import ClientRequest
from npuserve.scheduler.executor_client import ExecutorClient
from npuserve.scheduler.lane import ExecutorLane, Lane, LaneEvent, StepExecutor
from npuserve.scheduler.metrics import ExecutorLoad, SchedulerMetrics
from npuserve.scheduler.outputs import GenerateOutput, OpenStream, OutputSink, RequestStream, client_outputs
from npuserve.scheduler.prompts import ModelLimits, ModelNotFoundError, PromptInput, PromptProcessor
from npuserve.scheduler.request import InvalidRequestError, Request, RequestStatus, SamplingParams
from npuserve.scheduler.router import DEFAULT_PREFILL_WEIGHT, ROUTING_POLICIES, choose_lane, uncached_blocks
from npuserve.scheduler.scheduler import Scheduler, SchedulerConfig
from npuserve.scheduler.step_frames import LaneReport, RelayedPack, apply_report
from npuserve.scheduler.step_passes import check_num_scheduler_steps
from npuserve.scheduler.step_worker import LaneSettings
from npuserve.scheduler.step_workers import WORKER_START_TIMEOUT_S, RemoteLane, StepWorkerPool, WorkerHandle
from npuserve.scheduler.structured import Grammar, GrammarCompiler
from npuserve.scheduler.tokenizer import Tokenizer

log = structlog.get_logger(__name__)

__all__ = ["Engine", "EngineConfig", "ModelNotFoundError", "PoolState", "PromptInput"]


class StreamProcesses(Protocol):
    """The API server processes that serve client streams (`api_relay.ApiProcessPool`), as the
    engine uses them."""

    def behind(self) -> bool:
        """Too many relayed tokens wait to be applied there: the workers' steps wait too."""
        ...

    def forward(self, key: tuple[int, int], pack: RelayedPack) -> None:
        """Tokens a worker packed for API process ``key`` (index, incarnation), passed on as
        they are (dropped if that incarnation is gone)."""
        ...

    async def delivered(self, requests: list[Request]) -> dict[str, list[int]]:
        """The output token ids each sequence's stream holds (absent: its process is gone)."""
        ...


@dataclass(slots=True)
class PoolState:
    executor_id: str
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_requests: int
    prefix_cache_queries: int
    prefix_cache_hits: int


def _checked_state(scheduler: Scheduler, expect_idle: bool = False) -> PoolState:
    scheduler.check_integrity(expect_idle)
    pool = scheduler.kv.pool
    return PoolState(
        executor_id="",
        num_blocks=pool.num_blocks - 1,
        num_free_blocks=pool.num_free_blocks,
        num_cached_blocks=len(pool.cached_blocks),
        num_requests=len(scheduler.requests),
        prefix_cache_queries=scheduler.kv.stats.queries,
        prefix_cache_hits=scheduler.kv.stats.hits,
    )


def _prefix_stats(scheduler: Scheduler) -> tuple[int, int]:
    return scheduler.kv.stats.queries, scheduler.kv.stats.hits


class ProfilingUnavailable(RuntimeError):
    """Profiling asked of an executor that cannot profile (gRPC UNIMPLEMENTED, HTTP 400)."""


class QueueFullError(RuntimeError):
    """More requests wait than --max-queued-requests allows (gRPC RESOURCE_EXHAUSTED, HTTP 429)."""


@dataclass(slots=True)
class EngineConfig:
    served_model_name: str
    enable_prefix_caching: bool = True
    routing: str = "prefix-aware"
    routing_prefill_weight: float = DEFAULT_PREFILL_WEIGHT  # a prefill block's cost against a block in use
    max_queued_requests: int | None = None  # None: unbounded
    trust_request_chat_template: bool = False  # render chat templates that clients send
    async_scheduling: bool = False  # schedule each step while the executor runs the one before
    stream_interval: int = 1  # tokens per streamed delta after a sequence's first (`RequestStream`)
    # Passes per step of a sampling request (multi-step decoding); `AUTO_SCHEDULER_STEPS`: each
    # executor's lane chooses them (`step_passes`).
    num_scheduler_steps: int = 1

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"--routing must be one of {', '.join(ROUTING_POLICIES)}")
        if not self.routing_prefill_weight >= 0:  # NOTE: NaN too
            raise ValueError(f"--routing-prefill-weight must be >= 0, got {self.routing_prefill_weight}")
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be at least 1, got {self.stream_interval}")
        check_num_scheduler_steps(self.num_scheduler_steps)


class NoExecutorError(RuntimeError):
    """No executor is available to serve (gRPC UNAVAILABLE, HTTP 503)."""


MAX_FAILOVERS = 3  # executors a request may lose before it fails


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer,
        executors: Sequence[tuple[str, StepExecutor, ExecutorInfo]],
        step_workers: StepWorkerPool | None = None,
    ) -> None:
        """``step_workers``: run the executors' step loops in these worker processes (their
        executors must be gRPC clients); None runs them as threads of this process."""
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
        self.lanes: dict[str, Lane] = {}
        self._clients: dict[str, ClientRequest] = {}
        self._client_of_seq: dict[str, ClientRequest] = {}  # req_id of a sequence -> its client request
        self._sequences: dict[str, Request] = {}  # req_id -> the sequence (one lookup per token)
        self._lane_of: dict[str, Lane] = {}
        self.step_workers = step_workers
        # Requests of a lost scheduler worker, held while it restarts when no other lane is left.
        self._parked: list[Request] = []
        self._workers_restarting = 0
        self._background = BackgroundTasks()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Per lane (a rejoined executor is a new lane, its pool's counts start at zero again):
        # the prefix-cache totals already counted.
        self._prefix_counted: weakref.WeakKeyDictionary[Lane, tuple[int, int]] = weakref.WeakKeyDictionary()
        self._pending = list(executors)
        # req_id -> (lane, prompt blocks, blocks to prefill there)
        self._unstarted: dict[str, tuple[Lane, int, int]] = {}
        # The API server processes serving client streams (`--api-server-count` above 1).
        self.stream_processes: StreamProcesses | None = None
        self._held_acks: list[WorkerHandle] = []
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
            self.step_workers.start(settings, self._on_report, self._on_reports_handled, self._on_worker_lost)
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

    def stop(self) -> None:
        if self._gauge_task is not None:
            self._gauge_task.cancel()
        self.prompts.close()
        self.grammars.close()
        for lane in list(self.lanes.values()):
            lane.stop()
            lane.executor.close()
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
        # NOTE: read off the lane's thread or worker, as a hint: no new request comes to a
        # draining lane, so once nothing is queued, held or still to be dropped on the executor,
        # it stays so.
        if lane.draining and not lane.queued_requests and not lane.has_work:
            self.remove_executor(lane.executor_id, "drained")
            self.metrics.executors.left(lane.executor_id)

    def add_executor(self, executor_id: str, executor: StepExecutor, info: ExecutorInfo) -> None:
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
        old = self.lanes.get(executor_id)
        if old is not None:
            self.remove_executor(executor_id, "replaced by a new instance")
        lane: Lane
        if self.step_workers is not None:
            assert isinstance(executor, ExecutorClient), "worker processes drive remote executors"
            lane = self.step_workers.open_lane(executor_id, executor, info)
        else:
            scheduler = Scheduler(
                SchedulerConfig.for_executor(
                    info, self.config.enable_prefix_caching, self.config.num_scheduler_steps
                )
            )
            lane = ExecutorLane(
                executor_id, executor, scheduler, self._on_lane_event, self.config.async_scheduling
            )
        self.lanes[executor_id] = lane
        lane.start()
        self.metrics.executors.joined(executor_id, getattr(executor, "address", None))
        log.info(
            "executor joined",
            executor=executor_id,
            num_blocks=info.num_blocks,
            executors=len(self.live_lanes),
        )
        if self._parked:
            parked, self._parked = self._parked, []
            self._fail_over(parked, "a scheduler worker restarted", count=False)

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
        lane.stop()
        lane.executor.close()

    # -- requests --------------------------------------------------------------------------------

    async def add_request(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        request_id: str | None = None,
        model: str | None = None,
    ) -> RequestStream:
        """Validates, tokenizes and queues a request; errors are raised before anything is queued."""
        self.prompts.check_request(model, params)
        grammar = await self._compile_grammar(params)
        prompt_ids = await self.prompts.prompt_token_ids(prompt)
        self.prompts.check_lengths(prompt_ids, params)
        request_id = request_id or new_request_id()
        stream = RequestStream(request_id, self.tokenizer, params, prompt_ids, self.config.stream_interval)
        self.queue_request(request_id, prompt_ids, params, grammar, stream)
        return stream

    async def _compile_grammar(self, params: SamplingParams) -> Grammar | None:
        so = params.structured_outputs
        return None if so is None else await self.grammars.compile(so)

    async def add_tokenized(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: OutputSink,
        stream_at: tuple[int, int, int],
    ) -> None:
        """Queues a request an API server process has validated and tokenized (its model,
        sampling parameters and lengths are checked there); errors are raised before anything
        is queued. ``stream_at``: (that process's index, its incarnation, the stream's handle)."""
        grammar = await self._compile_grammar(params)
        self.queue_request(request_id, prompt_ids, params, grammar, sink, stream_at)

    def queue_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        grammar: Grammar | None,
        sink: OutputSink,
        stream_at: tuple[int, int, int] | None = None,
    ) -> ClientRequest:
        """Places a checked, tokenized request on an executor; its outputs go to ``sink``
        (``stream_at``: in an API server process, see `add_tokenized`)."""
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
        if grammar is not None:
            for child in children:
                child.grammar = grammar.new_state(child.max_output_tokens)
        if stream_at is not None:
            relay_every = 1 if params.stop else self.config.stream_interval
            for choice, child in enumerate(children):
                child.relay_to, child.relay_every = (*stream_at, choice), relay_every
        client = ClientRequest(request_id, children, prompt_ids, sink)
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

    async def generate(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        request_id: str | None = None,
        model: str | None = None,
    ) -> AsyncIterator[GenerateOutput]:
        """Streams a request's outputs; leaving the iteration early (or being cancelled) aborts it."""
        opened = await self.open(prompt, params, request_id, model)
        async with aclosing(client_outputs(opened)) as outputs:
            async for output in outputs:
                yield output

    async def open(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        request_id: str | None = None,
        model: str | None = None,
    ) -> OpenStream:
        """Queues a request for a client (`add_request`); closing it aborts what is left."""
        stream = await self.add_request(prompt, params, request_id, model)

        def leave() -> None:
            if not stream.finished:
                self.drop(stream.request_id)

        return OpenStream(stream, leave)

    def abort(self, request_id: str) -> bool:
        client = self._clients.get(request_id)
        if client is None:
            return False
        for child in client.children:
            if not client.is_finished(child.req_id):
                self._lane_of[child.req_id].finish([child.req_id], RequestStatus.FINISHED_ABORTED)
        log.info("request aborted", request_id=request_id)
        return True

    def drop(self, request_id: str) -> None:
        """Aborts a request whose client has gone, and forgets it now (no one reads its end)."""
        client = self._clients.get(request_id)
        if client is None or not self.abort(request_id):
            return
        for child in client.children:
            client.mark_finished(child.req_id)
        self._forget_if_finished(client)

    def _place(self, siblings: list[Request]) -> Lane:
        """Routes requests of one client request (siblings stay together) to a live executor."""
        first = siblings[0]
        num_blocks = len(first.block_hashes) + 1
        config = self.config
        lane = choose_lane(
            self.routable_lanes, first.block_hashes, num_blocks, config.routing, config.routing_prefill_weight
        )
        # NOTE: siblings share the prompt's blocks: one prefill, counted with the first.
        prefill = uncached_blocks(lane, first.block_hashes, num_blocks)
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

    # -- lane events (lane threads -> event loop) ------------------------------------------------

    def _on_lane_event(self, lane: ExecutorLane, event: LaneEvent) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._dispatch, lane, event)

    def _on_report(self, worker: WorkerHandle, report: LaneReport) -> None:
        """One lane report of a scheduler worker (event loop thread)."""
        lane = worker.lanes.get(report.lane_key)
        if lane is None:
            return  # a lane the front has retired; its requests were placed again
        lane.absorb(report)
        if report.relayed:
            assert self.stream_processes is not None, "tokens packed for API processes"
            for key, pack in report.relayed.items():  # NOTE: unopened: no per-token work here
                self.stream_processes.forward(key, pack)
        num_tokens = sum(len(update[1]) for update in report.updates) + report.num_relayed_tokens
        event = apply_report(report, self._sequences.get)
        self._dispatch(lane, event, (report.num_sequences, num_tokens))

    def _on_reports_handled(self, worker: WorkerHandle) -> None:
        """A worker's message of reports is handled: it is acknowledged."""
        # NOTE: the worker's lanes wait while too many go unacknowledged; and so they do while
        # the processes serving client streams are behind (`--api-server-count`).
        if self.stream_processes is not None and self.stream_processes.behind():
            self._held_acks.append(worker)
        else:
            worker.send(("ack",))

    def streams_caught_up(self) -> None:
        """The processes serving client streams caught up: the workers held back step again."""
        held, self._held_acks = self._held_acks, []
        for worker in held:
            worker.send(("ack",))

    def _on_worker_lost(self, worker: WorkerHandle) -> None:
        """A scheduler worker died: its lanes' requests move (or wait for its restart), and it
        is restarted with the same executors, which start clean (the first plan resets them)."""
        assert self.step_workers is not None
        lost = list(worker.lanes.values())
        lost_set = set(lost)
        for lane in lost:
            lane.alive = False
            if self.lanes.get(lane.executor_id) is lane:
                del self.lanes[lane.executor_id]
        requests = []
        for req_id, placed in list(self._lane_of.items()):
            request = self._sequences.get(req_id)
            if placed in lost_set and request is not None and not request.status.is_finished:
                self._started(req_id)
                requests.append(request)
        log.error(
            "scheduler worker lost", worker=worker.index, executors=len(lost), requests_moved=len(requests)
        )
        self._workers_restarting += 1
        reason = f"scheduler worker {worker.index} died"
        # NOTE: the worker sent the tokens of streams served by API processes straight to them:
        # those processes hold what this copy lacks (`Request.relay_to`).
        streamed = [r for r in requests if r.relay_to is not None]
        if streamed:
            self._background.spawn(self._take_output_and_fail_over(streamed, reason))
        held_here = [r for r in requests if r.relay_to is None]
        for request in held_here:
            request.reset_for_recompute()
        self._fail_over(held_here, reason)
        self._background.spawn(self._restart_worker(worker, lost))

    async def _take_output_and_fail_over(self, requests: list[Request], reason: str) -> None:
        """Moves sequences whose tokens the lost worker sent straight to API processes, once
        those processes have said what they streamed (a process that is gone took its clients
        with it: its sequences end)."""
        assert self.stream_processes is not None
        try:
            outputs = await self.stream_processes.delivered(requests)
        except Exception:
            log.exception("the API processes' outputs could not be taken", requests=len(requests))
            outputs = {}
        moving = []
        for request in requests:
            output = outputs.get(request.req_id)
            if output is None:
                self._end_unmoved(request, f"{reason}; its output could not be recovered")
                continue
            request.take_output(output, None)
            request.reset_for_recompute()
            moving.append(request)
        log.info(
            "outputs taken from the API processes", requests=len(moving), lost=len(requests) - len(moving)
        )
        self._fail_over(moving, reason)

    def _end_unmoved(self, request: Request, why: str) -> None:
        client = self._client_of_seq.get(request.req_id)
        if client is None or request.status.is_finished:
            return
        self._mark_failed(request)
        client.end(request, RequestStatus.FINISHED_ERROR, why)
        self._forget_if_finished(client)

    def _mark_failed(self, request: Request) -> None:
        """A sequence that cannot go on: it failed, its matcher is freed, its finish counted."""
        request.status = RequestStatus.FINISHED_ERROR
        if request.grammar is not None:
            request.grammar.release()
        self._record_finish(request, "error", time.monotonic())

    async def _restart_worker(self, worker: WorkerHandle, lanes: list[RemoteLane]) -> None:
        assert self.step_workers is not None
        try:
            # NOTE: serve's restart policy: 1 s, doubling while it keeps dying; a crash loop is given up.
            delay_s = worker.history.died()
            if delay_s is None:
                log.error(
                    "scheduler worker crash-looping; given up",
                    worker=worker.index,
                    deaths=worker.history.policy.describe(),
                )
                return
            await asyncio.sleep(delay_s)
            await asyncio.to_thread(self.step_workers.restart, worker)
            for lane in lanes:
                if lane.executor_id not in self.lanes:
                    self.add_executor(lane.executor_id, lane.executor, lane.info)
        except Exception:
            log.exception("scheduler worker restart failed", worker=worker.index)
        finally:
            self._workers_restarting -= 1
            if self._parked and not self.live_lanes and not self._workers_restarting:
                parked, self._parked = self._parked, []
                self._fail_over(parked, "no scheduler worker came back", count=False)

    def _dispatch(self, lane: Lane, event: LaneEvent, sampled: tuple[int, int] | None = None) -> None:
        """``sampled``: the sequences that sampled in the step and their tokens, when the event
        does not hold them all (a worker relayed some to the API processes); else counted here."""
        now = time.monotonic()
        client_of_seq, unstarted = self._client_of_seq, self._unstarted
        for update in event.updates:  # NOTE: once per token: the common case stays in this loop
            request = update.request
            req_id = request.req_id
            client = client_of_seq.get(req_id)
            if client is None:
                continue
            if req_id in unstarted:
                self._started(req_id)
            if request.first_token_time is None:
                request.first_token_time = now
                self.metrics.time_to_first_token.observe(now - request.arrival_time)
            finished = update.finished
            stop = client.deliver(request, update.new_token_ids, update.new_logprobs, finished)
            if stop is not None:
                self._stop_by_string(lane, request, stop, now)
            elif finished is not None:
                self._record_finish(request, finished.value, now)
            if client.finished:
                self._forget_if_finished(client)
        if event.lane_down:
            if self.lanes.get(lane.executor_id) is lane:  # not the executor's next lane
                del self.lanes[lane.executor_id]
            assert self._loop is not None
            self._loop.call_later(1.0, self._retire, lane)
        if event.evacuated:
            for request in event.evacuated:
                self._started(request.req_id)
            self._fail_over(event.evacuated, event.error or "executor lost")
        for request in event.ended:
            self._started(request.req_id)
            client = self._client_of_seq.get(request.req_id)
            if client is not None:
                client.end(request, request.status, event.error)
                self._forget_if_finished(client)
            if request.status != RequestStatus.FINISHED_STOPPED:
                self._record_finish(request, request.status.value, now)
        if sampled is None:
            sampled = len(event.updates), sum(len(update.new_token_ids) for update in event.updates)
        self._record_step(lane, event, *sampled)
        if event.failed_step:
            self.metrics.executors.step_failed(lane.executor_id)
        if event.joined_step:
            self.metrics.executors.step_joined(lane.executor_id)
        if event.executor_draining and self.lanes.get(lane.executor_id) is lane:
            self.drain_executor(lane.executor_id, "the executor is draining")
        if lane.draining and not event.lane_down:
            self._remove_if_drained(lane)

    def _stop_by_string(self, lane: Lane, request: Request, stop: str, now: float) -> None:
        """A stop string ended a sequence: the executor stops computing it."""
        request.stop_reason = stop
        lane.finish([request.req_id], RequestStatus.FINISHED_STOPPED)
        self._record_finish(request, "stop", now)

    def stopped_by_string(self, request_id: str, index: int, stop: str) -> None:
        """An API server process found a stop string in a sequence's text."""
        client = self._clients.get(request_id)
        if client is None or index >= len(client.children):
            return
        request = client.children[index]
        if client.mark_finished(request.req_id):
            self._stop_by_string(self._lane_of[request.req_id], request, stop, time.monotonic())
            self._forget_if_finished(client)

    def _fail_over(self, requests: list[Request], reason: str, count: bool = True) -> None:
        """Moves requests of a lost executor to others; each resumes from the tokens it has.
        While a scheduler worker restarts and no other lane is up, they wait for it."""
        if requests and not self.live_lanes and self._workers_restarting:
            self._parked.extend(requests)
            return
        by_parent: dict[str, list[Request]] = {}
        for request in requests:
            client = self._client_of_seq.get(request.req_id)
            parent = None if client is None else client.request_id
            if parent is not None and parent in self._clients:  # else: aborted meanwhile
                by_parent.setdefault(parent, []).append(request)
            elif request.grammar is not None:
                request.grammar.release()
        for parent, siblings in by_parent.items():
            client = self._clients[parent]
            if count:
                for request in siblings:
                    request.num_failovers += 1
            available = bool(self.routable_lanes)
            if not available or siblings[0].num_failovers > MAX_FAILOVERS:
                why = "no executor is available" if not available else f"lost {MAX_FAILOVERS} executors"
                for request in siblings:
                    self._mark_failed(request)
                if not available and not client.started:
                    # NOTE: nothing was sent: to the client this is a request that came while no
                    # executor was up (UNAVAILABLE, HTTP 503 with Retry-After), not a failed one.
                    client.refuse(NoExecutorError(f"{why} ({reason}); retry once one has joined"))
                else:
                    for request in siblings:
                        client.end(request, RequestStatus.FINISHED_ERROR, f"{why} ({reason})")
                self._forget_if_finished(client)
                continue
            lane = self._place(siblings)
            log.info("requests moved", request_id=parent, to_executor=lane.executor_id, reason=reason)

    def _record_finish(self, request: Request, reason: str, now: float) -> None:
        self.metrics.request_finished(reason)
        self.metrics.e2e_request_latency.observe(now - request.arrival_time)
        if request.first_token_time is not None and request.num_output_tokens > 1:
            tpot = (now - request.first_token_time) / (request.num_output_tokens - 1)
            self.metrics.time_per_output_token.observe(tpot)

    def _record_step(self, lane: Lane, event: LaneEvent, num_sequences: int, num_tokens: int) -> None:
        m = self.metrics
        if event.stats is not None:
            m.step(lane.executor_id, event.step_seconds, num_tokens, num_sequences)
            # NOTE: a counter's inc takes a lock: most steps have no prompt tokens, no preemption
            if event.stats.num_prompt_tokens:
                m.prompt_tokens.inc(event.stats.num_prompt_tokens)
            if event.stats.num_preemptions:
                m.num_preemptions.inc(event.stats.num_preemptions)
        now_queries, now_hits = lane.prefix_stats
        queries, hits = self._prefix_counted.get(lane, (0, 0))
        if (now_queries, now_hits) != (queries, hits):  # NOTE: most steps look nothing up
            m.prefix_cache(lane.executor_id, max(0, now_queries - queries), max(0, now_hits - hits))
            self._prefix_counted[lane] = (now_queries, now_hits)

    def refresh_gauges(self) -> None:
        """Running, waiting and KV usage over every executor (O(executors): not once a step)."""
        m = self.metrics
        lanes = self.live_lanes
        m.num_requests_running.set(sum(lane.num_running for lane in lanes))
        m.num_requests_waiting.set(sum(lane.num_waiting for lane in lanes) + len(self._parked))
        m.kv_cache_usage.set(sum(lane.kv_usage for lane in lanes) / len(lanes) if lanes else 0.0)
        m.executors.refresh(
            [
                ExecutorLoad(
                    lane.executor_id,
                    lane.num_running,
                    lane.num_waiting,
                    lane.kv_usage,
                    lane.num_scheduler_steps,
                )
                for lane in lanes
            ]
        )

    async def _refresh_gauges_forever(self, interval_s: float = 1.0) -> None:
        while True:
            self.refresh_gauges()
            await asyncio.sleep(interval_s)

    # -- introspection ---------------------------------------------------------------------------

    @property
    def num_active_requests(self) -> int:
        return len(self._clients)

    @property
    def lanes_settled(self) -> bool:
        """No live lane has a step to send, finished requests' drops included (a hint, read off
        the lane threads): the executors hold no request of this scheduler."""
        return not any(lane.has_work for lane in self.live_lanes)

    async def check_integrity(self, expect_idle: bool = False) -> list[PoolState]:
        """Every lane's block pool passes its integrity check (run on the lane threads, between
        steps); raises AssertionError naming the first violation. Returns each pool's state."""
        states = []
        for lane in list(self.lanes.values()):
            state = await asyncio.wrap_future(lane.call(partial(_checked_state, expect_idle=expect_idle)))
            state.executor_id = lane.executor_id
            states.append(state)
        live = self.grammars.num_live_states
        assert not (expect_idle and live), f"{live} grammar states of finished requests are still held"
        return states

    async def start_profile(self) -> list[str]:
        """Starts profiling on every live executor; returns their ids. A failure (profiling off,
        or already running) raises the executor's error, named by its id."""
        lanes = self._profiled_lanes()
        await asyncio.gather(*(self._on_executor(lane, "start_profile") for lane in lanes))
        return [lane.executor_id for lane in lanes]

    async def stop_profile(self) -> dict[str, list[str]]:
        """Ends every live executor's profile; returns the trace files each wrote."""
        lanes = self._profiled_lanes()
        files = await asyncio.gather(*(self._on_executor(lane, "stop_profile") for lane in lanes))
        return {lane.executor_id: list(f) for lane, f in zip(lanes, files, strict=True)}

    def _profiled_lanes(self) -> list[Lane]:
        lanes = self.live_lanes
        if not lanes:
            raise NoExecutorError("no executor is available to profile")
        return lanes

    @staticmethod
    async def _on_executor(lane: Lane, method: str) -> Any:
        call = getattr(lane.executor, method, None)
        if call is None:
            raise ProfilingUnavailable(f"executor {lane.executor_id} runs in-process and cannot profile")
        try:
            return await asyncio.to_thread(call)
        except Exception as exc:
            # NOTE: keep the executor's status code (see SchedulerServicer), add its id.
            exc.args = (f"executor {lane.executor_id}: {getattr(exc, 'message', exc)}",)
            raise

    async def prefix_cache_stats(self) -> dict[str, tuple[int, int]]:
        """Per executor: (prompt tokens looked up, tokens found in the cache)."""
        result = {}
        for lane in list(self.lanes.values()):
            stats = await asyncio.wrap_future(lane.call(_prefix_stats))
            result[lane.executor_id] = stats
        return result
