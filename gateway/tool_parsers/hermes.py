"""`--tool-call-parser hermes`: Hermes and Qwen2.5/Qwen3 calls, each a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, with content
before, between or after them."""

from __future__ import annotations

from enum import Enum, auto

from npuserve.gateway.tool_parsers.base import Parsed, ToolParser

START, END = "<tool_call>", "</tool_call>"


class _At(Enum):
    CONTENT = auto()
    CALL = auto()
    END_TAG = auto()  # after a call's object, before its closing tag


class HermesToolParser(ToolParser):
    name = "hermes"

    def __init__(self, streaming: bool = True) -> None:
        super().__init__(streaming)
        self._at = _At.CONTENT

    def _advance(self, out: Parsed, final: bool) -> None:
        while True:
            if self._at is _At.CONTENT:
                marker_at = self._content_until(out, START, final)
                if marker_at < 0:
                    return
                self._start_call(marker_at)
                self._at = _At.CALL
            if self._at is _At.CALL:
                state = self._step_call(out)
                if state == "open":
                    return
                if state == "invalid":  # the tag starts no call: it is content
                    self._content(out, self._call_from + len(START))
                    self._at = _At.CONTENT
                    continue
                self._at = _At.END_TAG
            if self._at is _At.END_TAG:
                if self._skip_whitespace() is None:
                    return
                rest = self.buffer[self.pos : self.pos + len(END)]
                if rest == END:
                    self.pos += len(END)
                elif END.startswith(rest) and not final:
                    return
                self._at = _At.CONTENT
