"""The executor: a model on one device (or a tensor-parallel group), driven over gRPC.

Every npuserve process that imports torch does so through this package (the CLI's executor and
benchmark commands, ``python -m npuserve.executor.server``, tensor-parallel ranks), so this is
where torch's device-backend autoload is turned off, before any torch import: otherwise torch's
``torch.backends`` entry point imports torch_npu inside ``import torch``, before npuserve checks
the version set, and even with ``--device cpu``. npuserve imports torch_npu itself, after the
checks, only when an NPU is asked for.
"""

from __future__ import annotations

import os

TORCH_AUTOLOAD_ENV = "TORCH_DEVICE_BACKEND_AUTOLOAD"

os.environ[TORCH_AUTOLOAD_ENV] = "0"
