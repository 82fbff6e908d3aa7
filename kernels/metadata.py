"""Attention metadata for one step: the host-side description of a flat batch of requests.

Every backend consumes the same `AttentionMetadata`; this module is the only place that decides
its dtypes and padding. A step's tokens are laid out request after request (``TND``): request
``i`` owns tokens ``query_start_loc[i]:query_start_loc[i + 1]``; its query tokens are the last
``query_len`` of its ``seq_len`` tokens, whose keys and values are (after the cache write) all in
the paged cache at the blocks of ``block_table[i]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from npuserve.kernels.staging import HostStaging
from npuserve.proto.kv_layout import cdiv


@dataclass
class AttentionMetadata:
    num_reqs: int
    num_tokens: int
    block_size: int
    max_query_len: int
    max_seq_len: int
    # Device tensors.
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths starting at 0
    seq_lens: torch.Tensor  # [B] int32, kv length of each request including this step's tokens
    block_table: torch.Tensor  # [B, max_num_blocks] int32; unused entries hold the null block
    slot_mapping: torch.Tensor  # [T] int32, cache slot of each new token
    # Host copies, for kernels that take lengths as Python lists (Ascend) and for planning.
    query_lens_host: list[int]
    seq_lens_host: list[int]
    # Derived state a backend computes once per step and reuses in every layer.
    backend_state: dict[str, Any] = field(default_factory=dict)
    # Set while a graph captures this step: the backend records there each attention call whose
    # host-side arguments a replay must be given anew (`KernelBackend.update_graph_attention`).
    graph_attention: list[Any] | None = None

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @property
    def query_ends_host(self) -> list[int]:
        """Cumulative query ends (``actual_seq_lengths`` of Ascend's TND layout)."""
        return np.cumsum(self.query_lens_host).tolist()


def build_attention_metadata(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_table: np.ndarray,
    slot_mapping: np.ndarray,
    block_size: int,
    device: torch.device,
    staging: HostStaging | None = None,
) -> AttentionMetadata:
    """query_lens, seq_lens: [B] ints; block_table: [B, >= needed] block ids; slot_mapping: [T].

    The device tensors come through ``staging``'s pinned buffers, with asynchronous copies; without
    it (a one-off, such as the memory profile) the copies block, so the host temporaries they
    read cannot be freed while a copy is in flight.
    """
    num_reqs = int(query_lens.shape[0])
    assert seq_lens.shape == (num_reqs,) and block_table.shape[0] == num_reqs
    assert (query_lens >= 1).all() and (seq_lens >= query_lens).all()
    num_tokens = int(query_lens.sum())
    assert slot_mapping.shape == (num_tokens,)
    max_seq_len = int(seq_lens.max())
    num_blocks_needed = cdiv(max_seq_len, block_size)
    assert block_table.shape[1] >= num_blocks_needed, "block table shorter than the sequence"
    table = block_table[:, :num_blocks_needed]
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])

    def to_device(name: str, array: np.ndarray) -> torch.Tensor:
        if staging is not None:
            return staging.to_device(name, array, torch.int32)
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int32)).to(device)

    return AttentionMetadata(
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        block_size=block_size,
        max_query_len=int(query_lens.max()),
        max_seq_len=max_seq_len,
        query_start_loc=to_device("query_start_loc", query_start_loc),
        seq_lens=to_device("seq_lens", seq_lens),
        block_table=to_device("block_table", table),
        slot_mapping=to_device("slot_mapping", slot_mapping),
        query_lens_host=query_lens.tolist(),
        seq_lens_host=seq_lens.tolist(),
    )
