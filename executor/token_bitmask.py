"""A step's structured-output bitmask, checked against the step: the one check both runners make.

Numpy and the contracts only (no torch), so the simulated runner checks a plan's bitmask exactly
as `ModelRunner` does; the sampler moves the checked rows to the device (`build_allowed_tokens`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from npuserve.proto.plan_checks import PlanError
from npuserve.proto.step_plan import bitmask_words


def bitmask_rows(req_ids: Sequence[str], sampled_req_ids: Sequence[str]) -> np.ndarray:
    """[M] int64: the index among this step's sampled requests of each bitmask row's request;
    PlanError for a row of a request that samples no token this step."""
    index_of = {req_id: i for i, req_id in enumerate(sampled_req_ids)}
    missing = [r for r in req_ids if r not in index_of]
    if missing:
        raise PlanError(f"a bitmask row for {missing[0]!r}, which samples no token this step")
    return np.array([index_of[r] for r in req_ids], dtype=np.int64)


def bitmask_matrix(words: bytes, num_rows: int, vocab_size: int) -> np.ndarray:
    """Packed little-endian int32 words -> [num_rows, W] int32, W = bitmask_words(vocab_size);
    PlanError (a ValueError) unless there are num_rows (at least one) rows of W words."""
    num_words = bitmask_words(vocab_size)
    packed = np.frombuffer(words, dtype="<i4")
    if num_rows == 0 or packed.size != num_rows * num_words:
        raise PlanError(f"a bitmask of {packed.size} words is not {num_rows} rows of {num_words}")
    return packed.astype(np.int32).reshape(num_rows, num_words)
