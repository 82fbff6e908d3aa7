"""gRPC's environment in npuserve's processes: set before gRPC starts in a process, inherited
by every process it starts. An operator's own setting of either variable is kept.

* No fork handlers (`GRPC_ENABLE_FORK_SUPPORT=0`): gRPC's own fork handlers restart its pollers
  in a forked child, where they can die on the file descriptors `close_fds` closes before exec
  (SIGABRT, "epoll_wait error: Bad file descriptor": 2 of 1,500 launches with threads in gRPC
  calls).
  npuserve never uses gRPC across a fork (children exec, or are spawned).
* gRPC core's older I/O stack for clients and servers (`GRPC_EXPERIMENTS`, the EventEngine's
  client and listener turned off; grpcio 1.85 turns them on by default). Under the EventEngine a
  message that arrives on a stream is read by a thread of its own and handed to the poller
  thread that wakes the asyncio loop; under iomgr the poller thread reads it itself: a thread
  hand-off (a lock, a wake-up, the GIL) less per message.
  A scheduler worker makes such a round trip per step of every executor it drives, and an
  executor one per step. In a microbenchmark (16 bidirectional grpc.aio streams on loopback, a
  1.5 kB message one way and 300 bytes back; both variants run at once, three times, so that
  they share the machine's state) a round trip cost the client 137-155 us of CPU instead of
  174-186 us, and the server 124-144 us instead of 161-178 us. In the scale bench that is about
  5% of a worker's CPU per step at 16 executors x 256 streams, less than the bench's
  run-to-run spread on a 2-core machine: it did not show there. A grpcio that no
  longer knows these experiments logs "Unknown experiment" once and runs its default.
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
