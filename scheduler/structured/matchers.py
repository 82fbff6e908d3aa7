"""Structured outputs in the scheduler: one matcher per request, its masks, and the step's bitmask.

The grammar engine is llguidance (vLLM's `guidance` backend), through its numpy API: no torch.
Grammars are compiled by `grammar_compiler`.

- `Grammar` is a compiled constraint; `GrammarState` is one sequence's matcher. It accepts each
  sampled token as the scheduler appends it, and keeps the bitmask of the tokens that may come
  next (computed after each accepted token, for a whole step's requests at once on llguidance's
  thread pool). The state always matches the request's output tokens: preemption and fail-over
  keep those tokens, and `sync` replays or rolls back to any other list of them.
- `step_bitmask` packs the bitmasks of a step's constrained, sampling requests for the plan.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par

from npuserve.proto.step_plan import TokenBitmask, bitmask_words
from npuserve.proto.structured_outputs import StructuredOutputs
from npuserve.scheduler.core.request import InvalidRequestError, Request
from npuserve.scheduler.structured.grammar_closing import ByteVocab, ClosingBounds, close_within, narrow_to

__all__ = ["Grammar", "GrammarState", "LiveCount", "advance_masks", "step_bitmask"]

# Masks are computed on llguidance's thread pool (Rust threads, no GIL) only for a batch of at
# least _PARALLEL_ROWS rows whose masks would take over _PARALLEL_ABOVE_S one after another: the
# hand-off to the pool costs ~0.1 ms on idle cores and milliseconds on busy ones (an executor's
# threads beside it), while a row's mask often takes ~10 us (measured in deploy/bench/structured).
_PARALLEL_ROWS = 4
_PARALLEL_ABOVE_S = 0.002
_REMEASURE_EVERY = 64  # calls: one in so many runs row by row, to keep the estimate fresh


@dataclass(frozen=True, slots=True)
class Grammar:
    """A compiled constraint: a matcher in its start state, copied for each sequence."""

    constraint: StructuredOutputs
    template: llguidance.LLMatcher
    vocab_size: int
    live: LiveCount
    vocab: ByteVocab
    closing: ClosingBounds | None  # None: its sequences are left to their budgets

    def new_state(self, max_tokens: int | None = None) -> GrammarState:
        """A matcher for one sequence that may write `max_tokens` tokens (None: no closing
        before a budget; see `grammar_closing`). InvalidRequestError naming max_tokens when
        they are fewer than the shortest output the scheduler writes of the constraint."""
        shortest = None if self.closing is None else self.closing.shortest.cost
        if max_tokens is not None and shortest is not None and max_tokens < shortest:
            raise InvalidRequestError(
                f"max_tokens {max_tokens} is less than the {shortest} tokens of the shortest output "
                f"its {self.constraint.kind} constraint allows (for a required or named tool_choice, "
                f"the shortest call); raise it to at least {shortest}",
                "max_tokens",
            )
        return GrammarState(self, max_tokens)


class LiveCount:
    """Matchers alive (not released), for the integrity check: every finished request frees its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def add(self, delta: int) -> None:
        with self._lock:
            self.value += delta


class GrammarState:
    """One sequence's matcher and the bitmask of the tokens it may sample next."""

    def __init__(self, grammar: Grammar, max_tokens: int | None = None) -> None:
        self.grammar = grammar
        self.matcher: llguidance.LLMatcher | None = grammar.template.deep_copy()
        self.max_tokens = max_tokens
        self.num_accepted = 0
        # The closing tokens the mask is narrowed to, while the sequence follows them.
        self.closing: list[int] | None = None
        self.mask = np.zeros((1, bitmask_words(grammar.vocab_size)), dtype=np.int32)  # [1, W]
        self.error: str | None = None
        grammar.live.add(1)
        _fill_masks([self])

    def release(self) -> None:
        """Drops the matcher (idempotent): the request has finished."""
        if self.matcher is not None:
            self.matcher = None
            self.grammar.live.add(-1)

    def accept(self, token_id: int) -> None:
        """Advances past a sampled token; a token the grammar refuses leaves `error` set.
        The next mask is computed by `advance_masks`, for the whole step at once."""
        assert self.matcher is not None, "a released grammar state was advanced"
        self.num_accepted += 1
        self.closing = self.closing[1:] if self.closing and self.closing[0] == token_id else None
        if self.error is None and not self.matcher.consume_token(token_id):
            self.error = (
                f"structured_outputs: the sampled token {token_id} breaks the constraint "
                f"({self.matcher.get_error()})"
            )

    @property
    def is_complete(self) -> bool:
        """The output matches the whole constraint and nothing may follow."""
        return self.matcher is not None and self.matcher.is_stopped()

    def sync(self, output_token_ids: list[int]) -> None:
        """Brings the matcher to exactly `output_token_ids` (a continuation that lost or replaced
        tokens): rolls back what it accepted beyond them, or replays the ones it lacks."""
        assert self.matcher is not None
        if self.num_accepted > len(output_token_ids):
            self.matcher.rollback(self.num_accepted - len(output_token_ids))
            self.num_accepted = len(output_token_ids)
            self.closing = None
        for token_id in output_token_ids[self.num_accepted :]:
            self.accept(token_id)
        _fill_masks([self])


def advance_masks(states: Iterable[GrammarState]) -> None:
    """Computes the next-token masks of states that just accepted a token; a state no token can
    continue (no bit set, not even EOS) gets `error`."""
    _fill_masks([s for s in states if s.matcher is not None and s.error is None])


_EXECUTOR: llguidance.LLExecutor | None = None


class _MaskCost:
    """What one row's mask costs computed alone (a running average, seconds), per process."""

    per_row_s = 0.0
    calls = 0

    @classmethod
    def parallel(cls, rows: int) -> bool:
        cls.calls += 1
        if rows < _PARALLEL_ROWS or cls.calls % _REMEASURE_EVERY == 0:
            return False
        return rows * cls.per_row_s > _PARALLEL_ABOVE_S

    @classmethod
    def measured(cls, rows: int, seconds: float) -> None:
        cls.per_row_s = 0.8 * cls.per_row_s + 0.2 * seconds / rows if cls.per_row_s else seconds / rows


def _fill_masks(states: list[GrammarState]) -> None:
    global _EXECUTOR
    if not states:
        return
    if _MaskCost.parallel(len(states)):
        if _EXECUTOR is None:
            _EXECUTOR = llguidance.LLExecutor()
        masks = np.zeros((len(states), states[0].mask.shape[1]), dtype=np.int32)  # [R, W]
        matchers = [(s.matcher, i) for i, s in enumerate(states) if s.matcher is not None]
        fill_next_token_bitmask_par(_EXECUTOR, matchers, masks)
        for i, state in enumerate(states):
            state.mask[0] = masks[i]
    else:
        start = time.perf_counter()
        for state in states:
            assert state.matcher is not None
            view = state.mask[0]
            state.matcher.unsafe_compute_mask_ptr(view.ctypes.data, view.nbytes)
        _MaskCost.measured(len(states), time.perf_counter() - start)
    for state in states:
        assert state.matcher is not None
        if not state.mask.any():
            why = state.matcher.get_error() if state.matcher.is_error() else "no token can continue it"
            state.error = f"structured_outputs: the output cannot continue ({why})"
        elif state.max_tokens is not None and (bounds := state.grammar.closing) is not None:
            # Keeps the output closable as the budget runs out: masks out what would not fit, then
            # narrows the mask to the constraint's closing path (see `grammar_closing`); a sequence
            # that follows the path keeps it without a new search (one from where it is now would
            # find the same rest).
            remaining, vocab = state.max_tokens - state.num_accepted, state.grammar.vocab
            if remaining > bounds.window:
                continue
            if state.closing is None or not narrow_to(state.mask[0], state.closing, vocab):
                state.closing = close_within(state.mask[0], state.matcher, vocab, remaining, bounds.limit)


def step_bitmask(sampling: list[Request]) -> TokenBitmask | None:
    """The plan's bitmask: one row per constrained request among those that sample this step,
    in batch order; None when there is none."""
    rows = []
    for request in sampling:
        state = request.grammar
        if state is None:
            continue
        if state.num_accepted != request.num_output_tokens:
            state.sync(request.output_token_ids)
        rows.append((request.req_id, state.mask))
    if not rows:
        return None
    words = np.concatenate([mask for _, mask in rows])  # [R, W] int32
    return TokenBitmask([req_id for req_id, _ in rows], words.astype("<i4", copy=False).tobytes())
