"""`--tool-call-parser mistral`: Mistral's `[TOOL_CALLS]` followed by a JSON array of
`{"name": ..., "arguments": {...}}` objects, or (tokenizers v11 and later) by `name[ARGS]{...}`,
one such marker per call; content may come before the first marker. `[TOOL_CALLS]` and `[ARGS]`
are special tokens, so requests parsed this way keep special tokens in their text."""

from __future__ import annotations

import json
from enum import Enum, auto

from npuserve.gateway.tool_parsers.base import Parsed, ToolCallDelta, ToolParser, tool_call_id
from npuserve.gateway.tool_parsers.json_scan import ObjectScanner

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"


class _At(Enum):
    CONTENT = auto()  # before the first marker
    MARKED = auto()  # after a marker: a JSON array or object, or a name and [ARGS]
    JSON = auto()  # the JSON form
    NAME = auto()
    ARGUMENTS = auto()
    NEXT = auto()  # after a named call: another marker, else content


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True

    def __init__(self, streaming: bool = True) -> None:
        super().__init__(streaming)
        self._at = _At.CONTENT
        self._arguments: ObjectScanner | None = None
        self._id, self._name, self._sent_to = "", "", 0
        self._args_from = 0  # where the search for the name's [ARGS] goes on (no rescans)

    def _advance(self, out: Parsed, final: bool) -> None:
        while True:
            if self._at in (_At.CONTENT, _At.NEXT):
                self._call_from = self._content_until(out, MARKER, final)
                if self._call_from < 0:
                    return
                self._at = _At.MARKED
            if self._at is _At.MARKED:
                c = self._skip_whitespace()
                if c is None:
                    return
                self._at = _At.JSON if c in "[{" else _At.NAME
            if self._at is _At.JSON:
                self._sequence(out, final, separators=",")
                return
            if self._at is _At.NAME and not self._named(out, final):
                return
            if self._at is _At.ARGUMENTS and not self._named_arguments(out):
                return

    def _named(self, out: Parsed, final: bool) -> bool:
        """`name[ARGS]`: True once read (its header sent when streaming)."""
        found = self.buffer.find(ARGS, max(self.pos, self._args_from))
        if found < 0:
            # NOTE: the next delta's search starts where this one's could still have matched.
            self._args_from = max(self.pos, len(self.buffer) - len(ARGS) + 1)
            if final:
                self._not_a_call(out)
            return final
        self._name = self.buffer[self.pos : found].strip()
        self.pos = found + len(ARGS)
        self._id, self._arguments = tool_call_id(), ObjectScanner(self.pos)
        if self.streaming:
            out.calls.append(ToolCallDelta(self.num_calls, "", self._id, self._name))
        self._sent_to, self._at = self.pos, _At.ARGUMENTS
        return True

    def _named_arguments(self, out: Parsed) -> bool:
        """The arguments object after `[ARGS]`: True once it closed (or turned out invalid)."""
        scanner = self._arguments
        assert scanner is not None
        scanner.scan(self.buffer)
        if scanner.invalid:
            if self.streaming:  # announced: the call ends here
                self._ended(scanner.pos - 1)
            else:
                self._not_a_call(out)
            return True
        upto = len(self.buffer) if scanner.end is None else scanner.end
        if self.streaming and scanner.started and upto > self._sent_to:
            start = max(self._sent_to, self.buffer.index("{", scanner.begin))
            out.calls.append(ToolCallDelta(self.num_calls, self.buffer[start:upto]))
            self._sent_to = upto
        if scanner.end is None:
            return False
        if not self.streaming:
            arguments = self.buffer[self.buffer.index("{", scanner.begin) : scanner.end]
            try:
                json.loads(arguments)
            except (ValueError, RecursionError):
                self._not_a_call(out)
                return True
            out.calls.append(ToolCallDelta(self.num_calls, arguments, self._id, self._name))
        self._ended(scanner.end)
        return True

    def _ended(self, pos: int) -> None:
        self.num_calls += 1
        self.pos, self._after_call, self._at, self._arguments = pos, True, _At.NEXT, None
        self._args_from = 0

    def _not_a_call(self, out: Parsed) -> None:
        """The marker's text was no call: it is content, and so is the rest."""
        self.pos, self._arguments, self._args_from = self._call_from, None, 0
        self._content(out, len(self.buffer))
        self._at = _At.NEXT
