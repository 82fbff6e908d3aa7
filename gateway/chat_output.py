"""One chat choice's text shaped as OpenAI's assistant message: reasoning split off
(`--reasoning-parser`), tool calls read from the rest (a tool parser), the remainder as content.

Streamed, each text delta becomes a `delta` object with what became certain (`reasoning_content`,
`content`, `tool_calls` pieces with their `index`, the id, type and name on a call's first piece);
whole, the choice's text becomes a `message`. A choice that made calls and stopped by itself
finishes with `tool_calls`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from npuserve.gateway.reasoning import REASONING_PARSERS, ThinkTagsParser
from npuserve.gateway.tool_calls import ToolPlan
from npuserve.gateway.tool_parsers import TOOL_PARSERS, ToolCallDelta, ToolParser, merge_calls


@dataclass(frozen=True, slots=True)
class ParserSettings:
    """The gateway's parsers: `--tool-call-parser` (used for tool_choice `auto` only with
    `--enable-auto-tool-choice`) and `--reasoning-parser`."""

    auto_tool_parser: type[ToolParser] | None = None
    reasoning: type[ThinkTagsParser] | None = None

    @classmethod
    def from_flags(
        cls, enable_auto_tool_choice: bool, tool_call_parser: str | None, reasoning_parser: str | None
    ) -> ParserSettings:
        """The settings of the flags; ValueError naming the flag for a wrong one."""
        if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}")
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}")
        if enable_auto_tool_choice and tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        auto = TOOL_PARSERS[tool_call_parser] if enable_auto_tool_choice and tool_call_parser else None
        return cls(auto, None if reasoning_parser is None else REASONING_PARSERS[reasoning_parser])


@dataclass(frozen=True, slots=True)
class OutputShape:
    """How a request's choices are read: its tool plan and the server's reasoning parser."""

    tools: ToolPlan
    reasoning: type[ThinkTagsParser] | None = None

    @property
    def plain(self) -> bool:
        return self.tools.parser is None and self.reasoning is None


class ChoiceOutput:
    """One choice's parsers, fed its text as it streams."""

    def __init__(self, shape: OutputShape) -> None:
        self.shape = shape
        self.reasoning = None if shape.reasoning is None else shape.reasoning()
        self.tools: ToolParser | None = None if shape.tools.parser is None else shape.tools.parser()
        self.called = False

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The `delta` fields for `text` (and, when `final`, for all that was held back)."""
        reasoning, content = "", text
        if self.reasoning is not None:
            split = self.reasoning.feed(text, final)
            reasoning, content = split.reasoning, split.content
        calls: list[ToolCallDelta] = []
        if self.tools is not None:
            parsed = self.tools.feed(content)
            if final:
                parsed.extend(self.tools.finish())
            content, calls = parsed.content, _kept(parsed.calls, self.shape.tools.max_calls)
            self.called = self.called or bool(calls)
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = _call_pieces(calls)
        return delta


def finish_reason(reason: str | None, called: bool) -> str | None:
    """A choice that made tool calls and stopped by itself finishes with `tool_calls`."""
    return "tool_calls" if reason == "stop" and called else reason


def whole_message(shape: OutputShape, text: str) -> tuple[dict[str, Any], bool]:
    """The assistant message of a whole choice's text, and whether it made tool calls."""
    message: dict[str, Any] = {"role": "assistant"}
    content = text
    if shape.reasoning is not None:
        split = shape.reasoning.parse(text)
        message["reasoning_content"] = split.reasoning or None
        content = split.content
    if shape.tools.parser is None:
        message["content"] = content
        return message, False
    parsed = shape.tools.parser.parse(content)
    calls = merge_calls(_kept(parsed.calls, shape.tools.max_calls))
    message["content"] = parsed.content or (None if calls else "")
    if calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    return message, bool(calls)


def _kept(calls: list[ToolCallDelta], max_calls: int | None) -> list[ToolCallDelta]:
    return calls if max_calls is None else [c for c in calls if c.index < max_calls]


def _call_pieces(calls: list[ToolCallDelta]) -> list[dict[str, Any]]:
    """Streamed `tool_calls` entries; a call's first piece and what follows it in the same
    delta are sent as one entry."""
    pieces: list[dict[str, Any]] = []
    for call in calls:
        if pieces and pieces[-1]["index"] == call.index and call.id is None:
            pieces[-1]["function"]["arguments"] += call.arguments
            continue
        piece: dict[str, Any] = {"index": call.index, "function": {"arguments": call.arguments}}
        if call.id is not None:
            piece.update(id=call.id, type="function")
            piece["function"]["name"] = call.name
        pieces.append(piece)
    return pieces
