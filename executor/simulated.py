"""A simulated executor: the real step protocol and request bookkeeping, no model, no tensors.

`SimulatedRunner` keeps per-request state the way the `ModelRunner` does (new requests whole,
then block deltas, finished ids, reset), refuses the plans the real runner refuses where that is
cheap to check (`PlanError`), and answers every request whose computed plus scheduled tokens
reach its known tokens with one token. The token is a hash of the request id and the position,
so runs are reproducible (`simulated_token`), and never an EOS unless `eos_after` asks for one.
A plan's KV block copies are checked and counted; they move nothing and take no modelled time.

Pulls from other executors (`StepPlan.kv_pulls`) run as a real executor runs them, beside its
steps, without the bytes: given a ``block_reader`` (`simulated_fleet` gives it
`kv_transfer.ReadBlocksClient.read`), the step that carries a pull calls the source's
`ReadBlocks` and checks the chunks it gets (`simulated_kv`; a pull that fails fails its request
only, named in that step's result). A pull carried at time t then lands at t plus its bytes over
`LatencyModel.pull_bytes_per_s` (an executor's pulls one after another), and the first step
result that ends after that names it (`PullOutcomes`); no step's modelled time includes it, and
a step that runs no token waits for the next landing, a little (`POLL_WAIT_S`). The source
serves `ReadBlocks` (`read_blocks`) between its steps, as a real executor does.

Each step takes as long as a latency model says a real NPU step would (`LatencyModel`); the
bookkeeping runs inside that time, and a step whose bookkeeping alone overruns it is counted.
It is served by the real `start_executor_server`, so a scheduler cannot tell it from a real
executor; `npuserve.deploy.bench.simulated_fleet` serves many in one process.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from npuserve.executor import simulated_kv
from npuserve.executor.pass_loop import PassLoop, StepPass
from npuserve.executor.pulls_beside_steps import POLL_WAIT_S, PullOutcomes, is_poll
from npuserve.executor.simulated_kv import BlockReader, ModelledPulls
from npuserve.executor.token_bitmask import bitmask_matrix, bitmask_rows
from npuserve.proto import executor_pb2 as pb
from npuserve.proto.plan_checks import (
    PlanError,
    check_block_copies,
    check_block_ids,
    check_kv_pulls,
    check_new_request,
    check_num_steps,
)
from npuserve.proto.step_plan import (
    EXECUTOR_ROLE_MIXED,
    ExecutorInfo,
    FirstPassAnswer,
    JoiningSteps,
    NewRequest,
    StepPlan,
    StepResult,
    StepTimings,
    TokenLogprobs,
)

_MASK32 = 0xFFFFFFFF


@dataclass(slots=True)
class LatencyModel:
    """Seconds one step takes: ``base_s + per_token_s * tokens + per_seq_s * sequences``; and
    beside the steps, a pull's bytes over ``pull_bytes_per_s``.

    The step terms resemble a decode step of a mid-size model on one Ascend 910B; the pull rate is
    a setting of the link between executors (10 GB/s by default).
    """

    base_s: float = 0.005
    per_token_s: float = 0.00002
    per_seq_s: float = 0.00001
    pull_bytes_per_s: float = 10e9

    def __post_init__(self) -> None:
        if min(self.base_s, self.per_token_s, self.per_seq_s) < 0:
            raise ValueError(f"latency terms must be >= 0, got {self}")
        if not self.pull_bytes_per_s > 0:
            raise ValueError(f"pull_bytes_per_s must be > 0, got {self.pull_bytes_per_s}")

    def step_seconds(self, num_tokens: int, num_seqs: int) -> float:
        return self.base_s + self.per_token_s * num_tokens + self.per_seq_s * num_seqs

    def joined_seconds(self, num_tokens: int, num_seqs: int) -> float:
        """What a step that joins another's pass adds to that pass: its tokens, no base."""
        return self.per_token_s * num_tokens + self.per_seq_s * num_seqs

    def pull_seconds(self, num_bytes: int) -> float:
        """How long pulling ``num_bytes`` of KV from another executor takes, beside the steps."""
        return num_bytes / self.pull_bytes_per_s


@dataclass(slots=True)
class SimulatedConfig:
    """What a simulated executor reports in the capacity handshake, and how fast it steps."""

    latency: LatencyModel = field(default_factory=LatencyModel)
    num_blocks: int = 100_000  # including the null block 0
    block_size: int = 128
    max_model_len: int = 8192
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 8192
    vocab_size: int = 512  # stories260K's tokenizer
    eos_token_ids: tuple[int, ...] = (2,)
    eos_after: int | None = None  # every request's N-th output token is EOS; None: never
    model: str = "simulated"
    seed: int = 0  # mixed into every token, for runs that must differ
    num_host_blocks: int = 0  # a host-memory KV tier: its copies are checked, not modelled in time
    role: str = EXECUTOR_ROLE_MIXED  # `ExecutorInfo.role`
    # KV bytes per token (keys and values, every layer), what a pull moves: Llama-3.2-1B's in
    # bf16 (16 layers x 8 KV heads x 64 dims x 2 x 2 bytes).
    kv_bytes_per_token: int = 32768

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {self.num_blocks}")
        for name in ("block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not all(0 <= t < self.vocab_size for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids {self.eos_token_ids} must be in [0, {self.vocab_size})")
        if self.vocab_size <= len(set(self.eos_token_ids)):
            raise ValueError(f"vocab_size {self.vocab_size} leaves no token that is not an EOS")
        if self.eos_after is not None and (self.eos_after < 1 or not self.eos_token_ids):
            raise ValueError("eos_after must be >= 1 and needs an EOS token id")
        if self.kv_bytes_per_token < 1:
            raise ValueError(f"kv_bytes_per_token must be >= 1, got {self.kv_bytes_per_token}")

    @property
    def max_blocks_per_req(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def block_bytes(self) -> int:
        """Modelled KV bytes of one block."""
        return self.block_size * self.kv_bytes_per_token


@dataclass(slots=True)
class SimulatedStats:
    """Totals since start; `modeled_s` is the time the latency model charged the steps (`pull_s`
    the pulls that landed, beside them), `busy_s` the wall time steps took (sleep included, a
    step's wait for a landing not), `num_overruns` the steps whose bookkeeping (a pull's
    `ReadBlocks` included) took longer."""

    num_steps: int = 0
    num_tokens: int = 0
    num_seqs: int = 0
    num_sampled: int = 0
    modeled_s: float = 0.0
    busy_s: float = 0.0
    num_overruns: int = 0
    pull_s: float = 0.0


@dataclass(slots=True)
class _ModelledStep:
    """The step a simulated runner runs: when it began, and its modelled seconds and tokens so far
    (its passes end at ``start + modeled_s`` in turn)."""

    start: float  # time.perf_counter()
    modeled_s: float = 0.0
    num_tokens: int = 0


@dataclass(slots=True)
class _RequestState:
    key: int  # hash of the request id, the seed of its tokens
    num_tokens: int
    num_prompt_tokens: int
    num_computed_tokens: int
    num_blocks: int
    num_logprobs: int | None


def request_key(req_id: str, seed: int = 0) -> int:
    """A stable 32-bit hash of a request id (never Python's `hash()`, which varies per process)."""
    return zlib.crc32(req_id.encode()) ^ (seed * 0x9E3779B1 & _MASK32)


def simulated_token(key: int, position: int, vocab_size: int, eos_token_ids: tuple[int, ...] = ()) -> int:
    """The token a simulated executor samples at ``position`` of the request keyed ``key``: a
    mix of both (murmur3's finaliser) modulo the vocabulary, stepped past EOS ids."""
    h = (key ^ (position * 0x85EBCA77)) & _MASK32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _MASK32
    h ^= h >> 16
    token = h % vocab_size
    while token in eos_token_ids:
        token = (token + 1) % vocab_size
    return token


class SimulatedRunner:
    """A `StepRunner` without a model. Steps are serialised by the server's lock, as for the
    `ModelRunner`; `stats` may be read from any thread (a snapshot, not a transaction).
    ``block_reader``: how a step's pulls reach their sources (None: they are checked, counted and
    modelled in time, and reach nothing)."""

    def __init__(
        self, config: SimulatedConfig | None = None, block_reader: BlockReader | None = None
    ) -> None:
        self.config = config or SimulatedConfig()
        self.block_reader = block_reader
        self.stats = SimulatedStats()
        self.num_block_copies = 0  # block copies of the host tier run so far (checked, not modelled)
        self.pull_outcomes = PullOutcomes()
        self._pulls = ModelledPulls(
            block_reader, self.pull_outcomes, self.config.latency.pull_seconds, self.config.block_bytes
        )
        self._requests: dict[str, _RequestState] = {}
        self._passes = PassLoop(self, self.config.max_num_batched_tokens)
        self._step = _ModelledStep(0.0)

    @property
    def num_pulled_blocks(self) -> int:
        """Blocks pulled from other executors so far (landed; no bytes moved)."""
        return self._pulls.num_blocks

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def holds(self, req_id: str) -> bool:
        """Whether the request's state is here (sent whole, not dropped since)."""
        return req_id in self._requests

    def info(self) -> ExecutorInfo:
        c = self.config
        return ExecutorInfo(
            model=c.model,
            architecture="SimulatedForCausalLM",
            block_size=c.block_size,
            num_blocks=c.num_blocks,
            max_model_len=c.max_model_len,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            vocab_size=c.vocab_size,
            eos_token_ids=list(c.eos_token_ids),
            dtype="bfloat16",
            device="simulated",
            joins_steps=True,
            num_host_blocks=c.num_host_blocks,
            role=c.role,
        )

    def token_for(self, req_id: str, position: int) -> int:
        """The token this runner samples at ``position`` of ``req_id`` (EOS only per `eos_after`)."""
        c = self.config
        return simulated_token(request_key(req_id, c.seed), position, c.vocab_size, c.eos_token_ids)

    def execute(
        self,
        plan: StepPlan,
        on_first_pass: FirstPassAnswer | None = None,
        joining: JoiningSteps | None = None,
    ) -> StepResult:
        """Runs one step, as `ModelRunner.execute` does (`PassLoop.run`), in its modelled time:
        each pass ends its `LatencyModel` seconds after the one before, and what a pass answers
        goes out once its time has come."""
        return self._passes.run(plan, on_first_pass, joining)

    # -- the passes of a step (`PassRunner`) ------------------------------------------------------

    def begin_step(self, plan: StepPlan, started: float) -> None:
        if plan.reset:  # NOTE: a new scheduler: no pull of the one before lands for it
            self._pulls.clear()
        self.pull_outcomes.acknowledge(plan)
        self._update_states(plan)
        if plan.kv_pulls:
            self._pulls.start(plan.kv_pulls, started)
        self._step = _ModelledStep(self._pulls.begins_at(plan, started))

    def run_pass(self, plan: StepPlan, step_pass: StepPass, result: StepResult) -> list[StepResult]:
        """The pass's tokens, then the joiners' (each sampled alone, as if it ran on its own);
        its modelled seconds are counted, not slept (`await_pass_end`)."""
        latency, step, stats = self.config.latency, self._step, self.stats
        num_sampled = len(result.sampled_req_ids)
        if step_pass.index == 0:
            self._run_scheduled(plan, result)
        else:  # multi-step decoding: each request of the pass takes the token the one before sampled
            for req_id in step_pass.tokens:
                state = self._requests[req_id]
                state.num_computed_tokens = state.num_tokens
                self._sample_into(result, req_id, state)
        stats.num_sampled += len(result.sampled_req_ids) - num_sampled
        num_tokens = sum(step_pass.tokens.values())
        pass_s = latency.step_seconds(num_tokens, len(step_pass.tokens))
        answers = []
        for joiner in step_pass.joiners:
            self._update_states(joiner)
            answer = StepResult(step_id=joiner.step_id)
            self._run_scheduled(joiner, answer)
            answers.append(answer)
            joined_tokens = joiner.total_num_scheduled_tokens
            pass_s += latency.joined_seconds(joined_tokens, len(joiner.num_scheduled_tokens))
            num_tokens += joined_tokens
            stats.num_sampled += len(answer.sampled_req_ids)
        for answer in answers:
            answer.timings = StepTimings(total_s=pass_s)
        step.modeled_s += pass_s
        step.num_tokens += num_tokens
        return answers

    def await_pass_end(self) -> None:
        """Sleeps until the modelled end of the pass last run."""
        step = self._step
        self._sleep_until(step.start + step.modeled_s, time.perf_counter())

    def end_step(self, plan: StepPlan, result: StepResult, started: float) -> None:
        """Sleeps what the step's bookkeeping left of its modelled time (an overrun where it left
        none), and counts the step; one that ran no token then waits for the next pull to land,
        a little. Its result names the pulls that landed by then."""
        step = self._step
        num_seqs = len(plan.num_scheduled_tokens)
        done = time.perf_counter()
        if not self._sleep_until(step.start + step.modeled_s, done) and num_seqs:
            self.stats.num_overruns += 1
        end = time.perf_counter()
        lands_at = self._pulls.next_landing
        if not num_seqs and not self.pull_outcomes.fresh and (lands_at is not None or is_poll(plan)):
            self._sleep_until(min(math.inf if lands_at is None else lands_at, end + POLL_WAIT_S), end)
        landed = self._pulls.land(time.perf_counter())
        self.stats.pull_s += landed.seconds
        self.pull_outcomes.report(result)
        result.timings = StepTimings(
            prepare_s=done - started,
            forward_s=end - done,
            total_s=end - started,
            kv_transfers=[landed] if landed.num_bytes else [],
        )
        s = self.stats
        s.num_steps += 1
        s.num_tokens += step.num_tokens
        s.num_seqs += num_seqs
        s.modeled_s += step.modeled_s
        s.busy_s += end - started

    def read_blocks(self, block_ids: list[int]) -> Iterator[pb.BlockChunk]:
        """Another executor's pull of ``block_ids`` (`ReadBlocks`), as `simulated_kv.read_blocks`
        serves it: a `PlanError` at once for an id outside 1..num_blocks-1."""
        c = self.config
        return simulated_kv.read_blocks(block_ids, c.num_blocks, c.block_size, c.block_bytes)

    def drop_requests(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self._requests.pop(req_id, None)

    @staticmethod
    def _sleep_until(deadline: float, now: float) -> bool:
        """Sleeps from ``now`` until ``deadline`` (perf_counter); False when it had passed."""
        remaining = deadline - now
        if remaining > 0:
            time.sleep(remaining)
        return remaining > 0

    def _update_states(self, plan: StepPlan) -> None:
        c = self.config
        check_kv_pulls(plan.kv_pulls, c.num_blocks)
        check_block_copies(plan.block_copies, c.num_blocks, c.num_host_blocks)
        self.num_block_copies += len(plan.block_copies)
        requests = self._requests
        if plan.reset:
            requests.clear()
        for req_id in plan.finished_req_ids:
            requests.pop(req_id, None)
        for new in plan.new_requests:
            self._add(new)
        for cached in plan.cached_requests:
            state = requests.get(cached.req_id)
            if state is None:
                raise PlanError(f"request {cached.req_id!r} is not on this executor; send it whole")
            check_block_ids(
                cached.req_id, cached.new_block_ids, state.num_blocks, c.num_blocks, c.max_blocks_per_req
            )
            state.num_blocks += len(cached.new_block_ids)

    def _run_scheduled(self, plan: StepPlan, result: StepResult) -> None:
        """A plan's first pass: its scheduled tokens, a token into ``result`` for each request
        that reaches its known tokens."""
        requests = self._requests
        # Check every scheduled request before changing any (the real runner's `prepare`).
        block_size = self.config.block_size
        scheduled = []
        for req_id, num_new in plan.num_scheduled_tokens.items():
            state = requests.get(req_id)
            if state is None:
                raise PlanError(f"request {req_id!r} is scheduled but unknown")
            seq_len = state.num_computed_tokens + num_new
            if num_new < 1 or seq_len > state.num_tokens:
                raise PlanError("tokens scheduled beyond a request's known tokens")
            if seq_len > state.num_blocks * block_size:
                raise PlanError("tokens scheduled beyond a request's blocks")
            num_steps = plan.num_steps.get(req_id, 1)
            if num_steps > 1:
                check_num_steps(
                    req_id,
                    num_steps,
                    seq_len == state.num_tokens,
                    seq_len,
                    state.num_blocks * block_size,
                    self.config.max_model_len,
                )
            scheduled.append((req_id, state, seq_len))
        masks = self._masks(plan, scheduled)
        for req_id, state, seq_len in scheduled:
            state.num_computed_tokens = seq_len
            if seq_len == state.num_tokens:
                self._sample_into(result, req_id, state, masks.get(req_id))

    def _add(self, req: NewRequest) -> None:
        c = self.config
        num_tokens = len(req.token_ids)
        if req.req_id in self._requests:
            raise PlanError(f"request {req.req_id!r} is already running on this executor")
        check_new_request(req, c.max_model_len, c.num_blocks, c.max_blocks_per_req)
        if len(self._requests) >= c.max_num_seqs:
            raise PlanError(f"more than max_num_seqs={c.max_num_seqs} requests at once")
        self._requests[req.req_id] = _RequestState(
            key=request_key(req.req_id, c.seed),
            num_tokens=num_tokens,
            num_prompt_tokens=req.num_prompt_tokens,
            num_computed_tokens=req.num_computed_tokens,
            num_blocks=len(req.block_ids),
            num_logprobs=req.sampling.num_logprobs,
        )

    def _masks(
        self, plan: StepPlan, scheduled: list[tuple[str, _RequestState, int]]
    ) -> dict[str, np.ndarray]:
        """Each constrained request's allowed token ids (structured outputs), as the real runner
        checks them: rows only for requests that sample, each of the vocabulary's width."""
        if plan.bitmask is None:
            return {}
        req_ids = plan.bitmask.req_ids
        bitmask_rows(req_ids, [req_id for req_id, state, seq_len in scheduled if seq_len == state.num_tokens])
        words = bitmask_matrix(plan.bitmask.words, len(req_ids), self.config.vocab_size)  # [M, W]
        bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")  # [M, 32 W]
        return {req_id: np.flatnonzero(row) for req_id, row in zip(req_ids, bits, strict=True)}

    def _sample_into(
        self, result: StepResult, req_id: str, state: _RequestState, allowed: np.ndarray | None = None
    ) -> None:
        """Appends the request's next token to it and to ``result``: the simulated token; under a
        bitmask, that token if allowed, else an allowed one picked by the same hash (so still a
        function of the request and the position)."""
        c = self.config
        output_index = state.num_tokens - state.num_prompt_tokens + 1  # 1-based
        eos_allowed = allowed is None or bool(np.isin(c.eos_token_ids[:1], allowed).all())
        if c.eos_after is not None and output_index == c.eos_after and eos_allowed:
            token = c.eos_token_ids[0]
        else:
            token = simulated_token(state.key, state.num_tokens, c.vocab_size, c.eos_token_ids)
            if allowed is not None and token not in allowed and len(allowed):
                token = int(allowed[simulated_token(state.key, state.num_tokens, len(allowed))])
        result.sampled_req_ids.append(req_id)
        result.sampled_token_ids.append(token)
        result.logprobs.append(self._logprobs(state, token))
        state.num_tokens += 1

    def _logprobs(self, state: _RequestState, token: int) -> TokenLogprobs | None:
        """A certain token (logprob 0, rank 1) and made-up runners-up, when the request asks."""
        if state.num_logprobs is None:
            return None
        vocab = self.config.vocab_size
        top_ids = [(token + i) % vocab for i in range(min(state.num_logprobs, vocab))]
        return TokenLogprobs(0.0, 1, top_ids, [0.0 if i == 0 else -20.0 for i in range(len(top_ids))])
