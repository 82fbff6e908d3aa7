"""The CPU emulation of torch_npu switched on for a test (or a module of tests), and off after."""

from __future__ import annotations

import sys

import pytest
import torch

from npuserve.kernels.npu_emulation import EMULATE_ENV
from npuserve.kernels.npu_emulation.runtime import MODULE_NAMES


def emulate_npu(patch: pytest.MonkeyPatch) -> None:
    """``NPUSERVE_EMULATE_NPU=1`` (for this process and those it starts) until ``patch`` is
    undone, which also removes the torch_npu stand-in that ``--device npu`` then installs."""
    patch.setenv(EMULATE_ENV, "1")
    for name in MODULE_NAMES:
        if name not in sys.modules:
            patch.setitem(sys.modules, name, None)  # restored (removed) at teardown
            del sys.modules[name]
    # The npu backend binds the torch_npu it imported first: import it afresh for this stand-in.
    patch.delitem(sys.modules, "npuserve.kernels.backends.npu_backend", raising=False)
    patch.setattr(torch, "npu", getattr(torch, "npu", None), raising=False)
    patch.setattr(torch.version, "cann", getattr(torch.version, "cann", None), raising=False)
