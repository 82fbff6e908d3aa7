"""The control plane yields the host's cores to executors that compute on them, and only then."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from npuserve.deploy.cpu_priority import CONTROL_PLANE, DEFAULT_PRIORITY, CpuPriority, control_plane_priority
from npuserve.proto.step_plan import EMULATED_NPU_DEVICE


@pytest.mark.parametrize(
    ("devices", "priority"),
    [
        (["cpu"], CONTROL_PLANE),
        ([EMULATED_NPU_DEVICE, EMULATED_NPU_DEVICE], CONTROL_PLANE),
        (["npu:0", "cpu"], CONTROL_PLANE),  # one executor on the CPU is enough to share it
        (["npu:0", "npu:1"], DEFAULT_PRIORITY),
        (["cuda:0"], DEFAULT_PRIORITY),
        ([], DEFAULT_PRIORITY),
    ],
)
def test_the_control_plane_yields_only_next_to_executors_on_the_cpu(
    devices: list[str], priority: CpuPriority
) -> None:
    assert CONTROL_PLANE.nice > 0
    ready = [{"address": f"127.0.0.1:{7000 + i}", "info": {"device": d}} for i, d in enumerate(devices)]
    assert control_plane_priority(iter(ready)) == priority


def test_applying_a_priority_lowers_the_process_and_the_threads_it_starts() -> None:
    """In a fresh process (a priority can only be lowered): its niceness, and a thread started
    after has it too; the policy stays the default one (SCHED_IDLE would starve, see the module)."""
    script = (
        "import os, threading; from npuserve.deploy.cpu_priority import CpuPriority\n"
        "base = os.nice(0); CpuPriority(nice=3).apply(); seen = []\n"
        "t = threading.Thread(target=lambda: seen.append(os.nice(0) - base))\n"
        "t.start(); t.join(); print(os.sched_getscheduler(0) == os.SCHED_OTHER, os.nice(0) - base, seen[0])"
    )
    base = os.nice(0)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    lowered = str(min(base + 3, 19) - base)
    assert out.split() == ["True", lowered, lowered]
    assert DEFAULT_PRIORITY.describe() == "" and CONTROL_PLANE.describe() == f"nice {CONTROL_PLANE.nice}"
