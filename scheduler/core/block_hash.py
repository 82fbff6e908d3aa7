"""Content hashes of full KV blocks, chained so equal hashes mean equal prefixes.

``hash(block i) = sha256(hash(block i - 1) || token ids of block i)``, over a fixed
little-endian encoding: stable across processes and machines (never Python's ``hash()``).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

# The parent of a request's first block.
ROOT_HASH: BlockHash = hashlib.sha256(b"npuserve-kv-root").digest()


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    digest = hashlib.sha256(parent or ROOT_HASH)
    digest.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return digest.digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int) -> None:
    """Appends the hash of every full block of ``token_ids`` that ``hashes`` does not cover yet."""
    for block in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        start = block * block_size
        hashes.append(hash_block_tokens(parent, token_ids[start : start + block_size]))
