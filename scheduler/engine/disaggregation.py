"""Prefill/decode disaggregation, decided by the front: which executor prefills a request, and
the hand-off of its KV to the one that decodes it (the protocol, and why the KV moves in one pull
once the prefill is over: docs/architecture.md, "Prefill/decode disaggregation").

A request is placed on a decode (or mixed) lane as any other (`router.choose_lane`). When the
prompt that lane would compute, its cached prefix aside, is longer than
``--max-local-prefill-length``, it waits there for its KV (`Request.remote_prefill`): that lane's
scheduler reserves its blocks and a sequence slot, and schedules nothing for it
(`scheduler.core.kv_handoff`). Its twin (`Request.prefill_twin`) prefills on a prefill lane,
chosen prefix-aware: it samples the first token and ends PREFILLED, its blocks held there
(`Scheduler.held`). The front then tells the decode lane where they are (`Lane.start_decode`),
whose next steps pull them beside the requests it decodes. Once the decode lane reports the
request again (its next token, its end or its evacuation), the prefill lane frees the held
blocks, which stay in its prefix cache.

Failures, decided here:

- A decode lane that goes down: the blocks held for its requests are released at once. A request
  still waiting for its KV keeps its prefill where it runs and waits on another decode lane; one
  already handed off starts over (its prompt mostly cached on the prefill lane by then).
- A prefill lane that goes down: its twins prefill again on another prefill lane or, with none
  left, their decode lanes compute their prompts. A twin that fails there (its steps failed, or
  the lane crashed) ends no client request: its decode lane computes the prompt.
- A pull that fails (its source gone, refusing, too slow) fails that request only: it computes its
  prompt where it decodes (`kv_handoff`).
- With no prefill lane left every request prefills where it decodes; with only prefill lanes left
  they decode too.
- An abort, or an end at the first token, frees both sides (`Lane.release_held`, with no report).

A mixin of `Engine`, which provides what is declared here.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import structlog

from npuserve.proto.step_plan import EXECUTOR_ROLE_PREFILL
from npuserve.scheduler.core.request import Prefilled, PrefilledBlocks, Request, RequestStatus
from npuserve.scheduler.core.router import cached_prefix, choose_lane, uncached_blocks

if TYPE_CHECKING:
    from npuserve.scheduler.engine.engine_config import EngineConfig
    from npuserve.scheduler.lanes.lane import Lane

log = structlog.get_logger(__name__)

__all__ = ["Disaggregation", "RemotePrefill"]


@dataclass(slots=True)
class RemotePrefill:
    """A request that waits on its decode lane for the KV its twin computes on a prefill lane."""

    decode: Lane
    prefill: Lane
    num_blocks: int  # its prompt's blocks, counted as queued on ``prefill``
    num_prefill_blocks: int  # of them, those not cached there when it was placed


class Disaggregation:
    config: EngineConfig
    block_size: int
    _lane_of: dict[str, Lane]
    _sequences: dict[str, Request]
    # req_id -> its prefill on a prefill lane, while its decode lane waits for the KV.
    _remote: dict[str, RemotePrefill]
    # req_id -> the prefill lane that holds the blocks its decode lane pulls (or will pull).
    _held: dict[str, Lane]

    if TYPE_CHECKING:  # provided by `Engine`

        @property
        def routable_lanes(self) -> list[Lane]: ...

        def _started(self, req_id: str) -> None: ...

    def _decode_lanes(self) -> list[Lane]:
        """The lanes that decode: every routable one but the prefill lanes, or, with none of
        those left, the prefill lanes themselves."""
        lanes = self.routable_lanes
        return [lane for lane in lanes if lane.role != EXECUTOR_ROLE_PREFILL] or lanes

    def _choose_lane(self, lanes: list[Lane], request: Request, num_blocks: int) -> Lane:
        """The lane of ``lanes`` for ``request`` (its prompt's ``num_blocks``), by --routing."""
        config = self.config
        return choose_lane(
            lanes, request.block_hashes, num_blocks, config.routing, config.routing_prefill_weight
        )

    def _prefill_lanes(self, excluded: Lane | None = None) -> list[Lane]:
        return [
            lane
            for lane in self.routable_lanes
            if lane.role == EXECUTOR_ROLE_PREFILL and lane is not excluded
        ]

    # -- placement ------------------------------------------------------------------------------

    def _prefill_elsewhere(self, siblings: list[Request], decode: Lane, num_blocks: int) -> bool:
        """Where the prompt of requests placed to decode on ``decode`` is computed. True: on a
        prefill lane, the first waiting on ``decode`` for its KV (`Request.remote_prefill`); a
        prefill that already runs for it (it was placed before, and its decode lane went down)
        goes on. False: on ``decode`` (a prompt short enough once its cache is counted, no
        prefill lane, or ``n > 1``: siblings share one prefill on their lane). Placed again, a
        request's blocks held for an earlier decode lane are released."""
        first = siblings[0]
        for request in siblings:
            request.remote_prefill, request.pull = False, None
            self._release_held(request.req_id)
        remote = self._remote.get(first.req_id)
        if remote is not None:
            if remote.prefill.alive and decode.role != EXECUTOR_ROLE_PREFILL:
                remote.decode = decode
                first.remote_prefill = True
                return True
            self._cancel_prefill(first.req_id)
        if len(siblings) > 1 or decode.role == EXECUTOR_ROLE_PREFILL:
            return False
        lanes = self._prefill_lanes()
        if not lanes:
            return False
        num_uncached = first.num_tokens - cached_prefix(decode, first.block_hashes)[0] * self.block_size
        if num_uncached <= self.config.max_local_prefill_length:
            return False
        self._start_prefill(first, decode, self._choose_lane(lanes, first, num_blocks), num_blocks)
        first.remote_prefill = True
        return True

    def _start_prefill(self, request: Request, decode: Lane, prefill: Lane, num_blocks: int) -> None:
        """The request's twin prefills on ``prefill``, counted as queued there until it is over."""
        num_prefill_blocks = uncached_blocks(prefill, request.block_hashes, num_blocks)
        prefill.queued_requests += 1
        prefill.queued_blocks += num_blocks
        prefill.queued_prefill_blocks += num_prefill_blocks
        self._remote[request.req_id] = RemotePrefill(decode, prefill, num_blocks, num_prefill_blocks)
        prefill.submit([request.prefill_twin()])

    def _prefill_over(self, req_id: str) -> RemotePrefill | None:
        """The request's prefill lane computes its prompt no longer: it no longer counts there."""
        remote = self._remote.pop(req_id, None)
        if remote is not None:
            lane = remote.prefill
            lane.queued_requests -= 1
            lane.queued_blocks -= remote.num_blocks
            lane.queued_prefill_blocks -= remote.num_prefill_blocks
        return remote

    def _cancel_prefill(self, req_id: str) -> RemotePrefill | None:
        remote = self._prefill_over(req_id)
        if remote is not None:
            remote.prefill.release_held([req_id])
        return remote

    # -- the hand-off ---------------------------------------------------------------------------

    def _prefilled(self, prefill_lane: Lane, request: Request, stopped: bool) -> None:
        """A twin sampled its first token on ``prefill_lane``, which holds its blocks (and
        delivered it; ``stopped``: a stop string ended the request there, and both sides are
        freed as it ends): its decode lane pulls them. A prefill no longer waited for (cancelled
        meanwhile) frees them."""
        req_id = request.req_id
        remote = self._remote.get(req_id)
        if remote is None or remote.prefill is not prefill_lane:
            prefill_lane.release_held([req_id])
            return
        if stopped:
            return
        self._prefill_over(req_id)
        sequence = self._sequences[req_id]
        if request is not sequence:  # NOTE: a lane of this process: its twin holds the output
            sequence.take_output(request.output_token_ids, request.output_logprobs)
            sequence.first_token_time = request.first_token_time
            sequence.num_cached_tokens = request.num_cached_tokens
            if sequence.grammar is not None:
                sequence.grammar.sync(sequence.output_token_ids)
        pulled, client = request.pull, prefill_lane.client
        source = None
        if pulled is not None and prefill_lane.alive and client.address:
            source = replace(pulled, address=client.address, instance_id=client.instance_id)
            self._held[req_id] = prefill_lane
        else:  # NOTE: gone with its executor, or out of other executors' reach: computed where it decodes
            prefill_lane.release_held([req_id])
        self._start_decode(remote.decode, sequence, source)
        log.debug(
            "prefilled", request_id=req_id, prefill=prefill_lane.executor_id, decode=remote.decode.executor_id
        )

    @staticmethod
    def _start_decode(decode: Lane, sequence: Request, source: PrefilledBlocks | None) -> None:
        """``decode`` pulls the sequence's KV from ``source``, or computes it (None)."""
        decode.start_decode(
            Prefilled(
                sequence.req_id,
                source,
                list(sequence.output_token_ids),
                list(sequence.output_logprobs),
                sequence.num_cached_tokens,
            )
        )

    def _prefill_again(self, req_id: str, failed: Lane, elsewhere: bool) -> None:
        """A twin's prefill lane lost it (``elsewhere``: the lane went down, and it prefills
        again on another prefill lane if one is left) or failed it: its decode lane computes the
        prompt."""
        remote = self._prefill_over(req_id)
        sequence = self._sequences.get(req_id)
        if remote is None or sequence is None:
            return
        lanes = self._prefill_lanes(failed) if elsewhere else []
        to = remote.decode
        if lanes:
            num_blocks = len(sequence.block_hashes) + 1
            to = self._choose_lane(lanes, sequence, num_blocks)
            self._start_prefill(sequence, remote.decode, to, num_blocks)
        else:
            self._start_decode(remote.decode, sequence, None)
        log.info(
            "prefill moved", request_id=req_id, from_executor=failed.executor_id, to_executor=to.executor_id
        )

    # -- lane events ----------------------------------------------------------------------------

    def _evacuated(self, lane: Lane, requests: list[Request]) -> list[Request]:
        """Requests ``lane`` handed back (its executor went down): the twins it prefilled prefill
        again; the others, returned, move, and the blocks held for their pulls are released now."""
        moved = []
        for request in requests:
            req_id = request.req_id
            if self._lane_of.get(req_id, lane) is not lane:  # NOTE: a twin, not the request placed there
                if request.prefill_only and request.grammar is not None:
                    request.grammar.release()  # a lane of this process's twin
                remote = self._remote.get(req_id)
                if remote is not None and remote.prefill is lane:
                    self._prefill_again(req_id, lane, elsewhere=True)
                continue
            self._started(req_id)
            self._release_held(req_id)
            moved.append(request)
        return moved

    def _twin_ended(self, lane: Lane, request: Request) -> bool:
        """Whether ``request``, which ``lane`` ended, is a twin it prefilled rather than the request
        placed there. A prefill lane ends a twin only when it fails it: its decode lane computes
        the prompt instead."""
        req_id = request.req_id
        if self._lane_of.get(req_id, lane) is lane:
            return False
        if request is self._sequences.get(req_id):  # NOTE: a worker's report ended the front's copy
            request.status, request.error = RequestStatus.WAITING_FOR_REMOTE_KVS, None
        remote = self._remote.get(req_id)
        if remote is not None and remote.prefill is lane:
            log.warning("prefill failed", request_id=req_id, executor=lane.executor_id)
            self._prefill_again(req_id, lane, elsewhere=False)
        return True

    def _prefill_lanes_lost(self, lost: AbstractSet[Lane]) -> None:
        """Lanes lost with their scheduler worker: the twins they prefilled for requests that
        decode elsewhere prefill again."""
        for req_id, remote in list(self._remote.items()):
            if remote.prefill in lost and remote.decode not in lost:
                self._prefill_again(req_id, remote.prefill, elsewhere=True)

    def _release_held(self, req_id: str) -> None:
        """The blocks a prefill lane holds for a request are needed no more (pulled, or never
        to be): they are freed there, and stay in its prefix cache."""
        lane = self._held.pop(req_id, None)
        if lane is not None:
            lane.release_held([req_id])

    def _forget_placement(self, req_id: str) -> None:
        """A request ended: what either side holds for it goes."""
        remote = self._cancel_prefill(req_id)
        if remote is not None:
            remote.decode.release_held([req_id])
        self._release_held(req_id)
