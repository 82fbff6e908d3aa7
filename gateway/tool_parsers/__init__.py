"""Parsers that turn model text into OpenAI tool calls, by `--tool-call-parser` name (vLLM's)."""

from __future__ import annotations

from npuserve.gateway.tool_parsers.base import ToolCallDelta, ToolParser, merge_calls
from npuserve.gateway.tool_parsers.hermes import HermesToolParser
from npuserve.gateway.tool_parsers.json_calls import JsonCallsParser
from npuserve.gateway.tool_parsers.llama3_json import Llama3JsonToolParser
from npuserve.gateway.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}

__all__ = [
    "TOOL_PARSERS",
    "JsonCallsParser",
    "ToolCallDelta",
    "ToolParser",
    "merge_calls",
]
