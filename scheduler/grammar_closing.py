"""Closing a constrained output before its token budget runs out.

A weak model may wander inside a grammar forever (a JSON string it never ends, an object that
keeps taking members) and stop at `max_tokens` with text that does not parse. When a sequence's
remaining budget comes near the length of the shortest way it knows to finish its constraint,
the scheduler narrows the sequence's mask to that way: the tokens whose bytes start the closing
text (and EOS once nothing is left to write), so the output ends complete, with finish reason
"stop", before the budget is spent.

`closing_path` finds the closing text on a copy of the matcher, one byte at a time: the bytes
the grammar forces, else the first byte it allows in `CLOSING_ORDER` (a quote ends a string, a
brace or bracket a container, a zero completes a number). It is a pure function of the matcher's
state, so a sequence replayed after preemption or fail-over closes exactly as it would have.
"""

from __future__ import annotations

from dataclasses import dataclass

import llguidance
import numpy as np

__all__ = ["CLOSING_LIMIT", "CLOSING_SLACK", "CLOSING_WINDOW", "ByteVocab", "closing_path", "narrow_to_path"]

# Closing paths are looked for only in a sequence's last CLOSING_WINDOW tokens (it costs a few
# matcher steps per byte), and the mask narrows once the path plus EOS plus CLOSING_SLACK
# tokens (what one token may add to the path) would fill what is left.
CLOSING_WINDOW = 64
CLOSING_SLACK = 8
CLOSING_LIMIT = 512  # bytes: a constraint that does not close by then is left to its budget
CLOSING_ORDER = b'"}]0' + bytes(b for b in range(0x20, 0x7F) if b not in b'"}]0') + b"\n"


@dataclass(frozen=True, slots=True)
class ByteVocab:
    """The bytes of each token, for writing a path of bytes as tokens."""

    by_bytes: dict[bytes, tuple[int, ...]]  # a token's bytes -> the tokens that are exactly them
    byte_tokens: dict[int, int]  # byte value -> a token of that one byte
    max_token_len: int
    eos_token_ids: tuple[int, ...]

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


def closing_path(matcher: llguidance.LLMatcher, vocab: ByteVocab, limit: int = CLOSING_LIMIT) -> bytes | None:
    """The bytes that bring `matcher` (left unchanged) to a state where its output is complete;
    None when none is found within `limit` bytes."""
    probe = matcher.deep_copy()
    path = bytearray()
    while len(path) <= limit:
        if probe.is_accepting() or probe.is_stopped():
            return bytes(path)
        forced = probe.compute_ff_bytes()
        if forced:
            tokens = [vocab.byte_tokens.get(b, -1) for b in forced]
            if -1 in tokens or probe.try_consume_tokens(tokens) != len(tokens):
                return None
            path += forced
            continue
        for byte in CLOSING_ORDER:
            token = vocab.byte_tokens.get(byte)
            if token is not None and probe.try_consume_tokens([token]) == 1:
                path.append(byte)
                break
        else:
            return None
    return None


def narrow_to_path(mask: np.ndarray, path: bytes, vocab: ByteVocab) -> None:
    """Keeps in `mask` ([W] int32 bits, in place) only the tokens whose bytes begin `path`, or
    EOS when `path` is empty; left as it is when the grammar allows none of them."""
    if path:
        ids = [
            i
            for k in range(1, min(len(path), vocab.max_token_len) + 1)
            for i in vocab.by_bytes.get(path[:k], ())
        ]
    else:
        ids = list(vocab.eos_token_ids)
    wanted = np.zeros(mask.shape[0] * 32, dtype=np.uint8)
    wanted[ids] = 1
    narrowed = mask & np.packbits(wanted, bitorder="little").view(np.int32)
    if narrowed.any():
        mask[:] = narrowed
