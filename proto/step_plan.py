"""The step contract between the scheduler and an executor, as plain Python data.

A request's full data travels once (`NewRequest`); later steps carry only what changed
(`CachedRequest`), the number of tokens scheduled for each request, and the ids of requests to
drop. The executor samples and returns token ids, never logits. This module imports no torch so
the scheduler can build plans; the gRPC converters map it to and from protobuf.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from npuserve.proto.kv_layout import cdiv


@dataclass(slots=True)
class SamplingOptions:
    """What the executor needs to sample one request's tokens (stop rules stay in the scheduler).

    Valid ranges live in `sampling_ranges` (checked by the scheduler and on decode). A new knob
    is a field here and in executor.proto's SamplingOptions, a column in the executor's
    `SAMPLING_COLUMNS`, and its use in the sampler; the codec carries every field by name.
    """

    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 means the whole vocabulary
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # None: the executor draws one; set: same tokens whatever the batch
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    num_logprobs: int | None = None  # top logprobs to return with each sampled token
    min_tokens: int = 0
    # Tokens that must not be sampled before min_tokens outputs exist (EOS and stop_token_ids).
    stop_token_ids: tuple[int, ...] = ()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


@dataclass(slots=True)
class NewRequest:
    """Sent once, when a request is first scheduled (or resumed after preemption)."""

    req_id: str
    # Prompt followed by any tokens already generated (a request resumed after preemption).
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingOptions
    block_ids: list[int]
    num_computed_tokens: int  # tokens whose KV is already in the cache (prefix-cache hit)


@dataclass(slots=True)
class CachedRequest:
    """A request the executor already holds, with blocks appended since its last step."""

    req_id: str
    new_block_ids: list[int]


def bitmask_words(vocab_size: int) -> int:
    """int32 words in one row of a next-token bitmask over `vocab_size` tokens."""
    return cdiv(vocab_size, 32)


@dataclass(slots=True)
class TokenBitmask:
    """Next-token bitmasks of the constrained requests that sample in one step (structured outputs).

    `words` holds len(req_ids) rows of `bitmask_words(vocab_size)` little-endian int32 words,
    row after row; bit (t % 32) of word (t // 32) of a row allows token t.
    """

    req_ids: list[str]
    words: bytes


class BlockCopy(NamedTuple):
    """One KV block copied whole, every layer, between the device and the host-memory tier:
    device block ``src`` to host block ``dst`` (``to_host``), or host ``src`` to device ``dst``."""

    to_host: bool
    src: int
    dst: int


@dataclass(slots=True)
class KvPull:
    """KV blocks of another executor (the source) copied whole, every layer, into this one's:
    ``src_block_ids[i]`` of the source into ``dst_block_ids[i]`` here (`executor.kv_transfer`),
    for request ``req_id``, beside the steps: a later result says it landed or failed
    (`StepResult.landed_pull_req_ids`, `failed_pull_req_ids`). Until then no step touches the
    blocks here, and the scheduler holds the source's unchanged. A pull that fails fails its
    request only."""

    address: str  # host:port of the source executor, as the scheduler reaches it
    instance_id: str  # its `ExecutorInfo.instance_id` (empty: any): a restarted source refuses
    src_block_ids: list[int]
    dst_block_ids: list[int]
    req_id: str = ""  # the request of the step whose blocks these are


@dataclass(slots=True)
class StepPlan:
    step_id: int
    new_requests: list[NewRequest] = field(default_factory=list)
    cached_requests: list[CachedRequest] = field(default_factory=list)
    # Every request that runs this step, in batch order, with its number of new tokens.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Finished, aborted or preempted requests: the executor drops their state before the step.
    finished_req_ids: list[str] = field(default_factory=list)
    # Set on the first step of a scheduler that (re)connects: drop every request held before.
    reset: bool = False
    # The constrained requests that sample this step, and the tokens each may sample.
    bitmask: TokenBitmask | None = None
    # Multi-step decoding (vLLM's --num-scheduler-steps): requests that run more than one
    # forward pass this step, with their count. The first pass runs the scheduled tokens and must
    # sample; each later one feeds back the token the pass before sampled, so the request
    # samples that many tokens. The scheduler has given it blocks for all of them.
    num_steps: dict[str, int] = field(default_factory=dict)
    # The scheduler that planned it (0: unnamed), whose step ids increase: an executor runs no
    # step of it older than one of it that ran (a broken stream's, still queued there).
    session: int = 0
    # A step that only admits requests and may run inside the multi-pass step its executor is
    # running (`admits_only`): its tokens join the next pass that step starts (its first, when
    # the step had not begun as this one came) with room for them within the executor's
    # max_num_batched_tokens, its answer comes after that pass. For an executor whose
    # `ExecutorInfo.joins_steps` says so, over the step stream.
    joins_running: bool = False
    # Copies between device blocks and the host-memory tier, run in order before anything else
    # of the step: spills of the prefix-cache blocks the step's allocations evict, and loads of
    # its host prefix hits into device blocks (`scheduler.core.host_tier`).
    block_copies: list[BlockCopy] = field(default_factory=list)
    # Blocks copied from other executors' KV caches into this one's: they start after
    # `block_copies`, and run beside this step and the next ones, in order. The step schedules
    # no token of their requests: a request whose prompt another executor computed continues
    # here once a result has said its pull landed (its `NewRequest.num_computed_tokens` counts
    # the pulled tokens then).
    kv_pulls: list[KvPull] = field(default_factory=list)

    @property
    def num_passes(self) -> int:
        """The forward passes the step runs: its multi-step requests' most, else one."""
        return max(self.num_steps.values(), default=1)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def has_first_pass_only(self) -> bool:
        """A multi-step plan in which some requests run only the first pass (those it admits,
        say): their tokens can be answered before the later passes (`early_results`)."""
        return 0 < len(self.num_steps) < len(self.num_scheduled_tokens)


@dataclass(slots=True)
class TokenLogprobs:
    logprob: float  # of the sampled token, under the model's raw distribution
    rank: int  # 1 for the most likely token
    top_token_ids: list[int]
    top_logprobs: list[float]


# What a step's KV transfers moved blocks between (`KvTransfer.kind`): its device blocks and its
# host-memory tier (`StepPlan.block_copies`), or another executor's device blocks and its own
# (`StepPlan.kv_pulls`).
KV_TRANSFER_HOST_TIER = "host_tier"
KV_TRANSFER_EXECUTOR = "executor"
KV_TRANSFER_KINDS = (KV_TRANSFER_HOST_TIER, KV_TRANSFER_EXECUTOR)


class KvTransfer(NamedTuple):
    """KV blocks one step moved, of one kind (`KV_TRANSFER_KINDS`): bytes, and seconds."""

    kind: str
    num_bytes: int
    seconds: float


@dataclass(slots=True)
class StepTimings:
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    total_s: float = 0.0
    # The step's forward passes, by how they ran: replaying a captured decode graph, or eagerly.
    graph_passes: int = 0
    eager_passes: int = 0
    # The step's KV block transfers, one per kind that moved bytes.
    kv_transfers: list[KvTransfer] = field(default_factory=list)


@dataclass(slots=True)
class StepResult:
    step_id: int
    # Requests whose scheduled tokens reached the end of their known tokens got one new token
    # (one per pass with `StepPlan.num_steps`: a request is named once per token, in the order
    # sampled); requests in the middle of a chunked prefill get none.
    sampled_req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    timings: StepTimings = field(default_factory=StepTimings)
    draining: bool = False  # the executor drains: no new requests for it
    # The first pass's tokens of the requests that run only that pass, answered before the
    # step's final result (`take_first_pass_only`); the final result does not name them.
    partial: bool = False
    # The requests whose `KvPull` (of this step or an earlier one) failed (their blocks hold
    # part of their KV at most), or landed (all of it). Named in every final result, never an
    # early one, from the first that ends after the outcome until a plan names the request again
    # (new, scheduled, dropped or pulled) or resets: a result lost on the way costs no outcome.
    failed_pull_req_ids: list[str] = field(default_factory=list)
    landed_pull_req_ids: list[str] = field(default_factory=list)


def named_req_ids(*plans: StepPlan) -> list[str]:
    """The requests ``plans`` run or send whole: whose state a runner drops when they fail."""
    return [
        req_id
        for plan in plans
        for req_id in (*plan.num_scheduled_tokens, *(r.req_id for r in plan.new_requests))
    ]


def admits_only(plan: StepPlan) -> bool:
    """Whether a plan only admits requests, one pass each: every request it runs is new in it,
    and it drops none, resets nothing, pulls no blocks and carries no bitmask (what a step that
    joins another's passes may hold: `StepPlan.joins_running`; a pull would hold up the running
    step's next pass while its bytes cross the network)."""
    return (
        not (plan.cached_requests or plan.finished_req_ids or plan.reset or plan.num_steps or plan.kv_pulls)
        and plan.bitmask is None
        and len(plan.new_requests) == len(plan.num_scheduled_tokens)
        and all(r.req_id in plan.num_scheduled_tokens for r in plan.new_requests)
    )


# Takes a multi-step plan's early answer: the tokens of the requests that run only its first pass.
FirstPassAnswer = Callable[[StepResult], None]


class JoiningSteps(Protocol):
    """Where a runner in the middle of a multi-pass step finds the steps that join it
    (`StepPlan.joins_running`, received after it) and sends their answers."""

    def take(self, max_tokens: int) -> StepPlan | None:
        """The next step, if it has come, joins the running one and schedules no more than
        ``max_tokens`` tokens (None: none has; or the next does not join, and runs after the
        running step, as usual; or it does not fit, and waits for a later pass)."""

    def answer(self, result: StepResult) -> None:
        """Sends a joined step's result, after the pass it joined."""


class PlanRunner(Protocol):
    """What runs step plans, wherever its caller is: the executor's servicer, or a scheduler
    driving a runner in its own process (`ModelRunner`, `SimulatedRunner`)."""

    def info(self) -> ExecutorInfo: ...

    def execute(
        self,
        plan: StepPlan,
        on_first_pass: FirstPassAnswer | None = None,
        joining: JoiningSteps | None = None,
    ) -> StepResult: ...


def take_first_pass_only(result: StepResult, num_steps: dict[str, int]) -> StepResult:
    """Moves the tokens of requests that run only the first pass (absent from ``num_steps``) out
    of ``result``, which holds a multi-step plan's first pass, into a partial result of their own."""
    rows = list(zip(result.sampled_req_ids, result.sampled_token_ids, result.logprobs, strict=True))
    result.sampled_req_ids, result.sampled_token_ids, result.logprobs = [], [], []
    early = StepResult(step_id=result.step_id, partial=True)
    for req_id, token_id, logprobs in rows:
        into = result if req_id in num_steps else early
        into.sampled_req_ids.append(req_id)
        into.sampled_token_ids.append(token_id)
        into.logprobs.append(logprobs)
    return early


# `ExecutorInfo.device` of the npu backend run on the CPU through its operators' emulation.
EMULATED_NPU_DEVICE = "npu (emulated on cpu)"


def computes_on_cpu(device: str) -> bool:
    """Whether an executor on ``device`` (`ExecutorInfo.device`) computes on its host's CPU."""
    return device in ("cpu", EMULATED_NPU_DEVICE)


# Executor roles (`--role`): a prefill executor computes the long prompts of requests that then
# decode on a decode executor, which pulls their KV (`KvPull`); a mixed one does both.
EXECUTOR_ROLE_PREFILL = "prefill"
EXECUTOR_ROLE_DECODE = "decode"
EXECUTOR_ROLE_MIXED = "mixed"
EXECUTOR_ROLES = (EXECUTOR_ROLE_PREFILL, EXECUTOR_ROLE_DECODE, EXECUTOR_ROLE_MIXED)


@dataclass(slots=True)
class ExecutorInfo:
    """The capacity handshake: what an executor can hold, reported before any step."""

    model: str  # served model identity (directory name)
    architecture: str
    block_size: int
    num_blocks: int  # including the null block 0
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    vocab_size: int
    eos_token_ids: list[int]
    dtype: str
    device: str
    tensor_parallel_size: int = 1
    # Runs a step that `joins_running` inside the multi-pass step it is running.
    joins_steps: bool = False
    num_host_blocks: int = 0  # KV blocks of the host-memory tier (`--kv-host-memory`)
    # `EXECUTOR_ROLES`: what the scheduler places on it (prefill/decode disaggregation).
    role: str = EXECUTOR_ROLE_MIXED
