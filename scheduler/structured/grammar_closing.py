"""Closing a constrained output before its token budget runs out.

A weak model may wander inside a grammar forever (a JSON string it never ends, an object that
keeps taking members) and stop at `max_tokens` with text that does not parse. When a sequence's
remaining budget comes near the number of tokens of the shortest way it knows to finish its
constraint, the scheduler narrows the sequence's mask to that way, one token at a time (and to
EOS once nothing is left to write), so the output ends complete, with finish reason "stop",
before the budget is spent. The narrowing starts CLOSING_SLACK tokens early: until then the
model writes freely, and one token may lengthen the way (`,{` in an array of objects with
required properties opens all of them); a token that lengthens it by more than the slack can
still leave an output cut at `max_tokens`.

`closing_path` finds the closing text on a copy of the matcher, one byte at a time: the bytes
the grammar forces, else the first byte it allows in `CLOSING_ORDER` (a quote ends a string, a
brace or bracket a container, a comma moves on to the next required member, a zero completes a
number); `ByteVocab.tokens_of` writes it with
the longest tokens that fit. Both are pure functions of the matcher's state, so a sequence
replayed after preemption or fail-over closes exactly as it would have.
"""

from __future__ import annotations

from dataclasses import dataclass

import llguidance
import numpy as np

__all__ = [
    "CLOSING_LIMIT",
    "CLOSING_SLACK",
    "CLOSING_STEPS",
    "CLOSING_WINDOW",
    "ByteVocab",
    "close_within",
    "closing_path",
]

# Closing paths are looked for only in a sequence's last CLOSING_WINDOW tokens (a search costs
# a few matcher steps per byte), and the mask narrows to the path once its tokens plus EOS plus
# CLOSING_SLACK (what the model's next tokens may add to it) fill what is left.
CLOSING_WINDOW = 64
CLOSING_SLACK = 16
# A search ends without a path after CLOSING_LIMIT bytes or CLOSING_STEPS tries of a byte (a
# grammar it cannot close, like the regex `a+b` that it would fill with a's: ~1 ms at most);
# such a constraint is left to its budget.
CLOSING_LIMIT = 256
CLOSING_STEPS = 400
CLOSING_ORDER = (
    b'"}],:0' + bytes(b for b in range(0x20, 0x7F) if b not in b'"}],:0') + b"\n" + bytes(range(0x80, 0x100))
)


@dataclass(frozen=True, slots=True)
class ByteVocab:
    """The bytes of each token, for writing a path of bytes as tokens."""

    by_bytes: dict[bytes, tuple[int, ...]]  # a token's bytes -> the tokens that are exactly them
    byte_tokens: dict[int, int]  # byte value -> a token of that one byte
    max_token_len: int
    eos_token_ids: tuple[int, ...]

    def tokens_of(self, path: bytes) -> list[int]:
        """`path` written greedily with the longest tokens that fit (every byte has a token)."""
        tokens, i = [], 0
        while i < len(path):
            for k in range(min(len(path) - i, self.max_token_len), 0, -1):
                ids = self.by_bytes.get(path[i : i + k])
                if ids:
                    tokens.append(ids[0])
                    i += k
                    break
            else:
                raise ValueError(f"byte {path[i]} has no token")
        return tokens

    @classmethod
    def of(
        cls, tokenizer: llguidance.LLTokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]
    ) -> ByteVocab:
        by_bytes: dict[bytes, list[int]] = {}
        for token_id in range(min(vocab_size, tokenizer.vocab_size)):
            if tokenizer.is_special_token(token_id):
                continue
            data = tokenizer.decode_bytes([token_id])
            if data:
                by_bytes.setdefault(data, []).append(token_id)
        byte_tokens = {data[0]: ids[0] for data, ids in by_bytes.items() if len(data) == 1}
        return cls(
            {data: tuple(ids) for data, ids in by_bytes.items()},
            byte_tokens,
            max((len(data) for data in by_bytes), default=1),
            eos_token_ids,
        )


def closing_path(
    matcher: llguidance.LLMatcher, vocab: ByteVocab, limit: int = CLOSING_LIMIT, steps: int = CLOSING_STEPS
) -> bytes | None:
    """The bytes that bring `matcher` (left unchanged) to a state where its output is complete;
    None when none is found within `limit` bytes and `steps` tries of a byte."""
    probe = matcher.deep_copy()
    path = bytearray()
    while len(path) <= limit and steps > 0:
        if probe.is_accepting() or probe.is_stopped():
            return bytes(path)
        forced = probe.compute_ff_bytes()
        if forced:
            tokens = [vocab.byte_tokens.get(b, -1) for b in forced]
            if -1 in tokens or probe.try_consume_tokens(tokens) != len(tokens):
                return None
            path += forced
            steps -= 1
            continue
        for byte in CLOSING_ORDER:
            token = vocab.byte_tokens.get(byte)
            if token is None:
                continue
            steps -= 1
            if probe.try_consume_tokens([token]) == 1:
                path.append(byte)
                break
            if steps <= 0:
                return None
        else:
            return None
    return None


def close_within(
    mask: np.ndarray, matcher: llguidance.LLMatcher, vocab: ByteVocab, remaining: int
) -> list[int] | None:
    """Narrows `mask` ([W] int32 bits, in place) for a sequence with `remaining` tokens left to
    the first token of its closing path, when the path (its tokens, EOS and the slack) fills
    them. Returns the closing tokens the mask was narrowed to (None: not narrowed)."""
    if remaining > CLOSING_WINDOW:
        return None
    path = closing_path(matcher, vocab)
    if path is None:
        return None
    tokens = vocab.tokens_of(path)
    if len(tokens) + 1 + CLOSING_SLACK < remaining:
        return None
    return tokens if narrow_to(mask, tokens, vocab) else None


def narrow_to(mask: np.ndarray, tokens: list[int], vocab: ByteVocab) -> bool:
    """Keeps in `mask` ([W] int32 bits, in place) only the first of the closing `tokens`, or EOS
    when there are none; False (left as it is) when the grammar allows none of them."""
    ids = tokens[:1] or list(vocab.eos_token_ids)
    wanted = np.zeros(mask.shape[0] * 32, dtype=np.uint8)
    wanted[ids] = 1
    narrowed = mask & np.packbits(wanted, bitorder="little").view(np.int32)
    if not narrowed.any():
        return False
    mask[:] = narrowed
    return True
