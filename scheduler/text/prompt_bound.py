"""The fewest tokens a text can become, read from its length alone, before tokenizing it.

A prompt that cannot fit the context is refused from its size: tokenizing megabytes takes seconds
and a gigabyte of memory, only to find it too long. The bound must never refuse a prompt that would
fit, so it holds only where the tokenizer's pipeline is known to keep every input character in some
token: each token then covers at most `chars_per_token` characters of the (normalized) text, the
length of the vocabulary's longest token. Normalizers that compose characters (NFC, NFKC) may shrink
the text by `COMPOSE_SHRINK`; normalizers that collapse runs of spaces (sentencepiece's "remove extra
whitespaces") leave the other characters counted (`uncounted`). A pipeline that may drop text
without bound (whitespace-splitting pre-tokenizers, fused unknown tokens, WordPiece's long-word
[UNK]) has no bound: its prompts are tokenized, off the event loop, before their length is checked.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

# NFC/NFKC turn at most 4 characters into one (the longest canonical decomposition, e.g. U+1F8F).
COMPOSE_SHRINK = 4
# A token standing for an unknown character covers one character of up to 4 UTF-8 bytes.
MIN_CHARS_PER_TOKEN = 1
# A regex that can match nothing but spaces (and anchors): `\A +`, ` +\z`, ` {2,}`.
_SPACES_ONLY_REGEX = re.compile(r"^(?:\\A|\\z|\\Z|\^|\$| |\+|\*|\?|\{\d*,?\d*\})+$")
_LENGTH_KEEPING_NORMALIZERS = frozenset({"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"})
_COMPOSING_NORMALIZERS = frozenset({"NFC", "NFKC"})
_LENGTH_KEEPING_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "FixedLength"}
)


@dataclass(frozen=True, slots=True)
class PromptSizeBound:
    """Every token covers at most `chars_per_token` counted characters; `uncounted` characters
    (spaces a normalizer may collapse) are not counted."""

    chars_per_token: int
    uncounted: str = ""

    def min_tokens(self, text: str) -> int:
        """The fewest tokens `text` encodes to (special tokens aside)."""
        counted = len(text) - sum(text.count(c) for c in self.uncounted)
        return math.ceil(counted / self.chars_per_token)

    def max_counted_chars(self, max_tokens: int) -> int:
        """The most counted characters a text of at most `max_tokens` tokens can hold."""
        return max_tokens * self.chars_per_token


class _Unbounded(Exception):
    """The pipeline may drop text without bound."""


def prompt_size_bound(tokenizer_json: dict[str, Any]) -> PromptSizeBound | None:
    """The bound of a `tokenizer.json` pipeline, or None where its tokens may cover any length."""
    try:
        shrink, uncounted = _normalizer_shrink(tokenizer_json.get("normalizer"))
        _check_pre_tokenizer(tokenizer_json.get("pre_tokenizer"))
        model = tokenizer_json.get("model") or {}
        kind, byte_fallback = model.get("type"), bool(model.get("byte_fallback"))
        bounded = byte_fallback or (kind == "BPE" and not model.get("fuse_unk"))
        if kind not in ("BPE", "Unigram") or not bounded:
            raise _Unbounded(f"model {kind} may cover any run of unknown characters with one token")
        added = tokenizer_json.get("added_tokens") or []
        if any(t.get("lstrip") or t.get("rstrip") for t in added):
            raise _Unbounded("an added token absorbs the whitespace around it")
    except _Unbounded:
        return None
    vocab = model.get("vocab") or {}
    pieces = (
        vocab.keys() if isinstance(vocab, dict) else (entry[0] for entry in vocab)
    )  # Unigram: [piece, score]
    longest = max([MIN_CHARS_PER_TOKEN, *map(len, pieces), *(len(t.get("content", "")) for t in added)])
    return PromptSizeBound(chars_per_token=longest * shrink, uncounted=uncounted)


def _normalizer_shrink(normalizer: dict[str, Any] | None) -> tuple[int, str]:
    """(how many characters may become one, characters that may vanish) for a normalizer."""
    if normalizer is None:
        return 1, ""
    kind = normalizer.get("type")
    if kind == "Sequence":
        shrink, uncounted = 1, ""
        for part in normalizer.get("normalizers", []):
            part_shrink, part_uncounted = _normalizer_shrink(part)
            shrink *= part_shrink
            uncounted = "".join(sorted(set(uncounted + part_uncounted)))
        return shrink, uncounted
    if kind in _LENGTH_KEEPING_NORMALIZERS:
        return 1, ""
    if kind in _COMPOSING_NORMALIZERS:
        return COMPOSE_SHRINK, ""
    if kind == "Replace":
        return _replace_shrink(normalizer.get("pattern") or {}, str(normalizer.get("content", "")))
    raise _Unbounded(f"normalizer {kind}")


def _replace_shrink(pattern: dict[str, str], content: str) -> tuple[int, str]:
    if "String" in pattern:
        source = pattern["String"]
        if content:
            return max(1, math.ceil(len(source) / len(content))), ""
        if len(source) == 1:
            return 1, source
    elif "Regex" in pattern and _SPACES_ONLY_REGEX.match(pattern["Regex"]) and not content.strip(" "):
        return 1, " "
    raise _Unbounded(f"replace {pattern} with {content!r}")


def _check_pre_tokenizer(pre_tokenizer: dict[str, Any] | None) -> None:
    if pre_tokenizer is None:
        return
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        for part in pre_tokenizer.get("pretokenizers", []):
            _check_pre_tokenizer(part)
    elif kind == "Split":
        if str(pre_tokenizer.get("behavior", "")).lower() == "removed":
            raise _Unbounded("a Split pre-tokenizer that removes its matches")
    elif kind not in _LENGTH_KEEPING_PRE_TOKENIZERS:
        raise _Unbounded(f"pre-tokenizer {kind}")
