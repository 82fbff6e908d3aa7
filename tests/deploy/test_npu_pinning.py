"""`npuserve serve` on NPUs: one executor per visible NPU by default, each pinned to its own."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from npuserve.deploy import cli
from npuserve.deploy.executor_flags import device_flag
from npuserve.deploy.launcher import LaunchError, device_env
from npuserve.executor.npu_devices import physical_npu_ids, visible_npu_ids


def args(**kwargs: object) -> argparse.Namespace:
    return argparse.Namespace(**{"num_executors": None, "device": "npu", "tensor_parallel_size": 1, **kwargs})


def test_davinci_device_files_are_the_npus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NPUSERVE_EMULATE_NPU", raising=False)
    for name in ("davinci0", "davinci1", "davinci3", "davinci_manager", "devmm_svm"):
        (tmp_path / name).touch()
    assert physical_npu_ids(tmp_path) == [0, 1, 3]
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    assert visible_npu_ids(tmp_path) == [0, 1, 3]
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "4,6")
    assert visible_npu_ids(tmp_path) == [4, 6]


def test_executors_default_to_the_visible_npus_and_pin_one_each(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "4,5,6,7")
    assert cli._num_executors(args()) == 4
    assert cli._num_executors(args(tensor_parallel_size=2)) == 2
    assert cli._num_executors(args(device="npu:1")) == 1
    assert cli._num_executors(args(device="cpu")) == 1
    assert cli._num_executors(args(num_executors=3)) == 3
    assert [device_env("npu", i, 4) for i in range(4)] == [
        {"ASCEND_RT_VISIBLE_DEVICES": str(n)} for n in (4, 5, 6, 7)
    ]
    assert device_env("npu", 1, 2, tp_size=2) == {"ASCEND_RT_VISIBLE_DEVICES": "6,7"}
    with pytest.raises(LaunchError, match="need 6 NPUs but 4 are visible"):
        device_env("npu", 0, 3, tp_size=2)


def test_device_flag_takes_an_index() -> None:
    assert device_flag("NPU:3") == "npu:3"
    for bad in ("npu:", "tpu", "cpu:1", "npu:x"):
        with pytest.raises(argparse.ArgumentTypeError):
            device_flag(bad)
