"""Render limits of chat templates: output size, counted characters, repetition and power bombs."""

from __future__ import annotations

import pytest

from npuserve.scheduler.text.chat_template import ChatRender, ChatTemplateError, RenderLimits, render

MESSAGES = [{"role": "user", "content": "hi"}]


def job(template: str, limits: RenderLimits, field: str | None = "chat_template") -> ChatRender:
    return ChatRender(template=template, variables={"messages": MESSAGES}, limits=limits, field=field)


def test_output_within_limits_renders_whole() -> None:
    template = "{% for i in range(100) %}ab {% endfor %}"
    assert render(job(template, RenderLimits(max_chars=300))) == "ab " * 100


def test_output_past_its_limit_is_refused_while_streaming() -> None:
    template = "{% for i in range(100000) %}{% for j in range(100000) %}ab {% endfor %}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="exceeds 1000 characters") as caught:
        render(job(template, RenderLimits(max_chars=1000)))
    assert caught.value.field == "chat_template"


def test_counted_limit_skips_uncounted_characters() -> None:
    spaces = "{{ 'a' }}{% for i in range(5000) %} {% endfor %}{{ 'b' }}"
    limits = RenderLimits(max_chars=10_000, max_counted_chars=2, uncounted=" ")
    assert render(job(spaces, limits)) == "a" + " " * 5000 + "b"
    letters = "{% for i in range(5000) %}ab{% endfor %}"
    with pytest.raises(ChatTemplateError, match="longer than the model's context") as caught:
        render(job(letters, limits, field=None))
    assert caught.value.field == "messages"  # the model's own template: the messages are too long


@pytest.mark.parametrize(
    "template",
    [
        '{{ "ab " * 10000000 }}',
        "{{ 10000000 * ['x'] }}",
        "{% set s = 'ab' * 999999999999 %}",
        "{{ 7 ** 99999999 }}",
    ],
)
def test_repetition_and_power_bombs_are_refused_before_they_are_built(template: str) -> None:
    with pytest.raises(ChatTemplateError) as caught:
        render(job(template, RenderLimits(max_chars=1 << 20)))
    assert caught.value.field == "chat_template"


def test_small_repetitions_and_powers_still_work() -> None:
    assert render(job("{{ '-' * 3 }}{{ 2 ** 10 }}", RenderLimits(max_chars=100))) == "---1024"
