"""The control plane yields the host's cores to executors that compute on them, and only then."""

from __future__ import annotations

import pytest

from npuserve.deploy.runtime.cpu_priority import CONTROL_PLANE_NICE, control_plane_nice
from npuserve.proto.step_plan import EMULATED_NPU_DEVICE


@pytest.mark.parametrize(
    ("devices", "nice"),
    [
        (["cpu"], CONTROL_PLANE_NICE),
        ([EMULATED_NPU_DEVICE, EMULATED_NPU_DEVICE], CONTROL_PLANE_NICE),
        (["npu:0", "cpu"], CONTROL_PLANE_NICE),  # one executor on the CPU is enough to share it
        (["npu:0", "npu:1"], 0),
        (["cuda:0"], 0),
        ([], 0),
    ],
)
def test_the_control_plane_is_nicer_only_next_to_executors_on_the_cpu(devices: list[str], nice: int) -> None:
    assert CONTROL_PLANE_NICE > 0
    ready = [{"address": f"127.0.0.1:{7000 + i}", "info": {"device": d}} for i, d in enumerate(devices)]
    assert control_plane_nice(iter(ready)) == nice
