"""The KV block arithmetic both sides of the step protocol agree on (no torch, no numpy).

Block 0 is the null block: allocated like every other block but never written, so padded
block-table entries may point at it. The scheduler never hands it out; executors keep it zeroed.
"""

from __future__ import annotations

NULL_BLOCK_ID = 0


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the blocks needed for ``a`` tokens at ``b`` tokens per block."""
    return -(-a // b)
