"""What a scheduler worker process reports to the front, compactly: lane events without the
request objects, the lane's load after them, and its prefix-cache changes.

A worker owns the `Request` objects its lanes schedule; the front keeps its own copy of each
(for streams, metrics and fail-over). Reports therefore name requests by id and carry only what
changed: new tokens, finish statuses, the ids of requests that ended or must move (with their
output, which the worker holds whole). The front applies them to its copies (`apply_report`),
which rebuilds the `LaneEvent` the engine handles for one of its own lanes, so both kinds of lane
drive the same engine code.

Tokens of a sequence that goes on and whose stream an API server process serves (most of them,
with `--api-server-count` above 1) skip all that: the worker packs them per API process, as the
items that process applies, and the front forwards each pack unopened (`LaneReport.relayed`).
The front's copy only counts them; whoever moves the sequence takes its output back first.
What a worker has sent of each sequence is its own record (`RelayProgress`), not the request's.
With `--stream-interval` above 1 (`StreamRelay.every`) the worker packs a sequence's tokens
in groups of that many, and the rest with its end or before it moves: one item, one
detokenization and one message to the client per group.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import TYPE_CHECKING

from npuserve.proto.step_plan import StepTimings, TokenLogprobs
from npuserve.scheduler.core.block_hash import BlockHash
from npuserve.scheduler.core.request import PrefilledBlocks, Request, RequestStatus, StreamRelay
from npuserve.scheduler.core.scheduler import RequestUpdate, StepStats
from npuserve.scheduler.lanes.async_lane import ExecutorLane
from npuserve.scheduler.lanes.lane import LaneEvent

if TYPE_CHECKING:
    from npuserve.scheduler.api.api_messages import PackedUpdate

# (req_id, new token ids, their logprobs, the finish status's value or None, why it failed,
#  the prompt tokens found in the prefix cache at its first schedule, its output tokens in all)
CompactUpdate = tuple[str, list[int], list[TokenLogprobs | None], str | None, str | None, int, int]
# A request that must move: (req_id, its output token ids, their logprobs), as the worker has them.
Evacuated = tuple[str, list[int], list[TokenLogprobs | None]]
# Packed tokens for one API process incarnation: (number of items, the pickled item list).
RelayedPack = tuple[int, bytes]
# A worker lane's record of the sequences it runs whose streams API processes serve
# (`Request.relay`): req_id -> its output tokens sent in this placement. A sequence enters once
# its first token in the placement has gone through the front (every output token before it
# counts as sent) and leaves when it finishes, ends or moves.
RelayProgress = dict[str, int]


@dataclass(slots=True)
class LaneLoad:
    """A lane's state after a report (the front's routing and gauges read it)."""

    num_waiting: int = 0
    num_running: int = 0
    num_used_blocks: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    has_work: bool = False  # a step to send (drops of finished requests, pulls that run included)
    num_scheduler_steps: int = 1  # the passes its steps run now

    def __reduce__(self) -> tuple[type[LaneLoad], tuple[object, ...]]:
        return LaneLoad, _LOAD_FIELDS(self)


@dataclass(slots=True)
class LaneReport:
    lane_key: str  # the front's name for this lane (an executor may rejoin as a new lane)
    updates: list[CompactUpdate] = field(default_factory=list)
    ended: list[tuple[str, str, int]] = field(default_factory=list)  # (req_id, status value, outputs)
    evacuated: list[Evacuated] = field(default_factory=list)
    # Prefill-only requests that ended PREFILLED in it: (req_id, the blocks the lane holds for
    # them, the tokens those hold), for the decode lane that pulls them (`Request.pull`).
    prefilled: list[tuple[str, list[int], int]] = field(default_factory=list)
    # (API process index, incarnation) -> the tokens for its streams (`_pack_unsent`).
    relayed: dict[tuple[int, int], RelayedPack] = field(default_factory=dict)
    num_relayed_tokens: int = 0  # tokens of this step in `relayed`, or held back for it
    num_sequences: int = 0  # sequences that sampled in this step (relayed or not)
    error: str | None = None
    lane_down: bool = False
    stats: tuple[int, int, int] | None = None  # (preemptions, scheduled tokens, prompt tokens)
    step_seconds: float = 0.0
    load: LaneLoad = field(default_factory=LaneLoad)
    # The pool's prefix-cache changes, in order: (`BlockPool.tier_of`, hash).
    kv_events: list[tuple[int, BlockHash]] = field(default_factory=list)
    executor_draining: bool = False  # the executor's step answer said it drains
    failed_step: bool = False  # a step failed while the executor still served
    joined_step: bool = False  # a step that ran inside another's pass landed
    timings: StepTimings | None = None  # what the executor measured of the step

    # NOTE: pickled as the arguments of the constructor, not as a state to set field by field:
    # smaller, and cheaper both ways (a worker pickles one report per step).
    def __reduce__(self) -> tuple[type[LaneReport], tuple[object, ...]]:
        return LaneReport, _REPORT_FIELDS(self)


_LOAD_FIELDS = attrgetter(*(f.name for f in fields(LaneLoad)))
_REPORT_FIELDS = attrgetter(*(f.name for f in fields(LaneReport)))


def make_report(lane_key: str, lane: ExecutorLane, event: LaneEvent, progress: RelayProgress) -> LaneReport:
    """On the worker's loop, right after the event: its compact form and the lane's load
    (``progress``: the lane's, which this advances)."""
    events = lane.scheduler.kv.pool.events
    kv_events = list(events) if events else []
    if events:
        events.clear()
    stats = event.stats
    updates: list[CompactUpdate] = []
    relayed: dict[tuple[int, int], list[PackedUpdate]] = {}
    num_relayed_tokens = 0
    prefilled: list[tuple[str, list[int], int]] = []
    for u in event.updates:  # NOTE: once per token
        request = u.request
        if u.finished is PREFILLED and (pull := request.pull) is not None:
            prefilled.append((request.req_id, pull.block_ids, pull.num_tokens))
        relay = request.relay
        if relay is not None:
            req_id = request.req_id
            num_sent = progress.get(req_id)
            if num_sent is None:  # its first token in this placement goes to the front
                if u.finished is None:
                    progress[req_id] = len(request.output_token_ids)
            elif u.finished is None:
                num_relayed_tokens += len(u.new_token_ids)
                progress[req_id] = _pack_unsent(relayed, request, relay, num_sent, least=relay.every)
                continue
            else:  # what it held goes before its end
                _pack_unsent(relayed, request, relay, num_sent, keep=len(u.new_token_ids))
                del progress[req_id]
        updates.append(
            (
                request.req_id,
                u.new_token_ids,
                u.new_logprobs,
                None if u.finished is None else u.finished.value,
                None if u.finished is None else request.error,
                request.num_cached_tokens,
                len(request.output_token_ids),
            )
        )
    for request in (*event.ended, *event.evacuated):
        num_sent = progress.pop(request.req_id, None)
        if num_sent is not None and request.relay is not None:  # held: before it ends or moves
            _pack_unsent(relayed, request, request.relay, num_sent)
    queries, hits = lane.prefix_stats
    return LaneReport(
        lane_key=lane_key,
        updates=updates,
        ended=[(r.req_id, r.status.value, len(r.output_token_ids)) for r in event.ended],
        evacuated=[evacuated(r) for r in event.evacuated],
        prefilled=prefilled,
        relayed={key: (len(items), pickle.dumps(items, protocol=5)) for key, items in relayed.items()},
        num_relayed_tokens=num_relayed_tokens,
        num_sequences=len(event.updates),
        error=event.error,
        lane_down=event.lane_down,
        stats=None
        if stats is None
        else (stats.num_preemptions, stats.num_scheduled_tokens, stats.num_prompt_tokens),
        step_seconds=event.step_seconds,
        load=LaneLoad(
            lane.num_waiting,
            lane.num_running,
            lane.num_used_blocks,
            lane.kv_usage,
            queries,
            hits,
            lane.has_work,
            lane.num_scheduler_steps,
        ),
        kv_events=kv_events,
        executor_draining=event.executor_draining,
        failed_step=event.failed_step,
        joined_step=event.joined_step,
        timings=event.timings,
    )


RUNNING = RequestStatus.RUNNING
PREFILLED = RequestStatus.PREFILLED


def _pack_unsent(
    relayed: dict[tuple[int, int], list[PackedUpdate]],
    request: Request,
    relay: StreamRelay,
    start: int,
    keep: int = 0,
    least: int = 1,
) -> int:
    """Packs the output tokens of ``request`` from ``start`` (the first not sent in this
    placement) but its last ``keep``, if there are at least ``least`` (a worker holds fewer than
    `StreamRelay.every`), as the item its API process applies (`api_messages.PackedUpdate`: the
    stream's handle, then `outputs.SequenceUpdate`'s fields for tokens that end nothing). Returns
    the tokens sent from then on."""
    output = request.output_token_ids
    end = len(output) - keep
    if end - start < least:
        return start
    item: PackedUpdate = (
        relay.handle,
        relay.choice,
        output[start:end],
        request.output_logprobs[start:end],
        None,
        None,
        None,
        len(output),
        request.num_cached_tokens,
    )
    key = (relay.process, relay.incarnation)
    items = relayed.get(key)
    if items is None:
        relayed[key] = [item]
    else:
        items.append(item)
    return end


def evacuated(request: Request) -> Evacuated:
    return request.req_id, request.output_token_ids, request.output_logprobs


def carries_reports(message: Sequence[object]) -> bool:
    """Whether a worker's message holds lane reports: the worker counts those messages as
    unacknowledged until the front, having handled one, acknowledges it."""
    return any(isinstance(item, LaneReport) for item in message)


def apply_report(report: LaneReport, request_of: Callable[[str], Request | None]) -> LaneEvent:
    """On the front's event loop: applies a report to the front's copies of the requests and
    returns the event it stands for. Requests the front no longer tracks are skipped."""
    event = LaneEvent(
        error=report.error,
        lane_down=report.lane_down,
        step_seconds=report.step_seconds,
        executor_draining=report.executor_draining,
        failed_step=report.failed_step,
        joined_step=report.joined_step,
        timings=report.timings,
    )
    updates = event.updates
    for req_id, token_ids, logprobs, finished, error, num_cached, num_output in report.updates:
        request = request_of(req_id)
        if request is None:
            continue
        if request.num_cached_tokens < 0:  # the usage reports the first schedule's hit
            request.num_cached_tokens = num_cached
        request.add_reported_output(token_ids, logprobs)
        request.num_direct_tokens = num_output - len(request.output_token_ids)  # sent straight to `relay`
        if finished is None:  # NOTE: once per token: the common case sets nothing it need not
            if request.status is not RUNNING:
                request.status = RUNNING
            updates.append(RequestUpdate(request, token_ids, logprobs, None))
            continue
        status = RequestStatus(finished)
        request.status = status
        request.error = error or request.error
        updates.append(RequestUpdate(request, token_ids, logprobs, status))
    for req_id, block_ids, num_tokens in report.prefilled:
        request = request_of(req_id)
        if request is not None:
            request.pull = PrefilledBlocks("", "", block_ids, num_tokens)
    for req_id, status_value, num_output in report.ended:
        request = request_of(req_id)
        if request is not None:
            # NOTE: a worker may hold fewer: a request that waited there for its KV, ended before
            # the token sampled where it prefilled reached it.
            request.num_direct_tokens = max(0, num_output - len(request.output_token_ids))
            request.status = RequestStatus(status_value)
            event.ended.append(request)
    for req_id, output_token_ids, output_logprobs in report.evacuated:
        request = request_of(req_id)
        if request is not None:
            # NOTE: one that waited there for its KV may have left before the token sampled where
            # it prefilled reached it: the front's copy holds that one.
            if len(output_token_ids) >= request.num_output_tokens:
                request.take_output(output_token_ids, output_logprobs)
            request.reset_for_recompute()
            event.evacuated.append(request)
    if report.stats is not None:
        preemptions, scheduled, prompt = report.stats
        event.stats = StepStats(preemptions, scheduled, prompt)
    return event
