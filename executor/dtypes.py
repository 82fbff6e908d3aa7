"""``--dtype`` resolution: the activation and weight dtype, checked to run on the target device.

`resolve_dtype` turns the flag (a name of `DTYPE_NAMES`, or ``auto``: the checkpoint's
``torch_dtype``, adjusted where the device cannot run it) into a torch dtype, and
`check_dtype_supported` proves it runs there: NPU rules first (no float32, no bfloat16 on Ascend
310P), then a tiny matmul + softmax on the device. Every failure raises `PlatformError` naming
the dtype, the device and the ``--dtype`` that fixes it.
"""

from __future__ import annotations

import logging

import torch

from npuserve.executor.platform import (
    DTYPE_CHOICES,
    DTYPE_NAMES,
    PlatformError,
    Target,
    is_ascend_310p,
    synchronize,
    torch_device,
)

logger = logging.getLogger(__name__)


def _parse_dtype(name: str, what: str) -> torch.dtype:
    key = name.strip().lower().removeprefix("torch.")
    dtype = DTYPE_NAMES.get(key)
    if dtype is None:
        raise PlatformError(f"unknown {what} {name!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    return dtype


def _auto_dtype(config_dtype: str | None, device: torch.device | Target) -> torch.dtype:
    if config_dtype is None:
        dtype = torch.float32
    else:
        try:
            dtype = _parse_dtype(config_dtype, "checkpoint torch_dtype")
        except PlatformError as exc:
            raise PlatformError(f"{exc}: pass --dtype explicitly") from None
    if device.type == "cpu" and dtype == torch.float16:
        # NOTE: like vLLM's CPU platform: float16 matmuls on CPUs are slow or missing.
        logger.info("--dtype auto: the checkpoint is float16; using bfloat16 on cpu")
        return torch.bfloat16
    if device.type == "npu" and dtype == torch.float32:
        # NOTE: the Ascend attention, cache and rope kernels take float16/bfloat16 only.
        half = torch.float16 if is_ascend_310p(device) else torch.bfloat16
        logger.info("--dtype auto: the checkpoint is float32; using %s on npu", half)
        return half
    return dtype


def resolve_dtype(name: str, config_dtype: str | None, device: torch.device | Target) -> torch.dtype:
    """``--dtype`` -> the activation and weight dtype, checked to run on ``device``.

    ``auto`` takes the checkpoint's ``torch_dtype`` (float32 when absent), except float16 on
    CPU, which becomes bfloat16, and float32 on NPU, which becomes the NPU's half type.
    """
    choice = name.strip().lower()
    dtype = _auto_dtype(config_dtype, device) if choice == "auto" else _parse_dtype(choice, "dtype")
    check_dtype_supported(device, dtype)
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> "bfloat16", as `ExecutorInfo.dtype` and `BlockChunk.dtype` say it."""
    return str(dtype).removeprefix("torch.")


def _dtype_fix(device: torch.device | Target, dtype: torch.dtype) -> str:
    if dtype == torch.bfloat16 and device.type != "cpu":
        return "--dtype float16"
    return "--dtype bfloat16" if device.type == "npu" else "--dtype float32"


def check_dtype_supported(device: torch.device | Target, dtype: torch.dtype) -> None:
    """Runs a tiny matmul + softmax in ``dtype`` on ``device``; raises PlatformError if it fails."""
    if device.type == "npu" and dtype == torch.float32:
        raise PlatformError(
            "float32 does not run on npu: the Ascend attention, cache and rope kernels take "
            "float16 or bfloat16. Use --dtype bfloat16 (or --dtype float16)."
        )
    if device.type == "npu" and dtype == torch.bfloat16 and is_ascend_310p(device):
        raise PlatformError(
            "bfloat16 does not run on npu: Ascend 310P has no bfloat16 support. Use --dtype float16."
        )
    try:
        a = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)).to(torch_device(device), dtype)
        probs = torch.softmax(a @ a.T, dim=-1)
        synchronize(device)
        ok = bool(torch.isfinite(probs.float()).all())
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        raise PlatformError(
            f"{dtype_name(dtype)} does not run on {device}: {exc}. Use {_dtype_fix(device, dtype)}."
        ) from exc
    if not ok:
        raise PlatformError(
            f"{dtype_name(dtype)} gives non-finite results on {device}. Use {_dtype_fix(device, dtype)}."
        )
