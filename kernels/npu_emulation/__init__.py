"""A CPU emulation of the torch_npu operators and ``torch.npu`` calls npuserve makes.

With ``NPUSERVE_EMULATE_NPU=1`` and ``--device npu``, `npuserve.executor.platform` installs a
``torch_npu`` stand-in instead of importing the real one, so the whole server runs the ``npu``
kernel backend on a machine without Ascend hardware (CI, laptops). Tensors stay on the CPU;
each operator checks its arguments as the CANN/op-plugin documentation states (`contracts`) and
computes in plain float32 torch (`ops`). ACL graphs (`graphs`: capture, replay, task updates)
and pinned host memory with its copies to the device (`host_memory`) are emulated the same way:
what a device refuses is refused. Nothing about performance carries over.

The emulated machine is set by environment variables (defaults in brackets):
``NPUSERVE_EMULATE_NPU_COUNT`` [1] NPUs, ``NPUSERVE_EMULATE_NPU_SOC`` [223, an A2; 200-205 is a
310P, 250-255 an A3], ``NPUSERVE_EMULATE_NPU_MEMORY_GIB`` [4] per device,
``NPUSERVE_EMULATE_CANN_VERSION`` [8.5.0], ``NPUSERVE_EMULATE_TORCH_NPU_VERSION`` [the installed
torch's release + ``.post2``], ``NPUSERVE_EMULATE_NNAL`` [1; 0: libatb.so is missing].
"""

from __future__ import annotations

import os

EMULATE_ENV = "NPUSERVE_EMULATE_NPU"


def requested() -> bool:
    """Whether the user asked for the emulation (``NPUSERVE_EMULATE_NPU=1``)."""
    return os.environ.get(EMULATE_ENV, "").strip().lower() in ("1", "true", "yes")
