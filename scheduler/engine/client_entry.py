"""The engine's entry points for clients: a request is checked, tokenized and its grammar
compiled (`Engine.queue_request` then places it), and its outputs streamed back; a client that
leaves early aborts what is left. A mixin of `Engine`, which provides what is declared here."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING

from npuserve.scheduler.core.request import SamplingParams
from npuserve.scheduler.engine.continuation import Continuation, resume_stream
from npuserve.scheduler.engine.engine_config import EngineConfig, new_request_id
from npuserve.scheduler.engine.outputs import (
    GenerateOutput,
    OpenStream,
    OutputSink,
    RequestStream,
    client_outputs,
)
from npuserve.scheduler.structured.matchers import Grammar
from npuserve.scheduler.text.prompts import PromptInput, PromptProcessor
from npuserve.scheduler.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from npuserve.deploy.runtime.gc_heap import IdleHeapRelease
    from npuserve.scheduler.engine.client_request import ClientRequest
    from npuserve.scheduler.structured.grammar_compiler import GrammarCompiler

__all__ = ["ClientEntryPoints"]


class ClientEntryPoints:
    config: EngineConfig
    tokenizer: Tokenizer
    prompts: PromptProcessor
    grammars: GrammarCompiler
    _heap: IdleHeapRelease  # a request being checked is work, refused or not

    if TYPE_CHECKING:  # provided by `Engine`

        def queue_request(
            self,
            request_id: str,
            prompt_ids: list[int],
            params: SamplingParams,
            grammar: Grammar | None,
            sink: OutputSink,
            stream_at: tuple[int, int, int] | None = None,
            continuation: Continuation | None = None,
        ) -> ClientRequest: ...

        def drop(self, request_id: str) -> None: ...

    async def open(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        request_id: str | None = None,
        model: str | None = None,
        continuation: Continuation | None = None,
    ) -> OpenStream:
        """Validates, tokenizes and queues a request for a client (``continuation``: a resumed
        generation's); errors are raised before anything is queued. Closing the stream aborts
        what is left."""
        with self._heap.working():
            self.prompts.check_request(model, params)
            grammar = await self._compile_grammar(params)
            prompt_ids = await self.prompts.prompt_token_ids(prompt)
            self.prompts.check_lengths(prompt_ids, params)
            request_id = request_id or new_request_id()
            stream = RequestStream(
                request_id, self.tokenizer, params, prompt_ids, self.config.stream_interval
            )
            resume_stream(stream, continuation, params, self.prompts.limits)
            self.queue_request(request_id, prompt_ids, params, grammar, stream, continuation=continuation)

        def leave() -> None:
            if not stream.finished:
                self.drop(stream.request_id)

        return OpenStream(stream, leave)

    async def _compile_grammar(self, params: SamplingParams) -> Grammar | None:
        so = params.structured_outputs
        return None if so is None else await self.grammars.compile(so)

    async def add_tokenized(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: OutputSink,
        stream_at: tuple[int, int, int],
        continuation: Continuation | None = None,
    ) -> None:
        """Queues a request an API server process has validated and tokenized (its model,
        sampling parameters, lengths and continuation are checked there); errors are raised
        before anything is queued. ``stream_at``: (that process's index, its incarnation, the
        stream's handle)."""
        with self._heap.working():
            grammar = await self._compile_grammar(params)
            self.queue_request(request_id, prompt_ids, params, grammar, sink, stream_at, continuation)

    async def generate(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        request_id: str | None = None,
        model: str | None = None,
    ) -> AsyncIterator[GenerateOutput]:
        """Streams a request's outputs; leaving the iteration early (or being cancelled) aborts it."""
        opened = await self.open(prompt, params, request_id, model)
        async with aclosing(client_outputs(opened)) as outputs:
            async for output in outputs:
                yield output
