"""OpenAI's `response_format` and vLLM's `structured_outputs` / `guided_*` as one scheduler constraint.

A request may constrain its output in one of these ways (at most one of them):

- `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`, or
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`;
- vLLM's `structured_outputs`: `{"json": schema, "regex": ..., "choice": [...], "grammar": ...,
  "json_object": true}` (one of them), with `disable_any_whitespace` and `disable_fallback`;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`
  (with `guided_decoding_backend`, which is ignored: llguidance always enforces).

`constraint_of` maps the body to the scheduler's `StructuredOutputs` message and remembers the
param the client used, so a constraint the scheduler refuses (a schema, regex or grammar that
does not compile) comes back as a 400 naming that param. Only shapes are checked here; whether
the constraint compiles is the scheduler's call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from npuserve.gateway.errors import bad_request
from npuserve.proto import scheduler_pb2 as pb

__all__ = ["Constraint", "constraint_of"]

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
# structured_outputs keys: the constraint kinds, and the options accepted beside them.
_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_SO_OPTIONS = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties")


@dataclass(frozen=True, slots=True)
class Constraint:
    """The scheduler's constraint, and the request param it came from (for errors)."""

    message: pb.StructuredOutputs
    param: str


def constraint_of(body: Any) -> Constraint | None:
    """The one constraint a completion or chat body asks for (None: free text); 400 naming the
    param for a malformed one or for two constraints at once."""
    found: list[Constraint] = []
    response_format = getattr(body, "response_format", None)
    if response_format is not None:
        constraint = _from_response_format(response_format)
        if constraint is not None:
            found.append(constraint)
    structured = getattr(body, "structured_outputs", None)
    if structured is not None:
        found.append(_from_structured_outputs(structured))
    for name in _GUIDED:
        value = getattr(body, name, None)
        if value is not None:
            found.append(_of_kind(name.removeprefix("guided_"), value, name))
    if getattr(body, "guided_whitespace_pattern", None) is not None:
        raise bad_request(
            "guided_whitespace_pattern is not supported: JSON is written without free whitespace",
            "guided_whitespace_pattern",
        )
    if len(found) > 1:
        raise bad_request(
            f"{found[1].param}: give one constraint; {found[0].param} already constrains the output",
            found[1].param,
        )
    return found[0] if found else None


def _from_response_format(value: Any) -> Constraint | None:
    if not isinstance(value, dict):
        raise bad_request("response_format must be an object", "response_format")
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(pb.StructuredOutputs(json_object=True), "response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request(
                "response_format.json_schema must be an object with a schema", "response_format.json_schema"
            )
        if "schema" not in spec:
            raise bad_request(
                "response_format.json_schema.schema is missing", "response_format.json_schema.schema"
            )
        return _of_kind("json", spec["schema"], "response_format.json_schema.schema")
    raise bad_request(
        f"response_format type {kind!r} is not supported: use 'text', 'json_object' or 'json_schema'",
        "response_format.type",
    )


def _from_structured_outputs(value: Any) -> Constraint:
    if not isinstance(value, dict):
        raise bad_request("structured_outputs must be an object", "structured_outputs")
    unknown = [k for k in value if k not in _SO_KINDS + _SO_OPTIONS and value[k] is not None]
    if unknown:
        raise bad_request(
            f"structured_outputs.{unknown[0]} is not supported (supported: {', '.join(_SO_KINDS + _SO_OPTIONS)})",
            f"structured_outputs.{unknown[0]}",
        )
    kinds = [k for k in _SO_KINDS if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise bad_request(
            f"structured_outputs must set exactly one of {', '.join(_SO_KINDS)}", "structured_outputs"
        )
    constraint = _of_kind(kinds[0], value[kinds[0]], f"structured_outputs.{kinds[0]}")
    if value.get("disable_any_whitespace") is False and constraint.message.WhichOneof("kind") in (
        "json_schema",
        "json_object",
    ):
        constraint.message.compact_whitespace = False
    return constraint


def _of_kind(kind: str, value: Any, param: str) -> Constraint:
    """The message for one constraint given as `param`, after checking its JSON type."""
    if kind == "json":
        if isinstance(value, str):
            text = value  # a schema sent as JSON text; the scheduler parses it
        elif isinstance(value, dict | bool):
            text = json.dumps(value)
        else:
            raise bad_request(f"{param} must be a JSON schema (an object)", param)
        return Constraint(pb.StructuredOutputs(json_schema=text), param)
    if kind == "json_object":
        if value is not True:
            raise bad_request(f"{param} must be true", param)
        return Constraint(pb.StructuredOutputs(json_object=True), param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad_request(f"{param} must be a non-empty list of non-empty strings", param)
        return Constraint(pb.StructuredOutputs(choice=pb.ChoiceList(choices=value)), param)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param} must be a non-empty string", param)
    message = pb.StructuredOutputs(regex=value) if kind == "regex" else pb.StructuredOutputs(grammar=value)
    return Constraint(message, param)
