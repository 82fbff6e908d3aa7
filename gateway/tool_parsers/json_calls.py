"""The output of a grammar-enforced tool choice (`required`, a named function): one call object
`{"name": ..., "arguments": {...}}` or a JSON array of them, and nothing else."""

from __future__ import annotations

from npuserve.gateway.tool_parsers.base import Parsed, ToolParser


class JsonCallsParser(ToolParser):
    name = "json"

    def _advance(self, out: Parsed, final: bool) -> None:
        self._sequence(out, final, separators=",")
