"""Prefill/decode disaggregation, decided by the front: which executor prefills a request, and
the hand-off of its KV to the one that decodes it.

A request is placed on a decode (or mixed) lane as any other (`router.choose_lane`). When the
prompt that lane would compute, its cached prefix aside, is longer than
``--max-local-prefill-length``, the request first runs on a prefill lane (chosen prefix-aware
among them) as a prefill-only request: the prefill executor computes it and samples its first
token, and the request ends there as PREFILLED, its blocks held (`Scheduler.held`). The front
then submits it to the decode lane with those blocks to pull (`Request.pull`): the decode lane's
scheduler allocates its blocks and admits it with a `KvPull`, its computed tokens pulled, not
computed. Once the decode lane reports the request again (its next token, its end, or its
evacuation), the prefill lane frees the held blocks, which stay in its prefix cache.

Failures need nothing more: a prefill lane that goes down evacuates its requests (prefill-only
ones are placed again, the held blocks are gone with its pool); a pull that fails fails the
decode step, whose requests compute their tokens there (`Scheduler.fail_step` drops the pull);
with no prefill lane left, every request prefills where it decodes, and with only prefill lanes
left, they decode too. A mixin of `Engine`, which provides what is declared here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import structlog

from npuserve.proto.step_plan import EXECUTOR_ROLE_PREFILL
from npuserve.scheduler.core.request import Request, RequestStatus
from npuserve.scheduler.core.router import cached_prefix, choose_lane

if TYPE_CHECKING:
    from npuserve.scheduler.engine.engine_config import EngineConfig
    from npuserve.scheduler.lanes.lane import Lane

log = structlog.get_logger(__name__)

__all__ = ["Disaggregation"]


class Disaggregation:
    config: EngineConfig
    block_size: int
    _lane_of: dict[str, Lane]
    # req_id -> the prefill lane that holds the blocks a decode lane pulls (or will pull).
    _held: dict[str, Lane]
    # req_id of a prefill-only request -> the decode lane chosen for it when it was placed.
    _decode_lane_of: dict[str, Lane]
    # Prefill-only requests aborted while they prefilled: an abort that reaches the prefill lane
    # after the request left it finds nothing there, so it ends them as they come back.
    _aborted_in_prefill: set[str]

    if TYPE_CHECKING:  # provided by `Engine`

        @property
        def routable_lanes(self) -> list[Lane]: ...

        def _end_outside_step(self, request: Request, status: RequestStatus, error: str | None) -> None: ...

    def _decode_lanes(self) -> list[Lane]:
        """The lanes that decode: every routable one but the prefill lanes, or, with none of
        those left, the prefill lanes themselves."""
        lanes = self.routable_lanes
        return [lane for lane in lanes if lane.role != EXECUTOR_ROLE_PREFILL] or lanes

    def _prefill_lane_for(self, siblings: list[Request], decode: Lane) -> Lane | None:
        """The prefill lane for requests whose decode lane is ``decode``, or None: they prefill
        there (a prompt short enough once ``decode``'s cache is counted, no prefill lane, or
        ``n > 1``: siblings share one prefill on their lane)."""
        first = siblings[0]
        if len(siblings) > 1 or decode.role == EXECUTOR_ROLE_PREFILL:
            return None
        prefill_lanes = [lane for lane in self.routable_lanes if lane.role == EXECUTOR_ROLE_PREFILL]
        if not prefill_lanes:
            return None
        num_uncached = first.num_tokens - cached_prefix(decode, first.block_hashes)[0] * self.block_size
        if num_uncached <= self.config.max_local_prefill_length:
            return None
        config = self.config
        num_blocks = len(first.block_hashes) + 1
        lane = choose_lane(
            prefill_lanes, first.block_hashes, num_blocks, config.routing, config.routing_prefill_weight
        )
        first.prefill_only = True
        self._decode_lane_of[first.req_id] = decode
        return lane

    def _prefilled(self, prefill_lane: Lane, request: Request, stopped: bool) -> None:
        """A prefill-only request sampled its first token on ``prefill_lane``, which holds its
        blocks (and delivered it; ``stopped``: a stop string ended it there): it goes on in the
        decode lane chosen for it, or, stopped or aborted meanwhile, ends and frees them."""
        req_id = request.req_id
        if stopped or req_id in self._aborted_in_prefill:
            prefill_lane.release_held([req_id])
            if not stopped:
                self._end_outside_step(request, RequestStatus.FINISHED_ABORTED, None)
            return
        self._hand_off(prefill_lane, request)

    def _hand_off(self, prefill_lane: Lane, request: Request) -> None:
        """A prefill-only request sampled its first token on ``prefill_lane``, which holds its
        blocks: it goes on in the decode lane chosen for it, which pulls them."""
        req_id = request.req_id
        pulled = request.pull
        assert pulled is not None, "a prefilled request names its blocks"
        decode = self._decode_lane_of.pop(req_id, None)
        if decode is None or not decode.alive or decode.draining:
            decode = choose_lane(
                self._decode_lanes(),
                request.block_hashes,
                len(request.block_hashes) + 1,
                self.config.routing,
                self.config.routing_prefill_weight,
            )
        request.prefill_only = False
        request.reset_for_recompute()
        self._held[req_id] = prefill_lane
        if decode is prefill_lane or not prefill_lane.alive:
            # NOTE: only prefill lanes are left (its blocks are its cache), or the prefill
            # executor is gone: the request computes its tokens where it decodes.
            self._release_held(req_id)
        else:
            client = prefill_lane.client
            request.pull = replace(pulled, address=client.address, instance_id=client.instance_id)
        self._lane_of[req_id] = decode
        decode.submit([request])
        log.debug("prefilled", request_id=req_id, prefill=prefill_lane.executor_id, decode=decode.executor_id)

    def _release_held(self, req_id: str) -> None:
        """The blocks a prefill lane holds for a request are needed no more (pulled, or never
        to be): they are freed there, and stay in its prefix cache."""
        lane = self._held.pop(req_id, None)
        if lane is not None:
            lane.release_held([req_id])

    def _forget_placement(self, req_id: str) -> None:
        """A request ended or moved: nothing is held for it any longer."""
        self._decode_lane_of.pop(req_id, None)
        self._aborted_in_prefill.discard(req_id)
        self._release_held(req_id)
