"""What machine a benchmark ran on, so that its CPU figures can be compared with another run's.

The scheduler's costs are CPU time in Python: the same code and workload measured 16 us of CPU per
token on one 2-core machine and 27 on another whose cores run Python about 1.7x slower. Every
bench's JSON therefore records the CPU, the load before the run, and `python_ns_per_op`: the best
of several timings of a fixed pure-Python loop (dict and list work, integer arithmetic, a method
call: what the scheduler's hot paths are made of). Divide two runs' CPU per token by their
`python_ns_per_op` before comparing them across machines.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REFERENCE_OPS = 20_000  # loop iterations per timing
REFERENCE_RUNS = 7  # timings; the fastest counts (the others were interrupted)


@dataclass(frozen=True)
class MachineInfo:
    cpu_model: str
    cpu_mhz: float | None
    cpus: int
    load_average_1m: float | None  # before the run: what else was using the machine
    python: str
    python_ns_per_op: float  # one iteration of `_reference_loop`, the fastest of REFERENCE_RUNS

    def row(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        mhz = f" at {self.cpu_mhz:,.0f} MHz" if self.cpu_mhz else ""
        load = f", load {self.load_average_1m:.2f}" if self.load_average_1m is not None else ""
        return (
            f"{self.cpus} x {self.cpu_model}{mhz}{load}; Python {self.python}: "
            f"{self.python_ns_per_op:.0f} ns per reference op"
        )


class _Counter:
    def __init__(self) -> None:
        self.total = 0

    def add(self, value: int) -> None:
        self.total += value


def _reference_loop(ops: int) -> int:
    """A fixed mix of the interpreter work the scheduler does per token."""
    table: dict[int, int] = {}
    items: list[int] = []
    counter = _Counter()
    for i in range(ops):
        key = i & 255
        table[key] = table.get(key, 0) + i
        items.append(key)
        if len(items) > 64:
            items.clear()
        counter.add(key * 3 + 1)
    return counter.total + len(table)


def python_ns_per_op(ops: int = REFERENCE_OPS, runs: int = REFERENCE_RUNS) -> float:
    """Nanoseconds per iteration of the reference loop: the fastest of `runs` timings."""
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter_ns()
        _reference_loop(ops)
        best = min(best, (time.perf_counter_ns() - started) / ops)
    return best


def _cpuinfo_field(cpuinfo: str, name: str) -> str | None:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


def describe(cpuinfo_path: Path = Path("/proc/cpuinfo")) -> MachineInfo:
    """This machine, now (about a tenth of a second, spent in the reference loop)."""
    try:
        cpuinfo = cpuinfo_path.read_text()
    except OSError:
        cpuinfo = ""
    mhz = _cpuinfo_field(cpuinfo, "cpu MHz")
    try:
        load: float | None = os.getloadavg()[0]
    except OSError:
        load = None
    return MachineInfo(
        cpu_model=_cpuinfo_field(cpuinfo, "model name") or platform.processor() or platform.machine(),
        cpu_mhz=float(mhz) if mhz else None,
        cpus=os.cpu_count() or 1,
        load_average_1m=load,
        python=platform.python_version(),
        python_ns_per_op=python_ns_per_op(),
    )
