"""Closing a constrained output before its token budget runs out.

A weak model may wander inside a grammar forever (a JSON string it never ends, an array that
keeps taking items) and stop at `max_tokens` with text that does not parse. In a sequence's last
tokens (`ClosingBounds.window`: CLOSING_WINDOW beyond its grammar's shortest output), the
scheduler keeps the output closable within its budget, by the cost of a way it knows to finish
the constraint from where the output is (a `Closing`: the tokens of that path, and EOS where the
grammar may not stop by itself):

- narrowing: once that cost plus CLOSING_SLACK fills the tokens left, the mask narrows to the
  path, one token at a time (and to EOS once nothing is left to write), so the output ends
  complete, with finish reason "stop", before the budget is spent;
- guarding: until then, the mask keeps only the tokens after which a path still fits. A state
  that allows at most CHOICE_LIMIT next bytes is a choice between structures (a comma that opens
  another array item, the letter that picks a tool or an enum member): each byte off the path
  gets its own path (or a cheap check that the path still completes after it), and a byte whose
  path no longer fits is masked out with the tokens that start with it. A state that allows more
  bytes writes free content (a string's characters), taken to leave the path as it is: there only
  the tokens that hold the path's first byte (the closing quote) without following the path are
  masked out. Either way a token that leaves the path and then takes another step of structure
  (`"},{"`) is masked out, so the model takes such steps a token at a time and each is checked.

`Closing.of` finds a path on a copy of the matcher, a step at a time: the tokens the grammar
forces (as its tokenizer writes them: the mask allows no other), else a token of the first byte
it allows in `CLOSING_ORDER` (a quote ends a string, a brace or bracket a container, a comma
moves on to the next required member, a zero completes a number). That greedy path can be long
(`{"":""}` for `{}`, the first enum member rather than the shortest), so before the mask narrows
to it, `Closing.shortened` looks one byte past each choice along it. The path from the start
state so shortened is the grammar's shortest output as the scheduler writes it
(`ClosingBounds.shortest`): a sequence with fewer tokens to write is refused
(`Grammar.new_state`), and one with at least that many always ends complete. All of it is a pure
function of the matcher's state and the tokens left (a search from any point along a path the
mask narrowed to finds the rest of that path), so a sequence replayed after preemption or
fail-over closes exactly as it would have.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import llguidance
import numpy as np

__all__ = [
    "CHOICE_LIMIT",
    "CLOSING_LIMIT",
    "CLOSING_SLACK",
    "CLOSING_WINDOW",
    "START_LIMIT",
    "ByteVocab",
    "Closing",
    "ClosingBounds",
    "close_within",
    "narrow_to",
]

# Closings are looked for in a sequence's last CLOSING_WINDOW tokens beyond its grammar's shortest
# output (a search costs a few matcher steps per byte), and the mask narrows to the path once its
# cost plus CLOSING_SLACK (what free content may still add to it) fills what is left.
CLOSING_WINDOW = 64
CLOSING_SLACK = 16
# A state that allows more next bytes than this writes free content; one with fewer is a choice
# whose every byte is looked past (a JSON string allows ~140, a number ~13, an enum a handful).
CHOICE_LIMIT = 64
# The search from the start state, once per grammar, ends without a path after START_LIMIT bytes
# (a grammar it cannot close, like the regex `a+b` that it would fill with a's: ~25 ms); such a
# constraint is left to its budget. The other searches give up after CLOSING_LIMIT bytes beyond
# the greedy path from the start.
START_LIMIT = 1024
CLOSING_LIMIT = 256
# The tokens of a closing a cheap check may skip after a byte off it (`_still_closes`).
QUICK_SKIPS = 3
CLOSERS = b'"}],:0'
CLOSING_ORDER = (
    CLOSERS + bytes(b for b in range(0x20, 0x7F) if b not in CLOSERS) + b"\n" + bytes(range(0x80, 0x100))
)


@dataclass(frozen=True, slots=True)
class ByteVocab:
    """The bytes of each token, for writing closing paths and masking by bytes."""

    by_bytes: dict[bytes, tuple[int, ...]]  # a token's bytes -> the tokens that are exactly them
    token_bytes: dict[int, bytes]  # a token -> its bytes
    byte_tokens: dict[int, int]  # byte value -> the tokenizer's token of that one byte
    eos_token_ids: tuple[int, ...]
    words: int  # int32 words of a mask over the vocabulary
    # CLOSING_ORDER's bytes that have a one-byte token ([B] uint8), and where the mask holds
    # those tokens' bits: their words ([B] int64) and their bit in the word ([B] uint32)
    order_bytes: np.ndarray = field(compare=False, repr=False)
    order_words: np.ndarray = field(compare=False, repr=False)
    order_bits: np.ndarray = field(compare=False, repr=False)
    # byte value -> [W] bits of the tokens whose bytes hold it (filled as bytes are asked for)
    _holding: dict[int, np.ndarray] = field(default_factory=dict, compare=False, repr=False)

    def text_of(self, tokens: Iterable[int]) -> bytes:
        return b"".join(self.token_bytes.get(token, b"") for token in tokens)

    def same_as(self, token: int) -> tuple[int, ...]:
        """The tokens whose bytes are `token`'s (a vocabulary may hold some bytes twice)."""
        return self.by_bytes.get(self.token_bytes.get(token, b""), (token,))

    def allowed_bytes(self, mask: np.ndarray) -> bytes:
        """The bytes whose one-byte token `mask` ([W] int32 bits) allows, in `CLOSING_ORDER`."""
        return self.order_bytes[(mask.view(np.uint32)[self.order_words] & self.order_bits) != 0].tobytes()

    def bits(self, ids: Iterable[int]) -> np.ndarray:
        """[W] int32 bits of the tokens `ids`."""
        wanted = np.zeros(self.words * 32, dtype=np.uint8)
        wanted[list(ids)] = 1
        return np.packbits(wanted, bitorder="little").view(np.int32)

    def holding(self, byte: int) -> np.ndarray:
        """[W] int32 bits of the tokens whose bytes hold `byte`."""
        bits = self._holding.get(byte)
        if bits is None:
            bits = self.bits(i for data, ids in self.by_bytes.items() if byte in data for i in ids)
            self._holding[byte] = bits
        return bits

    @classmethod
    def of(
        cls, tokenizer: llguidance.LLTokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], words: int
    ) -> ByteVocab:
        token_bytes: dict[int, bytes] = {}
        by_bytes: dict[bytes, list[int]] = {}
        for token_id in range(min(vocab_size, tokenizer.vocab_size)):
            if tokenizer.is_special_token(token_id):
                continue
            data = tokenizer.decode_bytes([token_id])
            if data:
                token_bytes[token_id] = data
                by_bytes.setdefault(data, []).append(token_id)
        byte_tokens = {
            data[0]: _one_token(tokenizer, data, ids) for data, ids in by_bytes.items() if len(data) == 1
        }
        order = bytes(b for b in CLOSING_ORDER if b in byte_tokens)
        order_ids = np.array([byte_tokens[b] for b in order], dtype=np.int64)
        return cls(
            {data: tuple(ids) for data, ids in by_bytes.items()},
            token_bytes,
            byte_tokens,
            eos_token_ids,
            words,
            np.frombuffer(order, dtype=np.uint8),
            order_ids >> 5,
            np.left_shift(1, order_ids & 31).astype(np.uint32),
        )


def _one_token(tokenizer: llguidance.LLTokenizer, data: bytes, ids: list[int]) -> int:
    """The token the tokenizer writes `data` with (the one a grammar forces), where the
    vocabulary holds those bytes more than once."""
    written = tokenizer.tokenize_bytes(data)
    return written[0] if len(written) == 1 and written[0] in ids else ids[0]


@dataclass(frozen=True, slots=True)
class Closing:
    """A way to complete a constrained output from where its matcher is: its tokens, the ones
    the grammar forces as it forces them and each byte it chooses as a token of its own."""

    tokens: list[int]
    text: bytes  # the tokens' bytes
    # EOS may have to follow them: the grammar does not stop by itself there, or was not asked
    ends_open: bool

    @property
    def cost(self) -> int:
        """The tokens a sequence writes to end complete this way."""
        return len(self.tokens) + self.ends_open

    @classmethod
    def of(
        cls,
        matcher: llguidance.LLMatcher,
        vocab: ByteVocab,
        limit: int = CLOSING_LIMIT,
        after: int | None = None,
    ) -> Closing | None:
        """The greedy closing of `matcher` (left unchanged) once the byte `after` is written,
        counting an EOS at its end (whether the grammar stops there is not asked: that is the
        dearest matcher step of a search); None when the grammar refuses `after` or no path is
        found within `limit` bytes."""
        probe = matcher.deep_copy()
        if after is not None and probe.try_consume_tokens([vocab.byte_tokens[after]]) != 1:
            return None
        tokens = _write_to_complete(probe, vocab, limit)
        return None if tokens is None else cls(tokens, vocab.text_of(tokens), True)

    def shortened(self, matcher: llguidance.LLMatcher, vocab: ByteVocab, limit: int) -> Closing:
        """This closing of `matcher` made shorter where, at a choice along it, another byte leads
        to a shorter greedy closing (`{}` rather than `{"":""}`, a short enum member rather than
        the first): one step of look-ahead at each choice, taken along the best so far. Each
        choice weighs only the rest of the path, so the rest from any point along the result is
        what this finds from there."""
        tokens = self.tokens
        probe = matcher.deep_copy()
        scratch = np.zeros(vocab.words, dtype=np.int32)
        at = 0
        while at < len(tokens):
            probe.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
            own = vocab.token_bytes[tokens[at]][0]
            for head in _choices(vocab.allowed_bytes(scratch), own):
                other = Closing.of(probe, vocab, limit, after=head)
                if other is not None and 1 + len(other.tokens) < len(tokens) - at:
                    tokens = [*tokens[:at], vocab.byte_tokens[head], *other.tokens]
            if probe.try_consume_tokens([tokens[at]]) != 1:
                break
            at += 1
        return self if tokens is self.tokens else Closing(tokens, vocab.text_of(tokens), self.ends_open)


@dataclass(frozen=True, slots=True)
class ClosingBounds:
    """What a grammar's sequences need to close within their budgets."""

    shortest: Closing  # the shortest output the scheduler writes, and whether the grammar stops after it
    window: int  # the tokens left from which a sequence keeps its output closable
    limit: int  # the bytes a search for a closing writes before it gives up

    @classmethod
    def of(cls, matcher: llguidance.LLMatcher, vocab: ByteVocab) -> ClosingBounds | None:
        """The bounds of a grammar in its start state `matcher`; None when it has no closing
        within START_LIMIT bytes (its sequences are left to their budgets)."""
        greedy = Closing.of(matcher, vocab, START_LIMIT)
        if greedy is None:
            return None
        best = greedy.shortened(matcher, vocab, START_LIMIT)
        probe = matcher.deep_copy()
        stops = probe.try_consume_tokens(best.tokens) == len(best.tokens) and probe.is_stopped()
        shortest = replace(best, ends_open=not stops)
        return cls(shortest, CLOSING_WINDOW + shortest.cost, CLOSING_LIMIT + len(greedy.text))


def _choices(allowed: bytes, own: int | None) -> list[int]:
    """The bytes other than `own` to look past at a state that allows `allowed` next: none in
    free content (more than CHOICE_LIMIT of them)."""
    return [] if len(allowed) > CHOICE_LIMIT else [b for b in allowed if b != own]


def _write_to_complete(probe: llguidance.LLMatcher, vocab: ByteVocab, limit: int) -> list[int] | None:
    """The tokens that complete `probe`'s output, written into it but for the last step (None:
    none within `limit` bytes). Completion is seen by EOS becoming valid after a step."""
    eos = vocab.eos_token_ids[0]
    if probe.is_stopped() or probe.validate_tokens([eos]) == 1:
        return []
    tokens: list[int] = []
    written = 0
    scratch = np.zeros(vocab.words, dtype=np.int32)
    while written <= limit:
        step = probe.compute_ff_tokens() or _chosen_token(probe, vocab, scratch)
        if not step:
            return None
        tokens += step
        written += len(vocab.text_of(step))
        if probe.validate_tokens([*step, eos]) == len(step) + 1:
            return tokens
        if probe.try_consume_tokens(step) != len(step):
            return None
    return None


def _chosen_token(probe: llguidance.LLMatcher, vocab: ByteVocab, scratch: np.ndarray) -> list[int]:
    """The token of the first byte in `CLOSING_ORDER` that `probe` allows next ([]: none). Where
    the grammar forces no bytes the closers are tried one by one (cheap); the rest, and any byte
    in part of a forced token, is read off the mask."""
    if not probe.compute_ff_bytes():
        for byte in CLOSERS:
            token = vocab.byte_tokens.get(byte)
            if token is not None and probe.validate_tokens([token]) == 1:
                return [token]
    probe.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
    allowed = vocab.allowed_bytes(scratch)
    return [vocab.byte_tokens[allowed[0]]] if allowed else []


def close_within(
    mask: np.ndarray,
    matcher: llguidance.LLMatcher,
    vocab: ByteVocab,
    remaining: int,
    limit: int = CLOSING_LIMIT,
) -> list[int] | None:
    """Keeps a sequence with `remaining` tokens left able to close (see the module's doc):
    narrows `mask` ([W] int32 bits, in place) to the first token of its closing once that fills
    them, else masks out the tokens after which no closing fits. Returns the closing tokens the
    mask was narrowed to (None: not narrowed)."""
    closing = Closing.of(matcher, vocab, limit)
    if closing is None:
        return None
    if closing.cost + CLOSING_SLACK >= remaining:
        closing = closing.shortened(matcher, vocab, limit)
        if closing.cost + CLOSING_SLACK >= remaining:
            return closing.tokens if narrow_to(mask, closing.tokens, vocab) else None
    _keep_closable(mask, matcher, vocab, closing, remaining, limit)
    return None


def _keep_closable(
    mask: np.ndarray,
    matcher: llguidance.LLMatcher,
    vocab: ByteVocab,
    closing: Closing,
    remaining: int,
    limit: int,
) -> None:
    """Masks out (in place) the tokens after which the output could not close in `remaining - 1`
    tokens: at a choice, those that start with a byte whose closing does not fit; in free
    content, those that leave it other than along the path. Tokens that take more than a step
    of the path, or more than the byte of another choice, are masked out too."""
    path = closing.tokens
    kept = list(vocab.same_as(path[0]) if path else vocab.eos_token_ids)
    own = closing.text[0] if closing.text else None
    allowed = vocab.allowed_bytes(mask)
    if len(allowed) > CHOICE_LIMIT:
        if own is None:
            return  # complete already: free content keeps it so
        closable = vocab.bits(kept) | ~vocab.holding(own)
    else:
        for head in _choices(allowed, own):
            still = _still_closes(matcher, vocab, head, closing)
            other = closing if still else Closing.of(matcher, vocab, limit, after=head)
            if other is not None and 1 + other.cost <= remaining:
                kept += vocab.same_as(vocab.byte_tokens[head])
        closable = vocab.bits(kept)
    _narrow_by(mask, closable)


def _still_closes(matcher: llguidance.LLMatcher, vocab: ByteVocab, head: int, closing: Closing) -> bool:
    """Whether `closing`, or its rest past one of its first QUICK_SKIPS tokens, still completes
    the output after the byte `head` (free content, a digit where `""` was the way to close a
    value): checks far cheaper than a search, and a way no longer than `closing`."""
    first, eos = [vocab.byte_tokens[head]], [vocab.eos_token_ids[0]]
    for skipped in range(min(QUICK_SKIPS, len(closing.tokens)) + 1):
        tokens = [*first, *closing.tokens[skipped:], *eos]
        if matcher.validate_tokens(tokens) == len(tokens):
            return True
    return False


def narrow_to(mask: np.ndarray, tokens: list[int], vocab: ByteVocab) -> bool:
    """Keeps in `mask` ([W] int32 bits, in place) only the first of the closing `tokens`, or EOS
    when there are none; False (left as it is) when the grammar allows none of them."""
    return _narrow_by(mask, vocab.bits(tokens[:1] or vocab.eos_token_ids))


def _narrow_by(mask: np.ndarray, bits: np.ndarray) -> bool:
    """`mask` &= `bits` (both [W] int32, in place); False (left as it is) when nothing would be left."""
    narrowed = mask & bits
    if not narrowed.any():
        return False
    mask[:] = narrowed
    return True
