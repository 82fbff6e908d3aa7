"""OpenAI `tools` and `tool_choice` on chat completions: their checks, what a request's choice
means for its answer, and the JSON schema that makes the grammar write a tool call.

`none` (the default without tools): the tools reach the chat template, the answer is content.
`auto` (the default with tools): the model may call; `--tool-call-parser` reads its calls from the
text, and only with `--enable-auto-tool-choice` (as vLLM). `required` and a named function: the
answer is constrained to a call by a JSON schema (`tool_call_schema`), so its arguments always
parse and match the function's parameters.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import jsonschema
from pydantic import AfterValidator, BaseModel, ConfigDict, field_validator

from npuserve.gateway.errors import bad_request
from npuserve.gateway.tool_parsers import JsonCallsParser, ToolParser

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_CHOICES = ("none", "auto", "required")


def check_parameters_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` if it is a valid JSON schema of an object, else ValueError saying why. It takes
    about 10 us a byte of schema, so the app validates a request with tools off its event loop."""
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"is not a valid JSON schema: {exc.message}") from None
    if schema.get("type", "object") != "object":
        raise ValueError("must be the JSON schema of an object (type 'object')")
    return schema


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionDefinition(_Model):
    name: str
    description: str | None = None
    # NOTE: required here, so every call can be checked against it
    parameters: Annotated[dict[str, Any], AfterValidator(check_parameters_schema)]
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not FUNCTION_NAME.fullmatch(value):
            raise ValueError("must be 1 to 64 letters, digits, underscores or dashes")
        return value


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDefinition


# NOTE: how many tools, and how large, is `RequestLimits`'s to bound, before this validates them.
Tools = list[Tool] | None


class FunctionName(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Model):
    name: str
    arguments: str  # JSON text

    @field_validator("arguments", mode="before")
    @classmethod
    def _arguments_as_text(cls, value: Any) -> Any:
        """Arguments sent as an object (not OpenAI's shape, but unambiguous) as its JSON text."""
        return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else value


class MessageToolCall(_Model):
    """A call in an assistant message of the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def parse_tool_choice(value: Any) -> ToolChoice | None:
    """`tool_choice` as sent: one of TOOL_CHOICES or {"type": "function", "function": {"name"}}."""
    if value is None or value in TOOL_CHOICES:
        return value
    if isinstance(value, dict):
        try:
            return NamedToolChoice.model_validate(value)
        except ValueError:
            pass
    raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request's tools mean for its answer."""

    parser: type[ToolParser] | None = None  # reads calls from the answer; None: all content
    schema: dict[str, Any] | None = None  # the answer's constraint (required, named)
    max_calls: int | None = None  # 1 when parallel_tool_calls is false


def tool_plan(
    tools: list[Tool] | None,
    choice: ToolChoice | None,
    parallel: bool,
    auto_parser: type[ToolParser] | None,
) -> ToolPlan:
    """The plan for a request; 400 naming `tool_choice` for a choice the tools cannot meet.
    `auto_parser`: the parser of `--tool-call-parser` when `--enable-auto-tool-choice` is set."""
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolPlan()
    if not tools:
        what = f"function {choice.function.name!r}" if isinstance(choice, NamedToolChoice) else repr(choice)
        raise bad_request(f"tool_choice {what} needs tools", "tool_choice")
    max_calls = None if parallel else 1
    if choice == "auto":
        if auto_parser is None:
            raise bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                'set (tools were given, and tool_choice defaults to "auto"); send tool_choice "none", '
                '"required" or a named function',
                "tool_choice",
            )
        return ToolPlan(auto_parser, None, max_calls)
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if all(tool.function.name != name for tool in tools):
            raise bad_request(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
        return ToolPlan(JsonCallsParser, tool_call_schema(tools, name, parallel), 1)
    return ToolPlan(JsonCallsParser, tool_call_schema(tools, None, parallel), max_calls)


def constrains_output(choice: ToolChoice | None) -> bool:
    """Whether the choice makes the grammar write a call (`required`, a named function)."""
    return choice == "required" or isinstance(choice, NamedToolChoice)


def tool_call_schema(tools: list[Tool], name: str | None, parallel: bool) -> dict[str, Any]:
    """The JSON schema of an answer that is a tool call: for function `name`, the object
    `{"name": name, "arguments": <its parameters>}`; with no name (`required`), such an object
    for any of `tools`, or an array of one or more of them when `parallel`.

    A parameters schema with references (`$ref`, `$defs`, `definitions`, as pydantic writes
    them) is moved under the result's `$defs` with its references rewritten, since a `#/...`
    reference is resolved from the root of the whole schema."""
    chosen = [tool.function for tool in tools if name is None or tool.function.name == name]
    defs: dict[str, Any] = {}
    objects = [_call_object(i, function, defs) for i, function in enumerate(chosen)]
    one = objects[0] if len(objects) == 1 else {"anyOf": objects}
    schema = one if name is not None or not parallel else {"type": "array", "items": one, "minItems": 1}
    return {**schema, "$defs": defs} if defs else schema


def _call_object(index: int, function: FunctionDefinition, defs: dict[str, Any]) -> dict[str, Any]:
    parameters = function.parameters
    if _has_references(parameters):
        prefix = f"tool{index}"
        local = {**parameters.get("definitions", {}), **parameters.get("$defs", {})}
        body = {k: v for k, v in parameters.items() if k not in ("$defs", "definitions")}
        defs[prefix] = _rebased({**body, "type": "object"}, prefix)
        defs.update({f"{prefix}.{key}": _rebased(value, prefix) for key, value in local.items()})
        arguments: dict[str, Any] = {"$ref": f"#/$defs/{prefix}"}
    else:
        arguments = {**parameters, "type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [function.name]}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _has_references(schema: Any) -> bool:
    if isinstance(schema, dict):
        if "$ref" in schema or "$defs" in schema or "definitions" in schema:
            return True
        return any(_has_references(v) for v in schema.values())
    return isinstance(schema, list) and any(_has_references(v) for v in schema)


def _rebased(schema: Any, prefix: str) -> Any:
    """`schema` with its local references pointing where `tool_call_schema` moves their targets."""
    if isinstance(schema, list):
        return [_rebased(v, prefix) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _rebased(v, prefix) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        pointer = ref[1:]
        out["$ref"] = f"#/$defs/{prefix}{pointer.rstrip('/')}"
        for container in ("/$defs/", "/definitions/"):
            if pointer.startswith(container):
                name, _, rest = pointer[len(container) :].partition("/")
                out["$ref"] = f"#/$defs/{prefix}.{name}" + (f"/{rest}" if rest else "")
                break
    return out
