"""`tools` and `tool_choice`: the checks of a request (400s naming the parameter), the plan a
choice makes, the JSON schema that makes the grammar write a call, and the scheduler request
that carries tools, tool calls and tool results to the chat template."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import llguidance
import pytest

from npuserve.gateway import convert
from npuserve.gateway.chat_output import ParserSettings
from npuserve.gateway.errors import APIError
from npuserve.gateway.protocol import ChatCompletionRequest, validate
from npuserve.gateway.tool_calls import Tool, ToolPlan, tool_call_schema, tool_plan
from npuserve.gateway.tool_parsers import TOOL_PARSERS, JsonCallsParser
from npuserve.proto import scheduler_pb2 as pb
from npuserve.scheduler.api.api_codec import prompt_from_proto
from npuserve.scheduler.core.request import InvalidRequestError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
        },
    },
}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def chat(**body: Any) -> ChatCompletionRequest:
    return validate({"messages": USER, **body}, ChatCompletionRequest)


def refusal(**body: Any) -> APIError:
    with pytest.raises(APIError) as caught:
        request = chat(**body)
        tool_plan(request.tools, request.tool_choice, request.parallel_tool_calls, None)
    assert caught.value.status == 400
    assert caught.value.body()["error"]["type"] == "invalid_request_error"
    return caught.value


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].function.parameters"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [WEATHER, {"type": "function", "function": {"name": "bad name!", "parameters": {}}}]},
            "tools[1].function.name",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": named("get_time")}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": named("get_weather")}, "tool_choice"),
        ({"tools": [WEATHER]}, "tool_choice"),  # "auto" by default, and auto is not enabled
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
        ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages[0].tool_call_id"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "x",
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}],
                    }
                ]
            },
            "messages[0].tool_calls",
        ),
    ],
)
def test_bad_tools_and_tool_choice_are_400s_naming_the_param(body: dict[str, Any], param: str) -> None:
    error = refusal(**body)
    assert error.param == param, error.message


def test_the_choices_plans() -> None:
    tools = [Tool.model_validate(WEATHER), Tool.model_validate(TIME)]
    hermes = TOOL_PARSERS["hermes"]
    assert tool_plan(None, None, True, None).parser is None
    assert tool_plan(tools, "none", True, None).parser is None
    auto = tool_plan(tools, None, False, hermes)
    assert (auto.parser, auto.schema, auto.max_calls) == (hermes, None, 1)
    choice = chat(tools=[WEATHER], tool_choice=named("get_weather")).tool_choice
    forced = tool_plan(tools, choice, True, hermes)
    assert forced.parser is JsonCallsParser and forced.max_calls == 1
    assert forced.schema == tool_call_schema(tools, "get_weather", True)
    assert tool_plan(tools, "required", True, None).schema == tool_call_schema(tools, None, True)


def test_parser_flags() -> None:
    assert ParserSettings.from_flags(False, "hermes", None).auto_tool_parser is None
    assert ParserSettings.from_flags(True, "mistral", "qwen3").auto_tool_parser is TOOL_PARSERS["mistral"]
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ParserSettings.from_flags(True, None, None)
    with pytest.raises(ValueError, match="--reasoning-parser"):
        ParserSettings.from_flags(False, None, "deepseek")


def accepts(schema: dict[str, Any], value: Any) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def test_tool_call_schemas_accept_exactly_calls_of_the_tools() -> None:
    tools = [Tool.model_validate(WEATHER), Tool.model_validate(TIME)]
    weather = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}
    time = {"name": "get_time", "arguments": {"zone": 2}}
    one = tool_call_schema(tools, "get_weather", parallel=True)
    assert accepts(one, weather)
    assert not accepts(one, time)  # another function
    assert not accepts(one, {"name": "get_weather", "arguments": {"city": "Paris"}})  # unit missing
    assert not accepts(one, {**weather, "extra": 1})
    assert not accepts(one, [weather])
    required = tool_call_schema(tools, None, parallel=False)
    assert accepts(required, weather) and accepts(required, time)
    assert not accepts(required, {"name": "get_time", "arguments": {"zone": 99}})
    parallel = tool_call_schema(tools, None, parallel=True)
    assert accepts(parallel, [weather, time]) and not accepts(parallel, []) and not accepts(parallel, weather)
    for schema in (one, required, parallel):
        jsonschema.Draft202012Validator.check_schema(schema)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        assert llguidance.LLMatcher.validate_grammar(grammar) == ""  # the grammar engine takes it


def test_a_named_choice_becomes_the_requests_json_schema_constraint() -> None:
    request = chat(tools=[WEATHER, TIME], tool_choice=named("get_weather"))
    plan = tool_plan(request.tools, request.tool_choice, request.parallel_tool_calls, None)
    msg = convert.chat_request(request, "r1", "", plan)
    constraint = msg.sampling.structured_outputs
    assert constraint.WhichOneof("kind") == "json_schema"
    assert json.loads(constraint.json_schema) == plan.schema
    both = chat(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
    with pytest.raises(APIError) as caught:
        convert.chat_request(both, "r2", "", tool_plan(both.tools, both.tool_choice, True, None))
    assert caught.value.param == "tool_choice"


def test_mistral_requests_keep_special_tokens_unless_asked() -> None:
    request = chat(tools=[WEATHER])
    plan = tool_plan(request.tools, request.tool_choice, True, TOOL_PARSERS["mistral"])
    assert convert.chat_request(request, "r", "", plan).sampling.skip_special_tokens is False
    asked = chat(tools=[WEATHER], skip_special_tokens=True)
    assert convert.chat_request(asked, "r", "", plan).sampling.skip_special_tokens is True


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C"},
]


def test_tools_calls_and_results_reach_the_template_as_transformers_passes_them() -> None:
    request = chat(messages=CONVERSATION, tools=[WEATHER], tool_choice="none")
    prompt = prompt_from_proto(convert.chat_request(request, "r", "", ToolPlan()))
    assert prompt.tools == [WEATHER]
    assert prompt.messages == [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}},
                }
            ],
        },
        {"role": "tool", "content": "18 C", "name": "get_weather", "tool_call_id": "call_1"},
    ]


def test_the_scheduler_refuses_parameters_that_are_not_a_json_object() -> None:
    chat_prompt = pb.ChatPrompt(
        messages=[pb.ChatMessage(role="user", content="x")],
        tools=[pb.Tool(type="function", function=pb.FunctionDefinition(name="f", parameters_json="[1]"))],
    )
    with pytest.raises(InvalidRequestError) as caught:
        prompt_from_proto(pb.GenerateRequest(chat=chat_prompt))
    assert caught.value.field == "tools[0].function.parameters"


def test_parameters_with_references_keep_them_working_inside_the_call_schema() -> None:
    address = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    parameters = {  # the way pydantic writes models that nest models
        "type": "object",
        "properties": {
            "home": {"$ref": "#/$defs/Address"},
            "work": {"$ref": "#/definitions/Address"},
            "also": {"$ref": "#/properties/home"},
        },
        "required": ["home"],
        "$defs": {"Address": address},
        "definitions": {"Address": address},
    }
    tools = [
        Tool.model_validate({"type": "function", "function": {"name": "move", "parameters": parameters}}),
        Tool.model_validate(TIME),
    ]
    schema = tool_call_schema(tools, None, parallel=False)
    jsonschema.Draft202012Validator.check_schema(schema)
    city = {"city": "Oslo"}
    assert accepts(schema, {"name": "move", "arguments": {"home": city, "work": city, "also": city}})
    assert not accepts(schema, {"name": "move", "arguments": {"home": {}}})
    assert not accepts(schema, {"name": "move", "arguments": {"home": city, "work": {"city": 1}}})
    assert not accepts(schema, {"name": "move", "arguments": {"home": city, "also": {}}})
    assert accepts(schema, {"name": "get_time", "arguments": {"zone": 3}})
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
