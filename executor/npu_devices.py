"""The NPUs a process on this node may use, found without importing torch or torch_npu.

``ASCEND_RT_VISIBLE_DEVICES`` (a comma list of physical ids) when set, else the ``/dev/davinciN``
device files the driver creates, one per NPU; with the CPU emulation
(``NPUSERVE_EMULATE_NPU=1``), the emulated machine's ``NPUSERVE_EMULATE_NPU_COUNT``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

VISIBLE_ENV = "ASCEND_RT_VISIBLE_DEVICES"
DAVINCI = re.compile(r"davinci(\d+)")


def physical_npu_ids(dev: Path = Path("/dev")) -> list[int]:
    """Ids of the NPUs the driver exposes (``/dev/davinci0``...; not ``davinci_manager``)."""
    # NOTE: the switch of `npuserve.kernels.npu_emulation.requested`, read here without importing
    # the kernels package (and torch): the serve launcher counts devices.
    if os.environ.get("NPUSERVE_EMULATE_NPU", "").strip().lower() in ("1", "true", "yes"):
        return list(range(int(os.environ.get("NPUSERVE_EMULATE_NPU_COUNT", "1"))))
    try:
        names = [path.name for path in dev.iterdir()]
    except OSError:
        return []
    return sorted(int(m.group(1)) for name in names if (m := DAVINCI.fullmatch(name)))


def visible_npu_ids(dev: Path = Path("/dev")) -> list[int]:
    """Physical ids this process may use, in the order device indices count them."""
    value = os.environ.get(VISIBLE_ENV)
    if value is None:
        return physical_npu_ids(dev)
    return [int(part) for part in value.split(",") if part.strip().isdigit()]
