"""Device, dtype and version-set checks, on a CPU-only machine.

Failures that need hardware this machine lacks (a broken CANN install, no visible device) are
simulated by replacing the one call that would reach the hardware or the installed packages.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import re
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from npuserve.executor import dtypes, platform
from npuserve.executor.dtypes import check_dtype_supported, resolve_dtype
from npuserve.executor.platform import (
    PlatformError,
    check_version_set,
    device_memory,
    empty_cache,
    peak_memory_allocated,
    reset_peak_memory,
    resolve_device,
    synchronize,
)

CPU = torch.device("cpu")
TORCH_RELEASE = torch.__version__.split("+")[0]


# --------------------------------------------------------------------------------------------
# Devices
# --------------------------------------------------------------------------------------------


def test_cpu() -> None:
    assert resolve_device("cpu") == CPU
    assert resolve_device(" CPU ") == CPU


def test_auto_falls_back_to_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "torch_npu_installed", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == CPU


def test_auto_warns_and_falls_back_when_torch_npu_is_broken(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> ModuleType:
        raise PlatformError("torch_npu could not load the CANN libraries")

    monkeypatch.setattr(platform, "torch_npu_installed", lambda: True)
    monkeypatch.setattr(platform, "import_torch_npu", broken)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger=platform.__name__):
        assert resolve_device("auto") == CPU
    assert "CANN libraries" in caplog.text


@pytest.mark.skipif(platform.torch_npu_installed(), reason="torch_npu is installed here")
def test_npu_without_torch_npu_says_how_to_install_it() -> None:
    with pytest.raises(PlatformError) as info:
        resolve_device("npu")
    message = str(info.value)
    assert "torch_npu is not installed" in message
    assert "pip install 'npuserve[ascend]'" in message
    assert f"torch_npu=={TORCH_RELEASE}.*" in message


def test_cuda_without_a_device_names_the_visibility_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    with pytest.raises(PlatformError, match="CUDA_VISIBLE_DEVICES='7'"):
        resolve_device("cuda")


def test_unknown_device_lists_the_choices() -> None:
    with pytest.raises(PlatformError, match="auto, cpu, cuda, npu"):
        resolve_device("tpu")


# --------------------------------------------------------------------------------------------
# torch / torch_npu version sets
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "torch_version, torch_npu_version",
    [
        ("2.8.0", "2.8.0.post2"),
        ("2.8.0+cpu", "2.8.0.post2"),
        ("2.10.0", "2.10.0.post4"),
        ("2.5.1", "2.5.1"),
    ],
)
def test_matching_version_sets_pass(torch_version: str, torch_npu_version: str) -> None:
    check_version_set(torch_version, torch_npu_version)


def test_version_mismatch_names_both_versions_and_what_to_install() -> None:
    with pytest.raises(PlatformError) as info:
        check_version_set("2.9.1+cpu", "2.8.0.post2")
    message = str(info.value)
    assert "torch 2.9.1+cpu and torch_npu 2.8.0.post2 are not one version set" in message
    assert "pip install 'torch_npu==2.9.1.*'" in message
    assert "pip install 'torch==2.8.*'" in message
    assert "CANN" in message


def test_a_torch_post_or_rc_build_asks_for_the_torch_npu_of_its_release() -> None:
    for torch_version in ("2.9.1.post3", "2.9.1.rc1"):
        with pytest.raises(PlatformError, match=re.escape("pip install 'torch_npu==2.9.1.*'")):
            check_version_set(torch_version, "2.8.0.post2")


def test_minor_versions_compare_as_numbers() -> None:
    with pytest.raises(PlatformError, match=re.escape("torch_npu==2.13.0")):
        check_version_set("2.13.0", "2.1.0.post3")


def test_unreadable_version() -> None:
    with pytest.raises(PlatformError, match="cannot read"):
        check_version_set("nightly", "2.8.0")


class FakeInstall:
    """torch_npu "installed" at a version, its import raising ``error`` (or succeeding)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, version: str, error: Exception | None):
        self.imported = False
        self._error = error
        self._real_version = importlib.metadata.version
        self._real_import = importlib.import_module
        monkeypatch.setattr(importlib.metadata, "version", self.version)
        monkeypatch.setattr(importlib, "import_module", self.import_module)
        self._version = version

    def version(self, name: str) -> str:
        return self._version if name == "torch_npu" else self._real_version(name)

    def import_module(self, name: str, *args: Any) -> ModuleType:
        if name != "torch_npu":
            return self._real_import(name, *args)
        self.imported = True
        if self._error is not None:
            raise self._error
        return ModuleType("torch_npu")


def test_import_checks_the_version_set_before_importing(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeInstall(monkeypatch, "1.11.0.post8", error=None)
    with pytest.raises(PlatformError, match="not one version set"):
        platform.import_torch_npu()
    assert not fake.imported


@pytest.mark.parametrize(
    "error",
    [
        ImportError("libatb.so: cannot open shared object file: No such file or directory"),
        ImportError("libascendcl.so: cannot open shared object file"),
        ImportError("libhccl.so: cannot open shared object file"),
        ImportError("torch_npu/lib/libtorch_npu.so: undefined symbol: _ZN3c1010Dispatcher"),
        RuntimeError("Failed to infer device type"),
    ],
)
def test_cann_failures_say_to_source_set_env(monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    FakeInstall(monkeypatch, TORCH_RELEASE, error)
    with pytest.raises(PlatformError) as info:
        platform.import_torch_npu()
    message = str(info.value)
    assert "source /usr/local/Ascend/ascend-toolkit/set_env.sh" in message
    assert "one version set" in message
    assert str(error) in message


def test_other_import_failures_keep_the_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeInstall(monkeypatch, TORCH_RELEASE, ImportError("No module named 'yaml'"))
    with pytest.raises(PlatformError, match=r"import torch_npu failed .*'yaml'"):
        platform.import_torch_npu()


def test_npu_with_no_visible_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "import_torch_npu", lambda: ModuleType("torch_npu"))
    monkeypatch.setattr(platform, "check_npu_runtime", lambda module: None)
    monkeypatch.setattr(platform, "_npu_count", lambda: 0)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "3")
    with pytest.raises(PlatformError, match="ASCEND_RT_VISIBLE_DEVICES='3'"):
        resolve_device("npu")


# --------------------------------------------------------------------------------------------
# Dtypes
# --------------------------------------------------------------------------------------------


def test_auto_float16_checkpoint_on_cpu_becomes_bfloat16(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger=dtypes.__name__):
        assert resolve_dtype("auto", "float16", CPU) == torch.bfloat16
    assert "bfloat16" in caplog.text


@pytest.mark.parametrize(
    "config_dtype, expected",
    [(None, torch.float32), ("float32", torch.float32), ("bfloat16", torch.bfloat16)],
)
def test_auto_follows_the_checkpoint(config_dtype: str | None, expected: torch.dtype) -> None:
    assert resolve_dtype("auto", config_dtype, CPU) == expected


@pytest.mark.parametrize(
    "name, expected",
    [
        ("float32", torch.float32),
        ("float", torch.float32),
        ("fp32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("BFloat16", torch.bfloat16),
        ("float16", torch.float16),
        ("half", torch.float16),
        ("fp16", torch.float16),
    ],
)
def test_explicit_names(name: str, expected: torch.dtype) -> None:
    assert resolve_dtype(name, "float32", CPU) == expected


def test_unknown_dtype_lists_the_choices() -> None:
    with pytest.raises(PlatformError) as info:
        resolve_dtype("float8", None, CPU)
    message = str(info.value)
    assert "'float8'" in message
    for choice in ("auto", "float32", "bfloat16", "float16", "half", "bf16", "fp16", "fp32"):
        assert choice in message


def test_unknown_checkpoint_dtype_asks_for_an_explicit_one() -> None:
    with pytest.raises(PlatformError, match="pass --dtype explicitly"):
        resolve_dtype("auto", "int8", CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probe_passes_on_cpu(dtype: torch.dtype) -> None:
    check_dtype_supported(CPU, dtype)


def test_probe_failure_names_dtype_device_and_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    def unsupported(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("\"softmax_lastdim_kernel_impl\" not implemented for 'BFloat16'")

    monkeypatch.setattr(torch, "softmax", unsupported)
    with pytest.raises(PlatformError) as info:
        check_dtype_supported(CPU, torch.bfloat16)
    message = str(info.value)
    assert message.startswith("bfloat16 does not run on cpu")
    assert "--dtype float32" in message


def _fake_npu(monkeypatch: pytest.MonkeyPatch, device_name: str) -> Any:
    fake_npu = SimpleNamespace(current_device=lambda: 0, get_device_name=lambda index: device_name)
    monkeypatch.setattr(torch, "npu", fake_npu, raising=False)
    # torch.device("npu") needs torch_npu; the checks below refuse before touching the device.
    return SimpleNamespace(type="npu", index=0)


def test_ascend_310p_refuses_bfloat16_before_probing(monkeypatch: pytest.MonkeyPatch) -> None:
    device = _fake_npu(monkeypatch, "Ascend310P3")
    with pytest.raises(PlatformError, match=r"310P has no bfloat16.*--dtype float16"):
        check_dtype_supported(device, torch.bfloat16)


def test_npu_refuses_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    device = _fake_npu(monkeypatch, "Ascend910B3")
    with pytest.raises(PlatformError, match=r"float32 does not run on npu.*--dtype bfloat16"):
        check_dtype_supported(device, torch.float32)


@pytest.mark.parametrize(
    "device_name, expected", [("Ascend910B3", torch.bfloat16), ("Ascend310P3", torch.float16)]
)
def test_auto_float32_checkpoint_on_npu_picks_its_half_type(
    monkeypatch: pytest.MonkeyPatch, device_name: str, expected: torch.dtype
) -> None:
    device = _fake_npu(monkeypatch, device_name)
    assert dtypes._auto_dtype(None, device) == expected


# --------------------------------------------------------------------------------------------
# Memory helpers
# --------------------------------------------------------------------------------------------


def test_device_memory_needs_an_accelerator() -> None:
    with pytest.raises(PlatformError, match="cuda and npu"):
        device_memory(CPU)


def test_memory_helpers_are_no_ops_on_cpu() -> None:
    reset_peak_memory(CPU)
    synchronize(CPU)
    empty_cache(CPU)
    assert peak_memory_allocated(CPU) == 0


# --------------------------------------------------------------------------------------------
# Ascend start-up checks, on the torch_npu emulation
# --------------------------------------------------------------------------------------------


def test_emulated_npu_is_an_npu_target_on_the_cpu(emulated_npu: pytest.MonkeyPatch) -> None:
    target = platform.resolve_target("npu")
    assert (target.kind, target.device, target.emulated) == ("npu", CPU, True)
    assert torch.npu.current_device() == 0  # type: ignore[attr-defined]
    assert dtypes.resolve_dtype("auto", "float32", target) == torch.bfloat16
    with pytest.raises(PlatformError, match="float32 does not run on npu"):
        dtypes.resolve_dtype("float32", None, target)


def test_npu_index_selects_the_device(emulated_npu: pytest.MonkeyPatch) -> None:
    emulated_npu.setenv("NPUSERVE_EMULATE_NPU_COUNT", "4")
    platform.resolve_target("npu:2")
    assert torch.npu.current_device() == 2  # type: ignore[attr-defined]
    with pytest.raises(PlatformError, match=r"npu:4: only 4 NPU\(s\) are visible"):
        platform.resolve_target("npu:4")
    with pytest.raises(PlatformError, match="only npu and cuda take an index"):
        platform.resolve_target("cpu:1")


def test_visible_devices_limit_the_emulated_npus(emulated_npu: pytest.MonkeyPatch) -> None:
    emulated_npu.setenv("NPUSERVE_EMULATE_NPU_COUNT", "4")
    emulated_npu.setenv("ASCEND_RT_VISIBLE_DEVICES", "3")
    platform.resolve_target("npu")
    assert torch.npu.device_count() == 1  # type: ignore[attr-defined]
    with pytest.raises(PlatformError, match="npu:1: only 1 NPU"):
        platform.resolve_target("npu:1")


def test_310p_is_refused(emulated_npu: pytest.MonkeyPatch) -> None:
    emulated_npu.setenv("NPUSERVE_EMULATE_NPU_SOC", "202")
    with pytest.raises(PlatformError, match=r"Ascend 310P is not supported yet.*A2/A3"):
        platform.resolve_target("npu")


def test_missing_nnal_is_refused_with_the_set_env_line(emulated_npu: pytest.MonkeyPatch) -> None:
    emulated_npu.setenv("NPUSERVE_EMULATE_NNAL", "0")
    emulated_npu.delenv("ATB_HOME_PATH", raising=False)
    with pytest.raises(PlatformError) as info:
        platform.resolve_target("npu")
    message = str(info.value)
    assert "libatb.so did not load" in message and "ATB_HOME_PATH is unset" in message
    assert "source /usr/local/Ascend/nnal/atb/set_env.sh" in message


def test_torch_npu_of_another_torch_is_refused(emulated_npu: pytest.MonkeyPatch) -> None:
    emulated_npu.setenv("NPUSERVE_EMULATE_TORCH_NPU_VERSION", "2.1.0.post17")
    with pytest.raises(PlatformError, match="not one version set"):
        platform.resolve_target("npu")


def test_cann_outside_the_torch_npu_set_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cann", "8.3.RC1", raising=False)
    with pytest.raises(
        PlatformError, match=r"CANN 8.3.RC1 is not the CANN torch_npu 2.8.0.post2 is built for \(8.5.0"
    ):
        platform.check_cann_version("2.8.0.post2")
    platform.check_cann_version("2.8.0")  # the 8.3.RC1 set
    monkeypatch.setattr(torch.version, "cann", "CANN-8.5.0", raising=False)
    platform.check_cann_version("2.8.0.post2+git1234")
    with pytest.raises(PlatformError, match=r"torch_npu 2.8.0 is built for \(8.3.RC2 or 8.3.RC1"):
        platform.check_cann_version("2.8.0")


def test_the_cann_of_vllm_ascend_images_is_accepted_and_another_rc_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch.version, "cann", "8.3.RC2", raising=False)
    with caplog.at_level(logging.WARNING, logger=platform.logger.name):
        platform.check_cann_version("2.8.0")  # vllm-ascend v0.12.0rc1's set
        platform.check_cann_version("2.7.1")  # vllm-ascend v0.11.0's
        assert not caplog.records
        monkeypatch.setattr(torch.version, "cann", "8.3.RC3", raising=False)
        platform.check_cann_version("2.8.0")
    (record,) = caplog.records
    assert "CANN 8.3.RC3 is not the CANN torch_npu 2.8.0 is built for" in record.getMessage()
    assert "RC number only" in record.getMessage()


def test_torch_backend_autoload_is_off_in_every_entry_point() -> None:
    import subprocess
    import sys

    code = (
        "import os, sys; import npuserve.executor.platform; "
        "print(os.environ['TORCH_DEVICE_BACKEND_AUTOLOAD'], 'torch_npu' in sys.modules)"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0", "False"]
