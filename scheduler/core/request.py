"""A generation request as the scheduler tracks it, and its full sampling parameters."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING

from npuserve.proto.sampling_ranges import Bounds, FieldValueError, check_options
from npuserve.proto.step_plan import SamplingOptions, TokenLogprobs
from npuserve.proto.structured_outputs import StructuredOutputs
from npuserve.scheduler.core.block_hash import BlockHash, extend_block_hashes

if TYPE_CHECKING:
    from npuserve.scheduler.structured.matchers import GrammarState


class InvalidRequestError(FieldValueError):
    """A client error; ``field`` names the offending parameter as the scheduler's API does
    (gRPC INVALID_ARGUMENT with the field in a BadRequest detail, HTTP 400)."""


# The client's names for the SamplingOptions fields that SamplingParams calls otherwise.
_PARAM_OF_OPTION = {"num_logprobs": "logprobs"}


@dataclass(slots=True)
class SamplingParams:
    """Everything a client may ask of one generation; vLLM's names and defaults."""

    n: int = 1
    max_tokens: int | None = None  # None: up to the context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # Constrained decoding (JSON schema, regex, choice, grammar); None: free text.
    structured_outputs: StructuredOutputs | None = None

    MAX_N = 128

    def validate(self, vocab_size: int) -> None:
        """Raises InvalidRequestError naming the first out-of-range field."""
        try:
            Bounds(1, self.MAX_N).check("n", self.n)
            if self.max_tokens is not None:
                Bounds(1).check("max_tokens", self.max_tokens)
            # NOTE: the executor's ranges, checked once here; -1 disables top-k, as 0 does.
            check_options(self.to_options(()), _PARAM_OF_OPTION)
            if self.max_tokens is not None:
                Bounds(0, self.max_tokens).check("min_tokens", self.min_tokens)
            if not all(isinstance(s, str) and s for s in self.stop):
                raise FieldValueError("stop entries must be non-empty strings", field="stop")
            for token_id in self.stop_token_ids:
                Bounds(0, vocab_size - 1).check("stop_token_ids", token_id)
        except FieldValueError as exc:
            raise InvalidRequestError(str(exc), exc.field) from None

    def for_sibling(self, index: int) -> SamplingParams:
        """Sibling ``index`` of an ``n > 1`` request: one sequence, its own seed if seeded."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed, stop=list(self.stop), stop_token_ids=list(self.stop_token_ids))

    def stop_ids(self, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
        """The ids that end a request once min_tokens are out: its stop token ids, and EOS unless
        it ignores EOS."""
        return tuple(self.stop_token_ids) + (() if self.ignore_eos else eos_token_ids)

    def to_options(self, eos_token_ids: tuple[int, ...]) -> SamplingOptions:
        """What the executor needs: sampling knobs, and the tokens min_tokens must hold back."""
        stop_ids = self.stop_ids(eos_token_ids)
        return SamplingOptions(
            temperature=self.temperature,
            top_k=0 if self.top_k == -1 else self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            num_logprobs=self.logprobs,
            min_tokens=self.min_tokens,
            stop_token_ids=stop_ids if self.min_tokens else (),
        )


@dataclass(frozen=True, slots=True)
class StreamRelay:
    """Where an API server process serves a sequence's stream (`--api-server-count`). A scheduler
    worker sends such a sequence's tokens, once its first one in a placement has gone through the
    front, straight to that process through the front, packed (`step_frames.make_report`)."""

    process: int  # the API process's index
    incarnation: int  # its start (a handle means nothing in another one)
    handle: int  # the stream's handle there
    choice: int  # the sequence's index among its request's n
    # Tokens per packed item (`--stream-interval`; 1 when stop strings are looked for, which the
    # API process does at every token): the worker holds fewer until the sequence ends or moves.
    every: int = 1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"
    # A prefill-only request sampled its first token: it leaves its (prefill) executor, whose
    # blocks stay held for a decode executor to pull (`Scheduler.release_held` frees them).
    PREFILLED = "prefilled"
    # On a decode executor: a request whose prompt another executor prefills holds its blocks
    # here, and is not scheduled until it is told where its KV is (`Scheduler.start_decode`).
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")


@dataclass(frozen=True, slots=True)
class PrefilledBlocks:
    """Where a request's KV was computed for it (prefill/decode disaggregation): the blocks a
    prefill executor holds for it, the first ``num_tokens`` tokens of its sequence."""

    address: str  # host:port of the prefill executor, as executors reach it ("" in-process)
    instance_id: str  # its process (`KvPull.instance_id`)
    block_ids: list[int]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Prefilled:
    """A request's prefill elsewhere is over, for the decode executor where it waits
    (`Request.remote_prefill`): its output so far (the first token sampled there included), and
    where its KV is (`pull`; None: nowhere now, so the decode executor computes it)."""

    req_id: str
    pull: PrefilledBlocks | None
    output_token_ids: list[int]
    output_logprobs: list[TokenLogprobs | None]
    num_cached_tokens: int  # the prompt tokens the prefill found in its prefix cache (-1: none ran)


@dataclass(eq=False)
class Request:
    """One sequence: its prompt, its output so far, and how much of it the KV cache holds."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    options: SamplingOptions
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    block_size: int
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    num_computed_tokens: int = 0  # advanced when a step is scheduled (the executor will hold them)
    # Tokens sampled by steps in flight, not known yet (async scheduling: 0 or 1).
    num_pending_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first schedule; -1 until scheduled
    num_preemptions: int = 0
    num_failovers: int = 0  # times its executor was lost and it moved to another
    num_step_retries: int = 0  # times it ran again after a failed step (`Scheduler.fail_step`)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)
    grammar: GrammarState | None = None  # structured outputs: the matcher of this sequence
    error: str | None = None  # why the scheduler ended it with FINISHED_ERROR, when it did
    # Where an API server process serves its stream, set by the front when it makes the request.
    # The worker that runs it keeps what it has sent there (`step_frames.RelayProgress`); the
    # front's copy counts those tokens (`num_direct_tokens`) but does not hold them, and takes
    # them back from the worker or the API process to move it.
    relay: StreamRelay | None = None
    num_direct_tokens: int = 0  # on the front's copy: output tokens that went straight to `relay`
    # Prefill/decode disaggregation, both sides at once. On the decode executor,
    # ``remote_prefill``: its blocks are reserved at once, and it starts once the front says
    # where its KV is (`Scheduler.start_decode`): ``pull`` then admits it with those tokens' KV
    # copied from the prefill executor (`KvPull`), not computed. On the prefill executor, its
    # `prefill_twin`, ``prefill_only``: it runs until it samples a token, then ends as PREFILLED
    # with its blocks held (`Scheduler.held`) until they are pulled.
    remote_prefill: bool = False
    prefill_only: bool = False
    pull: PrefilledBlocks | None = None

    def __post_init__(self) -> None:
        extend_block_hashes(self.block_hashes, self.prompt_token_ids, self.block_size)

    def __getstate__(self) -> dict[str, object]:
        """Pickled for a scheduler worker process without its matcher: the worker builds its own
        from ``params.structured_outputs`` and the output tokens."""
        state = dict(self.__dict__)
        state["grammar"] = None
        return state

    def prefill_twin(self) -> Request:
        """A copy of this request to prefill on another executor (``prefill_only``) while this one
        waits for its KV: the same id, tokens and sampling, and a matcher of its own."""
        twin = Request(
            req_id=self.req_id,
            prompt_token_ids=self.prompt_token_ids,
            params=self.params,
            options=self.options,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            arrival_time=self.arrival_time,
            output_token_ids=list(self.output_token_ids),
            output_logprobs=list(self.output_logprobs),
            block_hashes=list(self.block_hashes),
            relay=self.relay,
            prefill_only=True,
        )
        if self.grammar is not None:
            twin.grammar = self.grammar.grammar.new_state(self.grammar.max_tokens)
            twin.grammar.sync(twin.output_token_ids)
        return twin

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.num_direct_tokens

    @cached_property
    def max_output_tokens(self) -> int:
        # NOTE: cached (read at every sampled token): the prompt, the params and the context
        # length never change once a request exists.
        room = self.max_model_len - self.num_prompt_tokens
        return room if self.params.max_tokens is None else min(room, self.params.max_tokens)

    def append_output(self, token_id: int, logprobs: TokenLogprobs | None) -> None:
        self.output_token_ids.append(token_id)
        self.output_logprobs.append(logprobs)
        if self.grammar is not None:
            self.grammar.accept(token_id)
        if (len(self.prompt_token_ids) + len(self.output_token_ids)) % self.block_size == 0:
            extend_block_hashes(self.block_hashes, self.all_token_ids, self.block_size)

    def append_outputs(
        self, token_ids: list[int], logprobs: list[TokenLogprobs | None]
    ) -> RequestStatus | None:
        """Appends the tokens a multi-step plan's passes sampled, one each, up to the first that
        `check_stop`'s token rules end the request on (a request with a grammar runs one pass and
        is never here); the lists lose the tokens after it. Returns how it finished, or None.
        NOTE: one token at a time, `append_output` then `check_stop` cost less."""
        output = self.output_token_ids
        num_before = len(output)
        finished = None
        at = self._first_stop_candidate(token_ids, num_before)
        if at is not None:
            finished = self._token_stop(token_ids[at], num_before + at + 1)
            del token_ids[at + 1 :], logprobs[at + 1 :]
        output += token_ids
        self.output_logprobs += logprobs
        num_prompt, block_size = len(self.prompt_token_ids), self.block_size
        if (num_prompt + len(output)) // block_size > (num_prompt + num_before) // block_size:
            extend_block_hashes(self.block_hashes, self.all_token_ids, block_size)
        return finished

    def add_reported_output(self, token_ids: list[int], logprobs: list[TokenLogprobs | None]) -> None:
        """Tokens a scheduler worker sampled, onto the front's copy: no matcher to advance (the
        worker's has) nor block hashes (`reset_for_recompute` extends them if it is placed again)."""
        self.output_token_ids += token_ids
        self.output_logprobs += logprobs

    def take_output(self, token_ids: list[int], logprobs: list[TokenLogprobs | None] | None) -> None:
        """The whole output so far, from whoever holds it (the worker that ran the sequence, or
        the API process that streamed it), onto the front's copy before it moves."""
        self.output_token_ids = list(token_ids)
        self.output_logprobs = list(logprobs) if logprobs is not None else [None] * len(token_ids)
        self.num_direct_tokens = 0

    def reset_for_recompute(self) -> None:
        """Back to waiting with nothing computed; the tokens generated so far are kept (and
        hashed, block by block, for where it is placed next)."""
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0
        # NOTE: wherever it is placed next decides again where its prompt is computed; the
        # blocks held for a pull are released by the front.
        self.remote_prefill = False
        self.pull = None
        extend_block_hashes(self.block_hashes, self.all_token_ids, self.block_size)

    def check_stop(self) -> RequestStatus | None:
        """Stop rules that need no text, after an output token: the constraint (complete, or
        broken), then the token's (`_token_stop`)."""
        if self.grammar is not None:
            if self.grammar.error is not None:
                self.error = self.grammar.error
                return RequestStatus.FINISHED_ERROR
            if self.grammar.is_complete:
                return RequestStatus.FINISHED_STOPPED
        return self._token_stop(self.output_token_ids[-1], len(self.output_token_ids))

    @cached_property
    def _stop_ids(self) -> frozenset[int]:
        """`SamplingParams.stop_ids`, as a set (cached as `max_output_tokens`)."""
        return frozenset(self.params.stop_ids(self.eos_token_ids))

    def _first_stop_candidate(self, token_ids: list[int], num_before: int) -> int | None:
        """The index of the first of ``token_ids`` (after ``num_before`` output tokens) that
        `_token_stop` ends the request on, found without a call per token; None if none does."""
        if not token_ids:
            return None
        at_limit = self.max_output_tokens - num_before - 1  # the token that reaches max_tokens
        if at_limit <= 0:
            return 0
        stop_ids = self._stop_ids
        if stop_ids and not stop_ids.isdisjoint(token_ids):
            for i in range(max(0, self.params.min_tokens - num_before - 1), min(len(token_ids), at_limit)):
                if token_ids[i] in stop_ids:
                    return i
        return at_limit if at_limit < len(token_ids) else None

    def _token_stop(self, token_id: int, num_output_tokens: int) -> RequestStatus | None:
        """Whether output token ``token_id``, the ``num_output_tokens``-th, ends the request:
        EOS and stop token ids once there are min_tokens, then max_tokens and the context length."""
        params = self.params
        if num_output_tokens >= params.min_tokens and token_id in self._stop_ids:
            if token_id in params.stop_token_ids:  # NOTE: EOS is no stop reason
                self.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if num_output_tokens >= self.max_output_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
