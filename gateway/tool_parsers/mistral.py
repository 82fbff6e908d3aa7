"""`--tool-call-parser mistral`: Mistral's `[TOOL_CALLS]` followed by a JSON array of
`{"name": ..., "arguments": {...}}` objects (content may come before the marker).
`[TOOL_CALLS]` is a special token, so requests parsed this way keep special tokens in their text."""

from __future__ import annotations

from npuserve.gateway.tool_parsers.base import Parsed, ToolParser

MARKER = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True

    def __init__(self, streaming: bool = True) -> None:
        super().__init__(streaming)
        self._marked = False

    def _advance(self, out: Parsed, final: bool) -> None:
        if not self._marked:
            if not self._content_until(out, MARKER, final):
                return
            self._marked = True
        self._sequence(out, final, separators=",")
