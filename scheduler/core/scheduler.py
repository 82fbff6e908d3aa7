"""Continuous batching for one executor: one token budget per step, no prefill/decode phases.

Every request has ``num_computed_tokens`` chasing ``num_tokens``. Each step grants tokens under
``max_num_batched_tokens`` and ``max_num_seqs``: running requests first (a decode takes one
token, an unfinished prefill takes a chunk), then waiting ones, which may start from a
prefix-cache hit. When no block is left for a running request, the newest running request is
preempted (its blocks freed, recomputed later) and no waiting request is admitted that step.
A request whose prompt another executor computes is this scheduler's from its placement on
(`kv_handoff`).
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from npuserve.proto.step_plan import CachedRequest, NewRequest, StepPlan, StepResult, TokenLogprobs
from npuserve.scheduler.core.kv_cache_manager import KVCacheManager
from npuserve.scheduler.core.kv_handoff import KvHandOff
from npuserve.scheduler.core.request import PrefilledBlocks, Request, RequestStatus
from npuserve.scheduler.core.scheduler_config import SchedulerConfig
from npuserve.scheduler.structured.matchers import advance_masks, step_bitmask

# Times a request runs again after a step of its failed on an executor that still serves.
MAX_STEP_RETRIES = 1


@dataclass(slots=True)
class RequestUpdate:
    """What one step produced for one request."""

    request: Request
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]
    finished: RequestStatus | None = None


@dataclass(slots=True)
class StepStats:
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0
    num_prompt_tokens: int = 0  # of them, tokens of prompts (prefill work)


class Scheduler(KvHandOff):
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVCacheManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching, config.num_host_blocks
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._init_hand_off()  # `kv_handoff`: held blocks, requests reserved for their KV, pulls
        # Requests the executor must drop before the next step (finished, aborted, preempted).
        self._to_drop: list[str] = []
        # NOTE: a random base, so a restarted scheduler never repeats the step id an executor
        # answered last (it would return that cached result as a retry).
        self._step_ids = itertools.count(random.getrandbits(48))
        self.session = random.getrandbits(63) + 1  # names its plans (`StepPlan.session`)
        self.total_preemptions = 0
        # The executor may hold requests of an earlier scheduler (or of this one, before a
        # timeout dropped it): the first plan tells it to start clean.
        self._first_step = True

    # -- requests in and out ---------------------------------------------------------------

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + self.num_reserved

    def has_work(self) -> bool:
        """A step to send: requests to run, finished ones the executor must still drop, or pulls
        to start or that run (`kv_handoff`)."""
        return bool(self.waiting or self.running or self._to_drop) or self._hand_off_work()

    def waits_on_others(self) -> bool:
        """No step to send for them, but not done: blocks held for another executor's pull, or
        requests reserved while another prefills them (a draining executor waits for these too)."""
        return bool(self.held or self.awaiting)

    def add_request(self, request: Request) -> None:
        assert request.req_id not in self.requests, f"duplicate request id {request.req_id!r}"
        self._free_held(request.req_id)  # NOTE: placed here again: its blocks are cached
        self.requests[request.req_id] = request
        self.waiting.append(request)

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Ends requests from outside the step loop (abort, stop string); their blocks go back now."""
        finished = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            self._take_out(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def _take_out(self, request: Request) -> None:
        """Out of the queue it is in, before it ends."""
        status = request.status
        if status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            self._take_out_reserved(request)
        else:
            self.waiting.remove(request)
            self.ready_queued.pop(request.req_id, None)

    def _finish(self, request: Request, status: RequestStatus, valid: bool = True) -> None:
        request.status = status
        req_id = request.req_id
        if request.grammar is not None:
            request.grammar.release()
        if status is RequestStatus.PREFILLED:  # NOTE: the blocks stay for a pull (`kv_handoff`)
            request.pull = PrefilledBlocks("", "", self.kv.get_block_ids(req_id), request.num_computed_tokens)
            self.held[req_id] = request
        elif self._free_blocks(request, valid):  # NOTE: parked; dropped once its pull is over
            del self.requests[req_id]
            return
        del self.requests[req_id]
        self._to_drop.append(req_id)

    # -- one step ----------------------------------------------------------------------------

    def schedule(self, may_poll: bool = True) -> tuple[StepPlan, StepStats]:
        plan = StepPlan(
            step_id=next(self._step_ids),
            finished_req_ids=self._to_drop,
            reset=self._first_step,
            session=self.session,
        )
        self._to_drop = []
        stats = StepStats()
        budget = self.config.max_num_batched_tokens
        sampling: list[Request] = []

        running, kv = RequestStatus.RUNNING, self.kv
        # NOTE: a step that admits requests runs one pass, so their first tokens come after it
        # (vLLM's multi-step does the same with prefills), unless the executor answers them after
        # the first of its passes (`early_first_tokens`): the admitted requests run one pass, the
        # running ones all of theirs. Not while the token budget holds admissions back (a queue
        # of prompts): longer steps would only admit the rest later.
        multi_step = self.config.num_scheduler_steps > 1 and (
            not self._may_admit() or (self.config.early_first_tokens and self._budget_admits_all())
        )
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status is not running:
                continue  # preempted earlier in this loop
            num_pending = request.num_pending_tokens
            if num_pending and not self._may_run_ahead(request):
                continue  # its in-flight step decides what comes next
            num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
            num_new = min(num_tokens + num_pending - request.num_computed_tokens, budget)
            num_steps = self._num_steps(request, request.num_computed_tokens + num_new) if multi_step else 1
            # NOTE: the slots of a multi-step request's later passes are allocated with its first.
            num_slots = num_new + num_steps - 1
            if not kv.fits_held_blocks(request, num_slots):  # NOTE: most decode steps fit
                new_blocks = self._allocate_or_preempt(request, num_slots, plan, stats)
                if new_blocks is None:
                    continue  # the request itself was preempted
                if new_blocks:
                    plan.cached_requests.append(CachedRequest(request.req_id, new_blocks))
            self._grant(request, num_new, num_steps, plan, stats, sampling)
            budget -= num_new

        # NOTE: the requests reserved for their KV hold their blocks already.
        budget = self._start_pulled(plan, stats, budget, sampling)
        # NOTE: after a preemption the pool is short; admitting more would only thrash.
        if not stats.num_preemptions:
            self._admit(plan, stats, budget, sampling)

        plan.bitmask = step_bitmask(sampling)
        if self.worth_sending(plan, may_poll):
            # NOTE: only a plan that is sent; else the copies (of blocks reserved for a pull, say)
            # and the reset go with the next one.
            plan.block_copies = self.kv.pool.take_copies()
            self._first_step = False
        return plan, stats

    def schedule_joining(self, budget: int) -> tuple[StepPlan, StepStats] | None:
        """A step that only admits waiting requests, to join the executor's running multi-pass
        step (`StepPlan.joins_running`): their prompts, whole, within ``budget`` tokens; none that
        is constrained (the joined pass takes no bitmask). None when no request can start now."""
        plan = StepPlan(step_id=0, session=self.session, joins_running=True)
        stats = StepStats()
        self._admit(plan, stats, budget, [], joining=True)
        if not plan.num_scheduled_tokens:
            return None
        plan.step_id = next(self._step_ids)  # NOTE: only now: a step that is not sent takes no id
        plan.block_copies = self.kv.pool.take_copies()
        return plan, stats

    def _admit(
        self, plan: StepPlan, stats: StepStats, budget: int, sampling: list[Request], joining: bool = False
    ) -> None:
        """Starts waiting requests, in order, within ``budget`` tokens and the free sequence
        slots and blocks (a request whose KV is ready elsewhere first: `_make_way`); ``joining``
        (`schedule_joining`): prompts whole only, and none that is constrained."""
        # NOTE: a joining step carries no drops: requests that ended since the last step still
        # hold a sequence slot on the executor until the next one drops them.
        max_num_seqs = self.config.max_num_seqs - (len(self._to_drop) if joining else 0)
        while self.waiting and budget > 0:
            if self._num_admitted >= max_num_seqs:
                if joining or not self._make_way():
                    break
                continue
            request = self.waiting[0]
            if joining and (request.grammar is not None or request.remote_prefill):
                break  # NOTE: a joining step reserves nothing for a pull
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            if request.remote_prefill:  # NOTE: its KV comes from elsewhere (`kv_handoff`)
                if not self._reserve(request, hits, num_hit_tokens) and not self._make_way():
                    break
                continue
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if joining and num_new < request.num_tokens - num_hit_tokens:
                break
            if self.kv.allocate_slots(request, num_new, hits) is None:
                if joining or not self._make_way():
                    break
                continue
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            if self.config.enable_prefix_caching:
                self.kv.record_prefix_lookup(request.num_tokens, num_hit_tokens)
            self._send_whole(request, plan)
            self._grant(request, num_new, 1, plan, stats, sampling)
            budget -= num_new

    def _send_whole(self, request: Request, plan: StepPlan) -> None:
        """The plan sends a request that starts on the executor whole (its computed tokens
        before this step: prefix hits, and pulled ones)."""
        plan.new_requests.append(
            NewRequest(
                req_id=request.req_id,
                token_ids=request.all_token_ids,
                num_prompt_tokens=request.num_prompt_tokens,
                sampling=request.options,
                block_ids=self.kv.get_block_ids(request.req_id),
                num_computed_tokens=request.num_computed_tokens,
            )
        )

    def _may_admit(self) -> bool:
        """Whether the first waiting request may start this step: a sequence slot is free, and
        blocks for its tokens (prefix-cache hits aside, which only need fewer)."""
        if not self.waiting or self._num_admitted >= self.config.max_num_seqs:
            return False
        return self.kv.pool.num_free_blocks * self.config.block_size >= self.waiting[0].num_tokens

    def _budget_admits_all(self) -> bool:
        """Whether this step's token budget covers every waiting request that a sequence slot
        could take (their prompts whole, as if nothing were cached)."""
        budget = self.config.max_num_batched_tokens - len(self.running)
        slots = self.config.max_num_seqs - self._num_admitted
        for request in self.waiting:  # NOTE: stops at the budget or at the free slots
            if slots <= 0:
                return True
            budget -= request.num_tokens
            if budget < 0:
                return False
            slots -= 1
        return True

    @staticmethod
    def _may_run_ahead(request: Request) -> bool:
        """Whether a request whose last step is still in flight may be scheduled again now: not
        when it may sample no further token, nor when its grammar must see that token first."""
        if request.grammar is not None or request.prefill_only:
            return False
        return request.num_output_tokens + request.num_pending_tokens < request.max_output_tokens

    def _num_steps(self, request: Request, num_computed: int) -> int:
        """The passes a request runs in a multi-step plan: where its first pass samples (computes
        up to ``num_computed``, its last known token), up to ``num_scheduler_steps`` within the
        tokens it may still sample; else one, as for a constrained or prefill-only request."""
        num_pending = request.num_pending_tokens
        num_output = len(request.output_token_ids)
        known = len(request.prompt_token_ids) + num_output + num_pending
        if num_computed < known or request.grammar is not None or request.prefill_only:
            return 1
        return max(
            1, min(self.config.num_scheduler_steps, request.max_output_tokens - num_output - num_pending)
        )

    def _grant(
        self,
        request: Request,
        num_new: int,
        num_steps: int,
        plan: StepPlan,
        stats: StepStats,
        sampling: list[Request],
    ) -> None:
        """Puts ``num_new`` tokens of a request in the plan, and ``num_steps - 1`` passes after
        them if it samples (`_num_steps`); the executor will hold them."""
        plan.num_scheduled_tokens[request.req_id] = num_new
        stats.num_scheduled_tokens += num_new
        num_computed = request.num_computed_tokens
        num_prompt = len(request.prompt_token_ids)
        if num_computed < num_prompt:
            stats.num_prompt_tokens += min(num_prompt - num_computed, num_new)
        request.num_computed_tokens = num_computed = num_computed + num_new
        if num_computed >= num_prompt + len(request.output_token_ids) + request.num_pending_tokens:
            # NOTE: this step samples the request's next token (its value comes with the result).
            request.num_pending_tokens += num_steps
            sampling.append(request)
            if num_steps > 1:  # the later passes compute a token each: the one sampled before
                plan.num_steps[request.req_id] = num_steps
                request.num_computed_tokens += num_steps - 1
                stats.num_scheduled_tokens += num_steps - 1

    def _allocate_or_preempt(
        self, request: Request, num_new: int, plan: StepPlan, stats: StepStats
    ) -> list[int] | None:
        """New block ids for a running request, preempting the newest running requests until
        they fit; None if ``request`` itself had to be preempted."""
        while True:
            new_blocks = self.kv.allocate_slots(request, num_new)
            if new_blocks is not None:
                return [b.block_id for b in new_blocks]
            victim = self.running.pop()
            self._preempt(victim, plan)
            stats.num_preemptions += 1
            if victim is request:
                return None

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        # NOTE: victims come from the tail of `running`, which this step has not reached yet
        # (or are the request being scheduled), so none of them is already in the plan.
        assert request.req_id not in plan.num_scheduled_tokens
        self.kv.free(request)
        request.reset_for_recompute()
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.total_preemptions += 1
        self.waiting.appendleft(request)
        plan.finished_req_ids.append(request.req_id)

    def update_from_output(self, plan: StepPlan, result: StepResult) -> list[RequestUpdate]:
        """Appends the sampled tokens and applies the token stop rules (the plan's tokens were
        counted as computed when it was scheduled). A multi-step plan's result names a request
        once per token it sampled: its stop rules run after each, and the tokens its later
        passes sampled after a stop are dropped (a constrained request runs one pass)."""
        updates: list[RequestUpdate] = []
        requests, running = self.requests, RequestStatus.RUNNING
        if result.landed_pull_req_ids or result.failed_pull_req_ids:
            self._pulls_settled(result)
        if plan.num_steps:
            # NOTE: each request's tokens first, then its stop rules over them at once.
            by_request: dict[str, RequestUpdate] = {}
            for req_id, token_id, logprobs in zip(
                result.sampled_req_ids, result.sampled_token_ids, result.logprobs, strict=True
            ):
                update = by_request.get(req_id)
                if update is not None:
                    update.new_token_ids.append(token_id)
                    update.new_logprobs.append(logprobs)
                    continue
                request = requests.get(req_id)
                if request is None or request.status is not running:
                    continue  # aborted (or preempted) while the step ran
                update = by_request[req_id] = RequestUpdate(request, [token_id], [logprobs])
                updates.append(update)
        else:
            for req_id, token_id, logprobs in zip(
                result.sampled_req_ids, result.sampled_token_ids, result.logprobs, strict=True
            ):
                request = requests.get(req_id)
                if request is not None and request.status is running:
                    updates.append(RequestUpdate(request, [token_id], [logprobs]))
        constrained = []
        for update in updates:
            request = update.request
            request.num_pending_tokens -= len(update.new_token_ids)
            if request.grammar is None and plan.num_steps:
                update.finished = request.append_outputs(update.new_token_ids, update.new_logprobs)
                continue
            request.append_output(update.new_token_ids[0], update.new_logprobs[0])
            if request.grammar is not None:
                constrained.append(request.grammar)
        if constrained:  # NOTE: the stop rules read the masks: all of them advance first
            advance_masks(constrained)
        finished = []
        for update in updates:
            if not plan.num_steps or update.request.grammar is not None:
                update.finished = update.request.check_stop()
            if update.finished is None and update.request.prefill_only:
                update.finished = RequestStatus.PREFILLED
            if update.finished is not None:
                finished.append(update)
        if finished:
            self._finish_running(finished)
        return updates

    def _finish_running(self, finished: list[RequestUpdate]) -> None:
        """Ends running requests that a step finished (their stop rules say so)."""
        # NOTE: one pass over `running` for all of them, not a list.remove each.
        ended = {update.request for update in finished}
        self.running[:] = [r for r in self.running if r not in ended]
        for update in finished:
            assert update.finished is not None
            self._finish(update.request, update.finished)

    def fail_step(self, plan: StepPlan) -> tuple[list[Request], list[Request]]:
        """The executor failed this step but still serves (a step stream that broke mid-step, a
        device error): its running requests give back every block (un-registered from the
        prefix cache: their contents were never confirmed) and run again, from their prompt and
        the tokens they have, at the head of the queue; one that has run again
        `MAX_STEP_RETRIES` times already ends with an error instead (a request that fails every
        step it is in cannot fail its neighbours' steps forever). A request whose pull it carried
        computes its prompt here instead (`kv_handoff`). Returns (ended, retried)."""
        failed: list[Request] = []
        retried: list[Request] = []
        # NOTE: the executor may never have seen this plan; its drops go out again (idempotent).
        self._to_drop.extend(plan.finished_req_ids)
        self.kv.pool.undo_copies(plan.block_copies)
        self._pulls_failed_with(plan)
        for req_id in list(plan.num_scheduled_tokens):
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # queued to start over already: preempted since, or an earlier plan's
            self.running.remove(request)
            if request.num_step_retries < MAX_STEP_RETRIES:
                request.num_step_retries += 1
                self.kv.free(request, valid=False)
                request.reset_for_recompute()
                self._to_drop.append(req_id)  # the executor may hold it: it starts over there
                retried.append(request)
                continue
            self._finish(request, RequestStatus.FINISHED_ERROR, valid=False)
            failed.append(request)
        self.waiting.extendleft(reversed(retried))
        return failed, retried

    def evacuate(self) -> list[Request]:
        """Takes every unfinished request out (its executor is gone), reset to be recomputed
        elsewhere from its prompt and the tokens it has generated so far."""
        evacuated = [*self.running, *self.waiting, *self._take_reserved()]
        self.running.clear()
        self.waiting.clear()
        for request in evacuated:
            self.kv.free(request, valid=False)
            del self.requests[request.req_id]
            request.reset_for_recompute()
        for held in self.held.values():
            self.kv.free(held, valid=False)
        self.held.clear()
        self._to_drop = []
        return evacuated

    def check_integrity(self, expect_idle: bool = False) -> None:
        self.kv.check_integrity(expect_idle)
        if expect_idle:
            assert not self.requests, f"requests still tracked: {list(self.requests)[:8]}"
            assert not self.held, f"prefilled blocks still held: {list(self.held)[:8]}"
            self._check_hand_off_idle()
