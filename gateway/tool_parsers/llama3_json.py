"""`--tool-call-parser llama3_json`: Llama 3.1/3.2 JSON calls, `{"name": ..., "parameters": {...}}`,
the whole answer (after an optional `<|python_tag|>`), several joined by `;`. An answer that does
not start with a call object is content."""

from __future__ import annotations

from npuserve.gateway.tool_parsers.base import Parsed, ToolParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def __init__(self, streaming: bool = True) -> None:
        super().__init__(streaming)
        self._prefix_done = False

    def _advance(self, out: Parsed, final: bool) -> None:
        if not self._prefix_done:
            if self._skip_whitespace() is None:
                return
            rest = self.buffer[self.pos : self.pos + len(PYTHON_TAG)]
            if rest == PYTHON_TAG:
                self.pos += len(PYTHON_TAG)
            elif PYTHON_TAG.startswith(rest) and not final:
                return
            else:
                self.pos = 0  # content, if it is, keeps its leading whitespace
            self._prefix_done = True
        self._sequence(out, final, separators=";", arrays=False)
