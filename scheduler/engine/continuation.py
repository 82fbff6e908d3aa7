"""A resumed generation: the output each of its choices already has (`GenerateRequest.continuations`).

A client whose call was cut off (its scheduler restarted) sends the request again with each
choice's output token ids so far. Each choice then goes on as a sequence that moved to another
executor does: a `Request` that already has output tokens, recomputed from its prompt and them,
samples what it would have sampled (greedy, or seeded: the executor's draw depends only on the
seed and the token's position). Its stream reads them first: they count in the usage, the
detokenizer holds what the earlier call held back, and stop strings see their text, so the
next text delta is the one the earlier call would have sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from npuserve.scheduler.core.request import InvalidRequestError, Request, SamplingParams
from npuserve.scheduler.engine.outputs import RequestStream
from npuserve.scheduler.text.prompts import ModelLimits

FIELD = "continuations"  # the request field a refusal names


@dataclass(frozen=True, slots=True)
class Continuation:
    """The output token ids of each choice (index order) of a resumed generation."""

    token_ids: tuple[list[int], ...]

    def check(self, params: SamplingParams, num_prompt_tokens: int, limits: ModelLimits) -> None:
        """Raises InvalidRequestError (naming `continuations`) unless there is one entry per
        choice, of vocabulary ids, each leaving its choice room for more tokens."""
        if len(self.token_ids) != params.n:
            raise InvalidRequestError(
                f"{FIELD} has {len(self.token_ids)} entries for {params.n} choices: give one per choice",
                FIELD,
            )
        room = limits.max_model_len - num_prompt_tokens
        max_output = room if params.max_tokens is None else min(room, params.max_tokens)
        for index, ids in enumerate(self.token_ids):
            if ids and (min(ids) < 0 or max(ids) >= limits.vocab_size):
                raise InvalidRequestError(f"{FIELD} token ids must be in [0, {limits.vocab_size})", FIELD)
            if len(ids) >= max_output:
                raise InvalidRequestError(
                    f"{FIELD}[{index}] has {len(ids)} tokens, and that choice may have "
                    f"{max_output}: it is complete",
                    FIELD,
                )

    def prime(self, stream: RequestStream) -> None:
        """Starts each sequence of ``stream`` after its choice's tokens: counted, and read by its
        detokenizer (the text they make was the earlier call's to send, and is not sent again)."""
        for index, (state, ids) in enumerate(zip(stream.sequences, self.token_ids, strict=True)):
            if state.detokenizer.update(ids).stop_str is not None:
                raise InvalidRequestError(f"{FIELD}[{index}] ends at a stop string: it is complete", FIELD)
            state.token_ids = list(ids)
            state.num_output_tokens = len(ids)
        stream.resumed_tokens = sum(len(ids) for ids in self.token_ids)

    def resume(self, requests: Sequence[Request]) -> None:
        """Gives each sequence of a request, before it is placed, its choice's tokens, as a
        sequence that moved to another executor has them."""
        for request, ids in zip(requests, self.token_ids, strict=True):
            if not ids:
                continue
            request.take_output(ids, None)
            request.reset_for_recompute()
            if request.grammar is not None:
                request.grammar.sync(request.output_token_ids)


def resume_stream(
    stream: RequestStream,
    continuation: Continuation | None,
    params: SamplingParams,
    limits: ModelLimits,
) -> None:
    """Checks a resumed generation's ``continuation`` and primes its ``stream`` with it
    (nothing for a new generation); raises what refuses it, before anything is queued."""
    if continuation is not None:
        continuation.check(params, len(stream.prompt_token_ids), limits)
        continuation.prime(stream)
