"""Which profiler a step profile uses, that profiling is refused unless enabled, and that step
timings wait for the device only while a profile runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from npuserve.executor import platform
from npuserve.executor.step_profiler import ProfilingDisabled, StepClock, StepProfiler
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


def test_step_timings_wait_for_the_device_only_while_a_profile_runs(
    emulated_npu: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On the (emulated) NPU a forward's host time is its launch time: the step clock synchronizes
    while a profile runs, and never on the serving path."""
    target = platform.resolve_target("npu")
    synchronized: list[object] = []
    emulated_npu.setattr(torch.npu, "synchronize", synchronized.append)  # type: ignore[attr-defined]
    clock = StepClock(target)
    profiler = StepProfiler(tmp_path, EMULATED_NPU_DEVICE, "host:1", clock)
    clock()
    assert synchronized == []
    profiler.start()
    first, second = clock(), clock()
    assert len(synchronized) == 2 and first <= second
    profiler.stop()
    clock()
    assert len(synchronized) == 2
