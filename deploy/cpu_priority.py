"""Who yields the host's cores when executors compute on them.

`npuserve serve` on one machine with executors on the CPU (the `cpu` device, or the npu backend
emulated on it: the demo, CI, a laptop) runs everything on the same cores. An executor keeps one
torch thread per core busy for the length of a step (intra-op parallel regions); the scheduler's
and the gateway's processes work in bursts between steps. At the same priority the kernel's fair
share lets such a burst preempt a compute thread in the middle of a parallel region, and the
whole region then waits for that one thread. So when an executor computes on this host's CPU,
the scheduler and the gateway start as the host's idle work (`CONTROL_PLANE`: Linux's
SCHED_IDLE, and nice 10 where that policy is missing): they run on every core a compute thread
leaves free, and a compute thread that wakes takes its core back at once, instead of waiting
for the burst's share of it.

They cannot starve for long: an executor only runs the steps the scheduler sends, so it idles
when the scheduler falls behind, and the scheduler then has the cores. A host that also runs
other CPU-bound work would delay them, which is why this applies only next to CPU executors.
Executors on NPUs leave the host's cores to the control plane, which then keeps the default.

NOTE: Linux shares the CPU between sessions first (autogroups), and a priority counts only
within its session: serve keeps every child in its own session (`Launcher`'s process groups).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from npuserve.proto.step_plan import computes_on_cpu


@dataclass(frozen=True, slots=True)
class CpuPriority:
    """A process's CPU priority, set in it before it starts any thread (threads and children
    inherit it)."""

    nice: int = 0
    idle: bool = False  # Linux's SCHED_IDLE: runs where no other thread wants the core

    def apply(self) -> None:
        """Lowers this process's priority to this one (never raises it)."""
        if self.nice:
            os.nice(self.nice)
        if self.idle and hasattr(os, "SCHED_IDLE"):
            with contextlib.suppress(OSError):  # NOTE: the nice above stays where it is refused
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))

    def describe(self) -> str:
        return ", ".join([*(["idle"] if self.idle else []), *([f"nice {self.nice}"] if self.nice else [])])


DEFAULT_PRIORITY = CpuPriority()
# stories260K over gRPC on 2 cores, one server re-prioritised between interleaved rounds: nice 10
# alone gave 3% more tokens/s than nice 0, SCHED_IDLE 16-18% more than nice 10 (README).
CONTROL_PLANE = CpuPriority(nice=10, idle=True)


def control_plane_priority(executors_ready: Iterable[Mapping[str, Any]]) -> CpuPriority:
    """The priority the scheduler and the gateway start with next to these executors (what
    their ready files say: `ExecutorInfo` under "info")."""
    on_cpu = any(computes_on_cpu(str(ready["info"]["device"])) for ready in executors_ready)
    return CONTROL_PLANE if on_cpu else DEFAULT_PRIORITY
