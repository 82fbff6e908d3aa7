"""Client input to token ids and back, within the model's limits, never stalling the event loop.

A `PromptProcessor` validates a request's prompt, renders chat templates (in render processes,
with time and size limits), tokenizes (long texts on threads, after a length bound has shown
they can fit) and checks lengths against the context. The engine uses one, and so does each
API server process (`--api-server-count`), which does all of this before the core sees a request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from npuserve.deploy.runtime.process_name import CHAT_RENDER
from npuserve.deploy.runtime.unknown_message import unknown_message
from npuserve.proto.channel import MAX_API_MESSAGE_BYTES
from npuserve.scheduler.core.request import InvalidRequestError, SamplingParams
from npuserve.scheduler.text.chat_template import ChatRender, RenderLimits, render_worker
from npuserve.scheduler.text.sandbox_outcomes import JobDone, JobRefused, JobTimedOut, WorkerDied
from npuserve.scheduler.text.sandbox_pool import SandboxPool
from npuserve.scheduler.text.tokenizer import Tokenizer, TokenizerError

T = TypeVar("T")

# Texts up to this many characters are tokenized on the event loop; longer ones on a thread.
INLINE_TOKENIZE_CHARS = 512
TOKENIZE_THREADS = 4
MODEL_TEMPLATE_WORKERS = 2  # render processes for the model's own chat template
REQUEST_TEMPLATE_WORKERS = 1  # and for clients' templates (with --trust-request-chat-template)
# A rendered prompt may be no longer than a text prompt a client can send.
MAX_RENDERED_CHARS = MAX_API_MESSAGE_BYTES


class ModelNotFoundError(LookupError):
    """The request names a model this server does not serve (gRPC NOT_FOUND, HTTP 404)."""


@dataclass(slots=True)
class PromptInput:
    """Exactly one of text, token ids or chat messages."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict[str, object]] | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    add_special_tokens: bool | None = None  # None: True for text, False for chat
    tools: list[dict[str, object]] | None = None  # the chat template's `tools`


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What the served model accepts: its name, context length and vocabulary."""

    model_name: str
    max_model_len: int
    vocab_size: int


class PromptProcessor:
    def __init__(self, tokenizer: Tokenizer, limits: ModelLimits, trust_request_chat_template: bool) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        # NOTE: tokenizing, rendering and detokenizing long inputs never runs on the event loop,
        # which must keep answering every other request and dispatching steps meanwhile.
        self._threads = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="npuserve-tokenize")
        self._model_renders = SandboxPool("model", MODEL_TEMPLATE_WORKERS, render_worker, CHAT_RENDER)
        self._request_renders = (
            SandboxPool("request", REQUEST_TEMPLATE_WORKERS, render_worker, CHAT_RENDER)
            if trust_request_chat_template
            else None
        )

    def start(self) -> None:
        if self.tokenizer.chat_template is not None:
            self._model_renders.start()
        if self._request_renders is not None:
            self._request_renders.start()

    async def wait_started(self) -> None:
        """Returns once the render processes `start` started are up (or failed to start)."""
        for pool in (self._model_renders, self._request_renders):
            if pool is not None:
                await pool.wait_started()

    def close(self) -> None:
        for pool in (self._model_renders, self._request_renders):
            if pool is not None:
                pool.close()
        self._threads.shutdown(wait=False, cancel_futures=True)

    def check_model(self, model: str | None) -> None:
        name = self.limits.model_name
        if model and model != name:
            raise ModelNotFoundError(f"the model `{model}` does not exist; this server serves `{name}`")

    def check_request(self, model: str | None, params: SamplingParams) -> None:
        """The checks a request passes before its prompt is looked at."""
        self.check_model(model)
        params.validate(self.limits.vocab_size)

    async def prompt_token_ids(self, prompt: PromptInput) -> list[int]:
        """The prompt's token ids; a text that cannot fit the context is refused from its length,
        before it is tokenized."""
        given = [x is not None for x in (prompt.text, prompt.token_ids, prompt.messages)]
        if sum(given) != 1:
            raise InvalidRequestError(
                "give exactly one of a prompt text, prompt token ids or chat messages", "prompt"
            )
        if prompt.messages is not None:
            text = await self._render_chat(prompt)
            # NOTE: chat templates write their own special tokens (BOS included).
            return await self._encode(text, bool(prompt.add_special_tokens))
        if prompt.text is not None:
            if not prompt.text:
                raise InvalidRequestError("the prompt is empty", "prompt")
            return await self._encode(prompt.text, prompt.add_special_tokens is not False)
        token_ids = list(prompt.token_ids or [])
        self._check_token_ids(token_ids, "prompt token ids", "prompt")
        return token_ids

    def _check_token_ids(self, token_ids: list[int], what: str, field: str) -> None:
        vocab_size = self.limits.vocab_size
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
            raise InvalidRequestError(f"{what} must be in [0, {vocab_size})", field)

    async def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        """Text of `token_ids` (any number), decoded off the event loop when there are many."""
        self._check_token_ids(token_ids, "token ids", "token_ids")
        if len(token_ids) <= INLINE_TOKENIZE_CHARS:
            return self.tokenizer.decode(token_ids, skip_special_tokens)
        return await self.off_loop(
            lambda: self.tokenizer.decode(token_ids, skip_special_tokens, release_gil=True)
        )

    async def off_loop(self, work: Callable[[], T]) -> T:
        """Runs CPU-heavy work (tokenizer calls) on worker threads."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, work)

    async def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """The ids of `text`; refused when its length alone shows it holds at least
        `max_model_len` tokens."""
        bound = self.tokenizer.size_bound
        max_model_len = self.limits.max_model_len
        if bound is not None and (at_least := bound.min_tokens(text)) >= max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"prompt has at least {at_least} tokens ({len(text)} characters), and at least one "
                "token must be generated.",
                "prompt",
            )
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens)
        return await self.off_loop(lambda: self.tokenizer.encode(text, add_special_tokens, release_gil=True))

    async def _render_chat(self, prompt: PromptInput) -> str:
        assert prompt.messages is not None
        pool = self._model_renders
        if prompt.chat_template is not None:
            if self._request_renders is None:
                raise TokenizerError(
                    "chat templates sent with a request are off on this server: leave out "
                    "chat_template to use the model's own (the operator can start the scheduler "
                    "with --trust-request-chat-template)",
                    "chat_template",
                )
            pool = self._request_renders
        bound = self.tokenizer.size_bound
        max_counted = None if bound is None else bound.max_counted_chars(self.limits.max_model_len - 1)
        limits = RenderLimits(MAX_RENDERED_CHARS, max_counted, "" if bound is None else bound.uncounted)
        job = self.tokenizer.chat_render(
            prompt.messages, prompt.add_generation_prompt, prompt.chat_template, limits, prompt.tools
        )
        return await render_in(pool, job)

    def check_lengths(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        num_prompt = len(prompt_token_ids)
        max_model_len = self.limits.max_model_len
        if num_prompt == 0:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if num_prompt >= max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"prompt has {num_prompt} tokens, and at least one token must be generated.",
                "prompt",
            )
        if params.max_tokens is not None and num_prompt + params.max_tokens > max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {num_prompt + params.max_tokens} tokens ({num_prompt} in the prompt, "
                f"{params.max_tokens} in the completion). Please reduce the prompt or max_tokens.",
                "max_tokens",
            )


async def render_in(pool: SandboxPool, job: ChatRender) -> str:
    """The rendered text of `job`, by a worker of `pool`; TokenizerError when the template fails
    or exceeds a limit (time, memory, size)."""
    outcome = await pool.run(job)
    match outcome:
        case JobDone(value=text):
            return str(text)
        case JobRefused(message=message, field=field):
            raise TokenizerError(message, field or None)
        case JobTimedOut():
            raise TokenizerError(
                f"the chat template took longer than {pool.timeout_s:g} s to render", job.field
            )
        case WorkerDied():
            raise TokenizerError("the chat template ended its render process (out of memory?)", job.field)
        case _:
            unknown_message("a chat template render", outcome)
