"""gRPC's environment in npuserve's processes: set before gRPC starts in a process, inherited
by every process it starts. An operator's own setting of either variable is kept.

* No fork handlers (`GRPC_ENABLE_FORK_SUPPORT=0`): they restart gRPC's pollers in a forked child,
  where they can die on the descriptors `close_fds` closes before exec (SIGABRT, "epoll_wait
  error: Bad file descriptor": 2 of 1,500 launches). npuserve never uses gRPC across a fork.
* gRPC core's older I/O stack (`GRPC_EXPERIMENTS`: the EventEngine's client and listener off;
  grpcio 1.85 turns them on). Under the EventEngine a message is read by a thread of its own and
  handed to the poller thread that wakes the asyncio loop; under iomgr the poller reads it: a
  thread hand-off less per message, and a scheduler worker and an executor make one per step.
  In a microbenchmark (16 bidirectional grpc.aio streams on loopback, 1.5 kB one way and 300 bytes
  back, both stacks interleaved) a round trip cost the client 137-155 us of CPU instead of
  174-186, the server 124-144 instead of 161-178: about 5% of a scale-bench worker's CPU per
  step, within that bench's spread on 2 cores. A grpcio that no longer knows these experiments
  logs "Unknown experiment" once and runs its default.
"""

from __future__ import annotations

import os

GRPC_FORK_SUPPORT_ENV = "GRPC_ENABLE_FORK_SUPPORT"
GRPC_EXPERIMENTS_ENV = "GRPC_EXPERIMENTS"
# gRPC core's clients and servers on the iomgr stack rather than the EventEngine (see above).
GRPC_IO_EXPERIMENTS = "-event_engine_client,-event_engine_listener"


def set_grpc_environment() -> None:
    """Before gRPC starts in this process (and so in its children, which inherit it)."""
    os.environ.setdefault(GRPC_FORK_SUPPORT_ENV, "0")
    os.environ.setdefault(GRPC_EXPERIMENTS_ENV, GRPC_IO_EXPERIMENTS)
