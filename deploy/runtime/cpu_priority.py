"""Who yields the host's cores when executors compute on them.

`npuserve serve` on one machine with executors on the CPU (the `cpu` device, or the npu backend
emulated on it: the demo, CI, a laptop) runs everything on the same cores. An executor keeps one
torch thread per core busy for the length of a step (intra-op parallel regions); the scheduler's
and the gateway's processes work in bursts between steps. At the same priority the kernel's fair
share lets such a burst preempt a compute thread in the middle of a parallel region, and the
whole region then waits for that one thread. So when an executor computes on this host's CPU,
the scheduler and the gateway start at nice 10 (`CONTROL_PLANE_NICE`): a burst then runs mostly
in the executor's idle moments, and still gets about a tenth of a busy core, so nothing starves.

NOTE: not SCHED_IDLE, though it took stories260K over gRPC 16-18% further than nice 10 on 2 cores
(a compute thread that wakes takes its core back at once): an idle-policy task gets a core only
when no other task in its group wants one, so any CPU-bound work sharing serve's session (a load
generator, a build) starves it. With two busy loops in serve's session a 64-token completion took
23-26 s under SCHED_IDLE against 0.4-0.7 s at nice 10 and 0.6-0.7 s at nice 0.

Executors there also leave a core to the control plane where that costs their model little
(`npuserve serve` gives them `--cpu-threads auto`: `npuserve.executor.cpu_threads`).

NOTE: Linux shares the CPU between sessions first (autogroups), and a priority counts only
within its session: serve keeps every child in serve's session (`Launcher`'s process groups).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from npuserve.proto.step_plan import computes_on_cpu

# Nice 10: a weight of 110 against a compute thread's 1024, about a tenth of a contended core.
# stories260K over gRPC on 2 cores, one server re-prioritised between interleaved rounds: 3% more
# tokens/s than nice 0.
CONTROL_PLANE_NICE = 10


def control_plane_nice(executors_ready: Iterable[Mapping[str, Any]]) -> int:
    """The niceness the scheduler and the gateway start with next to these executors (what
    their ready files say: `ExecutorInfo` under "info")."""
    on_cpu = any(computes_on_cpu(str(ready["info"]["device"])) for ready in executors_ready)
    return CONTROL_PLANE_NICE if on_cpu else 0
