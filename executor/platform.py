"""Where the model runs and in which dtype, checked before anything is loaded.

`resolve_target` (and `resolve_device`) and `resolve_dtype` (in `dtypes`) turn the ``--device``
and ``--dtype`` flags into torch objects; every way a user's machine can get them wrong raises
`PlatformError` with the cause and the fix. torch_npu is imported here, lazily and only when an NPU is asked for
(or probed by ``auto``), after checking that torch and torch_npu belong to one version set: CANN,
torch and torch_npu are released together, and a mismatch is the most common Ascend failure.
Once imported, the NNAL/ATB library, the CANN version and the chip are checked too, and the
device is selected (``--device npu:N``).

With ``NPUSERVE_EMULATE_NPU=1``, ``--device npu`` installs the CPU emulation of torch_npu
(`npuserve.kernels.npu_emulation`) instead: the target's kind is ``npu`` (the npu kernels and
rules apply) while its tensors live on the CPU.

The memory helpers (`device_memory`, `reset_peak_memory`, `peak_memory_allocated`, `synchronize`,
`empty_cache`) hide the ``torch.cuda`` / ``torch.npu`` split from the executor.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import os
import re
from dataclasses import dataclass
from types import ModuleType

import torch

from npuserve.executor.version_matrix import cann_fit
from npuserve.kernels import npu_emulation

logger = logging.getLogger(__name__)

DEVICE_CHOICES = ("auto", "cpu", "cuda", "npu", "npu:N")
DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)

CANN_SET_ENV = "source /usr/local/Ascend/ascend-toolkit/set_env.sh"
ATB_SET_ENV = "source /usr/local/Ascend/nnal/atb/set_env.sh"
VERSION_SET_EXAMPLE = "e.g. CANN 8.5.0 + torch 2.8.0 + torch_npu 2.8.0.post2"
# Fragments of the errors torch_npu raises when the CANN libraries are missing or mismatched.
CANN_FAILURE_MARKERS = (
    "libascend",
    "libatb",
    "libhccl",
    "libacl",
    "libge_runner",
    "libruntime",
    "undefined symbol",
    "failed to infer device type",
)


class PlatformError(ValueError):
    """The machine cannot run what was asked; the message names the cause and the fix."""


@dataclass(frozen=True, slots=True)
class Target:
    """Where an executor runs: the torch device its tensors live on, and the device family whose
    kernels and rules apply. They differ only for the emulated NPU (kind npu, tensors on cpu)."""

    device: torch.device
    kind: str  # "npu" | "cuda" | "cpu"
    emulated: bool = False

    @property
    def type(self) -> str:
        """The kind, so helpers written for a torch.device take a Target as well."""
        return self.kind

    @property
    def index(self) -> int | None:
        return self.device.index


def torch_device(where: torch.device | Target) -> torch.device:
    return where.device if isinstance(where, Target) else where


# -- torch_npu and its version set -----------------------------------------------------------


def _major_minor(version: str) -> tuple[int, int]:
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    if match is None:
        raise PlatformError(f"cannot read a major.minor version from {version!r}")
    return int(match.group(1)), int(match.group(2))


def _torch_release(version: str) -> str:
    """``2.8.0+cpu`` and ``2.8.0.post2`` -> ``2.8.0``: the torch release a torch_npu is published
    for (not `version_matrix.release`, which keeps a post or rc suffix)."""
    match = re.match(r"\s*(\d+(?:\.\d+)*)", version)
    return match.group(1) if match else version


def check_version_set(torch_version: str, torch_npu_version: str) -> None:
    """Raises PlatformError unless torch and torch_npu share a major.minor version."""
    if _major_minor(torch_version) == _major_minor(torch_npu_version):
        return
    npu_major, npu_minor = _major_minor(torch_npu_version)
    raise PlatformError(
        f"torch {torch_version} and torch_npu {torch_npu_version} are not one version set: "
        f"torch_npu must be built for the same torch major.minor. Install the torch_npu for "
        f"your torch (pip install 'torch_npu=={_torch_release(torch_version)}.*'), or the torch for your torch_npu "
        f"(pip install 'torch=={npu_major}.{npu_minor}.*'), and use the CANN release that "
        f"torch_npu version names ({VERSION_SET_EXAMPLE})."
    )


def _install_hint() -> str:
    return (
        f"torch_npu is not installed. Install it for torch {torch.__version__}: "
        f"pip install 'npuserve[ascend]' 'torch_npu=={_torch_release(torch.__version__)}.*', with the CANN "
        f"release that torch_npu version names ({VERSION_SET_EXAMPLE}), then {CANN_SET_ENV}."
    )


def _import_failure(exc: BaseException, torch_npu_version: str) -> PlatformError:
    """Turns the exception ``import torch_npu`` raised into the fix a user can apply."""
    message = str(exc)
    if isinstance(exc, ModuleNotFoundError) and exc.name == "torch_npu":
        return PlatformError(_install_hint())
    versions = f"torch {torch.__version__}, torch_npu {torch_npu_version}"
    if any(marker in message.lower() for marker in CANN_FAILURE_MARKERS):
        return PlatformError(
            f"torch_npu could not load the CANN libraries ({versions}): {message}. "
            f"Source the CANN environment in the shell that starts npuserve: {CANN_SET_ENV} "
            f"(and {ATB_SET_ENV} for libatb.so), and check that the installed CANN, torch and "
            f"torch_npu are one version set ({VERSION_SET_EXAMPLE})."
        )
    return PlatformError(
        f"import torch_npu failed ({versions}): {message}. Check that CANN is sourced "
        f"({CANN_SET_ENV}) and that CANN, torch and torch_npu are one version set "
        f"({VERSION_SET_EXAMPLE})."
    )


def torch_npu_installed() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def import_torch_npu() -> ModuleType:
    """Imports torch_npu after checking its version set; raises PlatformError with the fix."""
    try:
        npu_version = importlib.metadata.version("torch_npu")
    except importlib.metadata.PackageNotFoundError:
        if not torch_npu_installed():
            raise PlatformError(_install_hint()) from None
        npu_version = "unknown"  # importable but without package metadata (a source build)
    if npu_version != "unknown":
        check_version_set(torch.__version__, npu_version)
    try:
        module = importlib.import_module("torch_npu")
    except (ImportError, OSError, RuntimeError) as exc:
        raise _import_failure(exc, npu_version) from exc
    cann = getattr(torch.version, "cann", None)
    logger.info("torch %s, torch_npu %s, CANN %s", torch.__version__, npu_version, cann)
    return module


# -- Devices ---------------------------------------------------------------------------------


def _npu_count() -> int:
    npu = getattr(torch, "npu", None)
    return npu.device_count() if npu is not None and npu.is_available() else 0


def _visible_devices(variable: str) -> str:
    value = os.environ.get(variable)
    return f"{variable} is unset" if value is None else f"{variable}={value!r}"


def _require_npu(index: int | None) -> Target:
    emulated = npu_emulation.requested()
    module = install_emulation() if emulated else import_torch_npu()
    check_npu_runtime(module)
    count = _npu_count()
    if count == 0:
        raise PlatformError(
            "--device npu: torch_npu imports but sees no NPU. Check `npu-smi info`, that "
            f"ASCEND_RT_VISIBLE_DEVICES names existing devices "
            f"({_visible_devices('ASCEND_RT_VISIBLE_DEVICES')}), and that a container has the "
            "/dev/davinci* devices mounted."
        )
    if index is not None and not 0 <= index < count:
        raise PlatformError(
            f"--device npu:{index}: only {count} NPU(s) are visible "
            f"({_visible_devices('ASCEND_RT_VISIBLE_DEVICES')}); pick npu:0..npu:{count - 1} "
            "(indices count the visible devices) or check `npu-smi info`."
        )
    # NOTE: select the device explicitly: an executor left on the default would run on NPU 0
    # whatever it was given, next to every other executor of the node.
    selected = index or 0
    torch.npu.set_device(selected)  # type: ignore[attr-defined]
    check_npu_chip()
    if emulated:
        return Target(torch.device("cpu"), "npu", emulated=True)
    return Target(torch.device("npu", selected), "npu")


def install_emulation() -> ModuleType:
    """The CPU stand-in for torch_npu, with the same version-set check as the real import."""
    from npuserve.kernels.npu_emulation.runtime import EmulatedMachine, install

    machine = EmulatedMachine.from_env()
    check_version_set(torch.__version__, machine.torch_npu_version)
    module = install(machine)
    logger.warning(
        "%s=1: torch_npu is EMULATED on the CPU (torch_npu %s, CANN %s, %s); nothing runs on an NPU",
        npu_emulation.EMULATE_ENV,
        machine.torch_npu_version,
        machine.cann_version,
        machine.device_name,
    )
    return module


def _auto_target() -> Target:
    if torch_npu_installed() or npu_emulation.requested():
        try:
            return _require_npu(None)
        except PlatformError as exc:
            logger.warning("--device auto: not using the NPU: %s", exc)
    if torch.cuda.is_available():
        return Target(torch.device("cuda"), "cuda")
    return Target(torch.device("cpu"), "cpu")


def parse_device(name: str) -> tuple[str, int | None]:
    """``npu:1`` -> ``("npu", 1)``; ``auto`` -> ``("auto", None)``; PlatformError when unknown."""
    kind, _, index_text = name.strip().lower().partition(":")
    if kind not in ("auto", "cpu", "cuda", "npu"):
        raise PlatformError(f"unknown device {name!r}; choose one of {', '.join(DEVICE_CHOICES)}")
    if not index_text:
        return kind, None
    if kind not in ("npu", "cuda") or not index_text.isdigit():
        raise PlatformError(f"bad device {name!r}: only npu and cuda take an index (npu:0, npu:1, ...)")
    return kind, int(index_text)


def resolve_target(name: str) -> Target:
    """``auto`` | ``cpu`` | ``cuda[:N]`` | ``npu[:N]`` -> a usable `Target`, or PlatformError."""
    kind, index = parse_device(name)
    if kind == "cpu":
        return Target(torch.device("cpu"), "cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise PlatformError(
                f"--device cuda: torch {torch.__version__} sees no CUDA device. Check `nvidia-smi`, "
                f"that CUDA_VISIBLE_DEVICES names existing devices "
                f"({_visible_devices('CUDA_VISIBLE_DEVICES')}), and that torch is a CUDA build "
                f"(torch.version.cuda is {torch.version.cuda})."
            )
        return Target(torch.device("cuda", index) if index is not None else torch.device("cuda"), "cuda")
    if kind == "npu":
        return _require_npu(index)
    target = _auto_target()
    logger.info("--device auto: using %s%s", target.kind, " (emulated)" if target.emulated else "")
    return target


def resolve_device(name: str) -> torch.device:
    """The torch device tensors go to for ``--device name`` (the CPU for an emulated NPU)."""
    return resolve_target(name).device


# -- Ascend runtime: NNAL/ATB, CANN version, chip --------------------------------------------

# torch_npu.npu.get_soc_version() ranges, as vllm-ascend v0.13.0 utils.check_ascend_device_type
# reads them: 220-225 Atlas A2, 250-255 Atlas A3, 200-205 Ascend 310P.
A2_A3_SOC_RANGES = ((220, 225), (250, 255))
SOC_310P_RANGE = (200, 205)


def register_atb_extensions() -> None:
    """Loads NNAL's ATB operators (``_npu_reshape_and_cache``, ``_npu_rotary_embedding``).

    NOTE: torch_npu swallows a failed ``libatb.so`` load at import and keeps the error until the
    first ATB call (op-plugin ``op_plugin/python/atb/_atb_ops.py``); ``_register_atb_extensions``,
    which vllm-ascend's worker calls at start-up, raises it, so it surfaces here.
    """
    try:
        atb_ops = importlib.import_module("torch_npu.op_plugin.atb._atb_ops")
    except ImportError as exc:
        raise PlatformError(
            f"this torch_npu has no ATB extension module ({exc}); install the torch_npu of a "
            f"supported version set ({VERSION_SET_EXAMPLE})."
        ) from exc
    try:
        atb_ops._register_atb_extensions()
    except OSError as exc:
        raise PlatformError(
            f"the NNAL/ATB library libatb.so did not load ({exc}; "
            f"{_visible_devices('ATB_HOME_PATH')}): npuserve's cache and rotary kernels are ATB "
            f"operators. Install the NNAL package of your CANN release and {ATB_SET_ENV} in the "
            "shell that starts npuserve (after the toolkit's set_env.sh)."
        ) from exc


def check_cann_version(torch_npu_version: str) -> None:
    cann = getattr(torch.version, "cann", None)
    fit = cann_fit(torch_npu_version, cann)
    if fit.status == "mismatch":
        raise PlatformError(
            f"{fit.message}. Install that CANN release (toolkit and NNAL) and {CANN_SET_ENV}, or the "
            f"torch_npu built for your CANN ({VERSION_SET_EXAMPLE})."
        )
    if fit.status == "rc_only":
        logger.warning("%s: serving anyway; `npuserve doctor` checks the whole set", fit.message)
    if cann is None:
        logger.warning("CANN version unknown (torch.version.cann unset): not checked against torch_npu")


def check_npu_runtime(module: ModuleType) -> None:
    """What importing torch_npu leaves unchecked: NNAL/ATB and the CANN release."""
    register_atb_extensions()
    check_cann_version(getattr(module, "__version__", "unknown"))


def check_npu_chip() -> None:
    """Refuses chips whose attention kernel npuserve cannot call (only Atlas A2/A3 run it)."""
    npu = getattr(torch, "npu", None)
    get_soc = getattr(npu, "get_soc_version", None)
    if npu is None or get_soc is None:
        return
    soc = int(get_soc())
    if any(low <= soc <= high for low, high in A2_A3_SOC_RANGES):
        return
    name = npu.get_device_name(npu.current_device())
    low, high = SOC_310P_RANGE
    what = "Ascend 310P" if low <= soc <= high or "310P" in name else f"this chip ({name}, soc {soc})"
    raise PlatformError(
        f"{what} is not supported yet: npuserve's attention calls npu_fused_infer_attention_score, "
        "which runs on Atlas A2/A3 (910B, 910_93) only (op-plugin docs, 产品支持情况). Serve on an "
        "A2/A3 device (choose it with ASCEND_RT_VISIBLE_DEVICES), or use --device cpu."
    )


def _device_module(device: torch.device | Target) -> ModuleType | None:
    """torch.cuda or torch.npu for an accelerator (an emulated NPU too), None for the CPU."""
    if device.type == "cuda":
        return torch.cuda
    if device.type == "npu":
        module = getattr(torch, "npu", None)
        if module is None:
            raise PlatformError(f"{device} needs torch_npu: call resolve_device('npu') first")
        return module
    return None


def is_ascend_310p(device: torch.device | Target) -> bool:
    if device.type != "npu":
        return False
    npu = _device_module(device)
    assert npu is not None
    index = device.index if device.index is not None else npu.current_device()
    return "310P" in npu.get_device_name(index)


# -- Memory and synchronisation --------------------------------------------------------------


def device_memory(device: torch.device | Target) -> tuple[int, int]:
    """(free, total) bytes of an accelerator's memory."""
    module = _device_module(device)
    if module is None:
        raise PlatformError(f"device memory is only known for cuda and npu devices, not {device.type}")
    free, total = module.mem_get_info(torch_device(device))
    return int(free), int(total)


def reset_peak_memory(device: torch.device | Target) -> None:
    module = _device_module(device)
    if module is not None:
        module.reset_peak_memory_stats(torch_device(device))


def peak_memory_allocated(device: torch.device | Target) -> int:
    """Peak bytes allocated by torch since the last reset; 0 on the CPU (not tracked)."""
    module = _device_module(device)
    return 0 if module is None else int(module.max_memory_allocated(torch_device(device)))


def synchronize(device: torch.device | Target) -> None:
    module = _device_module(device)
    if module is not None:
        module.synchronize(torch_device(device))


def empty_cache(device: torch.device | Target) -> None:
    module = _device_module(device)
    if module is not None:
        module.empty_cache()
