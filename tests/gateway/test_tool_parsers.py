"""Tool-call parsers (hermes, llama3_json, mistral, the grammar's JSON) and the qwen3 reasoning
parser: whole texts, and the same texts streamed in pieces of every size, so that split points
fall inside tags, keys, strings and escapes; streamed and whole answers must agree."""

from __future__ import annotations

import json

import pytest

from npuserve.gateway.chat_output import ChoiceOutput, OutputShape, finish_reason, whole_message
from npuserve.gateway.reasoning import REASONING_PARSERS, Split
from npuserve.gateway.tool_calls import ToolPlan
from npuserve.gateway.tool_parsers import TOOL_PARSERS, JsonCallsParser, ToolParser, merge_calls

Calls = list[tuple[str, str]]

WEATHER = '{"city": "Paris", "days": [1, {"unit": "}\\"]"}], "ok": true}'
PARSERS: dict[str, type[ToolParser]] = {**TOOL_PARSERS, "json": JsonCallsParser}

# (parser, model text, content, calls as (name, arguments JSON text))
CASES: list[tuple[str, str, str, Calls]] = [
    (
        "hermes",
        f'Let me look.\n<tool_call>\n{{"name": "weather", "arguments": {WEATHER}}}\n</tool_call>\n'
        '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>',
        "Let me look.\n",
        [("weather", WEATHER), ("time", "{}")],
    ),
    ("hermes", "no call <tool_ here, < tool_call>", "no call <tool_ here, < tool_call>", []),
    ("hermes", "<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    (
        "hermes",
        '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>\n\nDone.',
        "Done.",
        [("f", '{"x": 1}')],
    ),
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>',
        "",
        [("f", '{"x": 2}')],
    ),
    (
        "llama3_json",
        '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {"s": "a;b}"}}',
        "",
        [("f", '{"x": 1}'), ("g", '{"s": "a;b}"}')],
    ),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}', "", [("f", "{}")]),
    ("llama3_json", "  {not a call", "  {not a call", []),
    ("llama3_json", 'Sure: {"name": "f", "parameters": {}}', 'Sure: {"name": "f", "parameters": {}}', []),
    (
        "mistral",
        'Checking. [TOOL_CALLS] [{"name": "f", "arguments": {"a": [1, 2]}}, {"name": "g", "arguments": {}}]',
        "Checking. ",
        [("f", '{"a": [1, 2]}'), ("g", "{}")],
    ),
    ("mistral", "[TOOL_ CALLS] nothing", "[TOOL_ CALLS] nothing", []),
    (
        "mistral",
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": [1]}[TOOL_CALLS]get_time[ARGS]{}',
        "Sure.",
        [("get_weather", '{"city": "Paris", "days": [1]}'), ("get_time", "{}")],
    ),
    ("mistral", "[TOOL_CALLS]get_time no arguments", "[TOOL_CALLS]get_time no arguments", []),
    (
        "json",
        '{"name":"f","arguments":{"n":-1.5e3,"b":null,"s":"\\u00e9"}}',
        "",
        [("f", '{"n":-1.5e3,"b":null,"s":"\\u00e9"}')],
    ),
    (
        "json",
        '[{"name":"f","arguments":{}},{"name":"g","arguments":{"k":[]}}]',
        "",
        [("f", "{}"), ("g", '{"k":[]}')],
    ),
    ("json", '{"name":"f"}', "", [("f", "{}")]),
    ("json", '{"arguments":{}}', '{"arguments":{}}', []),  # no name: not a call
]


def streamed(parser: type[ToolParser], text: str, size: int) -> tuple[str, Calls]:
    p = parser()
    content, deltas = "", []
    for i in range(0, len(text), size):
        out = p.feed(text[i : i + size])
        content += out.content
        deltas += out.calls
    out = p.finish()
    content += out.content
    deltas += out.calls
    return content, [(c.name, c.arguments) for c in merge_calls(deltas)]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_whole_and_streamed_in_every_piece_size(name: str, text: str, content: str, calls: Calls) -> None:
    parser = PARSERS[name]
    whole = parser.parse(text)
    assert (whole.content, [(c.name, c.arguments) for c in merge_calls(whole.calls)]) == (content, calls)
    for _, arguments in calls:
        assert isinstance(json.loads(arguments), dict)
    for size in range(1, len(text) + 1):
        assert streamed(parser, text, size) == (content, calls), size


def test_streamed_calls_have_one_id_and_name_then_argument_pieces() -> None:
    text = '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
    p = TOOL_PARSERS["hermes"]()
    deltas = [d for ch in text for d in p.feed(ch).calls] + p.finish().calls
    first, rest = deltas[0], deltas[1:]
    assert first.id is not None and first.id.startswith("call_") and len(first.id) == 29
    assert (first.index, first.name, first.arguments) == (0, "weather", "")
    assert all(d.id is None and d.name is None and d.index == 0 for d in rest)
    assert len(rest) > 5  # the arguments arrive as the model writes them, not in one piece
    assert "".join(d.arguments for d in rest) == '{"city": "Paris"}'


def test_text_that_may_start_a_tag_is_held_back_until_it_cannot() -> None:
    p = TOOL_PARSERS["hermes"]()
    assert p.feed("Hello <tool").content == "Hello "
    assert p.feed("kit").content == "<toolkit"


def test_an_unfinished_call_is_content_whole_and_stays_announced_streamed() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"x": 1'
    assert TOOL_PARSERS["hermes"].parse(text).content == text
    assert streamed(TOOL_PARSERS["hermes"], text, 4) == ("", [("f", '{"x": 1')])


def test_mistral_keeps_special_tokens_in_the_text() -> None:
    assert TOOL_PARSERS["mistral"].keeps_special_tokens
    assert not TOOL_PARSERS["hermes"].keeps_special_tokens


# -- reasoning -------------------------------------------------------------------------------------

REASONING_CASES = [
    ("<think>\nLet me think.\n</think>\n\nThe answer is 4.", "\nLet me think.\n", "The answer is 4."),
    ("The answer is 4.", "", "The answer is 4."),
    ("<think>still thinking when it ran out", "still thinking when it ran out", ""),
    ("<thinking is not the tag", "", "<thinking is not the tag"),
    ("<think></think>Just this.", "", "Just this."),
]


@pytest.mark.parametrize(("text", "reasoning", "content"), REASONING_CASES)
def test_qwen3_reasoning_whole_and_streamed(text: str, reasoning: str, content: str) -> None:
    assert REASONING_PARSERS["qwen3"].parse(text) == Split(reasoning, content)
    for size in range(1, len(text) + 1):
        p = REASONING_PARSERS["qwen3"]()
        splits = [p.feed(text[i : i + size]) for i in range(0, len(text), size)] + [p.feed("", final=True)]
        got = Split("".join(s.reasoning for s in splits), "".join(s.content for s in splits))
        assert got == Split(reasoning, content), size


# -- OpenAI shapes ---------------------------------------------------------------------------------

REASONED_CALL = (
    "<think>Weather needs a tool.</think>\n"
    'I will check.<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)
SHAPE = OutputShape(ToolPlan(TOOL_PARSERS["hermes"]), REASONING_PARSERS["qwen3"])


def test_whole_message_has_reasoning_content_and_tool_calls() -> None:
    message, called = whole_message(SHAPE, REASONED_CALL)
    assert called
    call = message.pop("tool_calls")[0]
    assert message == {
        "role": "assistant",
        "reasoning_content": "Weather needs a tool.",
        "content": "I will check.",
    }
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    only_call, _ = whole_message(SHAPE, REASONED_CALL.replace("I will check.", ""))
    assert only_call["content"] is None  # OpenAI's null content beside tool calls


def test_streamed_deltas_in_openai_shape() -> None:
    output = ChoiceOutput(SHAPE)
    deltas = [output.delta(ch, final=False) for ch in REASONED_CALL] + [output.delta("", final=True)]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    pieces = [p for d in deltas for p in d.get("tool_calls", [])]
    assert (reasoning, content) == ("Weather needs a tool.", "I will check.")
    head = pieces[0]
    assert set(head) == {"index", "id", "type", "function"} and head["type"] == "function"
    assert head["function"] == {"name": "weather", "arguments": ""}
    assert all(set(p) == {"index", "function"} and set(p["function"]) == {"arguments"} for p in pieces[1:])
    assert "".join(p["function"]["arguments"] for p in pieces) == '{"city": "Oslo"}'
    assert finish_reason("stop", output.called) == "tool_calls"
    assert finish_reason("length", output.called) == "length"


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = '[{"name":"f","arguments":{}},{"name":"g","arguments":{}}]'
    message, _ = whole_message(OutputShape(ToolPlan(JsonCallsParser, max_calls=1)), text)
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["f"]


def test_mistral_searches_each_streamed_piece_for_args_once() -> None:
    """A long name streamed a character at a time is searched for `[ARGS]` from where the last
    search stopped, not from its start again (quadratic in the name's length)."""
    p = TOOL_PARSERS["mistral"]()
    p.feed("[TOOL_CALLS]")
    for _ in range(2_000):
        p.feed("x")
        assert p._args_from >= len(p.buffer) - len("[ARGS]") + 1  # type: ignore[attr-defined]
    deltas = p.feed("[AR").calls + p.feed('GS]{"a": 1}').calls + p.finish().calls
    assert [(c.name, c.arguments) for c in merge_calls(deltas)] == [("x" * 2_000, '{"a": 1}')]
