"""Ranks 1..N-1 of a single-node tensor-parallel group, started by its rank 0.

``npuserve executor --tensor-parallel-size N`` (without ``--tp-rank``) is rank 0; it starts the
others as its children: the same Python running ``npuserve executor --tp-rank r`` with rank 0's
rendezvous address, each pinned to one device of this node (ASCEND_RT_VISIBLE_DEVICES /
CUDA_VISIBLE_DEVICES). `npuserve executor` hands `LocalRanks` to the executor
(`npuserve.executor.parallel.start_tensor_parallel`), which calls it once the rendezvous listens.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING

import structlog

from npuserve.deploy.executor_flags import EXECUTOR, PARALLEL, TP_RANK_ENV
from npuserve.deploy.launcher import Launcher
from npuserve.executor.parallel_config import VISIBLE_DEVICES_ENV

if TYPE_CHECKING:
    import torch

    from npuserve.executor.config import ExecutorConfig
    from npuserve.executor.parallel_config import ParallelConfig

log = structlog.get_logger(__name__)


class LocalRanks:
    """Ranks 1..N-1 as child processes of rank 0, each pinned to one device of this node
    (`npuserve.executor.parallel.RankProcesses`)."""

    def __init__(
        self, config: ExecutorConfig, parallel: ParallelConfig, device: torch.device, host: str, port: int
    ) -> None:
        variable = VISIBLE_DEVICES_ENV.get(device.type)
        visible = os.environ.get(variable or "", "")
        devices = [d for d in visible.split(",") if d] or [str(i) for i in range(parallel.size)]
        self.launcher = Launcher()
        for rank in range(1, parallel.size):
            rank_config = replace(parallel, rank=rank, master_addr=host, master_port=port)
            args = [
                "executor",
                *EXECUTOR.to_flags(config),
                *PARALLEL.to_flags(rank_config),
                *parallel.worker_flags,
            ]
            env = {variable: devices[rank]} if variable is not None else {}
            env[TP_RANK_ENV] = ""  # NOTE: the rank is in the flags; an inherited one must not count
            # NOTE: a process group of their own: a terminal's Ctrl-C reaches rank 0, which stops them.
            child = self.launcher.start(f"rank-{rank}", args, env, ready_file=False, own_process_group=True)
            log.info("tensor-parallel rank started", rank=rank, pid=child.pid)

    def exited(self) -> str | None:
        """Why a started rank is gone, or None while all run."""
        return self.launcher.first_exited()

    def stop(self, grace_s: float) -> None:
        """Waits ``grace_s`` for the ranks to exit (they were told to stop), then SIGTERM, then
        SIGKILL."""
        self.launcher.wait_exit(grace_s)
        self.launcher.stop(grace_s=5.0)
