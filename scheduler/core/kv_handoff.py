"""Prefill/decode disaggregation in one executor's scheduler: its part of a request whose prompt
one executor computes and another decodes (`engine.disaggregation` decides which, and relays).

On the prefill executor, the request's `Request.prefill_twin` runs ``prefill_only``: it samples
its first token, ends PREFILLED, and its blocks stay held (`held`) until the decode executor has
pulled them (or never will), when the front releases them (`release_held`).

On the decode executor, the request (``remote_prefill``) is reserved as soon as it is placed,
before its prompt is computed anywhere: it takes its blocks (its own prefix-cache hits, and the
rest for the prompt and the first token; unregistered in the prefix cache), a sequence slot and
no token budget, and waits (WAITING_FOR_REMOTE_KVS) while its KV goes through four stages, the
vLLM KV connector's: ``awaiting`` (its source unknown), ``ready`` (told its source by the front,
`start_decode`), ``pulling`` (the next step carried its `KvPull`, which the executor runs beside
its steps: that step and the later ones schedule none of its tokens, and the other requests
decode on), ``landed`` (a result said the pull landed, `StepResult.landed_pull_req_ids`: its
pulled blocks join the prefix cache, and its next step admits it with its remaining tokens, its
first token, like any request). A pull whose blocks its prefix hits here cover all lands at once.
A request that cannot get its blocks yet waits in the queue like any other, and is reserved (or,
told its source meanwhile, pulls) once they are free.

A request told its source while still in the queue (`ready_queued`) comes before reservations
whose prefill is not over (`_make_way`): when it cannot get its blocks or a sequence slot, it
moves to the head of the queue, and the newest ``awaiting`` reservations go back to the queue
behind it, their blocks freed, until it fits (their prefills go on; nothing was pulled into their
blocks yet). Else the prefill executor's pool could fill with blocks held for requests queued
here while this pool is full of reservations whose prefills wait there for blocks, and neither
would free any. A ready request runs to its end, freeing what it holds on both sides, and a
reservation is given up only for one: none is released over and over while nothing progresses.

Only the results of the step that carried a pull, or of later ones, say how it went (a result
repeats an outcome until a plan names the request again: a result lost on the way costs none).
A pull that fails fails that request only (`StepResult.failed_pull_req_ids`): its blocks go
back and it computes its prompt here, from the head of the queue; so does one whose pulling
step failed. A request that ends while its pull runs (an abort) ends at once, but its blocks
are parked (`KVCacheManager.park`) until the executor says the pull landed or failed (a later
step must not reuse blocks the pull still writes), and only then is the executor told to drop
it. While pulls run and no step has tokens to run, the lane still sends a step now and then,
one at a time (`worth_sending`): the executor answers it once a pull lands, or after a short
wait.

A mixin of `Scheduler`, which provides what is declared here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

from npuserve.proto.kv_layout import cdiv
from npuserve.proto.step_plan import KvPull, StepPlan, StepResult
from npuserve.scheduler.core.block_hash import extend_block_hashes
from npuserve.scheduler.core.kv_cache_manager import KVCacheManager, PrefixHit
from npuserve.scheduler.core.request import Prefilled, Request, RequestStatus
from npuserve.scheduler.core.scheduler_config import SchedulerConfig

if TYPE_CHECKING:
    from npuserve.scheduler.core.scheduler import StepStats

AWAITING = RequestStatus.WAITING_FOR_REMOTE_KVS


class PullInFlight(NamedTuple):
    """A request's pull that the executor runs; only results of ``step_id`` (the step that
    carried it) or later say how it went."""

    request: Request
    step_id: int


class KvHandOff:
    config: SchedulerConfig
    kv: KVCacheManager
    requests: dict[str, Request]
    waiting: deque[Request]
    running: list[Request]
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
            sampling: list[Request],
        ) -> None: ...

    def _init_hand_off(self) -> None:
        # Prefill-only requests that ended PREFILLED: their blocks stay until `release_held`.
        self.held: dict[str, Request] = {}
        # Requests reserved here while another executor computes their prompt, by stage (the
        # module says which), each in order.
        self.awaiting: dict[str, Request] = {}
        self.ready: deque[Request] = deque()
        # Requests still in the queue (no blocks here yet) that were told their source, in order.
        self.ready_queued: dict[str, Request] = {}
        self.pulling: dict[str, PullInFlight] = {}
        self.landed: deque[Request] = deque()
        # The pulls still running for requests that ended meanwhile, by request id: the step that
        # carried each (their blocks are parked in `kv` until it lands or fails).
        self.orphaned: dict[str, int] = {}

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
            else:
                self.ready_queued[request.req_id] = request
            return
        request.remote_prefill = False
        if reserved:  # NOTE: admitted again as any request, from its prefix hits
            self._unreserve(self.awaiting.pop(request.req_id))
            self.waiting.appendleft(request)

    def release_held(self, req_ids: Iterable[str]) -> None:
        """Frees, with no report, what this executor holds for requests that go on, or ended,
        elsewhere: a prefilled request's blocks (they stay in the prefix cache), and a prefill-only
        request or one waiting for its KV (a running pull's blocks are parked until it ends). Other
        ids are ignored (a request that runs here as any other ends by `finish_requests`)."""
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

    # -- state -------------------------------------------------------------------------------------

    @property
    def num_reserved(self) -> int:
        """Requests reserved here while they wait for their KV (each holds a sequence slot)."""
        return len(self.awaiting) + len(self.ready) + len(self.pulling) + len(self.landed)

    @property
    def _num_admitted(self) -> int:
        """Requests that hold a sequence slot: running, or reserved while they wait for their KV."""
        return len(self.running) + self.num_reserved

    def _hand_off_work(self) -> bool:
        """Pulls to start, landed requests to run, or pulls that run (results say when they end)."""
        return bool(self.ready or self.landed or self.pulling or self.orphaned)

    def worth_sending(self, plan: StepPlan, may_poll: bool = True) -> bool:
        """Whether a plan `schedule` made goes to the executor: it runs tokens, drops requests or
        starts pulls; or, ``may_poll`` (no other step in flight), pulls run (their outcomes come
        with its result)."""
        if plan.num_scheduled_tokens or plan.finished_req_ids or plan.kv_pulls:
            return True
        return may_poll and bool(self.pulling or self.orphaned)

    def _take_out_reserved(self, request: Request) -> None:
        """Out of its stage, before it ends (one whose pull runs stays `pulling` until
        `_free_blocks` parks its blocks)."""
        req_id = request.req_id
        if self.awaiting.pop(req_id, None) is None and req_id not in self.pulling:
            (self.ready if request in self.ready else self.landed).remove(request)

    def _free_blocks(self, request: Request, valid: bool) -> bool:
        """An ended request's blocks go back; those of one whose pull runs are parked until it
        lands or fails (True: the executor, which never held the request, is told to drop it
        only then, after it has named the pull's outcome: `_pulls_settled`)."""
        pulled = self.pulling.get(request.req_id)
        if pulled is None or pulled.request is not request:
            self.kv.free(request, valid=valid)
            return False
        del self.pulling[request.req_id]
        self.kv.park(request.req_id)
        self.orphaned[request.req_id] = pulled.step_id
        return True

    def _take_reserved(self) -> list[Request]:
        """Every reserved request, out (its executor is gone), and the parked blocks freed (the
        queue, `ready_queued` in it, is the caller's)."""
        reserved = [
            *self.awaiting.values(),
            *self.ready,
            *(pulled.request for pulled in self.pulling.values()),
            *self.landed,
        ]
        for req_id in self.orphaned:
            self.kv.free_parked(req_id, valid=False)
        for stage in (self.awaiting, self.ready, self.ready_queued, self.pulling, self.landed, self.orphaned):
            stage.clear()
        return reserved

    def _check_hand_off_idle(self) -> None:
        assert not (self.awaiting or self.ready or self.landed or self.ready_queued), (
            f"requests await their KV: {[*self.awaiting, *(r.req_id for r in self.ready)][:8]}"
        )
        assert not (self.pulling or self.orphaned), f"pulls still run: {[*self.pulling, *self.orphaned][:8]}"

    # -- scheduling ----------------------------------------------------------------------------------

    def _reserve(self, request: Request, hits: list[PrefixHit], num_hit_tokens: int) -> bool:
        """Admits the first waiting request, whose prompt another executor computes: blocks for
        its tokens and the next one, its prefix hits among them; it waits for its KV (`ready`
        when its source is known already). False when the pool cannot hold them now."""
        num_slots = min(request.num_tokens + 1, request.max_model_len) - num_hit_tokens
        if self.kv.allocate_slots(request, num_slots, hits, cache_new=False) is None:
            return False
        self.waiting.popleft()
        request.status = AWAITING
        request.num_computed_tokens = num_hit_tokens  # the rest will be pulled
        if request.pull is None:
            self.awaiting[request.req_id] = request
        else:
            self.ready_queued.pop(request.req_id, None)
            self.ready.append(request)
        if self.config.enable_prefix_caching:
            self.kv.record_prefix_lookup(request.num_tokens, num_hit_tokens)
        return True

    def _make_way(self) -> bool:
        """The first waiting request cannot be admitted now (no blocks, or no sequence slot): a
        queued request whose source is known moves to the head of the queue; once it is there, the
        newest awaiting reservation goes back behind it, its blocks freed (the module says why).
        True when either was done (the caller tries again)."""
        if not (self.awaiting and self.ready_queued):
            return False
        waiting = self.waiting
        if waiting[0].req_id not in self.ready_queued:
            ready = next(iter(self.ready_queued.values()))
            waiting.remove(ready)
            waiting.appendleft(ready)
            return True
        _, released = self.awaiting.popitem()
        self._unreserve(released)
        waiting.insert(1, released)
        return True

    def _unreserve(self, request: Request) -> None:
        """A reservation still awaiting its KV, given up (the caller queues it again): its
        blocks go back (its prefix hits stay cached; nothing was pulled into the rest)."""
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING

    def _start_pulled(self, plan: StepPlan, stats: StepStats, budget: int, sampling: list[Request]) -> int:
        """The plan starts the pulls of the reserved requests whose source is known
        (`_plan_pulls`), and runs those whose pull landed, in order, within ``budget`` tokens, as
        any request admitted with its prompt computed. Returns the budget left."""
        if self.ready:
            self._plan_pulls(plan)
        landed = self.landed
        while landed and budget > 0:
            request = landed[0]
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new > budget or self.kv.allocate_slots(request, num_new) is None:
                break
            landed.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.pull, request.remote_prefill = None, False
            self._send_whole(request, plan)
            self._grant(request, num_new, 1, plan, stats, sampling)
            budget -= num_new
        return budget

    def _plan_pulls(self, plan: StepPlan) -> None:
        """The plan copies, for each ready request, the prefilled blocks that no prefix hit here
        covers; none of its tokens runs until a result says they landed. A request whose last
        pull still runs, ended (`orphaned`), waits for it."""
        block_size = self.config.block_size
        waiting_for_orphan: deque[Request] = deque()
        for request in self.ready:
            req_id, pull = request.req_id, request.pull
            assert pull is not None
            if req_id in self.orphaned:
                waiting_for_orphan.append(request)
                continue
            num_hit_blocks = request.num_computed_tokens // block_size
            num_blocks = cdiv(pull.num_tokens, block_size)
            dst = self.kv.get_block_ids(req_id)[num_hit_blocks:num_blocks]
            if not dst:  # NOTE: its hits here cover them all
                self._landed(request)
                continue
            src = pull.block_ids[num_hit_blocks:num_blocks]
            plan.kv_pulls.append(KvPull(pull.address, pull.instance_id, src, dst, req_id))
            self.pulling[req_id] = PullInFlight(request, plan.step_id)
        self.ready = waiting_for_orphan

    # -- results -------------------------------------------------------------------------------------

    def _pulls_settled(self, result: StepResult) -> None:
        """The pulls a result says failed or landed: each one's request computes its prompt here,
        or runs next (`_landed`); an ended request's parked blocks go back. What a result of a
        step before the one that carried a pull says is of an earlier pull of that id."""
        step_id = result.step_id
        for landed, req_ids in ((False, result.failed_pull_req_ids), (True, result.landed_pull_req_ids)):
            for req_id in req_ids:
                planned = self.orphaned.get(req_id)
                if planned is not None:
                    if step_id >= planned:
                        del self.orphaned[req_id]
                        self.kv.free_parked(req_id)
                        if req_id not in self.requests:
                            self._to_drop.append(req_id)  # NOTE: the executor names the outcome no more
                    continue
                pulled = self.pulling.get(req_id)
                if pulled is None or step_id < pulled.step_id:
                    continue  # an outcome taken already (results repeat them), or of an earlier pull
                del self.pulling[req_id]
                if landed:
                    self._landed(pulled.request)
                else:
                    self._pull_failed(pulled.request)

    def _landed(self, request: Request) -> None:
        """Its pulled tokens are computed: their blocks join the prefix cache, and it runs from
        the next step."""
        assert request.pull is not None
        request.num_computed_tokens = max(request.num_computed_tokens, request.pull.num_tokens)
        self.kv.cache_computed(request)
        self.landed.append(request)

    def _pull_failed(self, request: Request) -> None:
        """Its blocks past its prefix hits hold part of its KV at most (never registered): they
        go back, and it runs again from the head of the queue, its prompt computed here."""
        self.kv.free(request)
        request.reset_for_recompute()
        self.waiting.appendleft(request)

    def _pulls_failed_with(self, plan: StepPlan) -> None:
        """A failed step's pulls: their requests compute their prompts here, and the blocks of
        those that ended meanwhile go back (a pull the executor had begun writes no block a
        later step names: the executor waits for it first)."""
        for pull in plan.kv_pulls:
            req_id = pull.req_id
            if self.orphaned.get(req_id) == plan.step_id:
                del self.orphaned[req_id]
                self.kv.free_parked(req_id, valid=False)
                continue
            pulled = self.pulling.get(req_id)
            if pulled is not None and pulled.step_id == plan.step_id:
                del self.pulling[req_id]
                self._pull_failed(pulled.request)
