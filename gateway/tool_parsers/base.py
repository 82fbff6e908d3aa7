"""What every tool-call parser shares: the deltas it yields, one call's tracker, and the state
machine of a sequence of JSON call objects.

A parser is fed the model's text as it arrives and returns what became certain: content text,
and tool-call deltas in OpenAI's streaming shape (the first delta of a call has its id and name,
later ones extend its `arguments`). Text that may still turn out to start a call is held back.
The same machine answers a whole text at once (`parse`), so streamed and whole answers agree.

In streaming mode a call's name is sent once its JSON string is complete, and its arguments as
the raw JSON text the model writes, piece by piece. Whole mode sends a call only once its object
is complete and valid; an incomplete or invalid one is returned as content, as written.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from enum import Enum, auto

from npuserve.gateway.tool_parsers.json_scan import WHITESPACE, Member, ObjectScanner

ARGUMENT_KEYS = ("arguments", "parameters")  # llama3_json writes `parameters`
_ID_ALPHABET = string.ascii_letters + string.digits


def tool_call_id() -> str:
    """An id in OpenAI's form, `call_` and 24 letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of call `index`: id and name on its first piece, then arguments text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class Parsed:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: Parsed) -> None:
        self.content += other.content
        self.calls += other.calls


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


def merge_calls(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """Whole calls from their deltas, in index order."""
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        if delta.index not in calls:
            calls[delta.index] = ToolCall(delta.id or tool_call_id(), delta.name or "", "")
        calls[delta.index].arguments += delta.arguments
    return [calls[i] for i in sorted(calls)]


class _CallTracker:
    """One call object in the buffer: streams its name and arguments as the scan finds them."""

    def __init__(self, index: int, begin: int, streaming: bool) -> None:
        self.index = index
        self.scanner = ObjectScanner(begin)
        self.streaming = streaming
        self.id = tool_call_id()
        self.header_sent = False
        self.sent_to = 0  # buffer index up to which the arguments were sent (streamed object)

    def update(self, buffer: str, out: Parsed) -> None:
        """Scans on, adding what became certain of a streamed call to `out` (see `settle`)."""
        self.scanner.scan(buffer)
        if self.streaming and not self.scanner.invalid:
            self._stream(buffer, out)

    def _name(self, buffer: str) -> str | None:
        member = self.scanner.members.get("name")
        if member is None or member.end is None:
            return None
        try:
            name = json.loads(buffer[member.start : member.end])
        except ValueError:
            return None
        return name if isinstance(name, str) else None

    def _streamed_arguments(self, buffer: str) -> Member | None:
        """The arguments member when it is an object, which streams as it is written; arguments
        as a JSON string (or missing) are sent whole, on close."""
        for key in ARGUMENT_KEYS:
            member = self.scanner.members.get(key)
            if member is not None:
                return member if buffer[member.start] == "{" else None
        return None

    def _stream(self, buffer: str, out: Parsed) -> None:
        if not self.header_sent:
            name = self._name(buffer)
            if name is None:
                return
            out.calls.append(ToolCallDelta(self.index, "", self.id, name))
            self.header_sent = True
        member = self._streamed_arguments(buffer)
        if member is None:
            return
        upto = len(buffer) if member.end is None else member.end
        begin = max(member.start, self.sent_to)
        if upto > begin:
            out.calls.append(ToolCallDelta(self.index, buffer[begin:upto]))
            self.sent_to = upto

    def settle(self, buffer: str, out: Parsed) -> bool:
        """After the object closed: completes the call in `out`; False when it is not a valid
        call (a whole-mode or not-yet-announced one is then left for the caller to treat as
        content)."""
        assert self.scanner.end is not None
        arguments = self._arguments_text(buffer)
        name = self._name(buffer)
        if arguments is None or name is None:
            return self.header_sent  # an announced call stays announced
        if not self.streaming:
            out.calls.append(ToolCallDelta(self.index, arguments, self.id, name))
        elif self._streamed_arguments(buffer) is None:
            out.calls.append(ToolCallDelta(self.index, arguments))
        return True

    def _arguments_text(self, buffer: str) -> str | None:
        """The closed call object's arguments as JSON text: the object as written, a string's
        JSON as given, `{}` when missing or null; None when the object or its arguments do not
        parse."""
        assert self.scanner.end is not None
        try:
            call = json.loads(buffer[self.scanner.begin : self.scanner.end])
        except (ValueError, RecursionError):
            return None
        if not isinstance(call, dict):
            return None
        key = next((k for k in ARGUMENT_KEYS if k in call), None)
        value = None if key is None else call[key]
        if value is None:
            return "{}"
        if isinstance(value, str):
            try:
                decoded = json.loads(value)
            except (ValueError, RecursionError):
                return None
            return value if isinstance(decoded, dict) else None
        if not isinstance(value, dict):
            return None
        # NOTE: the text as the model wrote it (where the scan found it), so the streamed
        # pieces join into exactly this.
        member = self.scanner.members[key]  # type: ignore[index]
        return buffer[member.start : member.end]


class _Seq(Enum):
    START = auto()  # before the sequence's first character
    ITEM = auto()  # expecting a call object (or the array's end)
    CALL = auto()
    SEPARATOR = auto()
    TAIL = auto()  # after the sequence: content


class ToolParser:
    """Base of the parsers: a buffer, a read position, and call trackers.

    Subclasses implement `_advance(out, final)`, which consumes `self.buffer` from `self.pos`
    using the helpers below. `keeps_special_tokens`: the format's markers are special tokens,
    so the request must not skip them in detokenizing.
    """

    name = ""
    keeps_special_tokens = False

    def __init__(self, streaming: bool = True) -> None:
        self.streaming = streaming
        self.buffer = ""
        self.pos = 0
        self.num_calls = 0
        self._call: _CallTracker | None = None
        self._call_from = 0  # where the current call's text (its marker included) began
        self._seq = _Seq.START
        self._in_array = False
        self._after_call = False  # no content since the last call ended

    def feed(self, text: str) -> Parsed:
        self.buffer += text
        out = Parsed()
        self._advance(out, final=False)
        return out

    def finish(self) -> Parsed:
        """What the end of the text settles: held-back text, an unfinished call."""
        out = Parsed()
        self._advance(out, final=True)
        if self._call is not None:  # unfinished
            if not self._call.header_sent:
                out.content += self.buffer[self._call_from :]
            self._call = None
            self.pos = len(self.buffer)
        return out

    @classmethod
    def parse(cls, text: str) -> Parsed:
        """The whole `text` at once: complete valid calls, the rest as content."""
        parser = cls(streaming=False)
        out = parser.feed(text)
        out.extend(parser.finish())
        return out

    def _advance(self, out: Parsed, final: bool) -> None:
        raise NotImplementedError

    # -- helpers ---------------------------------------------------------------------------------

    def _content_until(self, out: Parsed, marker: str, final: bool) -> int:
        """Content up to `marker`; once it is found, where it begins (the position moved past
        it), else -1. Text that may be the start of the marker is held back until the final call."""
        found = self.buffer.find(marker, self.pos)
        if found >= 0:
            self._content(out, found)
            self.pos = found + len(marker)
            return found
        end = len(self.buffer)
        if not final:
            end -= partial_marker(self.buffer, marker, self.pos)
        self._content(out, end)
        return -1

    def _content(self, out: Parsed, end: int) -> None:
        """buffer[pos:end] as content; whitespace right after a call is dropped."""
        text = self.buffer[self.pos : end]
        self.pos = end
        if self._after_call:
            text = text.lstrip(WHITESPACE)
            self._after_call = not text
        out.content += text

    def _skip_whitespace(self) -> str | None:
        """The next non-space character (the position moved to it), or None when none yet."""
        while self.pos < len(self.buffer) and self.buffer[self.pos] in WHITESPACE:
            self.pos += 1
        return self.buffer[self.pos] if self.pos < len(self.buffer) else None

    def _start_call(self, marker_at: int) -> None:
        self._call = _CallTracker(self.num_calls, self.pos, self.streaming)
        self._call_from = marker_at

    def _step_call(self, out: Parsed) -> str:
        """Drives the current call: "open" (needs more text), "closed" (a call, position past
        it) or "invalid" (position back where its text began; the caller decides what it is)."""
        call = self._call
        assert call is not None
        call.update(self.buffer, out)
        if call.scanner.invalid:
            self._call = None
            if call.header_sent:  # announced: what follows is not a call any more
                self.num_calls += 1
                self.pos, self._after_call = call.scanner.pos, True
                return "closed"
            self.pos = self._call_from
            return "invalid"
        if not call.scanner.closed:
            return "open"
        assert call.scanner.end is not None
        self._call = None
        if not call.settle(self.buffer, out):
            self.pos = self._call_from
            return "invalid"
        self.num_calls += 1
        self.pos, self._after_call = call.scanner.end, True
        return "closed"

    def _sequence(self, out: Parsed, final: bool, separators: str, arrays: bool = True) -> None:
        """Calls written as one object, an array of objects (`arrays`), or objects joined by
        one of `separators`; whatever follows them, or text that is none of these, is content."""
        while True:
            if self._seq is _Seq.TAIL:
                self._content(out, len(self.buffer))
                return
            begin = self.pos
            c = self._skip_whitespace()
            if c is None:
                return
            if self._seq is _Seq.START:
                if arrays and c == "[":
                    self._in_array, self.pos = True, self.pos + 1
                elif c != "{":
                    self.pos, self._seq = begin, _Seq.TAIL
                    continue
                self._seq, self._call_from = _Seq.ITEM, begin
            elif self._seq is _Seq.ITEM:
                if self._in_array and c == "]" and self.num_calls:
                    self.pos, self._seq = self.pos + 1, _Seq.TAIL
                    continue
                self._start_call(self._call_from)
                self._seq = _Seq.CALL
            elif self._seq is _Seq.CALL:
                state = self._step_call(out)
                if state == "open":
                    return
                self._seq = _Seq.SEPARATOR if state == "closed" else _Seq.TAIL
            elif self._seq is _Seq.SEPARATOR:
                if c in separators:
                    self.pos, self._seq = self.pos + 1, _Seq.ITEM
                    self._call_from = self.pos
                elif self._in_array and c == "]":
                    self.pos, self._seq = self.pos + 1, _Seq.TAIL
                else:
                    self.pos, self._seq = begin, _Seq.TAIL


def partial_marker(text: str, marker: str, start: int = 0) -> int:
    """Length of the longest end of text[start:] that is a proper start of `marker` (text to
    hold back while a marker may be arriving)."""
    for size in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
