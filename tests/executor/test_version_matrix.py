"""`cann_fit`: the one decision on a CANN release that the executor and `npuserve doctor` take."""

from __future__ import annotations

import pytest

from npuserve.executor.version_matrix import VERSION_SETS, cann_fit


@pytest.mark.parametrize(
    "torch_npu, cann, status",
    [
        ("2.8.0", "8.3.RC2", "known"),  # vllm-ascend v0.12.0rc1 / v0.13.0rc1
        ("2.8.0", "8.3.RC1", "known"),  # Ascend/pytorch README
        ("2.7.1", "CANN-8.3.rc2", "known"),  # vllm-ascend v0.11.0
        ("2.8.0.post2+cpu", "8.5.0.B120", "known"),
        ("2.8.0", "8.3.rc3", "rc_only"),
        ("2.8.0", "8.3.RC3.alpha001", "rc_only"),
        ("2.8.0", "8.2.RC3", "mismatch"),  # another release line
        ("2.8.0", "8.5.0", "mismatch"),
        ("2.8.0.post2", "8.5.1", "mismatch"),  # not an RC: no leeway
        ("2.8.0.post2", "8.3.RC2", "mismatch"),
        ("9.9.0", "8.3.RC2", "unchecked"),  # not in the table
        ("2.8.0", None, "unchecked"),
    ],
)
def test_cann_fit(torch_npu: str, cann: str | None, status: str) -> None:
    fit = cann_fit(torch_npu, cann)
    assert fit.status == status, fit
    assert bool(fit.message) == (status in ("rc_only", "mismatch"))


def test_every_row_names_its_source() -> None:
    assert all(row.source for row in VERSION_SETS)
    rows = {(row.cann, row.torch_npu) for row in VERSION_SETS}
    assert len(rows) == len(VERSION_SETS)
