"""The text a token adds to a stream, for tokenizers whose decoder lets it be known in advance.

`IncrementalDetokenizer` decodes a window of recent ids for every token. For most tokens that is not
needed: with the decoders of sentencepiece models (Llama, Mistral, Gemma: Replace '▁' -> ' ',
ByteFallback, Fuse, Strip, or Metaspace) and of byte-level BPE models (GPT-2, Llama 3, Qwen), a *plain*
token `t` appended to ids whose text is non-empty always adds the same text, its piece:

    decode(ids + [t]) == decode(ids) + piece(t)    whenever decode(ids) != ""

A plain token is one of the model's own vocabulary (not an added or special token), not a byte-fallback
token ('<0xE4>': bytes join their neighbours), whose piece is non-empty and holds no U+FFFD (so its
bytes are whole UTF-8 characters, which never merge with the bytes before them).

With the sentencepiece decoder ('▁' -> ' ', ByteFallback, Fuse, Strip ' ') byte tokens are known
too, after text that does not end in U+FFFD (so its last bytes are whole characters): an ASCII byte
is plain, and any other byte leaves the text ending inside a character or on an invalid byte, which
decodes to a trailing U+FFFD. Its entry is the byte's value: the detokenizer holds it, and the
byte tokens that follow, until they decode: ByteFallback turns a run of byte tokens into its UTF-8
text, or into one U+FFFD per byte when the run is not valid UTF-8.
"""

from __future__ import annotations

import string
from collections.abc import Iterator
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

# (piece: the text the token adds after non-empty text, alone: decode([token]), which never ends
# in U+FFFD)
StreamPiece = tuple[str, str]

REPLACEMENT_CHAR = "\ufffd"


def has_fixed_pieces(decoder: dict[str, Any] | None) -> bool:
    """Whether `decoder` (tokenizer.json's "decoder") gives every plain token a fixed piece.

    Decoders first transform each token on its own, then some join the tokens into one text
    (Fuse, ByteLevel). A per-token step is always safe; on the joined text only steps that cannot
    reach across a token boundary are: Replace of a single character and Strip of the text's
    start (the text before the token is non-empty, so the token is never at the start).
    """
    if decoder is None:
        return False  # the tokens are joined with spaces
    joined = False
    for step in _steps(decoder):
        kind = step.get("type")
        if kind in ("Fuse", "ByteLevel") and not joined:
            joined = True
        elif kind == "Replace":
            if joined and len(_pattern(step) or "") != 1:
                return False
        elif kind == "Strip":
            if joined and step.get("stop") != 0:
                return False
        elif kind not in ("ByteFallback", "Metaspace") or joined:
            # NOTE: ByteFallback joins only byte tokens (never plain); Metaspace treats only the
            # first token differently, and a plain token follows non-empty text.
            return False
    return True


def has_known_bytes(decoder: dict[str, Any] | None) -> bool:
    """Whether byte-fallback tokens have known pieces (see the module's doc): ByteFallback after
    nothing but Replace '▁', straight into Fuse, then at most Strip ' ' of the start."""
    if decoder is None or not has_fixed_pieces(decoder):
        return False
    steps = list(_steps(decoder))
    kinds = [step.get("type") for step in steps]
    if "ByteFallback" not in kinds:
        return False
    at = kinds.index("ByteFallback")
    # NOTE: has_fixed_pieces leaves only Replace of one character and Strip of the start after Fuse.
    return (
        kinds[at + 1 : at + 2] == ["Fuse"]
        and all(step.get("type") == "Replace" and _pattern(step) == "▁" for step in steps[:at])
        and all(step.get("type") == "Strip" and step.get("content") == " " for step in steps[at + 2 :])
    )


def _pattern(step: dict[str, Any]) -> str | None:
    pattern = step.get("pattern") or {}
    return pattern.get("String")


def _steps(decoder: dict[str, Any]) -> Iterator[dict[str, Any]]:
    if decoder.get("type") == "Sequence":
        for step in decoder.get("decoders") or []:
            yield from _steps(step)
    else:
        yield decoder


def is_byte_token(token: str) -> bool:
    """A byte-fallback token such as '<0xE4>'."""
    return len(token) == 6 and token.startswith("<0x") and token.endswith(">")


def byte_value(token: str) -> int | None:
    """The byte of a byte-fallback token, or None."""
    digits = token[3:5]
    if not is_byte_token(token) or any(c not in string.hexdigits for c in digits):
        return None
    return int(digits, 16)


class StreamPieces(dict[int, "StreamPiece | int | None"]):
    """Token id -> its `StreamPiece`, the byte of a non-ASCII byte token (with `known_bytes`), or
    None for a token that must be decoded in context; filled on first use.

    Shared by every request of a process: a lookup is one dict access.
    """

    def __init__(self, backend: BackendTokenizer, anchor: int, known_bytes: bool) -> None:
        super().__init__()
        self._decode = backend.decode
        self._token_of = backend.id_to_token
        self._added_ids = set(backend.get_added_tokens_decoder())
        self._anchor = anchor
        self._anchor_text = backend.decode([anchor])
        self._known_bytes = known_bytes
        # With `known_bytes`: the ids of the ASCII byte tokens ('<0x41>'), whose pieces are plain
        # text but whose bytes join a run of byte tokens around them. Empty otherwise.
        self.ascii_bytes: dict[int, int] = {}
        if known_bytes:
            for value in range(0x80):
                token_id = backend.token_to_id(f"<0x{value:02X}>")
                if token_id is not None and byte_value(backend.id_to_token(token_id) or "") == value:
                    self.ascii_bytes[token_id] = value

    @classmethod
    def of(cls, backend: BackendTokenizer, decoder: dict[str, Any] | None) -> StreamPieces | None:
        """The pieces of a tokenizer whose `decoder` (tokenizer.json's) gives them fixed ones; None
        for any other."""
        if not has_fixed_pieces(decoder):
            return None
        anchor = backend.encode("a", add_special_tokens=False).ids[-1:]
        if not anchor or not backend.decode(anchor):
            return None
        return cls(backend, anchor[0], has_known_bytes(decoder))

    def __missing__(self, token_id: int) -> StreamPiece | int | None:
        piece = self._piece(token_id)
        if piece is not None or self._token_of(token_id) is not None:
            self[token_id] = piece  # ids outside the vocabulary are not kept
        return piece

    def _piece(self, token_id: int) -> StreamPiece | int | None:
        token = self._token_of(token_id)
        if token is None or token_id in self._added_ids:
            return None
        if is_byte_token(token):
            value = byte_value(token) if self._known_bytes else None
            if value is None:
                return None
            if value >= 0x80:
                return value
        piece = self._decode([self._anchor, token_id])[len(self._anchor_text) :]
        alone = self._decode([token_id])
        if not piece or REPLACEMENT_CHAR in piece or alone.endswith(REPLACEMENT_CHAR):
            return None
        return piece, piece if alone == piece else alone  # NOTE: one string kept where they agree
