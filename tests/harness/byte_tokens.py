"""The demo tokenizer's byte-fallback tokens: '<0x00>'..'<0xFF>' are ids 3..258 of stories260K."""

from __future__ import annotations

BYTE_ID_OFFSET = 3  # '<0x00>' is id 3 in stories260K


def byte_ids(char: str) -> list[int]:
    """The byte tokens that spell ``char`` in UTF-8."""
    return [BYTE_ID_OFFSET + b for b in char.encode("utf-8")]
