"""Per-request state the executor keeps between steps, as fixed-size arrays indexed by row.

A request takes a row when it arrives and frees it when it finishes; every per-step input
(token ids, positions, slot mapping, block tables, sampling parameters) is then gathered from
these arrays with vectorised numpy indexing, with no Python loop over the requests of a step.
Block ids come from the scheduler; the executor never invents one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from npuserve.kernels import NULL_BLOCK_ID, cdiv, slot_mapping
from npuserve.proto.plan_checks import PlanError, check_block_ids, check_new_request
from npuserve.proto.step_plan import NewRequest, SamplingOptions


@dataclass(slots=True)
class StepInputs:
    """The host-side inputs of one step; ``B`` requests, ``T`` tokens."""

    rows: np.ndarray  # [B] batch row of each scheduled request
    query_lens: np.ndarray  # [B] tokens scheduled
    seq_lens: np.ndarray  # [B] kv length after this step
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T] int32
    block_table: np.ndarray  # [B, max_blocks] int32
    sample_mask: np.ndarray  # [B] bool: the request's chunk reaches its last known token
    logits_indices: np.ndarray  # [num_sampled] token index whose hidden state is sampled


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, num_blocks: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_blocks_per_req = cdiv(max_model_len, block_size)
        rows = max_num_reqs
        # +1: a request may hold max_model_len tokens and still have one sampled after them.
        self.token_ids = np.zeros((rows, max_model_len + 1), dtype=np.int32)
        self.num_tokens = np.zeros(rows, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(rows, dtype=np.int32)
        self.num_computed_tokens = np.zeros(rows, dtype=np.int32)
        self.block_table = np.full((rows, self.max_blocks_per_req), NULL_BLOCK_ID, dtype=np.int32)
        self.num_req_blocks = np.zeros(rows, dtype=np.int32)
        self.sampling = SamplingArrays(rows)
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(rows - 1, -1, -1))

    @property
    def num_reqs(self) -> int:
        return len(self.row_of)

    # -- state changes ------------------------------------------------------------------------

    def check_new(self, req: NewRequest) -> None:
        if req.req_id in self.row_of:
            raise PlanError(f"request {req.req_id!r} is already running on this executor")
        check_new_request(req, self.max_model_len, self.num_blocks, self.max_blocks_per_req)

    def check_blocks(self, req_id: str, block_ids: list[int], num_held: int) -> None:
        check_block_ids(req_id, block_ids, num_held, self.num_blocks, self.max_blocks_per_req)

    def add(self, req: NewRequest, seed: int) -> None:
        if not self._free_rows:
            raise PlanError(f"more than max_num_seqs={self.max_num_reqs} requests at once")
        row = self._free_rows.pop()
        self.row_of[req.req_id] = row
        num_tokens = len(req.token_ids)
        self.token_ids[row, :num_tokens] = req.token_ids
        self.num_tokens[row] = num_tokens
        self.num_prompt_tokens[row] = req.num_prompt_tokens
        self.num_computed_tokens[row] = req.num_computed_tokens
        self.block_table[row] = NULL_BLOCK_ID
        self.num_req_blocks[row] = 0
        self.append_blocks(row, req.block_ids)
        self.sampling.set(row, req.sampling, seed)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_req_blocks[row])
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_req_blocks[row] = start + len(block_ids)

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self._free_rows.append(row)

    # -- per-step inputs ----------------------------------------------------------------------

    def prepare(self, num_scheduled_tokens: dict[str, int]) -> StepInputs:
        num_reqs = len(num_scheduled_tokens)
        try:
            rows = np.fromiter((self.row_of[r] for r in num_scheduled_tokens), dtype=np.int64, count=num_reqs)
        except KeyError as exc:
            raise PlanError(f"request {exc.args[0]!r} is scheduled but unknown") from None
        query_lens = np.fromiter(num_scheduled_tokens.values(), dtype=np.int32, count=num_reqs)
        seq_lens = self.num_computed_tokens[rows] + query_lens
        if (query_lens < 1).any() or (seq_lens > self.num_tokens[rows]).any():
            raise PlanError("tokens scheduled beyond a request's known tokens")
        if (seq_lens > self.num_req_blocks[rows] * self.block_size).any():
            raise PlanError("tokens scheduled beyond a request's blocks")
        query_ends = np.cumsum(query_lens)
        num_tokens = int(query_ends[-1])
        token_rows = np.repeat(rows, query_lens)  # [T]
        first_positions = self.num_computed_tokens[rows]  # [B]
        positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(
            first_positions - (query_ends - query_lens), query_lens
        )  # [T]
        sample_mask = seq_lens == self.num_tokens[rows]
        return StepInputs(
            rows=rows,
            query_lens=query_lens,
            seq_lens=seq_lens,
            input_ids=self.token_ids[token_rows, positions],
            positions=positions,
            slot_mapping=slot_mapping(self.block_table, token_rows, positions, self.block_size),
            block_table=self.block_table[rows],
            sample_mask=sample_mask,
            logits_indices=query_ends[sample_mask] - 1,
        )

    def commit(self, inputs: StepInputs, sampled_token_ids: np.ndarray) -> None:
        """Records the step: computed tokens advance, and sampled tokens join their requests."""
        self.num_computed_tokens[inputs.rows] = inputs.seq_lens
        sampled_rows = inputs.rows[inputs.sample_mask]
        self.token_ids[sampled_rows, self.num_tokens[sampled_rows]] = sampled_token_ids
        self.num_tokens[sampled_rows] += 1


@dataclass(frozen=True, slots=True)
class Column:
    """One per-request sampling value as a numpy column; ``unset`` stands for an option's None."""

    dtype: type[np.generic]
    unset: float = 0


# The executor's per-request sampling state: one column per SamplingOptions field, gathered per
# step by row and handed to the sampler under the same names. stop_token_ids, a list per
# request, is the one field kept apart (a [rows, K] matrix padded with -1).
SAMPLING_COLUMNS: dict[str, Column] = {
    "temperature": Column(np.float32),
    "top_k": Column(np.int32),
    "top_p": Column(np.float32, 1),
    "min_p": Column(np.float32),
    "seed": Column(np.int64),  # never unset here: the runner draws a seed for None
    "presence_penalty": Column(np.float32),
    "frequency_penalty": Column(np.float32),
    "repetition_penalty": Column(np.float32, 1),
    "num_logprobs": Column(np.int32, -1),  # -1: no logprobs
    "min_tokens": Column(np.int32),
}


class SamplingArrays:
    """`SamplingOptions` of every row as arrays, so a step gathers them with one index."""

    def __init__(self, rows: int) -> None:
        self.columns = {name: np.full(rows, c.unset, dtype=c.dtype) for name, c in SAMPLING_COLUMNS.items()}
        self.stop_token_ids = np.full((rows, 0), -1, dtype=np.int32)

    def set(self, row: int, options: SamplingOptions, seed: int) -> None:
        for name, column in self.columns.items():
            value = getattr(options, name)
            column[row] = SAMPLING_COLUMNS[name].unset if value is None else value
        self.columns["seed"][row] = seed
        stop_ids = options.stop_token_ids if options.min_tokens else ()
        width = self.stop_token_ids.shape[1]
        if len(stop_ids) > width:  # rare: widen once for the longest list seen
            extra = np.full((self.stop_token_ids.shape[0], len(stop_ids) - width), -1, np.int32)
            self.stop_token_ids = np.concatenate([self.stop_token_ids, extra], axis=1)
        self.stop_token_ids[row] = -1
        self.stop_token_ids[row, : len(stop_ids)] = stop_ids

    def gather(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """rows [B] -> every column at those rows ([B]; stop_token_ids [B, K]), by field name."""
        gathered = {name: column[rows] for name, column in self.columns.items()}
        gathered["stop_token_ids"] = self.stop_token_ids[rows]
        return gathered
