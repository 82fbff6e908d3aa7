"""Reading `npu-smi info`: the driver's view of the NPUs, their health and memory.

The table differs by driver generation: 23.0.x and 25.x print one chip per NPU on 910B
(``Chip`` column), 24.1+ on Atlas A3 prints two chips per NPU (``Chip  Phy-ID``), and 310P/310B
tables have a ``Chip  Device`` column and no HBM column (their memory is ``Memory-Usage``). Each
device is a pair of rows: ``| NPU  Name | Health | Power Temp Hugepages |`` then ``| Chip ... |
Bus-Id | AICore  Memory-Usage [HBM-Usage] |``. The process table after it is ignored.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

NPU_SMI_TIMEOUT_S = 20.0
_HEAD = re.compile(r"^(\d+)\s+(\S+)$")  # "0     910B3"
_CHIP = re.compile(r"^(\d+)(?:\s+(\d+))?$")  # "0", or "1     1" (chip, Phy-ID / Device)
_USAGE = re.compile(r"(\d+)\s*/\s*(\d+)")  # "3407 / 65536"
_VERSION = re.compile(r"npu-smi\s+(\S+)\s+Version:\s*(\S+)")


@dataclass(frozen=True, slots=True)
class NpuChip:
    """One chip, which is one device to torch_npu (its index is the chip's order)."""

    npu_id: int
    chip_id: int
    name: str  # e.g. "910B3", "Ascend910" (A3), "310P3"
    health: str  # "OK", "Warning", "Alarm", "Critical"
    bus_id: str
    memory_used_mb: int  # HBM where the table has it, else the chip's DDR memory
    memory_total_mb: int

    @property
    def memory_free_mb(self) -> int:
        return self.memory_total_mb - self.memory_used_mb


@dataclass(frozen=True, slots=True)
class NpuSmiInfo:
    version: str | None  # the driver version npu-smi reports
    chips: list[NpuChip]


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def parse_npu_smi_info(text: str) -> NpuSmiInfo:
    """The chips in an `npu-smi info` table, in device order."""
    match = _VERSION.search(text)
    version = match.group(2) if match else None
    has_hbm = "HBM-Usage" in text
    chips: list[NpuChip] = []
    head: tuple[int, str, str] | None = None
    for line in text.splitlines():
        if not line.startswith("|"):
            continue
        if "Process id" in line:
            break  # the process table follows; it has no device rows
        cells = _cells(line)
        if len(cells) < 3 or "Name" in cells[0] or "Bus-Id" in cells[1]:
            continue
        if head is None:
            found = _HEAD.match(cells[0])
            if found:
                head = (int(found.group(1)), found.group(2), cells[1].split()[0] if cells[1] else "")
            continue
        found = _CHIP.match(cells[0])
        if found is None:
            head = None
            continue
        usages = [(int(u), int(t)) for u, t in _USAGE.findall(cells[2])]
        used, total = (usages[-1] if has_hbm else usages[0]) if usages else (0, 0)
        npu_id, name, health = head
        chips.append(NpuChip(npu_id, int(found.group(1)), name, health, cells[1], used, total))
        head = None
    return NpuSmiInfo(version, chips)


def run_npu_smi() -> tuple[str | None, str]:
    """(the output of `npu-smi info`, or None) and why not when None."""
    path = shutil.which("npu-smi")
    if path is None:
        return None, "npu-smi is not on PATH"
    try:
        done = subprocess.run(
            [path, "info"], capture_output=True, text=True, timeout=NPU_SMI_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"npu-smi info failed: {exc}"
    if done.returncode != 0:
        return None, f"npu-smi info exited {done.returncode}: {(done.stderr or done.stdout).strip()[:300]}"
    return done.stdout, ""
