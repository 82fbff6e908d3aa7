"""The ModelRunner: executes step plans against a model and its paged KV cache.

It keeps per-request state between steps (`InputBatch`), so a plan carries a request's data
once and later only deltas. One step: drop finished requests, admit new ones, append blocks,
gather the flat batch, run the model, compute logits only for the requests that reached their
last known token, sample there, and record the sampled tokens. A multi-step plan then runs more
passes over its multi-step requests, each feeding back the tokens the one before sampled.
"""

from __future__ import annotations

import time

import numpy as np
import structlog
import torch

from npuserve.executor.config import ExecutorConfig, ModelConfig, check_npu_model
from npuserve.executor.dtypes import resolve_dtype
from npuserve.executor.input_batch import InputBatch, PlanError, StepInputs
from npuserve.executor.kv_cache import (
    CPU_DEFAULT_KV_CACHE_GIB,
    GIB,
    allocate_kv_caches,
    block_bytes,
    num_blocks_for_budget,
)
from npuserve.executor.layers import TensorParallel
from npuserve.executor.model_loader import load_model
from npuserve.executor.platform import resolve_target
from npuserve.executor.profiling import profile_kv_budget
from npuserve.executor.sampler import (
    AllowedTokens,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    build_allowed_tokens,
    build_sampling_metadata,
)
from npuserve.executor.token_bitmask import bitmask_rows
from npuserve.kernels import NPU_BLOCK_SIZE, build_attention_metadata, get_backend
from npuserve.proto.plan_checks import check_num_steps, take_joining
from npuserve.proto.step_plan import (
    EMULATED_NPU_DEVICE,
    ExecutorInfo,
    FirstPassAnswer,
    JoiningSteps,
    StepPlan,
    StepResult,
    StepTimings,
    TokenBitmask,
    TokenLogprobs,
    named_req_ids,
    take_first_pass_only,
)

log = structlog.get_logger(__name__)

__all__ = ["ModelRunner", "PlanError"]


class ModelRunner:
    def __init__(
        self,
        config: ExecutorConfig,
        model_config: ModelConfig | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        self.config = config
        self.model_config = model_config or ModelConfig.from_pretrained(config.model)
        self.tp = tp or TensorParallel()
        # The target's kind picks kernels and rules; its device holds the tensors (the CPU for
        # an emulated NPU).
        self.target = resolve_target(config.device)
        self.device = self.target.device
        if config.cpu_threads and self.device.type == "cpu":  # NOTE: 0 is auto (`cpu_threads`)
            torch.set_num_threads(config.cpu_threads)  # NOTE: the process's, for every runner in it
        is_npu = self.target.kind == "npu"
        self.block_size = config.block_size or (NPU_BLOCK_SIZE if is_npu else 16)
        if is_npu:
            check_npu_model(self.model_config, self.block_size)
        self.dtype = resolve_dtype(config.dtype, self.model_config.torch_dtype, self.target)
        self.max_model_len = config.resolve_max_model_len(self.model_config)
        self.backend = get_backend(self.target)
        self.model = load_model(
            self.model_config,
            self.backend,
            self.dtype,
            self.device,
            self.max_model_len,
            config.load_format,
            config.seed,
            self.tp,
        )
        self.num_blocks = self._size_kv_cache()
        self.kv_caches = allocate_kv_caches(
            self.model_config, self.num_blocks, self.block_size, self.dtype, self.device, self.tp
        )
        self.batch = InputBatch(config.max_num_seqs, self.max_model_len, self.block_size, self.num_blocks)
        self.sampler = Sampler()
        self._seed_source = np.random.default_rng(config.seed)
        self._last_result: StepResult | None = None

    def _size_kv_cache(self) -> int:
        per_block = block_bytes(self.model_config, self.block_size, self.dtype, self.tp)
        if self.config.kv_cache_memory_gib is not None:
            budget = int(self.config.kv_cache_memory_gib * GIB)
        elif self.target.kind == "cpu":
            budget = CPU_DEFAULT_KV_CACHE_GIB * GIB
        else:
            budget = profile_kv_budget(self)
        num_blocks = num_blocks_for_budget(budget, per_block, self.block_size, self.max_model_len)
        log.info(
            "kv cache sized",
            num_blocks=num_blocks,
            block_size=self.block_size,
            gib=round(num_blocks * per_block / GIB, 3),
            max_concurrency=round((num_blocks - 1) * self.block_size / self.max_model_len, 2),
        )
        return num_blocks

    def info(self) -> ExecutorInfo:
        return ExecutorInfo(
            model=self.model_config.served_name,
            architecture=self.model_config.architecture,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            max_model_len=self.max_model_len,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=list(self.model_config.eos_token_ids),
            dtype=str(self.dtype).removeprefix("torch."),
            device=EMULATED_NPU_DEVICE if self.target.emulated else str(self.device),
            tensor_parallel_size=self.tp.size,
            # NOTE: a tensor-parallel group's other ranks run the steps its leader sends them,
            # whole: none could take a joining step at the same pass as the leader.
            joins_steps=self.tp.size == 1,
        )

    @property
    def num_requests(self) -> int:
        """Requests whose state the runner holds."""
        return self.batch.num_reqs

    @torch.inference_mode()
    def execute(
        self,
        plan: StepPlan,
        on_first_pass: FirstPassAnswer | None = None,
        joining: JoiningSteps | None = None,
    ) -> StepResult:
        """Runs one step. A repeated step id returns the earlier result (retries are idempotent).

        ``on_first_pass``: takes the tokens of the requests that run only a multi-step plan's first
        pass as soon as it is done (`take_first_pass_only`); the result then leaves them out.
        ``joining``: before each pass of a multi-step plan (the first too: the steps sent while
        it waited to run), the steps that join it (`StepPlan.joins_running`) are taken, as room
        within max_num_batched_tokens allows; their prompts run in that pass, beside its own
        tokens, and each is answered after it (`_run_pass_joined`).

        A plan that contradicts the executor's state raises `PlanError`; any failure drops the
        state of every request in the plan (and in the steps that joined it), which the
        scheduler then fails or re-sends whole.
        """
        if self._last_result is not None and plan.step_id == self._last_result.step_id:
            return self._last_result
        joined: list[StepPlan] = []
        try:
            result = self._execute(plan, on_first_pass, joining, joined)
        except Exception:
            for req_id in named_req_ids(plan, *joined):
                self.batch.remove(req_id)
            raise
        self._last_result = result
        return result

    def _execute(
        self,
        plan: StepPlan,
        on_first_pass: FirstPassAnswer | None,
        joining: JoiningSteps | None,
        joined: list[StepPlan],
    ) -> StepResult:
        start = time.perf_counter()
        self._update_states(plan)
        result = StepResult(step_id=plan.step_id)
        if not plan.num_scheduled_tokens:
            return result
        timings = StepTimings()
        # NOTE: the steps sent while a multi-step plan waited to run join its first pass.
        first_joining = joining if plan.num_steps else None
        inputs, sampled_req_ids, joiners = self._prepare_pass(
            plan.num_scheduled_tokens, first_joining, joined
        )
        if plan.num_steps:
            self._check_num_steps(plan, inputs)
        # NOTE: checked before the forward, so a bad bitmask costs no forward and writes no KV.
        allowed = self._allowed_tokens(plan.bitmask, sampled_req_ids)
        self._run_pass_joined(inputs, sampled_req_ids, allowed, joiners, result, timings, joining, start)
        if on_first_pass is not None and plan.has_first_pass_only:
            early = take_first_pass_only(result, plan.num_steps)
            if early.sampled_req_ids:
                on_first_pass(early)
        # Multi-step decoding: each later pass feeds back the tokens the one before sampled.
        for index in range(1, plan.num_passes):
            pass_start = time.perf_counter()
            decoding = {r: 1 for r, n in plan.num_steps.items() if n > index}
            inputs, sampled_req_ids, joiners = self._prepare_pass(decoding, joining, joined)
            self._run_pass_joined(
                inputs, sampled_req_ids, None, joiners, result, timings, joining, pass_start
            )
        timings.total_s = time.perf_counter() - start
        result.timings = timings
        return result

    def _prepare_pass(
        self, own: dict[str, int], joining: JoiningSteps | None, joined: list[StepPlan]
    ) -> tuple[StepInputs, list[str], list[StepPlan]]:
        """A pass's inputs: ``own`` tokens per request, then those of the steps that join it
        (taken while the pass stays within max_num_batched_tokens, their requests added to the
        batch); with the requests that sample in it, and the steps that joined."""
        joiners = take_joining(joining, joined, self.config.max_num_batched_tokens, sum(own.values()))
        scheduled = own
        if joiners:
            scheduled = dict(own)
            for joiner in joiners:
                self._update_states(joiner)
                scheduled.update(joiner.num_scheduled_tokens)
        inputs = self.batch.prepare(scheduled)
        sampled_req_ids = [r for r, keep in zip(scheduled, inputs.sample_mask, strict=True) if keep]
        return inputs, sampled_req_ids, joiners

    def _run_pass_joined(
        self,
        inputs: StepInputs,
        sampled_req_ids: list[str],
        allowed: AllowedTokens | None,
        joiners: list[StepPlan],
        result: StepResult,
        timings: StepTimings,
        joining: JoiningSteps | None,
        start: float,
    ) -> None:
        """One pass of a plan (`_run_pass`) with the steps that joined it, whose requests run
        their scheduled (prompt) tokens in the same forward: their tokens go to each joined
        step's own result, answered at once, the rest to ``result``."""
        if not joiners or joining is None:
            self._run_pass(inputs, sampled_req_ids, allowed, result, timings, start)
            return
        mixed = StepResult(step_id=result.step_id)
        self._run_pass(inputs, sampled_req_ids, allowed, mixed, timings, start)
        pass_timings = StepTimings(total_s=time.perf_counter() - start)  # a joined step's: its pass
        answers = [StepResult(step_id=joiner.step_id, timings=pass_timings) for joiner in joiners]
        owner = {
            req_id: answer
            for joiner, answer in zip(joiners, answers, strict=True)
            for req_id in joiner.num_scheduled_tokens
        }
        for req_id, token_id, logprobs in zip(
            mixed.sampled_req_ids, mixed.sampled_token_ids, mixed.logprobs, strict=True
        ):
            into = owner.get(req_id, result)
            into.sampled_req_ids.append(req_id)
            into.sampled_token_ids.append(token_id)
            into.logprobs.append(logprobs)
        for answer in answers:
            joining.answer(answer)

    def _run_pass(
        self,
        inputs: StepInputs,
        sampled_req_ids: list[str],
        allowed: AllowedTokens | None,
        result: StepResult,
        timings: StepTimings,
        start: float,
    ) -> None:
        """One forward pass over ``inputs``; the tokens it samples join ``result`` and the batch."""
        metadata = build_attention_metadata(
            inputs.query_lens,
            inputs.seq_lens,
            inputs.block_table,
            inputs.slot_mapping,
            self.block_size,
            self.device,
        )
        self.backend.prepare(metadata)
        input_ids = torch.from_numpy(inputs.input_ids.astype(np.int64)).to(self.device)  # [T]
        positions = torch.from_numpy(inputs.positions).to(self.device)  # [T]
        prepared = time.perf_counter()

        hidden = self.model(input_ids, positions, self.kv_caches, metadata)  # [T, hidden]
        sampled_ids = np.zeros(0, dtype=np.int32)
        forwarded = sampled = time.perf_counter()
        if len(inputs.logits_indices):
            indices = torch.from_numpy(inputs.logits_indices).to(self.device)
            logits = self.model.compute_logits(hidden.index_select(0, indices))  # [S, V]
            forwarded = time.perf_counter()
            sampling = self._sampling_metadata(inputs)
            sampling.allowed_tokens = allowed
            output = self.sampler(logits, sampling)
            sampled_ids = output.token_ids.cpu().numpy().astype(np.int32)  # [S]
            result.sampled_req_ids += sampled_req_ids
            result.sampled_token_ids += sampled_ids.tolist()
            result.logprobs += _logprobs_lists(
                output, self.batch.sampling.columns["num_logprobs"][inputs.rows[inputs.sample_mask]]
            )
            sampled = time.perf_counter()
        self.batch.commit(inputs, sampled_ids)
        timings.prepare_s += prepared - start
        timings.forward_s += forwarded - prepared
        timings.sample_s += sampled - forwarded

    def _check_num_steps(self, plan: StepPlan, inputs: StepInputs) -> None:
        """Multi-step requests sample in the first pass and hold blocks for every later one."""
        batch = self.batch
        for index, req_id in enumerate(plan.num_scheduled_tokens):
            num_steps = plan.num_steps.get(req_id, 1)
            if num_steps > 1:
                check_num_steps(
                    req_id,
                    num_steps,
                    bool(inputs.sample_mask[index]),
                    int(inputs.seq_lens[index]),
                    int(batch.num_req_blocks[inputs.rows[index]]) * self.block_size,
                    self.max_model_len,
                )

    def _update_states(self, plan: StepPlan) -> None:
        batch = self.batch
        if plan.reset:
            for req_id in list(batch.row_of):
                batch.remove(req_id)
        for req_id in plan.finished_req_ids:
            batch.remove(req_id)
        for req in plan.new_requests:
            batch.check_new(req)
            seed = req.sampling.seed
            if seed is None:
                seed = int(self._seed_source.integers(0, 2**63 - 1))
            batch.add(req, seed)
        for cached in plan.cached_requests:
            row = batch.row_of.get(cached.req_id)
            if row is None:
                raise PlanError(f"request {cached.req_id!r} is not on this executor; send it whole")
            batch.check_blocks(cached.req_id, cached.new_block_ids, int(batch.num_req_blocks[row]))
            batch.append_blocks(row, cached.new_block_ids)

    def _allowed_tokens(
        self, bitmask: TokenBitmask | None, sampled_req_ids: list[str]
    ) -> AllowedTokens | None:
        """The plan's bitmask on the device, its rows placed among the sampled ones; PlanError
        for a row of a request that does not sample this step, or of the wrong width."""
        if bitmask is None:
            return None
        rows = bitmask_rows(bitmask.req_ids, sampled_req_ids)
        return build_allowed_tokens(rows, bitmask.words, self.model_config.vocab_size, self.device)

    def _sampling_metadata(self, inputs: StepInputs) -> SamplingMetadata:
        """The sampler's inputs for the rows sampled this step."""
        rows = inputs.rows[inputs.sample_mask]
        batch = self.batch
        num_tokens = batch.num_tokens[rows]
        return build_sampling_metadata(
            batch.sampling.gather(rows),
            token_ids=batch.token_ids[rows, : int(num_tokens.max())],
            num_prompt_tokens=batch.num_prompt_tokens[rows],
            num_tokens=num_tokens,
            vocab_size=self.model_config.vocab_size,
            device=self.device,
        )


def _logprobs_lists(output: SamplerOutput, num_logprobs: np.ndarray) -> list[TokenLogprobs | None]:
    """Host lists of the logprobs each sampled request asked for (None where it asked none)."""
    if output.logprobs is None:
        return [None] * len(output.token_ids)
    assert output.ranks is not None and output.top_token_ids is not None and output.top_logprobs is not None
    logprobs = output.logprobs.tolist()
    ranks = output.ranks.tolist()
    top_ids = output.top_token_ids.tolist()
    top_lps = output.top_logprobs.tolist()
    return [
        None
        if n < 0
        else TokenLogprobs(
            logprob=logprobs[i], rank=ranks[i], top_token_ids=top_ids[i][:n], top_logprobs=top_lps[i][:n]
        )
        for i, n in enumerate(num_logprobs.tolist())
    ]
