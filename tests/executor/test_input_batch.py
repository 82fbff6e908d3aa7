"""InputBatch on its own: the exact per-step arrays for a hand-built mix, row reuse, refusals.

The mix has one request of each kind the scheduler produces in one step: a decode, a chunked
prefill stopping mid-prompt, and a prefix-cache hit whose first blocks are already computed.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from npuserve.executor.input_batch import SAMPLING_COLUMNS, InputBatch, PlanError
from npuserve.kernels import NULL_BLOCK_ID
from npuserve.proto.step_plan import NewRequest, SamplingOptions

BLOCK_SIZE = 16
MAX_MODEL_LEN = 64  # 4 blocks per request
NUM_BLOCKS = 20


def make_batch(max_num_reqs: int = 4) -> InputBatch:
    return InputBatch(max_num_reqs, MAX_MODEL_LEN, BLOCK_SIZE, NUM_BLOCKS)


def new_request(
    req_id: str,
    token_ids: list[int],
    block_ids: list[int],
    num_computed_tokens: int = 0,
    num_prompt_tokens: int | None = None,
) -> NewRequest:
    return NewRequest(
        req_id=req_id,
        token_ids=token_ids,
        num_prompt_tokens=len(token_ids) if num_prompt_tokens is None else num_prompt_tokens,
        sampling=SamplingOptions(temperature=0),
        block_ids=block_ids,
        num_computed_tokens=num_computed_tokens,
    )


def admit(batch: InputBatch, req: NewRequest) -> None:
    batch.check_new(req)
    batch.add(req, seed=0)


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_mixed_step_inputs_are_exact() -> None:
    """Decode + mid-prompt chunk + prefix hit: every gathered array, value by value."""
    batch = make_batch()
    dec_prompt, chunk_prompt, hit_prompt = tokens(100, 3), tokens(200, 40), tokens(300, 20)
    admit(batch, new_request("dec", dec_prompt, [2]))
    admit(batch, new_request("chunk", chunk_prompt, [7, 3, 9]))
    # Step 1: dec prefills its 3 tokens and samples 77; chunk prefills its first 16 tokens.
    first = batch.prepare({"dec": 3, "chunk": 16})
    np.testing.assert_array_equal(first.sample_mask, [True, False])
    np.testing.assert_array_equal(first.logits_indices, [2])
    batch.commit(first, np.array([77], dtype=np.int32))
    # The hit arrives with its first block (16 tokens) already in the cache.
    admit(batch, new_request("hit", hit_prompt, [5, 11], num_computed_tokens=16))

    inputs = batch.prepare({"dec": 1, "chunk": 10, "hit": 4})

    np.testing.assert_array_equal(inputs.rows, [0, 1, 2])
    np.testing.assert_array_equal(inputs.query_lens, [1, 10, 4])
    np.testing.assert_array_equal(inputs.seq_lens, [4, 26, 20])
    np.testing.assert_array_equal(inputs.positions, [3, *range(16, 26), *range(16, 20)])
    np.testing.assert_array_equal(inputs.input_ids, [77, *chunk_prompt[16:26], *hit_prompt[16:20]])
    # slot = block_id * 16 + position % 16: dec in block 2, chunk in its 2nd block (3), hit in 11.
    expected_slots = [2 * 16 + 3, *range(3 * 16, 3 * 16 + 10), *range(11 * 16, 11 * 16 + 4)]
    np.testing.assert_array_equal(inputs.slot_mapping, expected_slots)
    assert inputs.slot_mapping.dtype == np.int32
    np.testing.assert_array_equal(inputs.block_table, [[2, 0, 0, 0], [7, 3, 9, 0], [5, 11, 0, 0]])
    assert inputs.block_table.dtype == np.int32
    np.testing.assert_array_equal(inputs.sample_mask, [True, False, True])
    np.testing.assert_array_equal(inputs.logits_indices, [0, 14])  # last token of dec and of hit

    batch.commit(inputs, np.array([78, 99], dtype=np.int32))
    np.testing.assert_array_equal(batch.num_computed_tokens[:3], [4, 26, 20])
    np.testing.assert_array_equal(batch.num_tokens[:3], [5, 40, 21])
    np.testing.assert_array_equal(batch.token_ids[0, :5], [*dec_prompt, 77, 78])
    assert batch.token_ids[2, 20] == 99
    np.testing.assert_array_equal(batch.num_prompt_tokens[:3], [3, 40, 20])


def test_cached_blocks_extend_the_table() -> None:
    """append_blocks adds a running request's new blocks after those it holds."""
    batch = make_batch()
    admit(batch, new_request("a", tokens(1, 17), [4]))
    with pytest.raises(PlanError, match="beyond a request's blocks"):
        batch.prepare({"a": 17})
    row = batch.row_of["a"]
    batch.check_blocks("a", [8], int(batch.num_req_blocks[row]))
    batch.append_blocks(row, [8])
    inputs = batch.prepare({"a": 17})
    np.testing.assert_array_equal(inputs.block_table, [[4, 8, 0, 0]])
    assert inputs.slot_mapping[-1] == 8 * 16 + 0


def test_rows_are_reused_after_remove_with_fresh_state() -> None:
    """A removed request's row goes to the next arrival, with none of the old blocks or tokens."""
    batch = make_batch(max_num_reqs=2)
    admit(batch, new_request("a", tokens(1, 30), [3, 4]))
    admit(batch, new_request("b", tokens(50, 5), [6]))
    assert batch.row_of == {"a": 0, "b": 1}
    batch.remove("a")
    batch.remove("a")  # removing twice (or an unknown id) is a no-op
    batch.remove("never-seen")
    assert batch.num_reqs == 1
    admit(batch, new_request("c", tokens(70, 2), [9]))
    assert batch.row_of["c"] == 0
    inputs = batch.prepare({"c": 2})
    np.testing.assert_array_equal(inputs.block_table, [[9, NULL_BLOCK_ID, NULL_BLOCK_ID, NULL_BLOCK_ID]])
    np.testing.assert_array_equal(inputs.input_ids, [70, 71])
    assert batch.num_req_blocks[0] == 1 and batch.num_tokens[0] == 2
    with pytest.raises(PlanError, match="max_num_seqs=2"):
        batch.add(new_request("d", [1], [10]), seed=0)


def test_duplicate_request_id() -> None:
    """A new request whose id is already running is refused."""
    batch = make_batch()
    admit(batch, new_request("a", [1, 2], [1]))
    with pytest.raises(PlanError, match="'a' is already running"):
        batch.check_new(new_request("a", [1, 2], [2]))


def test_unknown_scheduled_id() -> None:
    """Scheduling an id the batch never received names that id."""
    batch = make_batch()
    admit(batch, new_request("a", [1, 2], [1]))
    with pytest.raises(PlanError, match="'ghost' is scheduled but unknown"):
        batch.prepare({"a": 2, "ghost": 1})


@pytest.mark.parametrize("num_scheduled", [3, 0])
def test_tokens_beyond_known_tokens(num_scheduled: int) -> None:
    """More tokens than the request holds (or none at all) is refused."""
    batch = make_batch()
    admit(batch, new_request("a", [1, 2], [1]))
    with pytest.raises(PlanError, match="beyond a request's known tokens"):
        batch.prepare({"a": num_scheduled})


def test_tokens_beyond_held_blocks() -> None:
    """Tokens that would land past the request's last block are refused."""
    batch = make_batch()
    admit(batch, new_request("a", tokens(1, 20), [1]))
    with pytest.raises(PlanError, match="beyond a request's blocks"):
        batch.prepare({"a": 20})
    batch.prepare({"a": 16})  # the first block's worth is fine


@pytest.mark.parametrize("block_ids", [[0], [3, NUM_BLOCKS], [-1], [1, 2, 3, 4, 5]])
def test_bad_block_ids(block_ids: list[int]) -> None:
    """Block 0 (the null block), ids >= num_blocks, and more blocks than max_model_len needs."""
    batch = make_batch()
    with pytest.raises(PlanError, match=r"block id outside 1\.\.19|more blocks than max_model_len"):
        batch.check_new(new_request("a", [1], block_ids))
    admit(batch, new_request("b", [1], [1]))
    with pytest.raises(PlanError, match="'b'"):  # the same checks guard a running request's new blocks
        batch.check_blocks("b", block_ids, 1)


def test_too_many_requests_for_max_num_seqs() -> None:
    """A request beyond max_num_seqs rows is refused, naming the limit."""
    batch = make_batch(max_num_reqs=1)
    admit(batch, new_request("a", [1], [1]))
    with pytest.raises(PlanError, match="more than max_num_seqs=1 requests"):
        admit(batch, new_request("b", [1], [2]))
    assert batch.num_reqs == 1


@pytest.mark.parametrize(
    ("num_tokens", "num_prompt_tokens", "num_computed_tokens", "match"),
    [
        (MAX_MODEL_LEN + 1, MAX_MODEL_LEN + 1, 0, "65 tokens .65 prompt. for max_model_len 64"),
        (5, 0, 0, "5 tokens .0 prompt."),
        (5, 6, 0, "5 tokens .6 prompt."),
        (5, 5, 5, "bad num_computed_tokens"),
        (5, 5, -1, "bad num_computed_tokens"),
    ],
)
def test_bad_request_lengths(
    num_tokens: int, num_prompt_tokens: int, num_computed_tokens: int, match: str
) -> None:
    """A prompt longer than max_model_len, an empty prompt, or no token left to compute."""
    batch = make_batch()
    req = new_request("a", tokens(1, num_tokens), [1], num_computed_tokens, num_prompt_tokens)
    with pytest.raises(PlanError, match=match):
        batch.check_new(req)


def test_prompt_of_exactly_max_model_len_is_accepted() -> None:
    """A prompt filling the context is fine, and its one sampled token still has a slot."""
    batch = make_batch()
    admit(batch, new_request("a", tokens(1, MAX_MODEL_LEN), [1, 2, 3, 4]))
    inputs = batch.prepare({"a": MAX_MODEL_LEN})
    batch.commit(inputs, np.array([500], dtype=np.int32))
    assert batch.num_tokens[0] == MAX_MODEL_LEN + 1
    assert batch.token_ids[0, MAX_MODEL_LEN] == 500


def test_every_sampling_option_has_a_column() -> None:
    """stop_token_ids aside (a matrix), each SamplingOptions field is one column."""
    fields = {f.name for f in dataclasses.fields(SamplingOptions)}
    assert set(SAMPLING_COLUMNS) == fields - {"stop_token_ids"}


def test_sampling_columns_gather_each_request_options_by_row() -> None:
    batch = make_batch()
    options = SamplingOptions(temperature=0.5, top_k=7, top_p=0.9, min_p=0.1, seed=None, presence_penalty=1.0)
    blocked = SamplingOptions(num_logprobs=3, repetition_penalty=1.2, min_tokens=2, stop_token_ids=(2, 9))
    for req_id, sampling, blocks in [("a", options, [1]), ("b", blocked, [2])]:
        req = dataclasses.replace(new_request(req_id, tokens(1, 3), blocks), sampling=sampling)
        batch.check_new(req)
        batch.add(req, seed=1234 if req_id == "a" else 5)
    gathered = batch.sampling.gather(np.array([batch.row_of["b"], batch.row_of["a"]]))
    for name, column in SAMPLING_COLUMNS.items():
        assert gathered[name].dtype == column.dtype, name
    np.testing.assert_allclose(gathered["temperature"], [1.0, 0.5])
    np.testing.assert_array_equal(gathered["top_k"], [0, 7])
    np.testing.assert_array_equal(gathered["seed"], [5, 1234])  # the runner's seed, not None
    np.testing.assert_array_equal(gathered["num_logprobs"], [3, -1])  # -1: none asked
    np.testing.assert_array_equal(gathered["min_tokens"], [2, 0])
    np.testing.assert_array_equal(gathered["stop_token_ids"], [[2, 9], [-1, -1]])
