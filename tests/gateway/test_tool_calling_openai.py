"""Tool calling through the official `openai` client against `npuserve serve` on the demo model,
with `--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3` and a chat
template that uses tools (tests/gateway/data/tools_chat_template.jinja).

stories260K never writes a tool call by itself, so `auto` is covered by the parser unit tests;
here the grammar forces calls (a named function, `required`): their arguments must validate
against the function's parameters, streamed and whole alike, and greedy answers must repeat; a
forced call closes within max_tokens, and a max_tokens below the shortest call is a 400.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from harness.serve import Served, serve_checked

pytestmark = pytest.mark.slow  # a scheduler, executor and gateway in processes of their own

openai = pytest.importorskip("openai")

TEMPLATE = Path(__file__).parent / "data" / "tools_chat_template.jinja"
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["C", "F"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}, "dst": {"type": "boolean"}},
    "required": ["zone", "dst"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "A forecast", "parameters": WEATHER_PARAMETERS},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMETERS}},
]
# A function whose argument is a free string, the longest way a forced call can wander.
NOTE_TOOL = {
    "type": "function",
    "function": {
        "name": "take_note",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    },
}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in [*TOOLS, NOTE_TOOL]}
PROMPTS = ["Once upon a time", "The little dog"]


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


@pytest.fixture(scope="module")
def served(api_key: str) -> Iterator[Served]:
    flags = ["--kv-cache-memory", "0.02", "--api-key", api_key, "--chat-template", str(TEMPLATE)]
    flags += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
    with serve_checked(None, *flags) as served:
        yield served


def ask(client: openai.OpenAI, prompt: str, tool_choice: Any, **extra: Any) -> Any:
    return client.chat.completions.create(
        model="stories260K",
        messages=[{"role": "user", "content": prompt}],
        tools=TOOLS,
        tool_choice=tool_choice,
        temperature=0,
        **{"max_tokens": 120, **extra},
    )


def checked_arguments(name: str, arguments: str) -> dict[str, Any]:
    value = json.loads(arguments)
    jsonschema.validate(value, PARAMETERS[name])
    return value


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("function", ["get_weather", "get_time"])
def test_a_named_function_is_called_with_valid_arguments_streamed_or_not(
    client: openai.OpenAI, prompt: str, function: str
) -> None:
    first = ask(client, prompt, named(function)).choices[0]
    assert first.finish_reason == "tool_calls"
    assert first.message.content is None and first.message.role == "assistant"
    (call,) = first.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == function
    checked_arguments(function, call.function.arguments)
    again = ask(client, prompt, named(function)).choices[0].message.tool_calls[0]
    assert again.function.arguments == call.function.arguments  # greedy: the same call

    chunks = list(ask(client, prompt, named(function), stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    pieces = [p for d in deltas if d.tool_calls for p in d.tool_calls]
    head = pieces[0]
    assert (head.index, head.type, head.function.name) == (0, "function", function)
    assert head.id.startswith("call_")
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in pieces[1:])
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
    assert not any(d.content for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_required_calls_one_of_the_tools(client: openai.OpenAI) -> None:
    answers = [ask(client, p, "required", parallel_tool_calls=False).choices[0] for p in PROMPTS]
    for answer in answers:
        assert answer.finish_reason == "tool_calls"
        (call,) = answer.message.tool_calls
        checked_arguments(call.function.name, call.function.arguments)


def test_auto_and_none_answer_in_content(client: openai.OpenAI) -> None:
    for choice in ("auto", "none"):
        answer = ask(client, PROMPTS[0], choice, max_tokens=12).choices[0]
        assert answer.message.tool_calls is None
        assert answer.message.content and answer.finish_reason == "length"


def test_a_conversation_with_a_tool_result_renders_through_the_template(
    client: openai.OpenAI, served: Served, api_key: str
) -> None:
    call = {
        "id": "call_7",
        "type": "function",
        "function": {"name": "get_time", "arguments": '{"zone": 2, "dst": true}'},
    }
    messages = [
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_7", "content": "noon"},
    ]
    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(base_url=served.url, headers=headers, timeout=30) as http:
        tokens = http.post("/tokenize", json={"messages": messages, "tools": TOOLS}).json()["tokens"]
        prompt = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert f"Tool get_time: {json.dumps(TIME_PARAMETERS)}\n" in prompt
    # the arguments reach the template as an object (its tojson), the result with its call id
    assert (
        'What time is it?\nCall call_7 get_time {"zone": 2, "dst": true}\nResult of call_7: noon\n' in prompt
    )
    answer = client.chat.completions.create(
        model="stories260K", messages=messages, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=8
    )
    assert answer.choices[0].message.content


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"},
            "tools[0].function.parameters",
        ),
        ({"tools": TOOLS, "tool_choice": named("get_date")}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_param(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="stories260K", messages=[{"role": "user", "content": "hi"}], max_tokens=4, **extra
        )
    assert caught.value.body["param"] == param  # type: ignore[index]


def forced_call(client: openai.OpenAI, tool_choice: Any, seed: int, budget: dict[str, int]) -> Any:
    """A call forced by `tool_choice` among `take_note` and `get_time` (all three tools would
    not leave 64 tokens in the demo model's context), sampled at temperature 1, within `budget`
    (max_tokens or max_completion_tokens)."""
    return client.chat.completions.create(
        model="stories260K",
        messages=[{"role": "user", "content": PROMPTS[0]}],
        tools=[NOTE_TOOL, TOOLS[1]],
        tool_choice=tool_choice,
        temperature=1.0,
        seed=seed,
        **budget,
    )


def assert_whole_calls(answer: Any) -> None:
    """The answer is one or more calls that parse and match their functions' parameters."""
    assert answer.finish_reason == "tool_calls", answer.message.content
    assert answer.message.content is None and answer.message.tool_calls
    for call in answer.message.tool_calls:
        checked_arguments(call.function.name, call.function.arguments)


@pytest.mark.parametrize("tool_choice", ["required", named("take_note"), named("get_time")])
def test_forced_calls_are_whole_within_64_tokens(
    client: openai.OpenAI, served: Served, tool_choice: Any
) -> None:
    """At temperature 1 a weak model wanders in a string or opens call after call; within 64
    tokens the mask still keeps out what would not fit and closes the call in time, so each seed
    answers whole calls."""
    for seed in range(10):
        assert_whole_calls(forced_call(client, tool_choice, seed, {"max_tokens": 64}).choices[0])
    check = served.integrity(expect_idle=True)
    assert check.ok, check.message


@pytest.mark.parametrize("tool_choice", ["required", named("get_time")])
@pytest.mark.parametrize("limit", ["max_tokens", "max_completion_tokens"])
def test_a_budget_below_the_shortest_call_is_a_400_and_the_shortest_call_fits(
    client: openai.OpenAI, served: Served, tool_choice: Any, limit: str
) -> None:
    """A budget too small for any call is refused up front, streamed or not, naming the limit
    the client sent and the tokens the shortest call takes; with exactly that many the call is
    whole."""
    messages: list[str] = []
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            forced_call(client, tool_choice, 0, {limit: 8, "stream": stream})
        error = caught.value.body
        assert error["param"] == limit  # type: ignore[index]
        messages.append(error["message"])  # type: ignore[index]
    found = re.fullmatch(rf"{limit} 8 is less than the (\d+) tokens of the shortest output .*", messages[0])
    assert found and messages[1] == messages[0], messages
    shortest = int(found.group(1))
    assert_whole_calls(forced_call(client, tool_choice, 0, {limit: shortest}).choices[0])
    with pytest.raises(openai.BadRequestError):
        forced_call(client, tool_choice, 0, {limit: shortest - 1})
    check = served.integrity(expect_idle=True)
    assert check.ok, check.message
