"""What clients receive: incremental completion deltas, turned from token ids into text.

A `RequestStream` belongs to one client request (with ``n`` sibling sequences). It runs on the
event loop, off the lane threads' critical path: detokenization and stop strings happen here,
while the executors compute the next step.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from npuserve.proto.step_plan import TokenLogprobs
from npuserve.scheduler.detokenizer import IncrementalDetokenizer
from npuserve.scheduler.request import Request, RequestStatus, SamplingParams
from npuserve.scheduler.tokenizer import Tokenizer


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
    finished: bool = False
    error: str | None = None
    refusal: Exception | None = None  # the request ended before its first output: raise this


@dataclass(slots=True)
class SequenceState:
    request: Request
    detokenizer: IncrementalDetokenizer
    finished: bool = False


class RequestStream:
    """Collects a client request's sibling sequences into one stream of `GenerateOutput`."""

    def __init__(
        self,
        request_id: str,
        children: list[Request],
        tokenizer: Tokenizer,
        params: SamplingParams,
        prompt_token_ids: list[int],
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.arrival_time = time.monotonic()
        self.queue: asyncio.Queue[GenerateOutput] = asyncio.Queue()
        self.sequences = {
            child.req_id: SequenceState(
                child,
                IncrementalDetokenizer(
                    tokenizer,
                    prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                ),
            )
            for child in children
        }
        self.index_of = {child.req_id: index for index, child in enumerate(children)}
        self._sent_prompt = False
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences.values())

    def add_tokens(
        self,
        req_id: str,
        token_ids: list[int],
        logprobs: list[TokenLogprobs | None],
        finished: RequestStatus | None,
    ) -> bool:
        """Streams new tokens of one sequence; returns True if a stop string ended it here
        (the caller then tells the scheduler to stop computing it)."""
        state = self.sequences[req_id]
        if state.finished:
            return False  # a step that ran while its stop was on the way
        update = state.detokenizer.update(token_ids)
        kept = update.num_tokens_kept  # tokens after a stop string are not part of the output
        delta = CompletionDelta(
            self.index_of[req_id],
            update.text,
            token_ids[:kept],
            [lp for lp in logprobs[:kept] if lp is not None],
        )
        stopped_by_string = update.stop_str is not None
        if stopped_by_string:
            delta.finish_reason, delta.stop_reason = "stop", update.stop_str
            state.request.stop_reason = update.stop_str
        elif finished is not None:
            delta.text += state.detokenizer.flush()
            delta.finish_reason, delta.stop_reason = finished.value, state.request.stop_reason
            self.error = self.error or state.request.error
        state.finished = delta.finish_reason is not None
        self._emit(delta)
        return stopped_by_string

    def end(self, req_id: str, status: RequestStatus, error: str | None = None) -> None:
        """A sequence ended outside a step (aborted, or its executor failed)."""
        state = self.sequences.get(req_id)
        if state is None or state.finished:
            return
        state.finished = True
        self.error = self.error or error
        self._emit(CompletionDelta(self.index_of[req_id], "", [], finish_reason=status.value))

    @property
    def started(self) -> bool:
        """Whether the client has been sent anything (the prompt comes with the first output)."""
        return self._sent_prompt

    def refuse(self, refusal: Exception) -> None:
        """Ends a request that has sent nothing yet as if it had been refused on arrival: its
        stream raises ``refusal`` (a status for the client, e.g. UNAVAILABLE, not a broken stream)."""
        assert not self.started, "a request that has streamed output ends with `end`"
        for state in self.sequences.values():
            state.finished = True
        self.queue.put_nowait(GenerateOutput(self.request_id, [], finished=True, refusal=refusal))

    def _emit(self, delta: CompletionDelta) -> None:
        output = GenerateOutput(self.request_id, [delta])
        if not self._sent_prompt:
            output.prompt_token_ids, self._sent_prompt = self.prompt_token_ids, True
        if self.finished:
            output.finished, output.error = True, self.error
            output.usage = Usage(
                prompt_tokens=len(self.prompt_token_ids),
                completion_tokens=sum(s.request.num_output_tokens for s in self.sequences.values()),
                cached_prompt_tokens=max(
                    0, max(s.request.num_cached_tokens for s in self.sequences.values())
                ),
            )
        self.queue.put_nowait(output)


def coalesce(output: GenerateOutput, queue: asyncio.Queue[GenerateOutput]) -> GenerateOutput:
    """Merges the outputs already waiting behind ``output`` into it: a client that reads slower
    than tokens arrive gets one message per read rather than one per token."""
    while not output.finished and not queue.empty():
        following = queue.get_nowait()
        for delta in following.completions:
            previous = next((d for d in output.completions if d.index == delta.index), None)
            if previous is None or previous.finish_reason is not None:
                output.completions.append(delta)
                continue
            previous.text += delta.text
            previous.token_ids = previous.token_ids + delta.token_ids
            previous.logprobs = previous.logprobs + delta.logprobs
            previous.finish_reason, previous.stop_reason = delta.finish_reason, delta.stop_reason
        output.usage = following.usage or output.usage
        output.finished, output.error = following.finished, following.error or output.error
    return output
