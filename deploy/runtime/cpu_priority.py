"""Who yields the host's cores when executors compute on them.

With executors on this host's CPU (the `cpu` device, or the npu backend emulated on it: the demo,
CI, a laptop), an executor keeps one torch thread per core busy through a step's parallel
regions, while the scheduler and the gateway work in bursts between steps. At equal priority a
burst preempts a compute thread mid-region and the whole region waits for it. So next to such
executors the scheduler and the gateway start at nice 10 (`CONTROL_PLANE_NICE`): their bursts
run mostly in the executors' idle moments, yet get about a tenth of a busy core, so none starves.
(The executors also leave them a core where that costs little: `--cpu-threads auto`.)

NOTE: not SCHED_IDLE, though it ran stories260K 16-18% faster than nice 10 on 2 cores: an
idle-policy task gets a core only when nothing else in its group wants one, so any CPU-bound
work in serve's session (a load generator, a build) starves it: with two busy loops there a
64-token completion took 23-26 s against 0.4-0.7 s at nice 10 and 0.6-0.7 s at nice 0.

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
