"""Which profiler a step profile uses, and that profiling is refused unless enabled."""

from __future__ import annotations

from pathlib import Path

import pytest

from npuserve.executor.step_profiler import ProfilingDisabled, StepProfiler
from npuserve.proto.step_plan import EMULATED_NPU_DEVICE


@pytest.mark.parametrize(
    "device, device_type",
    [
        ("npu:1", "npu"),
        ("cuda:0", "cuda"),
        ("cpu", "cpu"),
        (EMULATED_NPU_DEVICE, "cpu"),
        ("simulated", "simulated"),
    ],
)
def test_the_device_picks_the_profiler(tmp_path: Path, device: str, device_type: str) -> None:
    """Only a real NPU uses torch_npu's profiler; an emulated one runs on the CPU."""
    assert StepProfiler(tmp_path, device, "host:1").device_type == device_type


def test_profiling_is_refused_without_a_profile_dir() -> None:
    profiler = StepProfiler(None, "cpu", "host:1")
    assert not profiler.enabled
    with pytest.raises(ProfilingDisabled, match="--profile-dir"):
        profiler.start()
