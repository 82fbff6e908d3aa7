"""SamplingParams validation and conversion, and Request bookkeeping."""

from __future__ import annotations

import random

import pytest

from npuserve.scheduler.core.block_hash import extend_block_hashes, hash_block_tokens
from npuserve.scheduler.core.request import InvalidRequestError, Request, RequestStatus, SamplingParams

VOCAB = 1000

# (field, valid values, invalid values), boundaries on both sides.
CASES: list[tuple[str, list[object], list[object]]] = [
    ("n", [1, 128], [0, -1, 129]),
    ("max_tokens", [None, 1, 10**6], [0, -5]),
    ("temperature", [0, 0.0, 2.0, 100.0], [-0.01, -1]),
    ("top_p", [1e-9, 0.5, 1.0], [0, 0.0, -0.1, 1.0001]),
    ("top_k", [-1, 0, 1, 10**6], [-2, -100]),
    ("min_p", [0.0, 1.0], [-0.01, 1.01]),
    ("presence_penalty", [-2.0, 0.0, 2.0], [-2.01, 2.01]),
    ("frequency_penalty", [-2.0, 0.0, 2.0], [-2.01, 2.01]),
    ("repetition_penalty", [1e-6, 1.0, 2.0, 5.0], [0, 0.0, -1.0]),
    ("min_tokens", [0, 10**6], [-1]),
    ("logprobs", [None, 0, 20], [-1, 21]),
    ("stop", [[], ["a"], ["\n", "END"]], [[""], ["ok", ""], [3]]),
    ("stop_token_ids", [[], [0], [VOCAB - 1], [0, 5, VOCAB - 1]], [[-1], [VOCAB], [5, VOCAB + 3]]),
]


@pytest.mark.parametrize(
    ("name", "value"), [(name, v) for name, good, _ in CASES for v in good], ids=lambda x: repr(x)
)
def test_validate_accepts_boundary_values(name: str, value: object) -> None:
    """Each field's in-range boundary values pass validation."""
    SamplingParams(**{name: value}).validate(VOCAB)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "value"), [(name, v) for name, _, bad in CASES for v in bad], ids=lambda x: repr(x)
)
def test_validate_names_the_offending_field(name: str, value: object) -> None:
    """Each field's out-of-range values raise InvalidRequestError with that field's name."""
    with pytest.raises(InvalidRequestError) as excinfo:
        SamplingParams(**{name: value}).validate(VOCAB)  # type: ignore[arg-type]
    assert excinfo.value.field == name
    assert name in str(excinfo.value)
    assert isinstance(excinfo.value, ValueError)


def test_min_tokens_bounded_by_max_tokens() -> None:
    """min_tokens may equal max_tokens but not exceed it."""
    SamplingParams(max_tokens=5, min_tokens=5).validate(VOCAB)
    with pytest.raises(InvalidRequestError) as excinfo:
        SamplingParams(max_tokens=5, min_tokens=6).validate(VOCAB)
    assert excinfo.value.field == "min_tokens"


def test_validate_reports_the_first_bad_field() -> None:
    """With several bad fields, the error names the first one checked."""
    with pytest.raises(InvalidRequestError) as excinfo:
        SamplingParams(n=0, temperature=-1, logprobs=99).validate(VOCAB)
    assert excinfo.value.field == "n"


def test_validate_message_shows_the_bounds() -> None:
    """The message states the allowed interval and the value received."""
    with pytest.raises(InvalidRequestError, match=r"top_p must be in \(0, 1\], got 0"):
        SamplingParams(top_p=0).validate(VOCAB)
    with pytest.raises(InvalidRequestError, match=r"max_tokens must be in \[1, inf\), got 0"):
        SamplingParams(max_tokens=0).validate(VOCAB)


def test_for_sibling_seeds() -> None:
    """Siblings get seed + index when seeded, stay unseeded otherwise, and have n == 1."""
    seeded = SamplingParams(n=3, seed=10, stop=["x"], stop_token_ids=[7])
    siblings = [seeded.for_sibling(i) for i in range(3)]
    assert [s.seed for s in siblings] == [10, 11, 12]
    assert all(s.n == 1 for s in siblings)
    assert all(s.stop == ["x"] and s.stop_token_ids == [7] for s in siblings)
    siblings[0].stop.append("y")
    siblings[0].stop_token_ids.append(8)
    assert seeded.stop == ["x"] and seeded.stop_token_ids == [7]  # lists are copies
    assert seeded.n == 3 and seeded.seed == 10
    unseeded = SamplingParams(n=2, temperature=0.7)
    assert [unseeded.for_sibling(i).seed for i in range(2)] == [None, None]
    assert unseeded.for_sibling(1).temperature == 0.7


def test_to_options_copies_the_sampling_knobs() -> None:
    """to_options carries the sampling fields over and maps top_k=-1 to 0."""
    params = SamplingParams(
        temperature=0.5,
        top_k=-1,
        top_p=0.9,
        min_p=0.1,
        seed=4,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logprobs=3,
    )
    opts = params.to_options((2,))
    assert (opts.temperature, opts.top_k, opts.top_p, opts.min_p, opts.seed) == (0.5, 0, 0.9, 0.1, 4)
    assert (opts.presence_penalty, opts.frequency_penalty, opts.repetition_penalty) == (0.5, -0.5, 1.2)
    assert opts.num_logprobs == 3
    assert SamplingParams(top_k=40).to_options((2,)).top_k == 40


def test_to_options_stop_ids_only_with_min_tokens() -> None:
    """Stop ids reach the executor only when min_tokens must hold them back."""
    assert SamplingParams(stop_token_ids=[7]).to_options((2,)).stop_token_ids == ()
    opts = SamplingParams(stop_token_ids=[7], min_tokens=3).to_options((2, 3))
    assert opts.min_tokens == 3
    assert opts.stop_token_ids == (7, 2, 3)


def test_to_options_ignore_eos_drops_eos_from_stop_ids() -> None:
    """With ignore_eos, min_tokens holds back only the explicit stop token ids."""
    opts = SamplingParams(stop_token_ids=[7], min_tokens=3, ignore_eos=True).to_options((2,))
    assert opts.stop_token_ids == (7,)
    opts = SamplingParams(min_tokens=3, ignore_eos=True).to_options((2,))
    assert opts.stop_token_ids == ()


def make_request(
    prompt: list[int], max_model_len: int = 100, block_size: int = 4, **params: object
) -> Request:
    sp = SamplingParams(**params)  # type: ignore[arg-type]
    return Request(
        "r",
        prompt,
        params=sp,
        options=sp.to_options((2,)),
        eos_token_ids=(2,),
        max_model_len=max_model_len,
        block_size=block_size,
    )


def test_max_output_tokens() -> None:
    """max_output_tokens is max_tokens capped by the room left in the context."""
    assert make_request([5] * 10).max_output_tokens == 90
    assert make_request([5] * 10, max_tokens=20).max_output_tokens == 20
    assert make_request([5] * 10, max_tokens=200).max_output_tokens == 90
    assert make_request([5] * 99, max_tokens=5).max_output_tokens == 1


def test_new_request_state() -> None:
    """A fresh request waits with nothing computed and the hashes of its full prompt blocks."""
    req = make_request(list(range(10, 21)))  # 11 tokens
    assert req.status == RequestStatus.WAITING and not req.status.is_finished
    assert (req.num_tokens, req.num_prompt_tokens, req.num_output_tokens) == (11, 11, 0)
    assert req.num_computed_tokens == 0 and req.num_cached_tokens == -1
    expected: list[bytes] = []
    extend_block_hashes(expected, list(range(10, 21)), 4)
    assert req.block_hashes == expected and len(expected) == 2


def test_block_hashes_extend_as_outputs_fill_blocks() -> None:
    """Each output that completes a block adds that block's chained hash; others add none."""
    req = make_request([10, 11, 12, 13, 14, 15])
    assert len(req.block_hashes) == 1
    req.append_output(16, None)
    assert len(req.block_hashes) == 1
    req.append_output(17, None)  # 8 tokens
    assert req.block_hashes[1] == hash_block_tokens(req.block_hashes[0], [14, 15, 16, 17])
    for t in range(18, 22):
        req.append_output(t, None)
    assert len(req.block_hashes) == 3
    expected: list[bytes] = []
    extend_block_hashes(expected, req.all_token_ids, 4)
    assert req.block_hashes == expected
    assert req.output_token_ids == list(range(16, 22))
    assert req.output_logprobs == [None] * 6


def test_status_is_finished() -> None:
    """Only the FINISHED_* statuses count as finished."""
    finished = {s for s in RequestStatus if s.is_finished}
    assert finished == {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }


def test_check_stop_rules() -> None:
    """check_stop: EOS and stop ids after min_tokens, then max_tokens, in that order."""
    req = make_request([5, 6], max_tokens=3, stop_token_ids=[9], min_tokens=1)
    req.append_output(9, None)
    assert req.check_stop() == RequestStatus.FINISHED_STOPPED and req.stop_reason == 9

    req = make_request([5, 6], max_tokens=3, min_tokens=2)
    req.append_output(2, None)
    assert req.check_stop() is None  # EOS before min_tokens
    req.append_output(2, None)
    assert req.check_stop() == RequestStatus.FINISHED_STOPPED and req.stop_reason is None

    req = make_request([5, 6], max_tokens=2, ignore_eos=True)
    req.append_output(2, None)
    assert req.check_stop() is None
    req.append_output(2, None)
    assert req.check_stop() == RequestStatus.FINISHED_LENGTH

    req = make_request([5, 6], max_model_len=3)
    req.append_output(4, None)
    assert req.check_stop() == RequestStatus.FINISHED_LENGTH


def test_a_passes_tokens_go_in_as_one_token_at_a_time_would() -> None:
    """append_outputs (a multi-step plan's tokens of one request) keeps exactly the tokens that
    appending them one by one with check_stop after each keeps, ends the same way with the same
    stop reason, and leaves the same block hashes."""
    rng = random.Random(3)
    for trial in range(600):
        options: dict[str, object] = {
            "max_tokens": rng.choice([None, 1, 3, 9]),
            "min_tokens": rng.choice([0, 0, 2, 5]),
            "stop_token_ids": rng.choice([[], [7], [7, 8]]),
            "ignore_eos": rng.random() < 0.3,
        }
        options["min_tokens"] = min(options["min_tokens"], options["max_tokens"] or 99)  # type: ignore[type-var]
        prompt = [5] * rng.randint(1, 9)
        before = [rng.choice([4, 6]) for _ in range(rng.randint(0, 3))]
        passes = [rng.choice([2, 4, 6, 7, 8, 11]) for _ in range(rng.randint(1, 8))]  # 2 is EOS
        one, bulk = (make_request(prompt, max_model_len=24, **options) for _ in range(2))  # type: ignore[arg-type]
        for req in (one, bulk):
            for token in before:
                req.append_output(token, None)
        if before and one.check_stop() is not None:
            continue
        finished = None
        for token in passes:
            one.append_output(token, None)
            finished = one.check_stop()
            if finished is not None:
                break
        tokens, logprobs = list(passes), [None] * len(passes)
        assert bulk.append_outputs(tokens, logprobs) == finished, trial
        assert bulk.output_token_ids == one.output_token_ids and tokens == one.output_token_ids[len(before) :]
        assert bulk.output_logprobs == one.output_logprobs and len(logprobs) == len(tokens)
        assert (bulk.stop_reason, bulk.block_hashes) == (one.stop_reason, one.block_hashes), trial
