"""Grammars compiled for a tokenizer: bounded first, vetted in killable worker processes, cached.

- `GrammarCompiler` turns a request's `StructuredOutputs` into a `Grammar` (`structured`) off the
  event loop and off the step path. A constraint past a size bound is refused before anything
  compiles it; any other is first compiled in a grammar worker process (`sandbox_pool`), within
  a time limit, because a hostile constraint can keep the grammar engine busy for minutes or
  crash it (a chain of a few thousand rules, or of a few hundred `$ref`s, overflows its stack):
  a crash or a time-out costs that worker only, which is replaced, and the request is refused
  naming `structured_outputs`. A constraint the worker compiled is then compiled here, on a
  thread (llguidance drops the GIL while it builds), where its matchers live. Outcomes are
  cached (LRU) under the constraint's canonical key, so a schema that repeats across requests
  compiles once (and a refused one is refused from the cache); each request starts from a copy.

JSON is compact by default (no whitespace between tokens, "," and ":"), and an object schema
that does not say otherwise takes no properties beyond its own (`additionalProperties: false`,
as OpenAI's strict mode requires), so a bounded schema always closes in a bounded number of
tokens, even on a weak model.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import llguidance
import structlog
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models

from npuserve.deploy.runtime.process_name import GRAMMAR_COMPILE
from npuserve.deploy.runtime.unknown_message import unknown_message
from npuserve.proto.step_plan import bitmask_words
from npuserve.proto.structured_outputs import FIELD, StructuredOutputs
from npuserve.scheduler.core.request import InvalidRequestError
from npuserve.scheduler.structured.grammar_closing import ByteVocab, ClosingBounds
from npuserve.scheduler.structured.matchers import Grammar, LiveCount
from npuserve.scheduler.text.sandbox_outcomes import (
    JobAnswer,
    JobDone,
    JobRefused,
    JobTimedOut,
    Outcome,
    WorkerDied,
)
from npuserve.scheduler.text.sandbox_pool import SandboxPool

log = structlog.get_logger(__name__)

__all__ = ["GrammarCompiler", "GrammarSettings", "check_bounds"]

COMPILE_TIMEOUT_S = 5.0
COMPILE_THREADS = 2
COMPILE_WORKERS = 2  # grammar worker processes, each compiling one constraint at a time
CACHE_SIZE = 256
# Bounds checked before any compile: a constraint's text (a schema, regex, grammar or its
# choices) and a grammar's rules. Real grammars (SQL, C in GBNF) have a few hundred rules.
MAX_CONSTRAINT_BYTES = 128 << 10
MAX_GRAMMAR_RULES = 1_000
# A rule's head: `name:` (Lark, also `?name:`, `!name:`, `name.2:`, `NAME:`) or `name ::=` (GBNF).
_RULE_HEAD = re.compile(r"^[ \t]*(?:[?!]?[A-Za-z_][\w]*(?:\.-?\d+)?[ \t]*:(?!:)|[\w-]+[ \t]*::=)", re.M)
# Resource limits of one grammar (llguidance's own, so a hostile grammar fails rather than runs on).
_MAX_GRAMMAR_SIZE, _MAX_LEXER_STATES, _INITIAL_LEXER_FUEL = 200_000, 100_000, 1_000_000
_COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
_SPACED = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANY_OBJECT = '{"type": "object"}'
_OPEN_OBJECT_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def check_bounds(constraint: StructuredOutputs, max_rules: int = MAX_GRAMMAR_RULES) -> None:
    """Refuses, naming `structured_outputs`, a constraint past the bounds on its size and (a
    grammar) its rules, before anything compiles it."""
    size = len(constraint.spec.encode()) + sum(len(choice.encode()) for choice in constraint.choices)
    if size > MAX_CONSTRAINT_BYTES:
        raise InvalidRequestError(
            f"structured_outputs: the {constraint.kind} constraint is {size} bytes long; at most "
            f"{MAX_CONSTRAINT_BYTES} are allowed",
            FIELD,
        )
    if constraint.kind == "grammar" and (rules := len(_RULE_HEAD.findall(constraint.spec))) > max_rules:
        raise InvalidRequestError(
            f"structured_outputs: the grammar has {rules} rules; at most {max_rules} are allowed",
            FIELD,
        )


# What a GrammarCompiler is built from (a scheduler worker process builds its own).
GrammarSettings = tuple[str, int, tuple[int, ...]]  # (tokenizer JSON, vocab size, EOS ids)


class GrammarCompiler:
    """Compiles constraints for one tokenizer; an LRU cache of grammars keyed canonically.
    `compile` vets each new constraint in the grammar workers, which `start` starts (or the
    first `compile`); `grammar_for` and `compile_now` compile on the calling thread."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        timeout_s: float = COMPILE_TIMEOUT_S,
        max_rules: int = MAX_GRAMMAR_RULES,
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self.timeout_s = timeout_s
        self.max_rules = max_rules
        self.workers = SandboxPool(
            "grammar", COMPILE_WORKERS, partial(grammar_worker, self.settings), GRAMMAR_COMPILE, timeout_s
        )
        self._started = False
        self._cache: OrderedDict[tuple[object, ...], Grammar | InvalidRequestError] = OrderedDict()
        self._inflight: dict[tuple[object, ...], asyncio.Future[Grammar]] = {}
        self._threads = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="npuserve-grammar")
        self._vocab: tuple[llguidance.LLTokenizer, ByteVocab] | None = None  # `_grammar_vocab`
        self._vocab_lock = threading.Lock()
        self.live = LiveCount()
        self.hits = 0
        self.misses = 0

    @property
    def settings(self) -> GrammarSettings:
        return self._tokenizer_json, self.vocab_size, tuple(self._eos)

    def start(self) -> None:
        """Starts the grammar workers in the background (on the event loop)."""
        if not self._started:
            self._started = True
            self.workers.start()

    async def wait_started(self) -> None:
        await self.workers.wait_started()

    def close(self) -> None:
        self.workers.close()
        self._threads.shutdown(wait=False, cancel_futures=True)

    def grammar_for(self, constraint: StructuredOutputs) -> Grammar:
        """The grammar of a constraint the front has already compiled once (so it compiles),
        from the cache or compiled on the calling thread (a scheduler worker's)."""
        key = constraint.key
        cached = self._cache.get(key)
        if isinstance(cached, Grammar):
            self._cache.move_to_end(key)
            return cached
        grammar = self.compile_now(constraint)
        self._remember(key, grammar)
        return grammar

    @property
    def num_live_states(self) -> int:
        return self.live.value

    async def compile(self, constraint: StructuredOutputs) -> Grammar:
        """The grammar of `constraint`, from the cache or vetted in a grammar worker, then
        compiled on a grammar thread; InvalidRequestError naming `structured_outputs` when it is
        past a bound, does not compile, does not in time, or crashes its worker."""
        key = constraint.key
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            if isinstance(cached, InvalidRequestError):
                raise type(cached)(str(cached), cached.field)
            return cached
        self.misses += 1
        future = self._inflight.get(key)
        if future is None:
            future = asyncio.ensure_future(self._vet_and_compile(constraint))
            self._inflight[key] = future
            future.add_done_callback(lambda f: self._store(key, f))
        return await asyncio.shield(future)

    async def _vet_and_compile(self, constraint: StructuredOutputs) -> Grammar:
        check_bounds(constraint, self.max_rules)
        self.start()
        refusal = _refusal(constraint, await self.workers.run(constraint), self.timeout_s)
        if refusal is not None:
            log.warning("grammar refused by its worker", kind=constraint.kind, why=str(refusal))
            raise refusal
        # NOTE: compiled once already, in about as long, without a crash: safe here.
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, self.compile_now, constraint)

    def _store(self, key: tuple[object, ...], future: asyncio.Future[Grammar]) -> None:
        self._inflight.pop(key, None)
        if future.cancelled():
            return
        error = future.exception()
        if error is not None and not isinstance(error, InvalidRequestError):
            return  # not the constraint's fault: not remembered
        self._remember(key, future.result() if error is None else error)

    def _remember(self, key: tuple[object, ...], value: Grammar | InvalidRequestError) -> None:
        """Caches a compile's outcome as the newest entry, dropping the oldest beyond the size."""
        self._cache[key] = value
        self._cache.move_to_end(key)
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)

    def compile_now(self, constraint: StructuredOutputs) -> Grammar:
        """Compiles on the calling thread (no cache); InvalidRequestError for a bad constraint."""
        source = _grammar_source(constraint)
        limits = llguidance.LLParserLimits(
            max_grammar_size=_MAX_GRAMMAR_SIZE,
            max_lexer_states=_MAX_LEXER_STATES,
            initial_lexer_fuel=_INITIAL_LEXER_FUEL,
        )
        tokenizer, vocab = self._grammar_vocab()
        matcher = llguidance.LLMatcher(tokenizer, source, log_level=0, limits=limits)
        if matcher.is_error():
            raise InvalidRequestError(
                f"structured_outputs: the {constraint.kind} constraint is invalid: {matcher.get_error()}",
                FIELD,
            )
        bounds = ClosingBounds.of(matcher, vocab)
        grammar = Grammar(constraint, matcher, self.vocab_size, self.live, vocab, bounds)
        probe = grammar.new_state()  # NOTE: a constraint no token can start is refused up front
        error = probe.error
        probe.release()
        if error is not None:
            raise InvalidRequestError(f"{error}: no token of this model can start it", FIELD)
        return grammar

    def _grammar_vocab(self) -> tuple[llguidance.LLTokenizer, ByteVocab]:
        """The grammar engine's tokenizer and the bytes of its tokens, built on first use."""
        with self._vocab_lock:
            if self._vocab is None:
                tokenizer_json = grammar_tokenizer_json(self._tokenizer_json)
                tokenizer = llguidance.LLTokenizer(
                    tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos
                )
                words = bitmask_words(self.vocab_size)
                self._vocab = tokenizer, ByteVocab.of(tokenizer, self.vocab_size, tuple(self._eos), words)
            return self._vocab


def grammar_worker(settings: GrammarSettings) -> Callable[[StructuredOutputs], JobAnswer]:
    """A grammar worker's job handler (`sandbox_pool`): compiles a constraint, answers whether
    it compiled. The worker builds the grammar tokenizer once, here."""
    compiler = GrammarCompiler(*settings)
    compiler._grammar_vocab()

    def vet(constraint: StructuredOutputs) -> JobAnswer:
        try:
            compiler.compile_now(constraint)
        except InvalidRequestError as exc:
            return JobRefused(str(exc), exc.field or FIELD)
        except MemoryError:
            return JobRefused(
                f"structured_outputs: the {constraint.kind} constraint needs more memory to compile than allowed",
                FIELD,
            )
        return JobDone()

    return vet


def _refusal(constraint: StructuredOutputs, outcome: Outcome, timeout_s: float) -> InvalidRequestError | None:
    """The refusal a grammar worker's outcome stands for; None when the constraint compiled."""
    kind = constraint.kind
    match outcome:
        case JobDone():
            return None
        case JobRefused(message=message, field=field):
            return InvalidRequestError(message, field or FIELD)
        case JobTimedOut():
            return InvalidRequestError(
                f"structured_outputs: the {kind} constraint did not compile within {timeout_s:g} s; simplify it",
                FIELD,
            )
        case WorkerDied():
            return InvalidRequestError(
                f"structured_outputs: the {kind} constraint crashed the grammar compiler (rules or "
                "references chained too deep?); simplify it",
                FIELD,
            )
        case _:
            unknown_message("a grammar compile", outcome)


_SPACES_PROBE = "  a  b  "


def grammar_tokenizer_json(tokenizer_json: str) -> str:
    """The tokenizer as the grammar engine needs it: one that turns any text into tokens whose
    bytes are exactly that text. Normalizer steps that drop or merge spaces (llama2.c exports
    strip leading and trailing spaces and collapse runs of them) go: llguidance tokenizes the
    bytes a grammar forces (" is " in a regex) to build the mask, and a tokenizer that loses
    their spaces yields a mask the matcher then refuses. The vocabulary and decoding are kept."""
    spec = json.loads(tokenizer_json)
    normalizer = spec.get("normalizer")
    if not isinstance(normalizer, dict):
        return tokenizer_json
    steps = normalizer.get("normalizers", []) if normalizer.get("type") == "Sequence" else [normalizer]
    kept = [step for step in steps if not _drops_spaces(step)]
    if len(kept) == len(steps):
        return tokenizer_json
    spec["normalizer"] = {"type": "Sequence", "normalizers": kept} if kept else None
    return json.dumps(spec)


def _drops_spaces(step: dict[str, Any]) -> bool:
    """Whether a normalizer step leaves fewer spaces (or metaspaces) than the probe holds."""
    spec = json.loads(BackendTokenizer(models.BPE()).to_str())  # an empty tokenizer, with the step
    spec["normalizer"] = step
    normalized = BackendTokenizer.from_str(json.dumps(spec)).normalizer
    assert normalized is not None
    out = normalized.normalize_str(_SPACES_PROBE)
    return out.count(" ") + out.count("\u2581") < _SPACES_PROBE.count(" ")


def _grammar_source(constraint: StructuredOutputs) -> str:
    """llguidance's grammar text for a constraint; InvalidRequestError where it cannot be one."""
    options = _COMPACT if constraint.compact_whitespace else _SPACED
    try:
        if constraint.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(_ANY_OBJECT, overrides=options)  # type: ignore[arg-type]
        if constraint.kind == "json_schema":
            schema = _closed_objects(json.loads(constraint.spec))
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)  # type: ignore[arg-type]
        if constraint.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(constraint.spec)
        if constraint.kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(list(constraint.choices)))
        is_gbnf = "::=" in constraint.spec
        return llguidance.grammar_from("gbnf" if is_gbnf else "lark", constraint.spec)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequestError(
            f"structured_outputs: the {constraint.kind} is invalid: {exc}", FIELD
        ) from None


def _closed_objects(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on each object schema that lists its
    properties and says nothing of others (strict JSON: only the properties it names)."""
    if isinstance(schema, list):
        return [_closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed_objects(value) for key, value in schema.items()}
    if "properties" in closed and not any(key in closed for key in _OPEN_OBJECT_KEYS):
        closed["additionalProperties"] = False
    return closed
