"""Chat templates: the sandboxed Jinja environment transformers renders them in, with size limits.

A template is code. Rendering here bounds what it may produce: the output is streamed and counted,
and refused past `RenderLimits`; repeating a string or list (`"ab " * 10000000`) or raising to a
power past those limits is refused before the value is built. Time and memory are bounded by
running renders in worker processes (`sandbox_pool`, with `render_worker` as their setup). This module imports Jinja and
`sandbox_outcomes` only, so a worker process stays small.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from npuserve.scheduler.text.sandbox_outcomes import JobAnswer, JobDone, JobRefused

# Largest exponent `a ** b` may take with |a| > 1 (larger powers are CPU and memory bombs).
MAX_POWER_EXPONENT = 4096


class ChatTemplateError(ValueError):
    """A chat template cannot be compiled or rendered, or it exceeded its limits; `field` names the
    request field at fault (`chat_template`, `messages`), when one is."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class RenderLimits:
    """How large a rendered prompt may be.

    `max_chars`: characters in all. `max_counted_chars`: characters other than `uncounted` ones
    (see `prompt_bound`): past it the prompt cannot fit the context, so rendering stops there.
    """

    max_chars: int
    max_counted_chars: int | None = None
    uncounted: str = ""


@dataclass(frozen=True, slots=True)
class ChatRender:
    """One render: the template text, its variables, its limits and the field to blame."""

    template: str
    variables: dict[str, Any]
    limits: RenderLimits
    field: str | None = None  # "chat_template" when the client gave the template
    model_name: str = ""


_limits: ContextVar[RenderLimits | None] = ContextVar("chat_template_limits", default=None)


def render(job: ChatRender) -> str:
    """The template's output, or ChatTemplateError (bad template, failure, or limits exceeded)."""
    try:
        compiled = compile_template(job.template)
    except ChatTemplateError as exc:
        raise ChatTemplateError(str(exc), job.field) from exc
    token = _limits.set(job.limits)
    try:
        return _collect(compiled.generate(**job.variables), job)
    except ChatTemplateError:
        raise
    except MemoryError as exc:
        raise ChatTemplateError("the chat template used more memory than allowed", job.field) from exc
    except Exception as exc:
        raise ChatTemplateError(
            f"the chat template of model {job.model_name} failed: {exc}", job.field
        ) from exc
    finally:
        _limits.reset(token)


def render_worker() -> Callable[[ChatRender], JobAnswer]:
    """A render worker's job handler (`sandbox_pool`): the rendered text, or why it failed."""
    return _render_outcome


def _render_outcome(job: ChatRender) -> JobAnswer:
    try:
        return JobDone(render(job))
    except ChatTemplateError as exc:
        return JobRefused(str(exc), exc.field)
    except MemoryError:  # past the worker's address-space limit outside the render itself
        return JobRefused("the chat template used more memory than allowed", job.field)


def _collect(chunks: Any, job: ChatRender) -> str:
    limits = job.limits
    parts: list[str] = []
    total = counted = 0
    for chunk in chunks:
        total += len(chunk)
        counted += len(chunk) - sum(chunk.count(c) for c in limits.uncounted)
        if limits.max_counted_chars is not None and counted > limits.max_counted_chars:
            raise ChatTemplateError(
                "the rendered chat prompt is longer than the model's context "
                f"(over {limits.max_counted_chars} characters already)",
                job.field or "messages",
            )
        if total > limits.max_chars:
            raise ChatTemplateError(
                f"the rendered chat prompt exceeds {limits.max_chars} characters", job.field or "messages"
            )
        parts.append(chunk)
    return "".join(parts)


class _LimitedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, refusing `*` and `**` results larger than the render's limit."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: jinja2.runtime.Context, op: str, left: Any, right: Any) -> Any:
        limits = _limits.get()
        limit = None if limits is None else limits.max_chars
        if op == "*" and limit is not None:
            for seq, times in ((left, right), (right, left)):
                size = (
                    len(seq) * times if isinstance(seq, (str, list, tuple)) and isinstance(times, int) else 0
                )
                if size > limit:
                    raise SecurityError(f"a repeated value of {size} items exceeds {limit}")
        is_power = op == "**" and isinstance(left, int) and isinstance(right, int)
        if is_power and abs(left) > 1 and right > MAX_POWER_EXPONENT:
            raise SecurityError(f"exponents above {MAX_POWER_EXPONENT} are not allowed")
        return super().call_binop(context, op, left, right)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # NOTE: jinja's own tojson escapes HTML characters and non-ASCII text; chat templates expect neither.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@lru_cache(maxsize=1)
def _jinja_env() -> ImmutableSandboxedEnvironment:
    """The sandboxed environment transformers renders chat templates in (templates are untrusted code)."""
    env = _LimitedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
    try:
        return _jinja_env().from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"the chat template is not valid jinja (line {exc.lineno}: {exc.message})"
        ) from exc
