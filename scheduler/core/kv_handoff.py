"""Prefill/decode disaggregation in one executor's scheduler: its part of a request whose prompt
one executor computes and another decodes (`engine.disaggregation` decides which, and relays).

On the prefill executor, the request's `Request.prefill_twin` runs ``prefill_only``: it samples
its first token, ends PREFILLED, and its blocks stay held (`held`) until the decode executor has
pulled them (or never will), when the front releases them (`release_held`).

On the decode executor, the request (``remote_prefill``) is admitted as soon as it is placed,
before its prompt is computed anywhere: it takes its blocks (its own prefix-cache hits, and the
rest for the prompt and the first token; unregistered in the prefix cache), a sequence slot and
no token budget, and waits (`awaiting`, WAITING_FOR_REMOTE_KVS). When the prefill is over, the
front says where its KV is (`start_decode`): its next step admits it with the blocks that no hit
covers pulled (`KvPull`), and the pulled blocks join the prefix cache once the step has landed.
A pull that fails fails that request only (`StepResult.failed_pull_req_ids`): its blocks go back
and it computes its prompt here, from the head of the queue. A request that cannot get its
blocks yet waits in the queue like any other, and is reserved (or, told its source meanwhile,
admitted with its pull) once they are free.

A mixin of `Scheduler`, which provides what is declared here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from npuserve.proto.step_plan import KvPull, StepPlan, StepResult
from npuserve.scheduler.core.block_hash import extend_block_hashes
from npuserve.scheduler.core.kv_cache_manager import KVCacheManager, PrefixHit
from npuserve.scheduler.core.request import Prefilled, PrefilledBlocks, Request, RequestStatus
from npuserve.scheduler.core.scheduler_config import SchedulerConfig

if TYPE_CHECKING:
    from npuserve.scheduler.core.scheduler import StepStats

AWAITING = RequestStatus.WAITING_FOR_REMOTE_KVS


class KvHandOff:
    config: SchedulerConfig
    kv: KVCacheManager
    requests: dict[str, Request]
    waiting: deque[Request]
    running: list[Request]
    # Prefill-only requests that ended PREFILLED: their blocks stay until `release_held`.
    held: dict[str, Request]
    # Requests reserved here while another executor computes their prompt, in order; and of
    # them, those whose KV is known, to start in the next step.
    awaiting: dict[str, Request]
    ready: deque[Request]
    _to_drop: list[str]

    if TYPE_CHECKING:  # provided by `Scheduler`

        def _take_out(self, request: Request) -> None: ...

        def _finish(self, request: Request, status: RequestStatus, valid: bool = True) -> None: ...

        def _send_whole(self, request: Request, plan: StepPlan) -> None: ...

        def _grant(
            self,
            request: Request,
            num_new: int,
            num_steps: int,
            plan: StepPlan,
            stats: StepStats,
            scheduled: list[Request],
            sampling: list[Request],
        ) -> None: ...

    # -- commands from the front -------------------------------------------------------------------

    def start_decode(self, prefilled: Prefilled) -> None:
        """A request waiting here for its KV takes its output so far (the first token sampled
        where it prefilled) and starts: with ``prefilled.pull``, its next step pulls its KV;
        without, it computes its prompt here. Ignored for a request no longer waiting (ended, or
        moved, meanwhile)."""
        request = self.requests.get(prefilled.req_id)
        if request is None or not request.remote_prefill or request.pull is not None:
            return
        output = prefilled.output_token_ids
        num_output = len(request.output_token_ids)
        if len(output) > num_output:  # NOTE: a copy of its own (a worker's): the token is new here
            request.add_reported_output(output[num_output:], prefilled.output_logprobs[num_output:])
        extend_block_hashes(request.block_hashes, request.all_token_ids, request.block_size)
        if request.grammar is not None:
            request.grammar.sync(request.output_token_ids)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = prefilled.num_cached_tokens
        reserved = request.status is AWAITING
        if prefilled.pull is not None:
            request.pull = prefilled.pull
            if reserved:
                del self.awaiting[request.req_id]
                self.ready.append(request)
            return
        request.remote_prefill = False
        if reserved:  # NOTE: admitted again as any request, from its prefix hits
            del self.awaiting[request.req_id]
            self.kv.free(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)

    def release_held(self, req_ids: Iterable[str]) -> None:
        """Frees, with no report, what this executor holds for requests that go on, or ended,
        elsewhere: the blocks of a prefilled request (pulled, or never to be; they stay in the
        prefix cache), and a request of its own that is no longer wanted here: a prefill-only
        one, or one waiting for its KV. Other ids are ignored (a request that runs here as any
        other is ended by `finish_requests`)."""
        for req_id in req_ids:
            if self._free_held(req_id):
                continue
            request = self.requests.get(req_id)
            if request is not None and (request.prefill_only or request.remote_prefill):
                self._take_out(request)
                self._finish(request, RequestStatus.FINISHED_ABORTED)

    def _free_held(self, req_id: str) -> bool:
        request = self.held.pop(req_id, None)
        if request is not None:
            self.kv.free(request)
        return request is not None

    # -- scheduling ----------------------------------------------------------------------------------

    @property
    def _num_admitted(self) -> int:
        """Requests that hold a sequence slot: running, or reserved while they wait for their KV."""
        return len(self.running) + len(self.awaiting) + len(self.ready)

    def _reserve(self, request: Request, hits: list[PrefixHit], num_hit_tokens: int) -> bool:
        """Admits the first waiting request, which waits for its KV (`remote_prefill`): its blocks
        for its tokens and the first token to come, its prefix hits among them; False when the
        pool cannot hold them now."""
        num_slots = min(request.num_tokens + 1, request.max_model_len) - num_hit_tokens
        if self.kv.allocate_slots(request, num_slots, hits, cache_new=False) is None:
            return False
        self.waiting.popleft()
        request.status = AWAITING
        request.num_computed_tokens = num_hit_tokens  # the rest will be pulled
        self.awaiting[request.req_id] = request
        if self.config.enable_prefix_caching:
            self.kv.record_prefix_lookup(request.num_tokens, num_hit_tokens)
        return True

    def _start_pulled(
        self,
        plan: StepPlan,
        stats: StepStats,
        budget: int,
        scheduled: list[Request],
        sampling: list[Request],
    ) -> int:
        """Starts the reserved requests whose KV is known, in order, within ``budget`` tokens:
        each pulls what its prefix hits here do not cover and computes the rest (its first
        token). Returns the budget left."""
        ready, block_size = self.ready, self.config.block_size
        while ready and budget > 0:
            request = ready[0]
            pull = request.pull
            assert pull is not None
            num_new = request.num_tokens - pull.num_tokens
            num_hit_tokens = request.num_computed_tokens
            if num_new > budget:
                break
            request.num_computed_tokens = pull.num_tokens
            if self.kv.allocate_slots(request, num_new, cache_new=False) is None:
                request.num_computed_tokens = num_hit_tokens
                break
            ready.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            self._pull(request, pull, num_hit_tokens // block_size, plan)
            self._send_whole(request, plan)
            self._grant(request, num_new, 1, plan, stats, scheduled, sampling)
            budget -= num_new
        return budget

    def _pull(self, request: Request, pull: PrefilledBlocks, num_hit_blocks: int, plan: StepPlan) -> None:
        """The plan copies the prefilled blocks of ``request`` that no prefix hit here covers."""
        num_blocks = -(-pull.num_tokens // self.config.block_size)
        dst = self.kv.get_block_ids(request.req_id)[num_hit_blocks:num_blocks]
        if not dst:  # NOTE: its hits here cover them all
            request.pull, request.remote_prefill = None, False
            return
        src = pull.block_ids[num_hit_blocks:num_blocks]
        plan.kv_pulls.append(KvPull(pull.address, pull.instance_id, src, dst, request.req_id))

    # -- results -------------------------------------------------------------------------------------

    def _pulls_landed(self, plan: StepPlan, result: StepResult) -> None:
        """The pulls of a step whose result (or early part of it) came: a pulled request whose
        pull failed computes its prompt here (the token sampled over its blocks is dropped);
        one whose pull landed has its pulled blocks registered in the prefix cache."""
        failed = result.failed_pull_req_ids
        sampled: set[str] | None = None
        for pull in plan.kv_pulls:
            request = self.requests.get(pull.req_id)
            if request is None or request.pull is None or request.status is not RequestStatus.RUNNING:
                continue  # ended, preempted or failed since, or answered in the early result
            if pull.req_id in failed:
                self._pull_failed(request)
                continue
            if result.partial:
                sampled = set(result.sampled_req_ids) if sampled is None else sampled
                if pull.req_id not in sampled:
                    continue  # its token comes with the step's final result
            request.pull, request.remote_prefill = None, False
            self.kv.cache_computed(request)

    def _pull_failed(self, request: Request) -> None:
        """Its blocks past its prefix hits hold part of its KV at most (never registered): they
        go back, and it runs again from the head of the queue, its prompt computed here."""
        self.running.remove(request)
        self.kv.free(request)
        request.reset_for_recompute()
        self._to_drop.append(request.req_id)  # NOTE: the executor holds it: it starts over there
        self.waiting.appendleft(request)
