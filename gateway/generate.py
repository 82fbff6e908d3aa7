"""One completion or chat request as scheduler calls: fan out, merge, and answer in OpenAI's shape.

A completions request with several prompts becomes one scheduler call per prompt; their choices
are numbered as OpenAI does (`prompt_index * n + choice`). The first update of every call is
awaited before anything is sent, so a refused request is a plain HTTP error rather than a
broken stream. Leaving a stream early (a client that went away) cancels every call, and the
scheduler then aborts those requests and frees their blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import structlog

from npuserve.gateway.chat_output import ChoiceOutput, OutputShape, whole_message
from npuserve.gateway.chat_output import finish_reason as chat_finish_reason
from npuserve.gateway.convert import ChoiceDelta, TokenLogprob, Update, Usage
from npuserve.gateway.errors import APIError, error_body
from npuserve.gateway.protocol import SSE_DONE, ChunkEvents, sse_event, usage_dict
from npuserve.gateway.scheduler_client import GenerateCall, SchedulerClient

log = structlog.get_logger(__name__)


async def start_calls(
    client: SchedulerClient, requests: Sequence[Any]
) -> tuple[list[GenerateCall], list[Update]]:
    """Starts every call and waits for each one's first update; cancels them all on any error."""
    calls = client.generate(requests)
    try:
        firsts = await asyncio.gather(*(call.next() for call in calls))
        updates = [Update([]) if u is None else u for u in firsts]
        for update in updates:
            _raise_on_error(update)
    except BaseException:
        for call in calls:
            call.cancel()
        raise
    return calls, updates


def _raise_on_error(update: Update) -> None:
    for delta in update.choices:
        if delta.finish_reason == "error":
            message = delta.error or "the request failed in the scheduler"
            raise APIError(500, message, "server_error", code="generation_failed")


async def _merged(
    calls: list[GenerateCall], firsts: list[Update]
) -> AsyncGenerator[tuple[int, Update], None]:
    """Every call's updates as (call index, update), in arrival order."""
    for i, first in enumerate(firsts):
        yield i, first
    if len(calls) == 1:  # the common case: no tasks, no queue
        while (update := await calls[0].next()) is not None:
            yield 0, update
        return
    # NOTE: bounded: output that a client does not read yet waits in its call's stream, as the
    # scheduler sent it, not converted to updates here; a client that stopped reading is cut
    # off after the stall timeout (`http_protocol`), and its calls with it, and one that reads
    # too slowly once its call's stream holds the most it may (`scheduler_client`).
    queue: asyncio.Queue[tuple[int, Update | APIError | None]] = asyncio.Queue(maxsize=len(calls))

    async def pump(i: int, call: GenerateCall) -> None:
        try:
            while (update := await call.next()) is not None:
                await queue.put((i, update))
            await queue.put((i, None))
        except APIError as exc:
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, call)) for i, call in enumerate(calls)]
    try:
        remaining = len(calls)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, APIError):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


@dataclass(slots=True)
class Choice:
    """What one output choice has produced so far."""

    index: int
    prompt_index: int
    started: bool = False  # the echoed prompt was sent (completions)
    text_len: int = 0  # characters of text already produced (completions' text_offset)
    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    output: ChoiceOutput | None = None  # its parsers, set by a streaming `ChatFormat` that has some

    def add(self, delta: ChoiceDelta) -> None:
        """Keeps ``delta``'s text, logprobs and finish for the whole response."""
        self.parts.append(delta.text)
        self.logprobs += delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


class Generation:
    """One client request over its scheduler calls; `stream()` or `collect()` consumes it once."""

    def __init__(
        self,
        kind: CompletionFormat | ChatFormat,
        calls: list[GenerateCall],
        firsts: list[Update],
        n: int,
        response_id: str,
        model: str,
        include_usage: bool,
    ) -> None:
        self.kind = kind
        self.calls = calls
        self.firsts = firsts
        self.n = n
        self.include_usage = include_usage
        self.head = {"id": response_id, "object": "", "created": int(time.time()), "model": model}
        self.choices = [Choice(p * n + j, p) for p in range(len(calls)) for j in range(n)]
        self.usage = Usage(0, 0, 0)

    def cancel(self) -> None:
        for call in self.calls:
            call.cancel()

    def _add_usage(self, usage: Usage | None) -> None:
        if usage is not None:
            self.usage.prompt_tokens += usage.prompt_tokens
            self.usage.completion_tokens += usage.completion_tokens
            self.usage.cached_tokens += usage.cached_tokens

    def _usage(self) -> dict[str, Any]:
        u = self.usage
        return usage_dict(u.prompt_tokens, u.completion_tokens, u.cached_tokens)

    async def stream(self) -> AsyncIterator[bytes]:
        """Server-sent events: chunks, the usage chunk when asked, then `[DONE]`; an error that
        happens mid-stream is sent as an OpenAI error event before `[DONE]`."""
        events = ChunkEvents({**self.head, "object": self.kind.chunk_object})
        for call in self.calls:
            call.streaming()
        try:
            for choice in self.choices:
                opening = self.kind.opening_chunk(choice)
                if opening is not None:
                    yield events.choice(opening)
            async with aclosing(_merged(self.calls, self.firsts)) as updates:
                async for p, update in updates:
                    _raise_on_error(update)
                    for delta in update.choices:
                        choice = self.choices[p * self.n + delta.index]
                        chunk = self.kind.delta_chunk(choice, delta, self.firsts[p].prompt_text)
                        if chunk is not None:
                            yield events.choice(chunk)
                    self._add_usage(update.usage)
            if self.include_usage:
                yield events.usage(self._usage())
        except APIError as exc:
            log.warning("stream failed", status=exc.status, error=exc.message)
            yield sse_event(exc.body())
        except Exception as exc:  # a bug here must still end the stream the way clients expect
            log.exception("stream failed", error=str(exc))
            yield sse_event(error_body("internal server error", "server_error"))
        finally:
            self.cancel()
        yield SSE_DONE

    async def collect(self) -> dict[str, Any]:
        """The whole response, once every choice has finished."""
        try:
            async with aclosing(_merged(self.calls, self.firsts)) as updates:
                async for p, update in updates:
                    _raise_on_error(update)
                    for delta in update.choices:
                        choice = self.choices[p * self.n + delta.index]
                        self.kind.accumulate(choice, delta, self.firsts[p].prompt_text)
                    self._add_usage(update.usage)
        finally:
            self.cancel()
        choices = [self.kind.full_choice(choice) for choice in self.choices]
        return {**self.head, "object": self.kind.full_object, "choices": choices, "usage": self._usage()}


class CompletionFormat:
    """`/v1/completions`: text choices, `echo`, and logprobs with text offsets."""

    chunk_object = full_object = "text_completion"

    def __init__(self, prompts: Sequence[str | list[int]], echo: bool, logprobs: bool) -> None:
        self.prompts = prompts
        self.echo = echo
        self.logprobs = logprobs

    def _echo_text(self, choice: Choice, prompt_text: str | None) -> str:
        if not self.echo or choice.started:
            return ""
        choice.started = True
        prompt = self.prompts[choice.prompt_index]
        return prompt if isinstance(prompt, str) else (prompt_text or "")

    def _logprobs(self, choice: Choice, entries: list[TokenLogprob]) -> dict[str, Any]:
        offsets, offset = [], choice.text_len
        for entry in entries:
            offsets.append(offset)
            offset += len(entry.token)
        return {
            "text_offset": offsets,
            "token_logprobs": [e.logprob for e in entries],
            "tokens": [e.token for e in entries],
            "top_logprobs": [_top_dict(e) for e in entries],
        }

    def opening_chunk(self, choice: Choice) -> dict[str, Any] | None:
        return None

    def delta_chunk(
        self, choice: Choice, delta: ChoiceDelta, prompt_text: str | None
    ) -> dict[str, Any] | None:
        echoed = self._echo_text(choice, prompt_text)
        choice.text_len += len(echoed)
        logprobs = self._logprobs(choice, delta.logprobs) if self.logprobs else None
        choice.text_len += len(delta.text)
        text = echoed + delta.text
        if not text and not delta.logprobs and delta.finish_reason is None:
            return None
        return {
            "index": choice.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason,
        }

    def accumulate(self, choice: Choice, delta: ChoiceDelta, prompt_text: str | None) -> None:
        echoed = self._echo_text(choice, prompt_text)
        if echoed:
            choice.parts.append(echoed)
            choice.text_len = len(echoed)  # where the first generated token's offset starts
        choice.add(delta)

    def full_choice(self, choice: Choice) -> dict[str, Any]:
        logprobs = self._logprobs(choice, choice.logprobs) if self.logprobs else None
        return {
            "index": choice.index,
            "text": "".join(choice.parts),
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }


def _top_dict(entry: TokenLogprob) -> dict[str, float]:
    top = {t.token: t.logprob for t in entry.top}
    top.setdefault(entry.token, entry.logprob)  # the sampled token is always listed, as vLLM does
    return top


class ChatFormat:
    """`/v1/chat/completions`: an assistant message per choice, logprobs as `content[]`."""

    chunk_object = "chat.completion.chunk"
    full_object = "chat.completion"

    def __init__(self, logprobs: bool, shape: OutputShape | None = None) -> None:
        self.logprobs = logprobs
        self.shape = None if shape is None or shape.plain else shape

    def opening_chunk(self, choice: Choice) -> dict[str, Any] | None:
        if self.shape is not None:
            choice.output = ChoiceOutput(self.shape)
        return {
            "index": choice.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def delta_chunk(
        self, choice: Choice, delta: ChoiceDelta, prompt_text: str | None
    ) -> dict[str, Any] | None:
        output = choice.output
        finish_reason = delta.finish_reason
        if output is None:
            message = {"content": delta.text} if delta.text else {}
        else:
            message = output.delta(delta.text, final=finish_reason is not None)
            finish_reason = chat_finish_reason(finish_reason, output.called)
        if not message and not delta.logprobs and finish_reason is None:
            return None
        return {
            "index": choice.index,
            "delta": message,
            "logprobs": {"content": [_chat_logprob(e) for e in delta.logprobs]} if self.logprobs else None,
            "finish_reason": finish_reason,
            "stop_reason": delta.stop_reason,
        }

    def accumulate(self, choice: Choice, delta: ChoiceDelta, prompt_text: str | None) -> None:
        choice.add(delta)

    def full_choice(self, choice: Choice) -> dict[str, Any]:
        text, finish_reason = "".join(choice.parts), choice.finish_reason
        if self.shape is None:
            message: dict[str, Any] = {"role": "assistant", "content": text}
        else:
            message, called = whole_message(self.shape, text)
            finish_reason = chat_finish_reason(finish_reason, called)
        return {
            "index": choice.index,
            "message": message,
            "logprobs": {"content": [_chat_logprob(e) for e in choice.logprobs]} if self.logprobs else None,
            "finish_reason": finish_reason,
            "stop_reason": choice.stop_reason,
        }


def _chat_logprob(entry: TokenLogprob) -> dict[str, Any]:
    return {
        "token": entry.token,
        "logprob": entry.logprob,
        "bytes": list(entry.token.encode("utf-8")),
        "top_logprobs": [
            {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode("utf-8"))}
            for t in entry.top
        ],
    }
