"""Vectorized token sampler: penalties, min_tokens, structured-output bitmasks, temperature,
min_p/top_k/top_p, logprobs.

Every step is one pass of batched tensor ops over `[B, V]` logits, with no Python loop over rows
and no host sync on the sampling path. Random rows draw by inverse CDF with one counter-based
uniform per row, `u = hash(seed, position)`: the token is the first whose cumulative probability
reaches `u`. A request's tokens depend only on its own logits, seed and position, the same
whatever the batch around it and on every run (the hash is exact integer arithmetic), and the
cost is one cumulative sum over the vocabulary rather than a random number per token. The hash
runs on the host with the rest of the per-row metadata (`hash_uniform`).

Semantics follow vLLM: logprobs come from the raw logits; repetition penalty applies to tokens in
the prompt or the output, frequency/presence penalties to output tokens only; greedy rows take
the argmax of the penalised logits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from npuserve.executor.token_bitmask import bitmask_matrix

# NOTE: like vLLM, a temperature this small is treated as greedy (dividing by it would overflow).
_GREEDY_TEMPERATURE = 1e-5
# The hash's constants as uint64, so numpy never promotes its arrays to float or int64.
_MASK32 = np.uint64(0xFFFFFFFF)
_GOLDEN = np.uint64(0x9E3779B9)  # 2**32 / golden ratio
_FMIX_C1, _FMIX_C2 = np.uint64(0x85EBCA6B), np.uint64(0xC2B2AE35)
_U2, _U6, _U8, _U13, _U16, _U32 = (np.uint64(n) for n in (2, 6, 8, 13, 16, 32))


@dataclass
class PenaltyMetadata:
    """Per-row penalties and the token statistics they act on (built once per step)."""

    presence: torch.Tensor  # [B] float32
    frequency: torch.Tensor  # [B] float32
    repetition: torch.Tensor  # [B] float32
    output_counts: torch.Tensor  # [B, V] int32: occurrences of each token in the row's output
    seen: torch.Tensor  # [B, V] bool: token occurs in the row's prompt or output


@dataclass
class MinTokensBlock:
    """(row, token) pairs to forbid: stop tokens of rows that have fewer than min_tokens outputs."""

    row_ids: torch.Tensor  # [N] int64
    token_ids: torch.Tensor  # [N] int64


@dataclass
class AllowedTokens:
    """Structured outputs: the tokens each constrained row may sample (packed bits)."""

    row_ids: torch.Tensor  # [M] int64: the constrained rows among the B sampled ones
    bitmask: torch.Tensor  # [M, W] int32: bit (t % 32) of word (t // 32) allows token t


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs; rows are the B requests sampled this step."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor | None  # [B] int64, 0 = off; None when no row uses top-k
    top_p: torch.Tensor | None  # [B] float32; None when no row uses it (all 1)
    min_p: torch.Tensor | None  # [B] float32; None when no row uses it (all 0)
    uniforms: torch.Tensor  # [B] float32 in (0, 1): hash(seed, position of the token sampled)
    all_greedy: bool
    max_num_logprobs: int | None  # None: no row wants logprobs
    penalties: PenaltyMetadata | None  # None when no row has a penalty
    min_tokens_block: MinTokensBlock | None  # None when no row is below its min_tokens
    max_top_k: int = 0  # largest active top_k (host-side, so top-k needs no host sync)
    allowed_tokens: AllowedTokens | None = None  # None when no row is constrained


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32: sampled token's logprob (raw distribution)
    ranks: torch.Tensor | None  # [B] int64, 1 = most likely
    top_token_ids: torch.Tensor | None  # [B, max_num_logprobs] int64
    top_logprobs: torch.Tensor | None  # [B, max_num_logprobs] float32


# ---------------------------------------------------------------------------- metadata (host)


def build_sampling_metadata(
    options: Mapping[str, np.ndarray],
    token_ids: np.ndarray,
    num_prompt_tokens: np.ndarray,
    num_tokens: np.ndarray,
    vocab_size: int,
    device: torch.device,
) -> SamplingMetadata:
    """Turn per-row numpy arrays into metadata: `options` holds one [B] array per SamplingOptions
    field (the executor's SAMPLING_COLUMNS, stop_token_ids [B, K] padded with -1), token_ids [B, L]."""
    temperature, top_k, top_p, min_p = (options[k] for k in ("temperature", "top_k", "top_p", "min_p"))
    temperature = np.where(temperature < _GREEDY_TEMPERATURE, 0.0, temperature).astype(np.float32)
    top_k = np.where((top_k > 0) & (top_k < vocab_size), top_k, 0).astype(np.int64)
    num_logprobs = options["num_logprobs"]
    uses_top_k = bool((top_k > 0).any())
    uses_top_p = bool((top_p < 1.0).any())
    uses_min_p = bool((min_p > 0.0).any())
    wants_logprobs = num_logprobs >= 0

    def on_device(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(np.ascontiguousarray(array), device=device).to(dtype)

    return SamplingMetadata(
        temperature=on_device(temperature, torch.float32),
        top_k=on_device(top_k, torch.int64) if uses_top_k else None,
        top_p=on_device(top_p, torch.float32) if uses_top_p else None,
        min_p=on_device(min_p, torch.float32) if uses_min_p else None,
        uniforms=on_device(hash_uniform(options["seed"], num_tokens), torch.float32),
        all_greedy=bool((temperature == 0).all()),
        max_num_logprobs=int(num_logprobs[wants_logprobs].max()) if wants_logprobs.any() else None,
        penalties=_build_penalties(options, token_ids, num_prompt_tokens, num_tokens, vocab_size, device),
        min_tokens_block=_build_min_tokens_block(options, num_prompt_tokens, num_tokens, vocab_size, device),
        max_top_k=int(top_k.max()) if uses_top_k else 0,
    )


def _build_penalties(
    options: Mapping[str, np.ndarray],  # as `build_sampling_metadata`'s
    token_ids: np.ndarray,  # [B, L] int32
    num_prompt_tokens: np.ndarray,  # [B] int32
    num_tokens: np.ndarray,  # [B] int32
    vocab_size: int,
    device: torch.device,
) -> PenaltyMetadata | None:
    presence, frequency = options["presence_penalty"], options["frequency_penalty"]  # [B] float32
    repetition = options["repetition_penalty"]  # [B] float32
    if not ((presence != 0).any() or (frequency != 0).any() or (repetition != 1).any()):
        return None
    batch_size, max_len = token_ids.shape
    tokens = torch.as_tensor(np.ascontiguousarray(token_ids), device=device).long()  # [B, L]
    idx = torch.arange(max_len, device=device)[None, :]  # [1, L]
    prompt_end = torch.as_tensor(num_prompt_tokens, device=device).long()[:, None]  # [B, 1]
    end = torch.as_tensor(num_tokens, device=device).long()[:, None]  # [B, 1]
    # NOTE: entries outside their range (and the garbage past num_tokens) go to a spare column V.
    output_idx = torch.where((idx >= prompt_end) & (idx < end), tokens, vocab_size)
    prompt_idx = torch.where(idx < prompt_end, tokens, vocab_size)
    counts = torch.zeros(batch_size, vocab_size + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(1, output_idx, torch.ones_like(output_idx, dtype=torch.int32))
    in_prompt = torch.zeros(batch_size, vocab_size + 1, dtype=torch.bool, device=device)
    in_prompt.scatter_(1, prompt_idx, True)
    output_counts = counts[:, :vocab_size].contiguous()  # [B, V]
    return PenaltyMetadata(
        presence=torch.as_tensor(presence, device=device).float(),
        frequency=torch.as_tensor(frequency, device=device).float(),
        repetition=torch.as_tensor(repetition, device=device).float(),
        output_counts=output_counts,
        seen=in_prompt[:, :vocab_size] | (output_counts > 0),
    )


def _build_min_tokens_block(
    options: Mapping[str, np.ndarray],  # as `build_sampling_metadata`'s
    num_prompt_tokens: np.ndarray,  # [B] int32
    num_tokens: np.ndarray,  # [B] int32
    vocab_size: int,
    device: torch.device,
) -> MinTokensBlock | None:
    min_tokens = options["min_tokens"]  # [B] int32
    stop_token_ids = options["stop_token_ids"]  # [B, K] int32, padded with -1
    below = (num_tokens - num_prompt_tokens) < min_tokens  # [B]
    blocked = below[:, None] & (stop_token_ids >= 0) & (stop_token_ids < vocab_size)  # [B, K]
    if not blocked.any():
        return None
    rows, cols = np.nonzero(blocked)
    return MinTokensBlock(
        row_ids=torch.as_tensor(rows, device=device).long(),
        token_ids=torch.as_tensor(stop_token_ids[rows, cols], device=device).long(),
    )


# ------------------------------------------------------------------------------ hash noise

# NOTE: on the host, in numpy: the hash shifts 64-bit integers, and op-plugin has no NPU kernel
# for bitwise_left_shift / bitwise_right_shift, so torch_npu would run them on the CPU and
# synchronize the device on every sampled step. [B] integers cost nothing here; the draws travel
# to the device with the other per-row metadata. uint64 keeps every product of two uint32 values
# exact, so the draws are the same bits on every machine.


def _fmix32(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finalizer (a bijection with full avalanche) of [N] uint64 holding
    uint32 values -> [N] uint64 holding uint32 values."""
    x = x ^ (x >> _U16)
    x = (x * _FMIX_C1) & _MASK32
    x = x ^ (x >> _U13)
    x = (x * _FMIX_C2) & _MASK32
    return x ^ (x >> _U16)


def _combine(h: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Hash of the pairs (h, v), [N] uint64 holding uint32 values (boost::hash_combine, then fmix32)."""
    return _fmix32(h ^ (((h << _U6) + (h >> _U2) + _GOLDEN + v) & _MASK32))


def hash_uniform(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """u[b] = hash(seeds[b], positions[b]) mapped into (0, 1). seeds [B] int64 (any sign),
    positions [B] non-negative -> [B] float32. Exact integer arithmetic: depends on nothing but
    these two inputs."""
    seeds = np.ascontiguousarray(seeds, dtype=np.int64).view(np.uint64)  # two's complement bits
    positions = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    key = _combine(_fmix32(seeds & _MASK32), seeds >> _U32)  # [B]
    bits = _combine(key, positions & _MASK32) >> _U8  # [B], 24 bits: exact in float32
    # NOTE: float32 arithmetic: bits + 0.5 rounds to float32, and that rounding is part of u.
    return (bits.astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / (1 << 24))


# ---------------------------------------------------------------------- logit processors


def apply_penalties(logits: torch.Tensor, penalties: PenaltyMetadata) -> torch.Tensor:
    """logits [B, V] float32 -> penalised copy [B, V] (repetition, then frequency, presence)."""
    rep = penalties.repetition[:, None]  # [B, 1]
    scaled = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(penalties.seen, scaled, logits)  # a new tensor: in place from here
    logits.sub_(penalties.frequency[:, None] * penalties.output_counts)
    return logits.sub_(penalties.presence[:, None] * (penalties.output_counts > 0))


def apply_min_tokens(logits: torch.Tensor, block: MinTokensBlock) -> torch.Tensor:
    """logits [B, V] -> copy with the blocked (row, stop token) pairs at -inf."""
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    return logits.index_put((block.row_ids, block.token_ids), neg_inf)


def build_allowed_tokens(
    row_ids: np.ndarray,  # [M] int64: sampled-row index of each bitmask row
    words: bytes,  # M rows of W little-endian int32 words
    vocab_size: int,
    device: torch.device,
) -> AllowedTokens:
    """The device form of a step's bitmask; PlanError (a ValueError) when its rows are not W words
    each."""
    bitmask = bitmask_matrix(words, len(row_ids), vocab_size)  # [M, W]
    return AllowedTokens(
        row_ids=torch.as_tensor(row_ids, device=device).long(),
        bitmask=torch.from_numpy(bitmask).to(device),
    )


def apply_token_bitmask(logits: torch.Tensor, allowed: AllowedTokens) -> torch.Tensor:
    """logits [B, V] -> copy with every token a constrained row's bitmask leaves unset at -inf."""
    vocab_size = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)  # [32]
    bits = (allowed.bitmask.unsqueeze(-1) >> shifts) & 1  # [M, W, 32]
    keep = bits.flatten(1)[:, :vocab_size].bool()  # [M, V]
    rows = logits.index_select(0, allowed.row_ids).masked_fill_(~keep, float("-inf"))  # [M, V]
    return logits.index_copy(0, allowed.row_ids, rows)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits [B, V], min_p [B] -> logits with tokens whose prob < min_p * max prob at -inf."""
    probs = logits.softmax(dim=-1)  # [B, V]
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """logits [B, V], top_k [B] (0 = off) -> logits below each row's k-th largest at -inf.
    Uses topk(max_top_k) instead of a full sort; ties with the k-th value are kept."""
    top_values = logits.topk(max_top_k, dim=-1).values  # [B, max_top_k]
    kth = top_values.gather(1, (top_k.clamp(min=1) - 1)[:, None])  # [B, 1]
    return logits.masked_fill((logits < kth) & (top_k > 0)[:, None], float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """logits [B, V], top_k [B] (0 = off) or None, top_p [B] (1 = off) -> filtered logits [B, V].
    Top-p keeps the smallest set of most likely tokens (after top-k) whose mass reaches top_p."""
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1)  # ascending, [B, V]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab_size - top_k)[:, None] % vocab_size)  # [B, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
    drop = cum_probs <= (1 - top_p)[:, None]
    drop[:, -1] = False  # always keep the most likely token
    # NOTE: rows with top_p == 1 skip the mask outright, so rounding in the cumulative sum can
    # never change them: a row samples the same whether or not its batch sorts.
    drop &= (top_p < 1)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


# ------------------------------------------------------------------------------- sampling


class Sampler:
    """Stateless: `Sampler()(logits [B, V], metadata) -> SamplerOutput`."""

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        assert logits.dim() == 2, f"logits must be [B, V], got {tuple(logits.shape)}"
        logits = logits.float()
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)  # [B, V]
        if metadata.penalties is not None:
            logits = apply_penalties(logits, metadata.penalties)
        if metadata.min_tokens_block is not None:
            logits = apply_min_tokens(logits, metadata.min_tokens_block)
        if metadata.allowed_tokens is not None:
            logits = apply_token_bitmask(logits, metadata.allowed_tokens)
        token_ids = logits.argmax(dim=-1)  # [B], greedy
        if not metadata.all_greedy:
            is_greedy = metadata.temperature == 0  # [B]
            token_ids = torch.where(is_greedy, token_ids, self._sample_random(logits, metadata))
        if raw_logprobs is None:
            return SamplerOutput(token_ids, None, None, None, None)
        assert metadata.max_num_logprobs is not None
        sampled = raw_logprobs.gather(1, token_ids[:, None])  # [B, 1]
        ranks = (raw_logprobs > sampled).sum(dim=-1) + 1  # [B]
        top_logprobs, top_ids = raw_logprobs.topk(metadata.max_num_logprobs, dim=-1)  # [B, n]
        return SamplerOutput(token_ids, sampled.squeeze(1), ranks, top_ids, top_logprobs)

    @staticmethod
    def _sample_random(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """logits [B, V] (penalised) -> [B] int64 drawn after temperature and the filters."""
        temperature = metadata.temperature
        logits = logits / torch.where(temperature == 0, 1.0, temperature)[:, None]
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        if metadata.top_p is not None:
            logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        elif metadata.top_k is not None:
            logits = apply_top_k(logits, metadata.top_k, metadata.max_top_k)
        # Inverse CDF: the first token whose cumulative probability reaches u * total. A token
        # of probability zero never adds to the sum, so it can never be the first to reach it.
        cdf = logits.softmax(dim=-1).cumsum_(dim=-1)  # [B, V]
        targets = (metadata.uniforms * cdf[:, -1]).unsqueeze(1)  # [B, 1]
        return torch.searchsorted(cdf, targets).squeeze(1).clamp_(max=logits.shape[-1] - 1)
