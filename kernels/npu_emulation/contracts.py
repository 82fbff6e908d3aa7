"""What the torch_npu operators npuserve calls accept, checked the way the operators check it.

Each rule names its source. Abbreviations used below:

* FIA: op-plugin ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_fused_infer_attention_score.md``
  (sections named after the ``##``/``###`` headings they come from).
* FIA-v2: the same folder, ``torch_npu-npu_fused_infer_attention_score_v2.md`` (newer CANN).
* ATB-RC: op-plugin ``op_plugin/ops/atb/ReshapeAndCachAtb.cpp`` and its test
  ``test/test_custom_ops/test_atb_reshape_and_cache.py``.
* ATB-ROPE: op-plugin ``op_plugin/ops/atb/RopeAtb.cpp`` and ``test/test_custom_ops/test_atb_rope.py``.
* RMS: ``(beta)torch_npu-npu_rms_norm.md``; ADD-RMS: ``torch_npu-npu_add_rms_norm.md``;
  SWIGLU: ``(beta)torch_npu-npu_swiglu.md`` (all in the op-plugin docs folder above).
* VA: vllm-ascend v0.13.0 ``vllm_ascend/attention/attention_v1.py`` and ``attention_mask.py``.

A rule marked INFERRED is not written in those sources; it is what the source code implies.
A broken rule raises `OpContractError`, as the real operators raise RuntimeError.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence

import torch

from npuserve.kernels.layout import NPU_ATTENTION_HEAD_DIMS

HALF_DTYPES = (torch.float16, torch.bfloat16)
FLOAT_DTYPES = (*HALF_DTYPES, torch.float32)
# FIA "sparse_mode" table: modes 2/3/4 take the compressed mask of exactly this size.
COMPRESSED_MASK_SIZE = 2048
SPARSE_MODE_RIGHT_DOWN_CAUSAL = 3
# FIA "TND布局约束", query D != 512 without rope: Q_D = K_D = V_D = 128, or Q_D = K_D = 192 with
# V_D 128/192; FIA-v2 "MHA场景": also all three 64, and "GQA和PA场景不支持V_D等于192". A paged
# cache gives V the keys' D, so 192 is out; 64 needs the newer CANN of FIA-v2.
TND_HEAD_SIZES = NPU_ATTENTION_HEAD_DIMS
# FIA "PageAttention约束": block_size for Q_S > 1 is 128..512 in steps of 128; for Q_S = 1
# non-zero and at most 512. FIA "TND布局约束" adds: a multiple of 16, at most 1024.
PAGED_BLOCK_MAX = 512
PAGED_PREFILL_BLOCK_MULTIPLE = 128
MAX_BATCH_TND = 4096  # FIA "actual_seq_lengths": TND batch (element count) <= 4096
MAX_HEADS = 256  # FIA "各轴取值范围速查": Q_N and KV_N <= 256
MAX_GQA_RATIO = 64  # FIA "num_key_value_heads": num_heads / num_key_value_heads <= 64
# Masks found to be the causal triangle, by id, while they live (a mask is built once and kept).
_VERIFIED_MASKS: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


class OpContractError(RuntimeError):
    """An argument the real operator would reject."""


def require(condition: bool, op: str, message: str) -> None:
    if not condition:
        raise OpContractError(f"{op}: {message}")


def _contiguous(tensor: torch.Tensor, op: str, name: str) -> None:
    require(
        tensor.is_contiguous(), op, f"{name} must be contiguous (non-contiguous tensors are not supported)"
    )


def _int_list(values: object, op: str, name: str) -> list[int]:
    # FIA "actual_seq_lengths" / "actual_seq_lengths_kv": List[int].
    require(
        isinstance(values, (list, tuple)), op, f"{name} must be a list of ints, got {type(values).__name__}"
    )
    assert isinstance(values, Sequence)
    require(all(type(v) is int for v in values), op, f"{name} must hold Python ints")
    return list(values)


# -- _npu_reshape_and_cache ------------------------------------------------------------------------


def check_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_indices: torch.Tensor,
) -> None:
    op = "_npu_reshape_and_cache"
    # ATB-RC test: key/value [T, N, D]; caches [num_blocks, block_size, N, D] (ND layout).
    require(
        key.dim() == 3 and value.dim() == 3,
        op,
        f"key/value must be [T, N, D], got {key.shape}, {value.shape}",
    )
    require(
        key_cache.dim() == 4 and value_cache.dim() == 4,
        op,
        "key_cache/value_cache must be [blocks, block_size, N, D]",
    )
    require(
        key.shape[0] == value.shape[0] == slot_indices.shape[0],
        op,
        "key, value and slot_indices need one row per token",
    )
    require(
        key_cache.shape[2:] == key.shape[1:],
        op,
        f"key {tuple(key.shape)} does not fit key_cache {tuple(key_cache.shape)}",
    )
    require(value_cache.shape[2:] == value.shape[1:], op, "value does not fit value_cache")
    require(
        key_cache.shape[:2] == value_cache.shape[:2],
        op,
        "key_cache and value_cache differ in blocks or block_size",
    )
    # ATB-RC test: slot_mapping built as np.int32.
    require(slot_indices.dtype == torch.int32, op, f"slot_indices must be int32, got {slot_indices.dtype}")
    require(slot_indices.dim() == 1, op, "slot_indices must be 1-D")
    require(
        key.dtype == key_cache.dtype and value.dtype == value_cache.dtype,
        op,
        "key/value dtype must match the caches",
    )
    # INFERRED: the caches are written in place through their storage (Output(key_cache)).
    _contiguous(key_cache, op, "key_cache")
    _contiguous(value_cache, op, "value_cache")
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    require(bool((slot_indices < num_slots).all()), op, f"slot index beyond the cache's {num_slots} slots")


# -- npu_fused_infer_attention_score (TND, paged, sparse_mode 3: the only form npuserve uses) ------


def check_causal_mask(atten_mask: torch.Tensor | None, op: str) -> None:
    require(atten_mask is not None, op, "sparse_mode 3 needs the compressed atten_mask")
    assert atten_mask is not None
    # FIA "atten_mask": bool, int8 or uint8, contiguous.
    require(
        atten_mask.dtype in (torch.bool, torch.int8, torch.uint8), op, f"atten_mask dtype {atten_mask.dtype}"
    )
    _contiguous(atten_mask, op, "atten_mask")
    size = COMPRESSED_MASK_SIZE
    # FIA "sparse_mode" table: (2048, 2048), (1, 2048, 2048) or (1, 1, 2048, 2048).
    allowed = {(size, size), (1, size, size), (1, 1, size, size)}
    require(
        tuple(atten_mask.shape) in allowed,
        op,
        f"sparse_mode 3 needs a {size}x{size} mask, got {tuple(atten_mask.shape)}",
    )
    # FIA: "需用户保证为下三角" (the user guarantees the triangle); VA attention_mask.py builds
    # triu(ones(2048, 2048), diagonal=1): 1 masks. The operator trusts it; emulated, a wrong
    # mask would silently pass, so it is checked here, once per mask tensor (NOTE: comparing
    # 4M elements in every layer's call made the check most of an emulated step's time).
    if _VERIFIED_MASKS.get(id(atten_mask)) is atten_mask:
        return
    expected = torch.ones(size, size, dtype=torch.bool, device=atten_mask.device).triu(1)
    require(
        torch.equal(atten_mask.reshape(size, size).bool(), expected),
        op,
        "atten_mask must be triu(ones(2048, 2048), 1)",
    )
    _VERIFIED_MASKS[id(atten_mask)] = atten_mask


def check_fused_infer_attention(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [num_blocks, block_size, Hkv * D]
    value: torch.Tensor,
    *,
    atten_mask: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    input_layout: str = "BSH",
    block_size: int = 0,
    actual_seq_lengths: object = None,
    actual_seq_lengths_kv: object = None,
    num_key_value_heads: int = 0,
    num_heads: int = 1,
    scale: float = 1.0,  # any scale is valid
    sparse_mode: int = 0,
    **unsupported: object,
) -> tuple[list[int], list[int]]:
    """The checks of ``npu_fused_infer_attention_score``, with the operator's defaults; returns
    (cumulative query ends, per-request kv lengths)."""
    op = "npu_fused_infer_attention_score"
    require(
        all(v is None or v in (0, False) for v in unsupported.values()),
        op,
        f"emulation does not cover {sorted(k for k, v in unsupported.items() if v not in (None, 0, False))}",
    )
    require(input_layout == "TND", op, f"emulated for input_layout 'TND' only, got {input_layout!r}")
    require(
        sparse_mode == SPARSE_MODE_RIGHT_DOWN_CAUSAL,
        op,
        f"emulated for sparse_mode 3 only, got {sparse_mode}",
    )
    require(block_table is not None, op, "emulated for the paged (block_table) form only")
    assert block_table is not None
    # FIA "query"/"key"/"value": float16 or bfloat16 (int8 key/value only in quant modes).
    require(query.dtype in HALF_DTYPES, op, f"query must be float16 or bfloat16, got {query.dtype}")
    require(key.dtype == query.dtype and value.dtype == query.dtype, op, "key/value dtype must equal query's")
    # FIA: "不支持非连续Tensor" for query, key and value.
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        _contiguous(tensor, op, name)
    # FIA "input_layout" table: TND query is (T, Q_N, D).
    require(query.dim() == 3, op, f"TND query must be (T, N, D), got {tuple(query.shape)}")
    num_tokens, q_heads, head_size = query.shape
    require(num_heads == q_heads, op, f"num_heads {num_heads} but query has {q_heads} heads")
    require(1 <= num_heads <= MAX_HEADS, op, f"num_heads must be 1..{MAX_HEADS}")
    kv_heads = num_key_value_heads or num_heads
    # FIA "num_key_value_heads": divides num_heads, ratio <= 64.
    require(
        num_heads % kv_heads == 0,
        op,
        f"num_heads {num_heads} not a multiple of num_key_value_heads {kv_heads}",
    )
    require(num_heads // kv_heads <= MAX_GQA_RATIO, op, f"num_heads / num_key_value_heads > {MAX_GQA_RATIO}")
    # FIA "TND布局约束" / FIA-v2: head sizes a paged TND call without rope accepts.
    require(
        head_size in TND_HEAD_SIZES,
        op,
        f"TND without rope supports head dim {TND_HEAD_SIZES}, got {head_size}",
    )
    # FIA "PageAttention约束" (PA: key/value layout ignored, cache (blocks, block_size, H)).
    require(
        key.dim() == 3 and key.shape == value.shape,
        op,
        "paged key/value must be (blocks, block_size, KV_N * D)",
    )
    require(
        key.shape[1] == block_size, op, f"block_size {block_size} but the cache blocks hold {key.shape[1]}"
    )
    require(key.shape[2] == kv_heads * head_size, op, f"cache rows {key.shape[2]} != num_key_value_heads * D")
    # FIA "block_table": int32, two-dimensional [B, maxBlockNumPerSeq].
    require(block_table.dtype == torch.int32, op, f"block_table must be int32, got {block_table.dtype}")
    require(block_table.dim() == 2, op, "block_table must be 2-D [B, max_blocks_per_seq]")
    check_causal_mask(atten_mask, op)

    query_ends = _int_list(actual_seq_lengths, op, "actual_seq_lengths")
    kv_lens = _int_list(actual_seq_lengths_kv, op, "actual_seq_lengths_kv")
    # FIA "TND布局约束": both must be given; the element count is the batch (<= 4096);
    # actual_seq_lengths holds cumulative ends (non-decreasing, non-negative).
    batch = len(query_ends)
    require(1 <= batch <= MAX_BATCH_TND, op, f"TND batch must be 1..{MAX_BATCH_TND}, got {batch}")
    require(all(v >= 0 for v in query_ends), op, "actual_seq_lengths must be non-negative")
    require(
        all(b >= a for a, b in itertools.pairwise(query_ends)),
        op,
        "actual_seq_lengths must be cumulative (non-decreasing)",
    )
    require(query_ends[-1] == num_tokens, op, f"last cumulative query end {query_ends[-1]} != T {num_tokens}")
    # FIA "TND布局约束", D=512 PA note, and VA _get_fia_params: with a block table the kv
    # lengths are per request (seq_lens_list), one per batch entry.
    require(len(kv_lens) == batch, op, f"actual_seq_lengths_kv has {len(kv_lens)} entries for batch {batch}")
    require(block_table.shape[0] >= batch, op, "block_table has fewer rows than the batch")
    query_lens = [b - a for a, b in zip([0, *query_ends[:-1]], query_ends, strict=True)]
    capacity = block_table.shape[1] * block_size
    for index, (q_len, kv_len) in enumerate(zip(query_lens, kv_lens, strict=True)):
        require(0 < kv_len <= capacity, op, f"batch {index}: kv length {kv_len} outside 1..{capacity}")
        # INFERRED from sparse_mode 3 (right-down causal): a query never has more rows than
        # keys; vllm-ascend never calls it that way.
        require(q_len <= kv_len, op, f"batch {index}: {q_len} query tokens but {kv_len} keys")
    _check_block_size(block_size, max(query_lens), op)
    return query_ends, kv_lens


def _check_block_size(block_size: int, max_query_len: int, op: str) -> None:
    # FIA "PageAttention约束" and "TND布局约束" (see the constants above).
    require(
        0 < block_size <= PAGED_BLOCK_MAX, op, f"block_size must be 1..{PAGED_BLOCK_MAX}, got {block_size}"
    )
    require(block_size % 16 == 0, op, f"TND paged block_size must be a multiple of 16, got {block_size}")
    if max_query_len > 1:
        require(
            block_size % PAGED_PREFILL_BLOCK_MULTIPLE == 0,
            op,
            f"paged prefill (Q_S > 1) needs block_size a multiple of {PAGED_PREFILL_BLOCK_MULTIPLE}, got {block_size}",
        )


# -- Norms, activation, rotary embedding -----------------------------------------------------------


def check_rms_norm(x: torch.Tensor, gamma: torch.Tensor) -> None:
    op = "npu_rms_norm"
    # RMS "参数说明": self has 2-8 dims; gamma is self's trailing dims.
    require(2 <= x.dim() <= 8, op, f"self must have 2-8 dims, got {x.dim()}")
    require(
        tuple(gamma.shape) == tuple(x.shape[x.dim() - gamma.dim() :]),
        op,
        "gamma must equal self's trailing dims",
    )
    # RMS "约束说明" (A2/A3): gamma in float32 or in self's dtype.
    require(
        x.dtype in FLOAT_DTYPES and gamma.dtype in (torch.float32, x.dtype),
        op,
        f"unsupported dtypes self {x.dtype}, gamma {gamma.dtype}",
    )


def check_add_rms_norm(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor) -> None:
    op = "npu_add_rms_norm"
    # ADD-RMS "参数说明": x1, x2 float32/float16/bfloat16, 1-8 dims, not empty; gamma has x1's dtype
    # and x1's trailing dims.
    require({x1.dtype, x2.dtype} <= set(FLOAT_DTYPES), op, f"unsupported dtypes {x1.dtype}, {x2.dtype}")
    require(1 <= x1.dim() <= 8, op, "x1 must have 1-8 dims")
    require(x1.numel() > 0 and x2.numel() > 0, op, "empty tensors are not supported")
    # INFERRED: the add is elementwise; the docs give x1 and x2 no broadcasting.
    require(x1.shape == x2.shape and x1.dtype == x2.dtype, op, "x1 and x2 must share shape and dtype")
    require(gamma.dtype == x1.dtype, op, f"gamma dtype {gamma.dtype} must equal x1's {x1.dtype}")
    require(
        tuple(gamma.shape) == tuple(x1.shape[x1.dim() - gamma.dim() :]),
        op,
        "gamma must equal x1's trailing dims",
    )


def check_swiglu(x: torch.Tensor, dim: int) -> None:
    op = "npu_swiglu"
    # SWIGLU "参数说明": 1-8 dims, even along dim, contiguous, not empty, float32/float16/bfloat16.
    require(x.dtype in FLOAT_DTYPES, op, f"unsupported dtype {x.dtype}")
    require(1 <= x.dim() <= 8, op, "input must have 1-8 dims")
    require(-x.dim() <= dim < x.dim(), op, f"dim {dim} out of range")
    require(x.numel() > 0, op, "empty tensors are not supported")
    require(x.shape[dim] % 2 == 0, op, f"size {x.shape[dim]} along dim {dim} is not even")
    _contiguous(x, op, "input")


def check_rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    table: torch.Tensor,
    is_neox_style: bool = True,  # either style is valid
) -> None:
    """The checks of ``_npu_rotary_embedding``, with its arguments (what a graph capture runs)."""
    op = "_npu_rotary_embedding"
    # ATB-ROPE test: query/key [T, N * D] in float16; positions one per token; table [P, D]
    # as cat(cos, sin) in float32 (the table's dtype may differ from the query's).
    require(query.dtype in FLOAT_DTYPES, op, f"query dtype {query.dtype}")
    require(key.dtype == query.dtype, op, "key dtype must equal query's")
    require(query.dim() == 2 and key.dim() == 2, op, "query/key must be [T, N * head_size]")
    num_tokens = positions.numel()
    require(query.shape[0] == num_tokens and key.shape[0] == num_tokens, op, "one position per token")
    require(query.shape[1] % head_size == 0 and key.shape[1] % head_size == 0, op, "rows are not whole heads")
    # RopeAtb.cpp: index_select(0, positions) needs an integer index.
    require(
        positions.dtype in (torch.int32, torch.int64),
        op,
        f"positions must be int32/int64, got {positions.dtype}",
    )
    require(table.dim() == 2 and table.shape[1] == head_size, op, f"cos_sin_cache must be [P, {head_size}]")
    # INFERRED: rotated in place through the tensors' storage (Output(query), Output(key)).
    _contiguous(query, op, "query")
    _contiguous(key, op, "key")
