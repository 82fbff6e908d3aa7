"""The ModelRunner: executes step plans against a model and its paged KV cache.

It keeps per-request state between steps (`InputBatch`), so a plan carries a request's data
once and later only deltas. One step: drop finished requests, admit new ones, append blocks,
gather the flat batch, run the model, compute logits only for the requests that reached their
last known token, sample there, and record the sampled tokens. A multi-step plan then runs more
passes over its multi-step requests, each feeding back the tokens the one before sampled; the
order of a step's passes, with the steps that join them and the early answers, is `PassLoop`'s.
On npu and cuda a pure-decode pass replays a captured graph (`graph_runner`) unless
``enforce_eager``; a step's inputs reach the device through pinned staging buffers (`HostStaging`).
Before anything else a step runs its KV block copies to and from the host-memory tier
(`kv_host_tier`), then starts its pulls from other executors' caches (`kv_transfer`, whose
source side is `read_blocks`): one thread runs them beside the steps, and each final result
names those that landed or failed (`pulls_beside_steps`; a tensor-parallel group runs them
inside the step, and names them in its result).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import structlog
import torch

from npuserve.executor.config import ExecutorConfig, ModelConfig, check_npu_model
from npuserve.executor.dtypes import dtype_name, resolve_dtype
from npuserve.executor.graph_runner import DecodeGraphs, GraphDevice, pool_estimate_bytes
from npuserve.executor.graph_sizes import capture_sizes
from npuserve.executor.input_batch import InputBatch, PlanError, StepInputs
from npuserve.executor.kv_cache import (
    CPU_DEFAULT_KV_CACHE_GIB,
    GIB,
    allocate_kv_caches,
    block_bytes,
    num_blocks_for_budget,
)
from npuserve.executor.kv_host_tier import HostKvTier
from npuserve.executor.kv_transfer import KvPuller, read_blocks
from npuserve.executor.layers import TensorParallel
from npuserve.executor.model_loader import load_model
from npuserve.executor.pass_loop import PassLoop, StepPass
from npuserve.executor.platform import resolve_target
from npuserve.executor.profiling import profile_kv_budget
from npuserve.executor.pulls_beside_steps import BackgroundPulls, PullOutcomes
from npuserve.executor.rpc_status import KvPullFailed
from npuserve.executor.sampler import (
    AllowedTokens,
    Sampler,
    SamplerOutput,
    build_allowed_tokens,
    build_sampling_metadata,
)
from npuserve.executor.step_profiler import StepClock
from npuserve.executor.token_bitmask import bitmask_rows
from npuserve.executor.transfer_tally import TransferTally
from npuserve.kernels import NPU_BLOCK_SIZE, build_attention_metadata, get_backend
from npuserve.kernels.staging import HostStaging
from npuserve.proto import executor_pb2 as pb
from npuserve.proto.plan_checks import check_kv_pulls, check_num_steps
from npuserve.proto.step_plan import (
    EMULATED_NPU_DEVICE,
    ExecutorInfo,
    FirstPassAnswer,
    JoiningSteps,
    KvPull,
    StepPlan,
    StepResult,
    StepTimings,
    TokenLogprobs,
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
        # Step timings: device times while a profile runs (`StepProfiler`), else launch times.
        self.step_clock = StepClock(self.target)
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
        self.graph_sizes = self._graph_sizes()
        self.num_blocks = self._size_kv_cache()
        # NOTE: in graph mode the cache holds one block beyond the scheduler's pool, block
        # `num_blocks`, which no plan may name: the scratch block padded decode rows write to.
        self.kv_caches = allocate_kv_caches(
            self.model_config,
            self.num_blocks + (1 if self.graph_sizes else 0),
            self.block_size,
            self.dtype,
            self.device,
            self.tp,
        )
        # Pulls from other executors; `serve_executor` gives it the cluster token.
        self.kv_puller = KvPuller()
        # What the pulls came to, told in the step results. A tensor-parallel group runs its pulls
        # inside the step (its ranks' collectives must not interleave with the step's).
        self.pull_outcomes = PullOutcomes()
        self._pulls = BackgroundPulls(self._pull, self.pull_outcomes) if self.tp.size == 1 else None
        self.batch = InputBatch(config.max_num_seqs, self.max_model_len, self.block_size, self.num_blocks)
        self.staging = HostStaging(self.backend.host_transfers(self.device), self.device)
        self.host_kv: HostKvTier | None = None
        if config.kv_host_memory_gib:  # NOTE: as many host blocks as the budget holds
            per_block = block_bytes(self.model_config, self.block_size, self.dtype, self.tp)
            num_host_blocks = max(1, int(config.kv_host_memory_gib * GIB) // per_block)
            self.host_kv = HostKvTier(self.kv_caches, num_host_blocks, self.staging)
        self.sampler = Sampler()
        self._seed_source = np.random.default_rng(config.seed)
        self._passes = PassLoop(self, config.max_num_batched_tokens)
        self.graphs = self._capture_graphs() if self.graph_sizes else None

    def _graph_sizes(self) -> list[int]:
        """The decode batch sizes to capture graphs of; none on the CPU or with enforce_eager."""
        if self.config.enforce_eager or self.target.kind not in ("npu", "cuda"):
            return []
        return capture_sizes(
            self.config.graph_capture_sizes,
            self.config.max_num_seqs,
            self.model_config.num_layers,
            self.tp.size,
            on_npu=self.target.kind == "npu",
        )

    @torch.inference_mode()
    def _capture_graphs(self) -> DecodeGraphs | None:
        try:
            return DecodeGraphs.capture(
                GraphDevice(self.target.kind),
                self.model,
                self.kv_caches,
                self.backend,
                self.staging,
                self.graph_sizes,
                self.block_size,
                self.batch.max_blocks_per_req,
                scratch_block=self.num_blocks,
                tensor_device=self.device,
            )
        except RuntimeError as exc:
            if self.target.kind == "npu":
                raise
            # NOTE: the CUDA path has not run on a GPU in npuserve's tests: a capture that fails
            # leaves the executor eager rather than down.
            log.warning("decode graph capture failed; every step runs eagerly", error=str(exc))
            return None

    def _size_kv_cache(self) -> int:
        """The scheduler's blocks. In graph mode a profiled budget also holds the graphs' memory
        pool (estimated: it is captured afterwards) and the scratch block; an explicit one
        (--kv-cache-memory) is the scheduler's blocks alone."""
        per_block = block_bytes(self.model_config, self.block_size, self.dtype, self.tp)
        if self.config.kv_cache_memory_gib is not None:
            budget = int(self.config.kv_cache_memory_gib * GIB)
        elif self.target.kind == "cpu":
            budget = CPU_DEFAULT_KV_CACHE_GIB * GIB
        else:
            budget = profile_kv_budget(self)
            if self.graph_sizes:
                pool = pool_estimate_bytes(self.model_config, self.graph_sizes, self.dtype, self.tp.size)
                budget -= pool + per_block
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
            dtype=dtype_name(self.dtype),
            device=EMULATED_NPU_DEVICE if self.target.emulated else str(self.device),
            tensor_parallel_size=self.tp.size,
            # NOTE: a tensor-parallel group's other ranks run the steps its leader sends them,
            # whole: none could take a joining step at the same pass as the leader.
            joins_steps=self.tp.size == 1,
            num_host_blocks=self.host_kv.num_blocks if self.host_kv is not None else 0,
            role=self.config.role,
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
        """Runs one step, pass by pass (`PassLoop.run`); `PlanError` for a plan that contradicts
        the executor's state."""
        return self._passes.run(plan, on_first_pass, joining)

    # -- the passes of a step (`PassRunner`) ------------------------------------------------------

    def begin_step(self, plan: StepPlan, started: float) -> None:
        if plan.reset and self._pulls is not None:
            self._pulls.cancel()
        self.pull_outcomes.acknowledge(plan)
        self._update_states(plan)

    def run_pass(self, plan: StepPlan, step_pass: StepPass, result: StepResult) -> list[StepResult]:
        """One forward pass: the plan's tokens of the pass, then the joiners' prompts (their
        requests added to the batch first), in one batch."""
        scheduled = step_pass.tokens
        if step_pass.joiners:
            scheduled = dict(scheduled)
            for joiner in step_pass.joiners:
                self._update_states(joiner)
                scheduled.update(joiner.num_scheduled_tokens)
        inputs = self.batch.prepare(scheduled)
        sampled_req_ids = [r for r, keep in zip(scheduled, inputs.sample_mask, strict=True) if keep]
        allowed = None
        if step_pass.index == 0:
            # Multi-step requests sample in the first pass and hold blocks for every later one.
            for index, req_id in enumerate(plan.num_scheduled_tokens if plan.num_steps else ()):
                if (num_steps := plan.num_steps.get(req_id, 1)) > 1:
                    check_num_steps(
                        req_id,
                        num_steps,
                        bool(inputs.sample_mask[index]),
                        int(inputs.seq_lens[index]),
                        int(self.batch.num_req_blocks[inputs.rows[index]]) * self.block_size,
                        self.max_model_len,
                    )
            # NOTE: checked before the forward, so a bad bitmask costs no forward and writes no KV:
            # PlanError for a row of a request that does not sample this step, or of the wrong width.
            bitmask = plan.bitmask
            if bitmask is not None:
                rows = bitmask_rows(bitmask.req_ids, sampled_req_ids)
                allowed = build_allowed_tokens(rows, bitmask.words, self.model_config.vocab_size, self.device)
        mixed = StepResult(step_id=result.step_id) if step_pass.joiners else result
        self._run_pass(inputs, sampled_req_ids, allowed, mixed, result.timings, step_pass.started)
        return _split_joined(mixed, step_pass.joiners, result, step_pass.started) if step_pass.joiners else []

    def await_pass_end(self) -> None:
        """A pass has ended once `run_pass` returns."""

    def end_step(self, plan: StepPlan, result: StepResult, started: float) -> None:
        if plan.num_scheduled_tokens:  # NOTE: a step that ran no pass reports no time
            result.timings.total_s = self.step_clock() - started
        elif self._pulls is not None:  # NOTE: one with nothing to run waits a little for a pull
            self._pulls.wait_for_outcome(plan)
        self.pull_outcomes.report(result)
        # NOTE: its joiners' copies too: they ran in its passes.
        tallies = (
            [self.kv_puller.tally] if self.host_kv is None else [self.host_kv.tally, self.kv_puller.tally]
        )
        result.timings.kv_transfers = [t for t in map(TransferTally.take, tallies) if t.num_bytes]

    def read_blocks(self, block_ids: list[int]) -> Iterator[pb.BlockChunk]:
        """Blocks of this cache for another executor's pull, beside the steps (`kv_transfer.read_blocks`;
        a tensor-parallel group's: `GroupLeader.read_blocks`)."""
        return read_blocks(self.kv_caches, block_ids, self.num_blocks)

    def drop_requests(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self.batch.remove(req_id)

    def _run_pass(
        self,
        inputs: StepInputs,
        sampled_req_ids: list[str],
        allowed: AllowedTokens | None,
        result: StepResult,
        timings: StepTimings,
        start: float,
    ) -> None:
        """One forward pass over ``inputs``, replayed in a decode graph where one fits; the
        tokens it samples join ``result`` and the batch."""
        graph = self.graphs.load(inputs) if self.graphs is not None else None
        if graph is None:
            metadata = build_attention_metadata(
                inputs.query_lens,
                inputs.seq_lens,
                inputs.block_table,
                inputs.slot_mapping,
                self.block_size,
                self.device,
                self.staging,
            )
            self.backend.prepare(metadata)
            input_ids = self.staging.to_device("input_ids", inputs.input_ids, torch.int64)  # [T]
            positions = self.staging.to_device("positions", inputs.positions, torch.int64)  # [T]
        prepared = self.step_clock()

        if graph is not None:
            hidden = graph.replay(len(inputs.query_lens))  # [B, hidden]
            timings.graph_passes += 1
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, metadata)  # [T, hidden]
            timings.eager_passes += 1
        sampled_ids = np.zeros(0, dtype=np.int32)
        forwarded = sampled = self.step_clock()
        if len(inputs.logits_indices):
            indices = self.staging.to_device("logits_indices", inputs.logits_indices, torch.int64)
            logits = self.model.compute_logits(hidden.index_select(0, indices))  # [S, V]
            forwarded = self.step_clock()
            batch, rows = self.batch, inputs.rows[inputs.sample_mask]  # [S]: the rows sampled
            num_tokens = batch.num_tokens[rows]
            sampling = build_sampling_metadata(
                batch.sampling.gather(rows),
                token_ids=batch.token_ids[rows, : int(num_tokens.max())],
                num_prompt_tokens=batch.num_prompt_tokens[rows],
                num_tokens=num_tokens,
                vocab_size=self.model_config.vocab_size,
                device=self.device,
            )
            sampling.allowed_tokens = allowed
            output = self.sampler(logits, sampling)
            sampled_ids = output.token_ids.cpu().numpy().astype(np.int32)  # [S]
            result.sampled_req_ids += sampled_req_ids
            result.sampled_token_ids += sampled_ids.tolist()
            result.logprobs += _logprobs_lists(output, batch.sampling.columns["num_logprobs"][rows])
            sampled = self.step_clock()
        self.batch.commit(inputs, sampled_ids)
        timings.prepare_s += prepared - start
        timings.forward_s += forwarded - prepared
        timings.sample_s += sampled - forwarded

    def _update_states(self, plan: StepPlan) -> None:
        if plan.kv_pulls:
            check_kv_pulls(plan.kv_pulls, self.num_blocks)  # NOTE: before the block copies run
        # NOTE: no step names a block a pull writes, but a failed step's pull may outlive it.
        if self._pulls is not None and self._pulls.busy:
            self._pulls.wait_for_blocks(plan)
        if plan.block_copies:
            if self.host_kv is None:
                raise PlanError("block copies to a host tier this executor does not have (--kv-host-memory)")
            self.host_kv.run(plan.block_copies, self.kv_caches, self.num_blocks)
        # The results name each pull's outcome (`pull_outcomes`). Beside the steps, a pull runs
        # after those before it (a plan that also runs its request's tokens waits for it); a
        # tensor-parallel group runs each now, its ranks agreeing on the outcome (`GroupKvPuller`).
        if plan.kv_pulls and self._pulls is not None:
            self._pulls.start(plan.kv_pulls)
            self._pulls.wait_for_blocks(plan)
        elif plan.kv_pulls:
            for pull in plan.kv_pulls:
                self.pull_outcomes.settle(pull.req_id, self._pull(pull))
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

    @torch.inference_mode()
    def _pull(self, pull: KvPull) -> bool:
        """Runs one pull; False when it failed (`KvPullFailed`: the source is gone, refused or
        too slow). Its blocks then hold part of the KV at most, and the scheduler computes the
        request's prompt here instead."""
        try:
            self.kv_puller.run([pull], self.kv_caches)
        except KvPullFailed as exc:
            log.warning("kv pull failed", request_id=pull.req_id, error=str(exc))
            return False
        return True


def _split_joined(
    mixed: StepResult, joiners: list[StepPlan], result: StepResult, pass_started: float
) -> list[StepResult]:
    """A pass's tokens (``mixed``) parted: the joiners' requests' into a result for each joiner
    (returned; timed as the pass, begun at ``pass_started``), the rest into ``result``."""
    pass_timings = StepTimings(total_s=time.perf_counter() - pass_started)
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
    return answers


def _logprobs_lists(output: SamplerOutput, num_logprobs: np.ndarray) -> list[TokenLogprobs | None]:
    """Host lists of the logprobs each sampled request asked for (None where it asked none)."""
    if output.logprobs is None:
        return [None] * len(output.token_ids)
    assert output.ranks is not None and output.top_token_ids is not None and output.top_logprobs is not None
    logprobs, ranks, top_ids, top_lps = (
        t.tolist() for t in (output.logprobs, output.ranks, output.top_token_ids, output.top_logprobs)
    )
    return [
        None
        if n < 0
        else TokenLogprobs(
            logprob=logprobs[i], rank=ranks[i], top_token_ids=top_ids[i][:n], top_logprobs=top_lps[i][:n]
        )
        for i, n in enumerate(num_logprobs.tolist())
    ]
