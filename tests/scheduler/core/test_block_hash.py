"""Chained block hashes: stable bytes across processes, parent chaining, incremental extension."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from npuserve.scheduler.core.block_hash import ROOT_HASH, extend_block_hashes, hash_block_tokens

TOKENS = [5, 17, 99, 3, 40_000, 151_935, 0, 12, 7, 8, 9, 10]

_CHILD = """
from npuserve.scheduler.core.block_hash import extend_block_hashes
hashes = []
extend_block_hashes(hashes, {tokens!r}, 4)
print(",".join(h.hex() for h in hashes))
"""


def _hashes_in_subprocess(hash_seed: str) -> list[bytes]:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD.format(tokens=TOKENS)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    return [bytes.fromhex(h) for h in out.split(",")]


@pytest.mark.slow
def test_hashes_are_stable_across_processes() -> None:
    """The same blocks hash to the same bytes in processes with different PYTHONHASHSEEDs."""
    here: list[bytes] = []
    extend_block_hashes(here, TOKENS, 4)
    assert len(here) == 3 and all(len(h) == 32 for h in here)
    assert _hashes_in_subprocess("1") == here
    assert _hashes_in_subprocess("12345") == here


def test_hash_is_a_fixed_function_of_parent_and_tokens() -> None:
    """A block hash depends on its parent and its tokens, and on nothing else."""
    block = [1, 2, 3, 4]
    assert hash_block_tokens(None, block) == hash_block_tokens(ROOT_HASH, block)
    assert hash_block_tokens(None, block) == hash_block_tokens(None, tuple(block))
    assert hash_block_tokens(None, block) != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(None, block) != hash_block_tokens(None, [4, 3, 2, 1])


def test_same_block_after_different_prefixes_differs() -> None:
    """Equal tokens in block 1 hash differently when block 0 differs (the chain carries the prefix)."""
    a: list[bytes] = []
    b: list[bytes] = []
    extend_block_hashes(a, [1, 2, 3, 4, 9, 9, 9, 9], 4)
    extend_block_hashes(b, [1, 2, 3, 5, 9, 9, 9, 9], 4)
    assert a[0] != b[0]
    assert a[1] != b[1]
    assert a[1] == hash_block_tokens(a[0], [9, 9, 9, 9])
    assert b[1] == hash_block_tokens(b[0], [9, 9, 9, 9])


def test_extend_hashes_only_full_blocks() -> None:
    """A partial trailing block gets no hash; nothing is hashed below one full block."""
    hashes: list[bytes] = []
    extend_block_hashes(hashes, [1, 2, 3], 4)
    assert hashes == []
    extend_block_hashes(hashes, [1, 2, 3, 4, 5, 6, 7], 4)
    assert hashes == [hash_block_tokens(None, [1, 2, 3, 4])]


def test_extend_is_incremental() -> None:
    """Extending block by block gives the same chain as hashing all at once, and keeps old entries."""
    tokens = list(range(100, 117))  # 4 full blocks of 4 and one token more
    at_once: list[bytes] = []
    extend_block_hashes(at_once, tokens, 4)
    assert len(at_once) == 4

    step: list[bytes] = []
    seen: list[bytes] = []
    for n in range(len(tokens) + 1):
        extend_block_hashes(step, tokens[:n], 4)
        assert len(step) == n // 4
        assert step[: len(seen)] == seen  # earlier hashes are never rewritten
        seen = list(step)
    assert step == at_once


def test_extend_does_not_rehash_covered_blocks() -> None:
    """Blocks already covered by the list are left alone, even if the tokens passed differ there."""
    hashes = [b"x" * 32]
    extend_block_hashes(hashes, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert hashes == [b"x" * 32, hash_block_tokens(b"x" * 32, [5, 6, 7, 8])]
