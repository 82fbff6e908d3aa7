"""An incremental scan of one JSON object as its text arrives, for tool calls in model output.

The scanner does not parse values; it finds where the object ends and where each top-level
member's value starts and ends, so a caller can stream one member (a call's `arguments`) while
the model writes it. Text is given as a growing buffer and scanned once, from where the last
scan stopped: streaming a long call costs time linear in its length.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum, auto

WHITESPACE = " \t\n\r"


class _At(Enum):
    """Where the scan is, at the object's own level (depth 1)."""

    START = auto()  # before the opening brace
    KEY = auto()  # expecting a key (or the end of an empty object)
    IN_KEY = auto()
    COLON = auto()
    VALUE = auto()  # expecting a value
    IN_VALUE = auto()
    AFTER_VALUE = auto()  # expecting ',' or '}'
    CLOSED = auto()
    INVALID = auto()


@dataclass(slots=True)
class Member:
    start: int  # index of the value's first character in the buffer
    end: int | None = None  # one past its last character, once it has ended


@dataclass
class ObjectScanner:
    """Scans the JSON object that starts at `begin` in a buffer (leading whitespace allowed)."""

    begin: int
    pos: int = -1
    end: int | None = None  # one past the closing brace, once closed
    members: dict[str, Member] = field(default_factory=dict)
    _at: _At = _At.START
    _depth: int = 0
    _in_string: bool = False
    _escape: bool = False
    _key_start: int = 0
    _key: str = ""
    _primitive: bool = False  # the current top-level value is a number, true, false or null

    def __post_init__(self) -> None:
        self.pos = self.begin

    @property
    def closed(self) -> bool:
        return self._at is _At.CLOSED

    @property
    def invalid(self) -> bool:
        return self._at is _At.INVALID

    @property
    def started(self) -> bool:
        """The opening brace has been seen."""
        return self._at is not _At.START

    def scan(self, buffer: str) -> None:
        """Scans what `buffer` holds beyond the previous scan (stops at the closing brace)."""
        while self.pos < len(buffer) and self._at not in (_At.CLOSED, _At.INVALID):
            self._step(buffer, self.pos, buffer[self.pos])
            self.pos += 1

    def _step(self, text: str, i: int, c: str) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                if self._depth == 1 and self._at is _At.IN_KEY:
                    try:
                        self._key = json.loads(text[self._key_start : i + 1])
                        self._at = _At.COLON
                    except ValueError:
                        self._at = _At.INVALID
                elif self._depth == 1 and self._at is _At.IN_VALUE:
                    self._value_ended(i + 1)
            return
        if self._depth > 1:  # inside a member's value
            if c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 1:
                    self._value_ended(i + 1)
            return
        if self._at is _At.IN_VALUE and self._primitive:
            if c not in WHITESPACE and c not in ",}":
                return
            self._value_ended(i)
        if c in WHITESPACE:
            return
        self._top_level(i, c)

    def _value_ended(self, end: int) -> None:
        self.members[self._key].end = end
        self._at, self._primitive = _At.AFTER_VALUE, False

    def _top_level(self, i: int, c: str) -> None:
        at = self._at
        if at is _At.START:
            if c != "{":
                self._at = _At.INVALID
                return
            self._depth, self._at = 1, _At.KEY
        elif at is _At.KEY and c == '"':
            self._key_start, self._in_string, self._at = i, True, _At.IN_KEY
        elif at is _At.COLON and c == ":":
            self._at = _At.VALUE
        elif at is _At.VALUE:
            self.members[self._key] = Member(i)
            self._at = _At.IN_VALUE
            if c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            else:
                self._primitive = True
        elif at is _At.AFTER_VALUE and c == ",":
            self._at = _At.KEY
        elif c == "}" and (at is _At.AFTER_VALUE or (at is _At.KEY and not self.members)):
            self._depth, self._at, self.end = 0, _At.CLOSED, i + 1
        else:
            self._at = _At.INVALID
