"""Sampler tests on CPU: greedy, seeded reproducibility, distribution, filters, penalties,
min_tokens and logprobs, each against a direct reference."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from npuserve.executor.input_batch import SAMPLING_COLUMNS
from npuserve.executor.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    apply_penalties,
    apply_top_k,
    apply_top_k_top_p,
    build_allowed_tokens,
    build_sampling_metadata,
    hash_uniform,
)
from npuserve.proto.step_plan import bitmask_words

CPU = torch.device("cpu")


@dataclass
class Row:
    """One request to sample; its position is len(prompt) + len(output)."""

    logits: torch.Tensor  # [V]
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    num_logprobs: int = -1
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    prompt: tuple[int, ...] = (0,)
    output: tuple[int, ...] = ()


def build(rows: list[Row], garbage: int = 7) -> SamplingMetadata:
    vocab_size = rows[0].logits.shape[0]
    max_len = max(len(r.prompt) + len(r.output) for r in rows) + 2
    max_stops = max(len(r.stop_token_ids) for r in rows)
    token_ids = np.full((len(rows), max_len), garbage, dtype=np.int32)
    stops = np.full((len(rows), max_stops), -1, dtype=np.int32)
    for i, r in enumerate(rows):
        known = r.prompt + r.output
        token_ids[i, : len(known)] = known
        stops[i, : len(r.stop_token_ids)] = r.stop_token_ids

    def col(name: str, dtype: type) -> np.ndarray:
        return np.array([getattr(r, name) for r in rows], dtype=dtype)

    # The executor's columns, names and dtypes; Row names the penalties briefly.
    short = {f"{kind}_penalty": kind for kind in ("presence", "frequency", "repetition")}
    options = {name: col(short.get(name, name), c.dtype) for name, c in SAMPLING_COLUMNS.items()}
    return build_sampling_metadata(
        {**options, "stop_token_ids": stops},
        token_ids=token_ids,
        num_prompt_tokens=np.array([len(r.prompt) for r in rows], dtype=np.int32),
        num_tokens=np.array([len(r.prompt) + len(r.output) for r in rows], dtype=np.int32),
        vocab_size=vocab_size,
        device=CPU,
    )


def sample(rows: list[Row]) -> SamplerOutput:
    return Sampler()(torch.stack([r.logits for r in rows]), build(rows))


def sample_positions(row: Row, num: int) -> torch.Tensor:
    """Sample `row` at positions 0..num-1 in one batch -> [num] token ids."""
    uniforms = hash_uniform(np.full(num, row.seed), np.arange(num))
    meta = dataclasses.replace(build([row] * num), uniforms=torch.from_numpy(uniforms))
    return Sampler()(row.logits.expand(num, -1), meta).token_ids


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


# ---------------------------------------------------------------------------------- greedy


def test_greedy_equals_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    rows = [Row(logits[i], temperature=0.0, seed=i) for i in range(6)]
    meta = build(rows)
    assert meta.all_greedy
    out = Sampler()(logits, meta)
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.token_ids.dtype == torch.int64


def test_greedy_ties_pick_first_index() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    rows = [Row(logits[0], temperature=0.0), Row(logits[1], temperature=0.0)]
    assert sample(rows).token_ids.tolist() == [1, 0]


def test_greedy_rows_in_mixed_batch_and_bf16_input() -> None:
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(1))
    temps = [0.0, 1.0, 0.0, 0.7, 1e-7]  # below 1e-5 counts as greedy
    rows = [Row(logits[i], temperature=t, seed=i, top_p=0.9) for i, t in enumerate(temps)]
    meta = build(rows)
    assert not meta.all_greedy
    out = Sampler()(logits.bfloat16(), meta)
    expected = logits.bfloat16().float().argmax(dim=-1)
    for i in (0, 2, 4):
        assert out.token_ids[i] == expected[i]


def test_logits_are_not_modified() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    rows = [
        Row(logits[0], repetition=1.5, prompt=(1, 2), output=(3,), min_tokens=4, stop_token_ids=(5,)),
        Row(logits[1], top_k=4, top_p=0.8, min_p=0.1),
        Row(logits[2], temperature=0.0, frequency=0.5, output=(7, 7)),
    ]
    Sampler()(logits, build(rows))
    assert torch.equal(logits, before)


# ------------------------------------------------------------------------------ hash noise


# Draws pinned for fixed (seed, position) pairs: seeded sampling gives the same tokens on every
# machine and release. A change here changes every seeded request's output.
PINNED_SEEDS = [0, 1, -5, 2**40 + 3, 2**63 - 1, -(2**63), 123456789, 42]
PINNED_POSITIONS = [0, 7, 100, 4095, 1, 2**31, 65536, 3]
PINNED_DRAWS = [
    "0x1.2c96d40000000p-1",
    "0x1.da29fc0000000p-1",
    "0x1.da364c0000000p-1",
    "0x1.4f9ee80000000p-1",
    "0x1.55089c0000000p-1",
    "0x1.0114bc0000000p-1",
    "0x1.2721d00000000p-1",
    "0x1.cb4c7c0000000p-1",
]
# Tokens seeded rows sample from fixed logits (vocab 64, seed 11), at positions 0..23.
PINNED_TOKENS = {
    "plain": [17, 44, 63, 22, 3, 27, 10, 31, 55, 21, 27, 59, 49, 53, 25, 22, 12, 53, 17, 44, 44, 20, 30, 50],
    "filtered": [
        44,
        28,
        44,
        12,
        44,
        17,
        22,
        10,
        10,
        17,
        44,
        10,
        1,
        12,
        44,
        28,
        44,
        44,
        28,
        12,
        10,
        44,
        44,
        12,
    ],
}


def test_seeded_draws_and_tokens_are_pinned() -> None:
    seeds, positions = np.array(PINNED_SEEDS, dtype=np.int64), np.array(PINNED_POSITIONS)
    assert [float(u).hex() for u in hash_uniform(seeds, positions)] == PINNED_DRAWS
    logits = torch.randn(64, generator=torch.Generator().manual_seed(11))
    rows = {
        "plain": Row(logits, seed=1234),
        "filtered": Row(logits, seed=-7, temperature=0.8, top_k=20, top_p=0.9),
    }
    for name, row in rows.items():
        assert sample_positions(row, 24).tolist() == PINNED_TOKENS[name], name


def test_hash_uniform_is_uniform_and_deterministic() -> None:
    # Four seeds (small, negative, wider than 32 bits), 50,000 positions each.
    seeds = np.repeat(np.array([0, 1, -5, 2**40 + 3], dtype=np.int64), 50_000)
    positions = np.tile(np.arange(50_000), 4)
    u = torch.from_numpy(hash_uniform(seeds, positions))
    assert u.shape == (200_000,) and u.dtype == torch.float32
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert torch.equal(u, torch.from_numpy(hash_uniform(seeds, positions)))
    assert abs(u.mean().item() - 0.5) < 0.005
    # Ten equal-width bins, each ~1/10 of the draws.
    counts = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert torch.allclose(counts, torch.full((10,), 0.1), atol=0.003)
    # Streams of different seeds are decorrelated, and so are neighbouring positions.
    per_seed = u.view(4, 50_000) - 0.5
    assert abs(torch.corrcoef(per_seed)[0, 1].item()) < 0.02
    assert abs(torch.corrcoef(torch.stack([per_seed[0, :-1], per_seed[0, 1:]]))[0, 1].item()) < 0.02


# ---------------------------------------------------------------------------------- seeded


def test_seeded_sampling_is_identical_across_calls_and_batches() -> None:
    gen = torch.Generator().manual_seed(3)
    vocab = 64
    subject = Row(torch.randn(vocab, generator=gen), temperature=0.9, seed=1234)
    others = [
        Row(torch.randn(vocab, generator=gen), temperature=0.0),
        Row(torch.randn(vocab, generator=gen), top_k=5, seed=9),
        Row(torch.randn(vocab, generator=gen), top_p=0.5, min_p=0.05, seed=10),
        Row(torch.randn(vocab, generator=gen), top_k=3, top_p=0.7, seed=11, num_logprobs=2),
        Row(torch.randn(vocab, generator=gen), repetition=1.3, frequency=0.4, output=(1, 2, 2)),
        Row(torch.randn(vocab, generator=gen), min_tokens=5, stop_token_ids=(0, 1, 2)),
    ]
    variants = [
        dataclasses.replace(subject),
        dataclasses.replace(subject, top_k=8),
        dataclasses.replace(subject, top_p=0.8),
        dataclasses.replace(subject, min_p=0.1, presence=0.5, output=(4, 4)),
    ]
    for variant in variants:
        subjects = [dataclasses.replace(variant, prompt=(0,) * pos) for pos in range(1, 17)]
        alone = [sample([row]).token_ids[0].item() for row in subjects]
        assert sample([subjects[0]]).token_ids[0].item() == alone[0]  # same on a second call
        assert len(set(alone)) > 4  # the positions really draw different tokens
        expected = {id(row): token for row, token in zip(subjects, alone, strict=True)}
        mixed = [r for pair in zip(subjects[:12], others * 2, strict=True) for r in pair]
        batches = [
            [*subjects, *others],
            [*mixed[::-1], *subjects[12:]],
            [others[2], *subjects[::2], others[0]],
            [others[1], *subjects],
        ]
        for batch in batches:
            tokens = sample(batch).token_ids.tolist()
            got = {id(r): t for r, t in zip(batch, tokens, strict=True) if id(r) in expected}
            assert got == {key: expected[key] for key in got}
            assert len(got) >= 8


def test_different_seeds_and_positions_give_different_draws() -> None:
    row = Row(torch.zeros(1000), seed=1)
    draws_a = sample_positions(row, 300)
    draws_b = sample_positions(dataclasses.replace(row, seed=2), 300)
    assert (draws_a == draws_b).float().mean().item() < 0.02
    assert len(set(draws_a.tolist())) > 250  # 300 uniform draws from 1000: ~260 distinct
    assert torch.equal(draws_a, sample_positions(row, 300))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_frequencies_match_softmax(temperature: float) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5, -3.0])
    num = 20_000
    draws = sample_positions(Row(logits, temperature=temperature, seed=77), num)
    observed = torch.bincount(draws, minlength=7).double()
    expected = (logits.double() / temperature).softmax(dim=-1) * num
    chi_square = ((observed - expected) ** 2 / expected).sum().item()
    assert chi_square < 30.0  # df = 6: p(chi2 > 30) ~ 4e-5; deterministic seeds cannot flake


# --------------------------------------------------------------------------------- filters

PROBS = [0.05, 0.4, 0.25, 0.15, 0.1, 0.05]


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        ({"top_k": 3}, {1, 2, 3}),
        ({"top_k": 1}, {1}),
        ({"top_p": 0.6}, {1, 2}),
        ({"top_p": 0.7}, {1, 2, 3}),
        ({"top_p": 0.01}, {1}),  # the top token always stays
        ({"min_p": 0.5}, {1, 2}),
        ({"min_p": 0.3}, {1, 2, 3}),
        ({"top_k": 3, "top_p": 0.7}, {1, 2}),  # top-p over the top-k renormalised mass
        ({"min_p": 0.3, "top_p": 0.7}, {1, 2}),
        ({"top_k": 4, "min_p": 0.5}, {1, 2}),
    ],
)
def test_filters_keep_the_allowed_set(params: dict[str, float], allowed: set[int]) -> None:
    row = Row(logits_from_probs(PROBS), seed=5, **params)  # type: ignore[arg-type]
    draws = sample_positions(row, 3000)
    assert set(draws.tolist()) == allowed
    # The same row next to others that switch on other filter paths.
    neighbour = Row(torch.zeros(6), top_k=2, top_p=0.9, min_p=0.2)
    assert sample([row, neighbour]).token_ids[0].item() in allowed


def test_filter_functions_mask_exactly() -> None:
    logits = logits_from_probs(PROBS).expand(3, -1)
    top_k = torch.tensor([3, 0, 1])
    kept = apply_top_k(logits, top_k, max_top_k=3).isfinite()
    assert kept.tolist() == [
        [False, True, True, True, False, False],
        [True] * 6,
        [False, True, False, False, False, False],
    ]
    top_p = torch.tensor([1.0, 0.6, 0.7])
    kept = apply_top_k_top_p(logits, top_k, top_p).isfinite()
    assert kept.tolist() == [
        [False, True, True, True, False, False],
        [False, True, True, False, False, False],
        [False, True, False, False, False, False],
    ]
    assert torch.equal(apply_top_k_top_p(logits, None, torch.ones(3)), logits)


# ------------------------------------------------------------------------------- penalties


def reference_penalties(logits: torch.Tensor, row: Row) -> torch.Tensor:
    out = logits.clone()
    for token in set(row.prompt) | set(row.output):
        value = out[token].item()
        out[token] = value / row.repetition if value > 0 else value * row.repetition
    for token in set(row.output):
        count = row.output.count(token)
        out[token] -= row.frequency * count + row.presence
    return out


@pytest.mark.parametrize(
    "penalty",
    [
        {"repetition": 1.7},
        {"repetition": 0.6},
        {"frequency": 0.8},
        {"frequency": -0.5},
        {"presence": 1.2},
        {"repetition": 1.3, "frequency": 0.4, "presence": -0.7},
    ],
)
def test_penalties_match_reference(penalty: dict[str, float]) -> None:
    gen = torch.Generator().manual_seed(4)
    vocab = 12
    rows = [
        Row(torch.randn(vocab, generator=gen) * 3, prompt=(0, 1, 1, 2), output=(2, 3, 3, 3, 5)),
        Row(torch.randn(vocab, generator=gen) * 3, prompt=(4, 6), output=()),
        Row(torch.randn(vocab, generator=gen) * 3, prompt=(7,), output=(7, 8, 11, 8)),
        Row(torch.randn(vocab, generator=gen) * 3),  # no penalty: must stay unchanged
    ]
    rows[:3] = [dataclasses.replace(r, **penalty) for r in rows[:3]]  # type: ignore[arg-type]
    meta = build(rows, garbage=vocab + 5)  # out-of-range garbage past num_tokens is ignored
    assert meta.penalties is not None
    logits = torch.stack([r.logits for r in rows])
    got = apply_penalties(logits, meta.penalties)
    for i, row in enumerate(rows):
        torch.testing.assert_close(got[i], reference_penalties(row.logits, row))
    assert torch.equal(got[3], logits[3])
    # Greedy sampling uses the penalised logits.
    greedy = [dataclasses.replace(r, temperature=0.0) for r in rows]
    assert torch.equal(sample(greedy).token_ids, got.argmax(dim=-1))


def test_min_tokens_blocks_stop_tokens_then_releases() -> None:
    logits = torch.tensor([0.0, 1.0, 5.0, 2.0, 4.0, 3.0])
    blocked = Row(logits, temperature=0.0, min_tokens=3, stop_token_ids=(2, 4), output=(1, 1))
    released = dataclasses.replace(blocked, output=(1, 1, 1))
    meta = build([blocked, released])
    assert meta.min_tokens_block is not None
    assert meta.min_tokens_block.row_ids.tolist() == [0, 0]
    assert sample([blocked, released]).token_ids.tolist() == [5, 2]
    assert build([released]).min_tokens_block is None
    # Random rows never draw a blocked token either.
    draws = sample_positions(dataclasses.replace(blocked, temperature=1.0), 500)
    assert not set(draws.tolist()) & {2, 4}


# -------------------------------------------------------------------------------- logprobs


def test_logprobs_ranks_and_top_logprobs_use_raw_logits() -> None:
    gen = torch.Generator().manual_seed(6)
    vocab = 30
    logits = torch.randn(4, vocab, generator=gen) * 2
    top3 = (int(logits[3].argmax()),) * 3
    rows = [
        Row(logits[0], num_logprobs=-1, temperature=0.0),
        Row(logits[1], num_logprobs=0, repetition=2.0, prompt=(3, 4), seed=1),
        Row(logits[2], num_logprobs=3, temperature=1.5, top_k=10, seed=2),
        Row(logits[3], num_logprobs=5, temperature=0.0, presence=2.0, frequency=2.0, output=top3),
    ]
    meta = build(rows)
    assert meta.max_num_logprobs == 5
    out = Sampler()(logits, meta)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and out.ranks is not None
    assert out.top_token_ids is not None and out.top_logprobs is not None
    assert out.top_token_ids.shape == (4, 5) and out.top_token_ids.dtype == torch.int64
    expected_lp = raw.gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, expected_lp)
    for i in range(4):
        assert out.ranks[i].item() == 1 + int((raw[i] > expected_lp[i]).sum())
    top = raw.topk(5, dim=-1)
    assert torch.equal(out.top_token_ids, top.indices)
    torch.testing.assert_close(out.top_logprobs, top.values)
    assert out.ranks[3].item() > 1  # penalties moved greedy off the raw argmax


def test_no_logprobs_when_none_requested() -> None:
    out = sample([Row(torch.randn(10), seed=1)])
    assert out.logprobs is None and out.ranks is None
    assert out.top_token_ids is None and out.top_logprobs is None


# -------------------------------------------------------------------------------- metadata


def test_metadata_leaves_unused_features_none() -> None:
    rows = [Row(torch.zeros(16), top_k=16, stop_token_ids=(3,)), Row(torch.zeros(16), top_k=0)]
    meta = build(rows)
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None
    assert meta.penalties is None and meta.min_tokens_block is None
    assert meta.max_num_logprobs is None and not meta.all_greedy
    assert meta.uniforms.tolist() == hash_uniform(np.array([0, 0]), np.array([1, 1])).tolist()

    rows[1] = dataclasses.replace(rows[1], top_k=4, top_p=0.9, min_p=0.1, presence=0.1)
    meta = build(rows)
    assert meta.top_k is not None and meta.top_k.tolist() == [0, 4] and meta.max_top_k == 4
    assert meta.top_p is not None and meta.min_p is not None and meta.penalties is not None
    assert meta.penalties.output_counts.shape == (2, 16)


def test_metadata_dtypes() -> None:
    meta = build([Row(torch.zeros(8), top_k=2, top_p=0.5, min_p=0.1, seed=-3)])
    assert meta.temperature.dtype == torch.float32
    assert meta.top_k is not None and meta.top_k.dtype == torch.int64
    assert meta.top_p is not None and meta.top_p.dtype == torch.float32
    assert meta.uniforms.dtype == torch.float32
    assert meta.uniforms.item() == hash_uniform(np.array([-3]), np.array([1])).item()
    assert math.isclose(meta.temperature.item(), 1.0)


def _bitmask(allowed: list[list[int]], vocab_size: int) -> bytes:
    """Rows of packed int32 words allowing exactly the given token ids."""
    bits = np.zeros((len(allowed), bitmask_words(vocab_size) * 32), dtype=np.uint8)
    for row, ids in enumerate(allowed):
        bits[row, ids] = 1
    return np.packbits(bits, axis=1, bitorder="little").view("<i4").tobytes()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_bitmask_confines_its_rows_and_leaves_the_others_alone(temperature: float) -> None:
    """Rows 1 and 3 may sample only their allowed tokens (never the likeliest, which the mask
    forbids); rows 0 and 2 sample exactly what they sample without any mask."""
    vocab_size = 70  # not a multiple of 32: the last word is partial
    generator = torch.Generator().manual_seed(5)
    allowed = [[3, 40, 69], [7]]
    for seed in range(20):
        rows = [
            Row(torch.randn(vocab_size, generator=generator) * 4, temperature=temperature, seed=seed)
            for _ in range(4)
        ]
        for row, ids in zip((1, 3), allowed, strict=True):
            rows[row].logits[[i for i in range(vocab_size) if i not in ids][:5]] += 50.0
        metadata = build(rows)
        free = Sampler()(torch.stack([r.logits for r in rows]), metadata).token_ids
        metadata.allowed_tokens = build_allowed_tokens(
            np.array([1, 3]), _bitmask(allowed, vocab_size), vocab_size, CPU
        )
        out = Sampler()(torch.stack([r.logits for r in rows]), metadata).token_ids
        assert out[1].item() in allowed[0] and out[3].item() == 7
        assert out[0] == free[0] and out[2] == free[2]


def test_a_bitmask_of_the_wrong_width_is_refused() -> None:
    with pytest.raises(ValueError):
        build_allowed_tokens(np.array([0]), _bitmask([[1]], 64), 100, CPU)
