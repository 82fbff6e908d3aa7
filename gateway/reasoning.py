"""`--reasoning-parser`: a reasoning model's thinking, split from its answer into
`reasoning_content`, whole and as it streams.

`qwen3`: Qwen3 writes `<think>reasoning</think>answer`. An answer that does not begin with
`<think>` is all content (Qwen3 with thinking switched off by its template writes no tags); one
that never closes its `<think>` is all reasoning (it ran out of tokens while thinking). The
whitespace the model puts between `</think>` and its answer is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto

from npuserve.gateway.tool_parsers.base import partial_marker
from npuserve.gateway.tool_parsers.json_scan import WHITESPACE


@dataclass(slots=True)
class Split:
    reasoning: str = ""
    content: str = ""


class _At(Enum):
    START = auto()  # not yet known whether the text opens with the start tag
    REASONING = auto()
    AFTER = auto()  # past the end tag, before the answer's first non-space character
    CONTENT = auto()


class ThinkTagsParser:
    """Reasoning between `start` and `end` tags at the beginning of the answer."""

    start = "<think>"
    end = "</think>"

    def __init__(self) -> None:
        self.buffer = ""
        self._at = _At.START

    def feed(self, text: str, final: bool = False) -> Split:
        self.buffer += text
        out = Split()
        if self._at is _At.START:
            head = self.buffer.lstrip(WHITESPACE)
            if head.startswith(self.start):
                self.buffer, self._at = head[len(self.start) :], _At.REASONING
            elif self.start.startswith(head) and not final:
                return out
            else:
                self._at = _At.CONTENT
        if self._at is _At.REASONING:
            found = self.buffer.find(self.end)
            if found < 0:
                cut = len(self.buffer) - (0 if final else partial_marker(self.buffer, self.end))
                out.reasoning, self.buffer = self.buffer[:cut], self.buffer[cut:]
                return out
            out.reasoning, self.buffer = self.buffer[:found], self.buffer[found + len(self.end) :]
            self._at = _At.AFTER
        if self._at is _At.AFTER:
            self.buffer = self.buffer.lstrip(WHITESPACE)
            if not self.buffer:
                return out
            self._at = _At.CONTENT
        out.content, self.buffer = self.buffer, ""
        return out

    @classmethod
    def parse(cls, text: str) -> Split:
        return cls().feed(text, final=True)


REASONING_PARSERS: dict[str, type[ThinkTagsParser]] = {"qwen3": ThinkTagsParser}
