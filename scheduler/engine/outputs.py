"""What clients receive: incremental completion deltas, turned from token ids into text.

A `RequestStream` belongs to one client request (with ``n`` sibling sequences). It runs on the
event loop of the process that serves the client's stream, off the step path: detokenization and
stop strings happen here, while the executors compute the next step. The engine feeds it
`SequenceUpdate`s through an `OutputSink`: the stream itself, or a relay to the API server process
that holds the stream (`api_relay`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import structlog

from npuserve.proto.step_plan import TokenLogprobs
from npuserve.scheduler.core.request import SamplingParams
from npuserve.scheduler.text.detokenizer import IncrementalDetokenizer
from npuserve.scheduler.text.tokenizer import Tokenizer

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class CompletionDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per new token, when asked
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0


@dataclass(slots=True)
class GenerateOutput:
    request_id: str
    completions: list[CompletionDelta]
    prompt_token_ids: list[int] | None = None  # on the first output
    usage: Usage | None = None  # on the last output
    resumed_tokens: int = 0  # on the first output of a resumed generation (`continuation`)
    finished: bool = False
    error: str | None = None
    refusal: Exception | None = None  # the request ended before its first output: raise this


class SequenceUpdate(NamedTuple):
    """What a step (or an end outside a step) did to one sequence, as its client stream needs it:
    a plain tuple, as it crosses from the core to an API server process in (pickled) batches."""

    choice: int  # the sequence's index among the request's n
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    finished: str | None  # the finish reason (a `RequestStatus` value) when it ended here
    stop_reason: int | str | None
    error: str | None
    num_output_tokens: int  # the sequence's output so far, this update's tokens included
    num_cached_tokens: int


# Takes one sequence's new text and token ids (choice, text, token_ids), when that is all an
# output would say.
TextListener = Callable[[int, str, list[int]], None]


class OutputSink(Protocol):
    """Where the engine sends a client request's sequence updates."""

    def add(self, update: SequenceUpdate) -> str | None:
        """New tokens (and perhaps the end) of one sequence; returns the stop string that ended
        it here, if one did (the engine then stops computing it)."""

    def end(self, update: SequenceUpdate) -> None:
        """A sequence ended outside a step (aborted, or its executor failed)."""

    def refuse(self, refusal: Exception) -> None:
        """The request ends before anything was sent: its stream raises ``refusal``."""


@dataclass(slots=True)
class SequenceState:
    detokenizer: IncrementalDetokenizer
    finished: bool = False
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    # Every token received (in an API server process, what the sequence resumes from if the
    # scheduler worker that ran it dies: `api_process.CoreLink`).
    token_ids: list[int] = field(default_factory=list)
    streamed: bool = False  # whether a delta of it has gone to the client
    held: CompletionDelta | None = None  # what waits for `--stream-interval` tokens


class RequestStream:
    """Collects a client request's ``n`` sibling sequences into one stream of `GenerateOutput`:
    detokenization and stop strings happen here, where the client's stream is served.

    ``stream_interval`` (vLLM's `--stream-interval`): a sequence's first delta and its last go
    out at once; the ones between are held until they carry this many tokens, so a stream sends
    one message per that many tokens (stop strings are still found at every token)."""

    def __init__(
        self,
        request_id: str,
        tokenizer: Tokenizer,
        params: SamplingParams,
        prompt_token_ids: list[int],
        stream_interval: int = 1,
    ) -> None:
        self.request_id = request_id
        self.stream_interval = stream_interval
        self.prompt_token_ids = prompt_token_ids
        self.arrival_time = time.monotonic()
        self._queue: asyncio.Queue[GenerateOutput] | None = None  # see `queue`
        # NOTE: None (queue the output) rather than a bound method of the stream, which would
        # make it a reference cycle that only the garbage collector frees (see `deploy/gc_heap`).
        self._deliver: Callable[[GenerateOutput], None] | None = None  # see `listen`
        self._on_text: TextListener | None = None  # see `listen`
        self.sequences = [
            SequenceState(
                IncrementalDetokenizer(
                    tokenizer,
                    prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                ),
            )
            for _ in range(params.n)
        ]
        self.finish_reasons: list[str | None] = [None] * params.n
        self.started = False  # the client has been sent something (the prompt comes with the first output)
        self.resumed_tokens = 0  # the output it resumed from (`continuation`), over all choices
        self.error: str | None = None
        self._num_unfinished = params.n

    @property
    def finished(self) -> bool:
        return self._num_unfinished == 0

    @property
    def queue(self) -> asyncio.Queue[GenerateOutput]:
        """The outputs made for `outputs` (made on first use: a stream that is listened to from
        its start, as `GenerateMany`'s are, never needs one)."""
        if self._queue is None:
            self._queue = asyncio.Queue()
        return self._queue

    def _mark_finished(self, index: int, reason: str) -> None:
        state = self.sequences[index]
        if not state.finished:
            state.finished = True
            self.finish_reasons[index] = reason
            self._num_unfinished -= 1

    def _count(self, state: SequenceState, update: SequenceUpdate, num_dropped: int = 0) -> None:
        """The sequence's output count after ``update``, less its last ``num_dropped`` tokens
        (those after a stop string: a multi-step step's, or a `--stream-interval` group's)."""
        # NOTE: an end relayed by the core may count fewer than the tokens a worker sent here
        # directly (`step_frames`): the count never goes down.
        num_output_tokens = update.num_output_tokens - num_dropped
        if num_output_tokens > state.num_output_tokens:
            state.num_output_tokens = num_output_tokens
        state.num_cached_tokens = update.num_cached_tokens

    def add(self, update: SequenceUpdate) -> str | None:
        # NOTE: runs for every token of every stream (or every `--stream-interval` of them):
        # what most tokens need costs no copy (whole token lists, no logprobs), and, with a text
        # listener (`listen`), no output objects either.
        state = self.sequences[update.choice]
        if state.finished:
            return None  # a step that ran while its stop was on the way
        token_ids = update.token_ids
        state.token_ids += token_ids
        result = state.detokenizer.update(token_ids)
        if (
            update.finished is None
            and result.stop_str is None
            and self._on_text is not None
            and self.started
            and (self.stream_interval == 1 or (state.held is None and len(token_ids) >= self.stream_interval))
            and not any(update.logprobs)
        ):
            # The usual update: text and ids that end nothing, for a listener of text.
            self._count(state, update)
            state.streamed = True
            self._on_text(update.choice, result.text, token_ids)
            return None
        kept = result.num_tokens_kept  # tokens after a stop string are not part of the output
        self._count(state, update, len(token_ids) - kept)
        logprobs = update.logprobs
        delta = CompletionDelta(
            update.choice,
            result.text,
            token_ids if kept == len(token_ids) else token_ids[:kept],
            [lp for lp in logprobs[:kept] if lp is not None] if any(logprobs) else [],
        )
        if result.stop_str is not None:
            delta.finish_reason, delta.stop_reason = "stop", result.stop_str
        elif update.finished is not None:
            delta.text += state.detokenizer.flush()
            delta.finish_reason, delta.stop_reason = update.finished, update.stop_reason
            self.error = self.error or update.error
        if delta.finish_reason is not None:
            self._mark_finished(update.choice, delta.finish_reason)
        self._emit(delta)
        return result.stop_str

    def end(self, update: SequenceUpdate) -> None:
        state = self.sequences[update.choice]
        if state.finished:
            return
        self._count(state, update)
        reason = update.finished or "abort"
        self._mark_finished(update.choice, reason)
        self.error = self.error or update.error
        self._emit(CompletionDelta(update.choice, "", [], finish_reason=reason))

    def refuse(self, refusal: Exception) -> None:
        """Ends a request that has sent nothing yet as if it had been refused on arrival: its
        stream raises ``refusal`` (a status for the client, e.g. UNAVAILABLE, not a broken stream)."""
        assert not self.started, "a request that has streamed output ends with `end`"
        for index in range(len(self.sequences)):
            self._mark_finished(index, "abort")
        self._hand_over(GenerateOutput(self.request_id, [], finished=True, refusal=refusal))

    def _emit(self, delta: CompletionDelta) -> None:
        if self.stream_interval > 1:
            state = self.sequences[delta.index]
            if state.held is not None:
                delta, state.held = merge_delta(state.held, delta), None
            if state.streamed and delta.finish_reason is None and len(delta.token_ids) < self.stream_interval:
                state.held = delta
                return
            state.streamed = True
        output = GenerateOutput(self.request_id, [delta])
        if not self.started:
            output.prompt_token_ids, self.started = self.prompt_token_ids, True
            output.resumed_tokens = self.resumed_tokens
        if not self._num_unfinished:
            output.finished, output.error = True, self.error
            num_prompt = len(self.prompt_token_ids)
            # NOTE: a resumed sequence's cache hit may reach into its output: prompt tokens only.
            num_cached = max(0, max(s.num_cached_tokens for s in self.sequences))
            output.usage = Usage(
                prompt_tokens=num_prompt,
                completion_tokens=sum(s.num_output_tokens for s in self.sequences),
                cached_prompt_tokens=min(num_cached, num_prompt),
            )
        self._hand_over(output)

    def _hand_over(self, output: GenerateOutput) -> None:
        deliver = self._deliver
        if deliver is None:
            self.queue.put_nowait(output)
        else:
            deliver(output)

    def listen(self, listener: Callable[[GenerateOutput], None], on_text: TextListener | None = None) -> None:
        """Hands each output to ``listener`` as it is made (any made already first), rather than
        queueing it for `outputs`: a client that writes outputs as they come (`GenerateMany`)
        then costs no task switch per output.

        With ``on_text``, an output that would carry only one sequence's new text and ids (no
        prompt, logprobs, end or usage: most of them) is handed to it as those instead, with no
        output made for it."""
        while self._queue is not None and not self._queue.empty():
            listener(self._queue.get_nowait())
        self._deliver = listener
        self._on_text = on_text

    async def outputs(self) -> AsyncIterator[GenerateOutput]:
        """The client's outputs, each merging what waited behind it, up to the last; raises the
        refusal of a request refused before it started."""
        while True:
            output = coalesce(await self.queue.get(), self.queue)
            if output.refusal is not None:
                raise output.refusal
            yield output
            if output.finished:
                return


def coalesce(output: GenerateOutput, queue: asyncio.Queue[GenerateOutput]) -> GenerateOutput:
    """Merges the outputs already waiting behind ``output`` into it: a client that reads slower
    than tokens arrive gets one message per read rather than one per token."""
    while not output.finished and not queue.empty():
        following = queue.get_nowait()
        for delta in following.completions:
            previous = next((d for d in output.completions if d.index == delta.index), None)
            if previous is None or previous.finish_reason is not None:
                output.completions.append(delta)
            else:
                merge_delta(previous, delta)
        output.usage = following.usage or output.usage
        output.finished, output.error = following.finished, following.error or output.error
    return output


def merge_delta(previous: CompletionDelta, delta: CompletionDelta) -> CompletionDelta:
    """``previous`` followed by ``delta`` (same choice), as one delta: ``previous``, extended."""
    previous.text += delta.text
    previous.token_ids = previous.token_ids + delta.token_ids
    previous.logprobs = previous.logprobs + delta.logprobs
    previous.finish_reason, previous.stop_reason = delta.finish_reason, delta.stop_reason
    return previous


@dataclass(slots=True, eq=False)
class OpenStream:
    """A request queued for a client: its stream, and what aborts what is left of the request
    once the client is done with it (`close`)."""

    stream: RequestStream
    leave: Callable[[], None]
    closed: bool = field(default=False, init=False)

    def close(self, usage: Usage | None) -> None:
        """The client is done with the stream (at its end, early, or gone): what is left of the
        request is aborted, and the request is logged; once (a stream whose reader stalled is
        closed before its generator is)."""
        if self.closed:
            return
        self.closed = True
        self.leave()
        stream = self.stream
        log.info(
            "request done",
            request_id=stream.request_id,
            finish_reasons=stream.finish_reasons,
            prompt_tokens=len(stream.prompt_token_ids),
            completion_tokens=usage.completion_tokens if usage else None,
            cached_prompt_tokens=usage.cached_prompt_tokens if usage else None,
            seconds=round(time.monotonic() - stream.arrival_time, 4),
        )


async def client_outputs(opened: OpenStream) -> AsyncGenerator[GenerateOutput, None]:
    """The stream's outputs for its client; however it leaves (at the end, early, or
    cancelled), the stream is closed."""
    usage = None
    try:
        async for output in opened.stream.outputs():
            usage = output.usage or usage
            yield output
    finally:
        opened.close(usage)
