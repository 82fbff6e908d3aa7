"""Structured outputs through the official `openai` client against `npuserve serve` on the demo
model (a KV cache small enough that a burst preempts): JSON schemas, JSON objects, choices and
regexes hold on every answer, streaming or not, and under preemption; bad constraints get a 400
naming the param. Fail-over is tested in-process (tests/scheduler/structured/test_matchers.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from harness.serve import Served, serve

pytestmark = pytest.mark.slow  # a scheduler, an executor and a gateway in processes of their own

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "stories260K"
MAX_TOKENS = 250
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required or list(properties)}


NAME = {"type": "string", "maxLength": 16}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}
SCORE = {"type": "number", "minimum": 0, "maximum": 10}
COLOR = {"enum": ["red", "green", "blue"]}
# Twenty schemas: nested objects, arrays, enums, required and optional fields, bounded numbers.
SCHEMAS: list[dict[str, Any]] = [
    _obj({"name": NAME, "age": AGE}),
    _obj({"color": COLOR}),
    _obj({"ok": {"type": "boolean"}, "count": {"type": "integer", "minimum": 1, "maximum": 9}}),
    _obj({"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}}),
    _obj({"person": _obj({"name": NAME, "age": AGE})}),
    _obj({"pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 4}}),
    _obj({"score": SCORE, "label": NAME}),
    _obj({"a": _obj({"b": _obj({"c": {"type": "integer", "minimum": -5, "maximum": 5}})})}),
    _obj({"title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2100}}),
    _obj(
        {
            "mood": {"enum": ["happy", "sad", "angry"]},
            "level": {"type": "integer", "minimum": 0, "maximum": 3},
        }
    ),
    _obj({"name": NAME, "nickname": NAME}, required=["name"]),
    _obj({"points": {"type": "array", "items": _obj({"x": AGE, "y": AGE}), "maxItems": 2}}),
    _obj({"answer": {"const": "yes"}, "why": NAME}),
    _obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "null"}]}}),
    _obj({"friends": {"type": "array", "items": _obj({"name": NAME, "color": COLOR}), "maxItems": 2}}),
    _obj({"size": {"enum": ["small", "big"]}, "weight": SCORE, "alive": {"type": "boolean"}}),
    _obj(
        {"matrix": {"type": "array", "items": {"type": "array", "items": AGE, "maxItems": 2}, "maxItems": 2}}
    ),
    _obj({"story": _obj({"hero": NAME, "place": NAME, "end": {"enum": ["good", "bad"]}})}),
    _obj(
        {
            "id": {"type": "integer", "minimum": 1, "maximum": 1000},
            "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        }
    ),
    {"type": "array", "items": _obj({"name": NAME}), "minItems": 1, "maxItems": 2},
]
PROMPTS = [
    "Lily and her dog",
    "Tom found a ball",
    "The sun was hot",
    "A big red car",
    "Sue and her mom",
    "The cat was sad",
    "Ben had a toy",
    "The bird sang",
    "A little boy named Tim",
    "Once upon a time",
    "The tree was tall",
    "Mia saw a fish",
    "The dog ran fast",
    "Max wanted a cake",
    "Anna went to the park",
    "The fox was hungry",
    "Two friends played",
    "The moon was bright",
    "Sam lost his hat",
    "A girl named Amy",
]


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    # NOTE: ~100 KV blocks per executor: a burst of 24 long answers preempts, one at a time never.
    with serve(None, "--kv-cache-memory", "0.002") as served:
        yield served
        check = served.integrity(expect_idle=True)
        assert check.ok, check.message


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, prompt: str, stream: bool = False, **body: Any) -> tuple[str, str]:
    """(content, finish reason) of a greedy chat completion."""
    args: dict[str, Any] = dict(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=body.pop("max_tokens", MAX_TOKENS),
    )
    if "response_format" in body:
        args["response_format"] = body.pop("response_format")
    if not stream:
        choice = client.chat.completions.create(**args, extra_body=body or None).choices[0]
        return choice.message.content or "", choice.finish_reason
    content, reason = "", ""
    for chunk in client.chat.completions.create(**args, extra_body=body or None, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return content, reason


def _json_schema_format(i: int) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i], "strict": True}}


def test_twenty_schemas_validate_streaming_and_not(client: openai.OpenAI) -> None:
    assert len(SCHEMAS) == len(PROMPTS) == 20

    def run(i: int) -> tuple[tuple[str, str], tuple[str, str]]:
        fmt = _json_schema_format(i)
        return _chat(client, PROMPTS[i], response_format=fmt), _chat(
            client, PROMPTS[i], stream=True, response_format=fmt
        )

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(20)))
    for i, ((whole, reason), (streamed, stream_reason)) in enumerate(results):
        assert reason == stream_reason == "stop", (i, whole)
        assert streamed == whole  # greedy: deterministic, streamed or not
        assert not re.search(r"\s", _STRING.sub("", whole)), whole  # compact: no whitespace outside strings
        jsonschema.validate(json.loads(whole), SCHEMAS[i])


def test_completions_and_vllm_extras_take_the_same_schema(client: openai.OpenAI) -> None:
    fmt = _json_schema_format(0)
    chat, _ = _chat(client, PROMPTS[0], response_format=fmt)
    assert _chat(client, PROMPTS[0], structured_outputs={"json": SCHEMAS[0]})[0] == chat
    assert _chat(client, PROMPTS[0], guided_json=SCHEMAS[0])[0] == chat
    completion = client.completions.create(
        model=MODEL, prompt="Lily", temperature=0, max_tokens=MAX_TOKENS, extra_body={"response_format": fmt}
    )
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMAS[0])


def test_json_object_choice_and_regex(client: openai.OpenAI) -> None:
    # NOTE: the demo model never ends a free-form string by itself: the mask narrows to the
    # object's closing path as max_tokens nears, so the answer is still whole JSON.
    json_object = {"type": "json_object"}
    choices = ["happy", "sad", "sleepy"]
    patterns = [r"[A-Z][a-z]{2,8} is [0-9]{1,2}\.", r"(yes|no), said [A-Z][a-z]{1,6}\.", r"[a-z]+ and [a-z]+"]
    calls: list[tuple[str, bool, dict[str, Any]]] = []
    for prompt in ["{", *PROMPTS[:3]]:
        calls += [
            (prompt, stream, {"response_format": json_object, "max_tokens": 80}) for stream in (False, True)
        ]
        calls.append((prompt, False, {"structured_outputs": {"json_object": True}, "max_tokens": 80}))
    for prompt in PROMPTS[:3]:
        calls += [
            (prompt, False, {"guided_choice": choices}),
            (prompt, False, {"structured_outputs": {"choice": choices}}),
        ]
        calls += [(prompt, False, {"guided_regex": pattern, "max_tokens": 80}) for pattern in patterns]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda call: _chat(client, call[0], call[1], **dict(call[2])), calls))
    for (_, _, body), (content, reason) in zip(calls, answers, strict=True):
        assert reason == "stop", (body, content)
        if "guided_regex" in body:
            assert re.fullmatch(body["guided_regex"], content), (body, content)
        elif "max_tokens" in body:
            assert isinstance(json.loads(content), dict), content
        else:
            assert content in choices
    objects = answers[: 3 * 4]
    assert all(objects[i] == objects[i + 1] == objects[i + 2] for i in range(0, len(objects), 3))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"guided_json": {"properties": {"a": {"$ref": "#/missing"}}}}, "guided_json"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"guided_grammar": "start: missing_rule"}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ],
)
def test_bad_constraints_are_400_naming_the_param(
    client: openai.OpenAI, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(client, "Lily", **body)
    assert refused.value.body["param"] == param


def test_constrained_answers_survive_preemption(client: openai.OpenAI, served: Served) -> None:
    """24 long answers at once overflow the cache: some are preempted and recomputed, and each
    still equals the answer it gets alone."""
    schema = _obj({"words": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 8}})
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
    prompts = [f"{p}." for p in PROMPTS] + PROMPTS[:4]
    alone = [_chat(client, p, response_format=fmt) for p in prompts[:6]]
    before = served.metric("vllm:num_preemptions_total")
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: _chat(client, p, response_format=fmt), prompts))
    assert served.metric("vllm:num_preemptions_total") > before
    assert together[:6] == alone
    for content, _ in together:
        jsonschema.validate(json.loads(content), schema)
