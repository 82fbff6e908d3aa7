"""Who yields the host's cores when executors compute on them.

`npuserve serve` on one machine with executors on the CPU (the `cpu` device, or the npu backend
emulated on it: the demo, CI, a laptop) runs everything on the same cores. An executor keeps one
torch thread per core busy for the length of a step (intra-op parallel regions); the scheduler's
and the gateway's processes work in bursts between steps. At the same priority the kernel's fair
share lets such a burst preempt a compute thread in the middle of a parallel region, and the
whole region then waits for that one thread. So when an executor computes on this host's CPU,
the scheduler and the gateway start at a lower priority (`CONTROL_PLANE_NICE`): they still run
in every idle moment, and still get a share of a busy core, but no longer stall a step.
Executors on NPUs leave the host's cores to the control plane, which then keeps the default.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from npuserve.proto.step_plan import computes_on_cpu

# Nice 10: a weight of 110 against a compute thread's 1024 (Linux CFS), about a tenth of a
# contended core. stories260K over gRPC on 2 cores: 3-7% more tokens/s (README "Serve a model").
CONTROL_PLANE_NICE = 10


def control_plane_nice(executors_ready: Iterable[Mapping[str, Any]]) -> int:
    """The niceness the scheduler and the gateway start with next to these executors (what
    their ready files say: `ExecutorInfo` under "info")."""
    on_cpu = any(computes_on_cpu(str(ready["info"]["device"])) for ready in executors_ready)
    return CONTROL_PLANE_NICE if on_cpu else 0
