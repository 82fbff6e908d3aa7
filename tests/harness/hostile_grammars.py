"""Constraints built to hurt the grammar compiler (llguidance): its compile's depth grows with a
chain of rules or of `$ref`s, and past a few thousand rules, or a few hundred references, its
stack overflows and the process dies; GBNF's compile time grows as the square of the rules."""

from __future__ import annotations

import json


def chained_rules(count: int, gbnf: bool = False) -> str:
    """A Lark (or GBNF) grammar of `count` + 2 rules, each naming the next."""
    define, start = ("::=", "root") if gbnf else (":", "start")
    rules = "".join(f'r{i} {define} "t{i}" r{i + 1} | "u{i}"\n' for i in range(count))
    return f'{start} {define} r0\n{rules}r{count} {define} "end"\n'


def chained_refs(count: int) -> dict[str, object]:
    """A JSON schema of `count` definitions, each referring to the next (about 94 bytes each)."""
    defs: dict[str, object] = {
        f"d{i}": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}}]}
        for i in range(count)
    }
    defs[f"d{count}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def chained_refs_text(count: int) -> str:
    return json.dumps(chained_refs(count))
