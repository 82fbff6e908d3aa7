"""The emulated machine: ``torch.npu`` (devices, memory, streams) and the ``torch_npu`` module.

`EmulatedMachine` describes the NPUs the emulation pretends to have, read from the environment
(see `kernels.npu_emulation`). `build_torch_npu` assembles a ``torch_npu`` stand-in module with
the operators of `ops` and a ``torch.npu`` stand-in; tensors stay on the CPU.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from npuserve.kernels.npu_emulation import contracts, graph_api, graphs, ops
from npuserve.kernels.npu_emulation.host_memory import EmulatedHostMemory

GIB = 1 << 30
# What `install` puts in sys.modules.
MODULE_NAMES = (
    "torch_npu",
    "torch_npu.npu",
    "torch_npu.op_plugin",
    "torch_npu.op_plugin.atb",
    "torch_npu.op_plugin.atb._atb_ops",
)


@dataclass(frozen=True, slots=True)
class EmulatedMachine:
    count: int = 1  # NPUs in the machine (before ASCEND_RT_VISIBLE_DEVICES)
    soc_version: int = 223  # torch_npu.npu.get_soc_version(): 220-225 A2, 250-255 A3, 200-205 310P
    memory_gib: float = 4.0  # HBM per device
    cann_version: str = "8.5.0"
    torch_npu_version: str = "2.8.0.post2"
    nnal_installed: bool = True  # whether libatb.so loads

    @classmethod
    def from_env(cls) -> EmulatedMachine:
        env = os.environ
        default = cls()
        # The torch_npu release of the installed torch's line, as pip would pair them.
        matching_torch_npu = torch.__version__.split("+")[0] + ".post2"
        return cls(
            count=int(env.get("NPUSERVE_EMULATE_NPU_COUNT", default.count)),
            soc_version=int(env.get("NPUSERVE_EMULATE_NPU_SOC", default.soc_version)),
            memory_gib=float(env.get("NPUSERVE_EMULATE_NPU_MEMORY_GIB", default.memory_gib)),
            cann_version=env.get("NPUSERVE_EMULATE_CANN_VERSION", default.cann_version),
            torch_npu_version=env.get("NPUSERVE_EMULATE_TORCH_NPU_VERSION", matching_torch_npu),
            nnal_installed=env.get("NPUSERVE_EMULATE_NNAL", "1") != "0",
        )

    @property
    def device_name(self) -> str:
        if 200 <= self.soc_version <= 205:
            return "Ascend310P3"
        if 250 <= self.soc_version <= 255:
            return "Ascend910_9392"
        return f"Ascend910B{max(1, self.soc_version - 220)}"


def _visible_ids(count: int) -> list[int]:
    """Physical ids the process sees: ASCEND_RT_VISIBLE_DEVICES, as CANN reads it."""
    value = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    if value is None:
        return list(range(count))
    ids = [int(part) for part in value.split(",") if part.strip()]
    return [i for i in ids if 0 <= i < count]


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class _Stream:
    """A stream on an emulated NPU: work runs on the CPU at once, so there is nothing to wait for."""

    def synchronize(self) -> None:
        graphs.refuse_host_sync("Stream.synchronize()")


class _OperatorWithOut:
    """An operator with an ``.out`` form (``torch_npu.npu_fused_infer_attention_score.out``)."""

    def __init__(self, call: Callable[..., Any], out: Callable[..., Any]) -> None:
        self._call = call
        self.out = out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)


def _fused_attention_outside_graphs(*args: Any, **kwargs: Any) -> Any:
    if graphs.capturing():
        raise graphs.GraphCaptureError(
            "npu_fused_infer_attention_score captured without a task group: its host-side lengths "
            "would be frozen at the capture's; capture .out between graph_task_group_begin/end and "
            "update it before each replay"
        )
    return ops.fused_infer_attention_score(*args, **kwargs)


def _fused_attention_out_at_capture(*args: Any, **kwargs: Any) -> Any:
    if kwargs.get("workspace") is None:
        raise graphs.GraphCaptureError(
            "npu_fused_infer_attention_score.out captured without a workspace: the operator would "
            "allocate one at replay, outside the graph's pool"
        )
    ops.check_fused_infer_attention_score_out(*args, **kwargs)
    return kwargs["out"]


def build_npu_module(machine: EmulatedMachine) -> ModuleType:
    """The ``torch.npu`` stand-in: the calls npuserve makes, with torch.cuda's signatures."""
    npu = ModuleType("torch_npu.npu")
    default_stream = _Stream()
    state: dict[str, Any] = {"device": 0, "stream": default_stream}

    @contextmanager
    def stream(stream: _Stream | None) -> Iterator[None]:
        """``torch.npu.stream(s)``: makes ``s`` the current stream inside the block."""
        previous = state["stream"]
        state["stream"] = stream or previous
        try:
            yield
        finally:
            state["stream"] = previous

    def device_count() -> int:
        return len(_visible_ids(machine.count))

    def _index(device: object = None) -> int:
        if device is None:
            return state["device"]
        index = device if isinstance(device, int) else getattr(device, "index", None)
        return state["device"] if index is None else int(index)

    def set_device(device: object) -> None:
        index = _index(device)
        if not 0 <= index < device_count():
            raise RuntimeError(f"set_device: invalid device id {index}; {device_count()} NPU(s) visible")
        state["device"] = index

    def mem_get_info(device: object = None) -> tuple[int, int]:
        _index(device)
        total = int(machine.memory_gib * GIB)
        return max(0, total - _resident_bytes()), total

    vars(npu).update(
        {
            "is_available": lambda: device_count() > 0,
            "device_count": device_count,
            "set_device": set_device,
            "current_device": lambda: state["device"],
            "get_device_name": lambda device=None: machine.device_name,
            "get_soc_version": lambda: machine.soc_version,
            "mem_get_info": mem_get_info,
            # NOTE: tensors live in host memory, where the emulation tracks no allocations.
            "reset_peak_memory_stats": lambda device=None: None,
            "max_memory_allocated": lambda device=None: 0,
            # What graph pools hold: the only device memory the emulation reserves.
            "memory_reserved": lambda device=None: graphs.reserved_bytes(),
            "synchronize": lambda device=None: graphs.refuse_host_sync("torch.npu.synchronize()"),
            "empty_cache": lambda: None,
            "Stream": _Stream,
            "current_stream": lambda device=None: state["stream"],
            "stream": stream,
            "NPUGraph": graphs.NPUGraph,
            "graph": graphs.graph,
            "graph_pool_handle": graphs.graph_pool_handle,
            "ExternalEvent": graph_api.ExternalEvent,
            "graph_task_group_begin": graph_api.graph_task_group_begin,
            "graph_task_group_end": graph_api.graph_task_group_end,
            "graph_task_update_begin": graph_api.graph_task_update_begin,
            "graph_task_update_end": graph_api.graph_task_update_end,
            # NOTE: not in torch_npu: the emulation's model of pinned host memory and of copies
            # to the device, which torch cannot see on an emulated device (`host_memory`).
            "emulated_host_memory": EmulatedHostMemory(),
        },
    )
    return npu


def build_torch_npu(machine: EmulatedMachine) -> dict[str, ModuleType]:
    """The stand-in ``torch_npu`` and its submodules, keyed by module name (for sys.modules)."""
    torch_npu = ModuleType("torch_npu")
    # A spec, so importlib.util.find_spec("torch_npu") finds the stand-in as installed.
    torch_npu.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    npu = build_npu_module(machine)
    op_plugin = ModuleType("torch_npu.op_plugin")
    atb = ModuleType("torch_npu.op_plugin.atb")
    atb_ops = ModuleType("torch_npu.op_plugin.atb._atb_ops")

    def _register_atb_extensions() -> None:
        """Raises the OSError the real one raises when libatb.so did not load at import
        (op-plugin ``op_plugin/python/atb/_atb_ops.py``)."""
        if not machine.nnal_installed:
            raise OSError(
                2,
                "Please check that the nnal package is installed. "
                "Please run 'source set_env.sh' in the NNAL installation path.",
            )

    # The torch_npu operators by name, each with what a graph capture runs of it: None for the
    # operator itself (it returns new tensors), or its checks (it writes only its arguments).
    operators: dict[str, tuple[Callable[..., Any], Callable[..., Any] | None]] = {
        "_npu_reshape_and_cache": (ops.reshape_and_cache, contracts.check_reshape_and_cache),
        "npu_rms_norm": (ops.rms_norm, None),
        "npu_add_rms_norm": (ops.add_rms_norm, None),
        "npu_swiglu": (ops.swiglu, None),
        "_npu_rotary_embedding": (ops.RotaryEmbedding(), contracts.check_rotary_embedding),
    }
    vars(torch_npu).update(
        {
            "__version__": machine.torch_npu_version,
            "__npuserve_emulated__": True,
            "npu": npu,
            **{name: graphs.graph_operator(name, *fns) for name, fns in operators.items()},
            "_npu_fused_infer_attention_score_get_max_workspace": graphs.host_query(
                ops.fused_infer_attention_score_max_workspace
            ),
            "npu_fused_infer_attention_score": _OperatorWithOut(
                _fused_attention_outside_graphs,
                graphs.graph_operator(
                    "npu_fused_infer_attention_score.out",
                    ops.fused_infer_attention_score_out,
                    at_capture=_fused_attention_out_at_capture,
                ),
            ),
            "op_plugin": op_plugin,
        },
    )
    vars(op_plugin).update({"atb": atb})
    vars(atb).update({"_atb_ops": atb_ops})
    vars(atb_ops).update({"_register_atb_extensions": _register_atb_extensions})
    return dict(zip(MODULE_NAMES, (torch_npu, npu, op_plugin, atb, atb_ops), strict=True))


def install(machine: EmulatedMachine) -> ModuleType:
    """Puts the stand-in in sys.modules and on torch (``torch.npu``, ``torch.version.cann``), as
    importing the real torch_npu does; returns the ``torch_npu`` module. Idempotent."""
    current = sys.modules.get("torch_npu")
    if current is not None and getattr(current, "__npuserve_emulated__", False):
        return current
    modules = build_torch_npu(machine)
    sys.modules.update(modules)
    torch.npu = modules["torch_npu.npu"]  # type: ignore[attr-defined]
    torch.version.cann = machine.cann_version  # type: ignore[attr-defined]
    return modules["torch_npu"]
