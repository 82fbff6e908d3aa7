"""Structured outputs: the constraint a request puts on its generated text, as plain data.

The scheduler's API carries it as `SamplingParams.structured_outputs` (scheduler.proto); the
scheduler compiles it into a grammar (`npuserve.scheduler.structured.matchers`) and sends the executor
one next-token bitmask per constrained row and step (`step_plan.TokenBitmask`). This module imports
neither torch nor the grammar engine, so the gateway and the codecs can use it.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Literal

from npuserve.proto.sampling_ranges import FieldValueError

__all__ = ["FIELD", "KINDS", "StructuredOutputs"]

# The request field every refusal of a constraint names (the scheduler's API name).
FIELD = "structured_outputs"

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[Kind, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """Exactly one constraint: `kind` says which, `spec` holds it.

    - json_schema: the schema as JSON text; json_object: spec is "" (any JSON object);
    - regex: the expression the whole output matches;
    - choice: the output is one of `choices` (spec is "");
    - grammar: Lark in llguidance's syntax (may embed `%json { ... }`) or llama.cpp's GBNF.

    `compact_whitespace` (JSON kinds): True writes no whitespace between JSON tokens and
    separators "," and ":"; False writes ", " and ": ". JSON never has free whitespace here.
    """

    kind: Kind
    spec: str = ""
    choices: tuple[str, ...] = ()
    compact_whitespace: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise FieldValueError(f"unknown structured output kind {self.kind!r}", field=FIELD)
        if self.kind == "choice":
            if not self.choices or not all(isinstance(c, str) and c for c in self.choices):
                raise FieldValueError("choice needs a non-empty list of non-empty strings", field=FIELD)
        elif self.kind != "json_object" and not self.spec:
            raise FieldValueError(f"the {self.kind} constraint is empty", field=FIELD)

    @classmethod
    def json_schema(cls, schema: object, compact_whitespace: bool = True) -> StructuredOutputs:
        """From a schema given as a JSON-like object or as JSON text."""
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls("json_schema", text, compact_whitespace=compact_whitespace)

    @property
    def key(self) -> tuple[object, ...]:
        """The canonical form: equal keys compile to the same grammar (the compile cache's key).
        A JSON schema is keyed by its parsed value written compactly, so spacing does not
        matter; key order does (properties are generated in the schema's order)."""
        spec = self.spec
        if self.kind == "json_schema":
            with contextlib.suppress(ValueError, RecursionError):  # refused when it is compiled
                spec = json.dumps(json.loads(spec), separators=(",", ":"))
        return (self.kind, spec, self.choices, self.compact_whitespace)
