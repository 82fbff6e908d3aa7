"""A tensor-parallel group's rendezvous and process groups (`RankGroup`).

Rank 0 hosts a TCPStore at the master address; every rank announces itself there and waits for
the others within the connect timeout (a rank that does not come fails the group with an error
naming it). Then `torch.distributed` starts on this rank's device (`select_device`) with the
device's backend (`BACKENDS`: hccl on NPU, nccl on CUDA, gloo on CPU) and a gloo group carries
host metadata: rank 0's messages to the others (`send`, `receive`) and the KV shards that move
between executors (`send_to`, `gather_bytes`, ...: `kv_transfer_group`). Collectives of both
groups wait up to the collective timeout (``--distributed-timeout-seconds``), not the connect
timeout.
Start-up results (`agree_min`, `check_same`), start-up barriers (`barrier`) and start-up failures
(`post_failure`) travel through the store; a group that cannot form raises `TensorParallelError`.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import structlog
import torch
import torch.distributed as dist

from npuserve.executor.config import ConfigError
from npuserve.executor.layers import TensorParallel
from npuserve.executor.parallel_config import VISIBLE_DEVICES_ENV, ParallelConfig
from npuserve.executor.rank_messages import RankMessage

log = structlog.get_logger(__name__)

# How long ranks wait for each other to load weights and size the KV cache.
STARTUP_TIMEOUT_S = 3600.0
BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
_FAILED_KEY = "npuserve/failed"


class TensorParallelError(ConfigError):
    """The group could not form, or a rank failed while it started."""


class RankGroup:
    """Rendezvous, the device and gloo process groups, and rank 0's messages to the others."""

    def __init__(
        self,
        parallel: ParallelConfig,
        device: torch.device,
        store: dist.TCPStore,
        probe: Callable[[], str | None] = lambda: None,
    ) -> None:
        """Joins the group through ``store``; ``probe`` reports a failure seen elsewhere (a
        started rank that exited) while this rank waits."""
        self.parallel = parallel
        self.rank, self.size = parallel.this_rank, parallel.size
        self.tp = TensorParallel(self.rank, self.size)
        self.store = store
        self.probe = probe
        self.timeout = timedelta(seconds=parallel.collective_timeout_s)
        self.share("joined", socket.gethostname(), parallel.connect_timeout_s, "join the group")
        backend = BACKENDS[device.type]
        select_device(device)
        try:
            dist.init_process_group(
                backend,
                store=dist.PrefixStore("npuserve/pg", store),
                rank=self.rank,
                world_size=self.size,
                timeout=self.timeout,
            )
            # NOTE: on CPU the world group is gloo already; on devices host metadata gets its own.
            self.meta_group = (
                None if backend == "gloo" else dist.new_group(backend="gloo", timeout=self.timeout)
            )
            self.tp.all_reduce(torch.ones(1, device=device))  # forms the device communicator now
        except Exception as exc:
            raise TensorParallelError(
                f"rank {self.rank}: the {backend} process group did not form ({exc}); between nodes "
                "check GLOO_SOCKET_IFNAME, HCCL_IF_IP / HCCL_SOCKET_IFNAME and the firewall"
            ) from exc
        log.info("tensor-parallel group formed", rank=self.rank, size=self.size, backend=backend)

    @classmethod
    def connect_store(cls, parallel: ParallelConfig, host: str, port: int) -> dist.TCPStore:
        """Rank 0 listens (port 0: a free one), the others connect, within the connect timeout."""
        rank, timeout = parallel.this_rank, parallel.connect_timeout_s
        try:
            return dist.TCPStore(
                host,
                port,
                parallel.size,
                is_master=rank == 0,
                timeout=timedelta(seconds=timeout),
                wait_for_workers=False,
            )
        except Exception as exc:
            what = f"listen on {host}:{port}" if rank == 0 else f"reach rank 0 at {host}:{port}"
            raise TensorParallelError(
                f"tensor-parallel rank {rank} could not {what} within {timeout:g} s "
                f"(--tp-connect-timeout): {str(exc).rstrip('.')}; check that rank 0 runs and that "
                "--master-addr and --master-port are the same on every rank and reachable from this node"
            ) from exc

    def share(self, name: str, value: str, timeout_s: float, what: str) -> list[str]:
        """Sets this rank's ``value`` of ``name`` and waits until every rank has set its own;
        returns their values in rank order."""
        self.store.set(f"npuserve/{name}/{self.rank}", value)
        keys = [f"npuserve/{name}/{rank}" for rank in range(self.size)]
        deadline = time.monotonic() + timeout_s
        try:
            while not self.store.check(keys):
                failure = self.probe() or (
                    self.store.get(_FAILED_KEY).decode() if self.store.check([_FAILED_KEY]) else None
                )
                if failure:
                    raise TensorParallelError(f"tensor-parallel group failed to start: {failure}")
                if time.monotonic() > deadline:
                    missing = [rank for rank, key in enumerate(keys) if not self.store.check([key])]
                    flag = " (--tp-connect-timeout)" if timeout_s == self.parallel.connect_timeout_s else ""
                    raise TensorParallelError(
                        f"tensor-parallel ranks {missing} of {self.size} did not {what} within "
                        f"{timeout_s:g} s{flag}; start each with --tensor-parallel-size "
                        f"{self.size} --tp-rank R and rank 0's --master-addr/--master-port, or raise "
                        "the timeout"
                    )
                time.sleep(0.05)
            return [self.store.get(key).decode() for key in keys]
        except TensorParallelError:
            raise
        except Exception as exc:  # the store lives in rank 0: it is gone
            raise TensorParallelError(
                f"tensor-parallel rank {self.rank} lost rank 0 while waiting to {what}: {exc}"
            ) from exc

    def check_same(self, name: str, value: str) -> None:
        """TensorParallelError unless every rank reports the same ``value`` as rank 0."""
        values = self.share(name, value, self.parallel.connect_timeout_s, f"report {name}")
        differ = [rank for rank, other in enumerate(values) if other != values[0]]
        if differ:
            raise TensorParallelError(
                f"tensor-parallel ranks {differ} run with other {name} than rank 0 ({values[differ[0]]} "
                f"against {values[0]}); start every rank with the same executor flags and model"
            )

    def barrier(self, name: str, what: str) -> None:
        """Waits until every rank has reached ``name`` (start-up only: it waits through the store,
        up to the start-up timeout, and a rank that failed meanwhile is named)."""
        self.share(name, "done", STARTUP_TIMEOUT_S, what)

    def agree_min(self, name: str, value: int) -> int:
        """The smallest ``value`` over the ranks (start-up only: it waits through the store)."""
        return min(int(v) for v in self.share(name, str(value), STARTUP_TIMEOUT_S, f"report {name}"))

    def send(self, message: RankMessage) -> None:
        """Rank 0: one message to every other rank."""
        dist.broadcast_object_list([message], src=0, group=self.meta_group)

    def receive(self) -> RankMessage:
        """Ranks >= 1: rank 0's next message (waits at most the collective timeout)."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.meta_group)
        return box[0]

    # NOTE: the exchanges below run inside a step or a message of rank 0's, on every rank alike.

    def send_to(self, rank: int, value: Any) -> None:
        """Rank 0: ``value`` to ``rank`` alone (it calls `receive_from_leader`)."""
        dist.send_object_list([value], dst=rank, group=self.meta_group)

    def receive_from_leader(self) -> Any:
        """Ranks >= 1: what rank 0 sent this rank with `send_to`."""
        box: list[Any] = [None]
        dist.recv_object_list(box, src=0, group=self.meta_group)
        return box[0]

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank."""
        values: list[Any] = [None] * self.size
        dist.all_gather_object(values, value, group=self.meta_group)
        return values

    def gather_bytes(self, data: torch.Tensor) -> list[torch.Tensor]:
        """data: [n] uint8 on the host, as long on every rank -> every rank's, in rank order, on
        rank 0 (an empty list elsewhere)."""
        gathered = [torch.empty_like(data) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(data, gathered, dst=0, group=self.meta_group)
        return gathered or []

    def close(self) -> None:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def select_device(device: torch.device) -> None:
    """Makes ``device`` this process's current device before its process group forms: hccl and
    nccl bind their communicator to the current device. ``--device npu:N`` is index N; a rank
    pinned to one device through `VISIBLE_DEVICES_ENV` sees it as index 0."""
    if device.type in VISIBLE_DEVICES_ENV:
        getattr(torch, device.type).set_device(device.index or 0)


def post_failure(store: dist.TCPStore, rank: int, message: str) -> None:
    """Tells the other ranks, waiting in `RankGroup.share`, why this rank cannot start."""
    with contextlib.suppress(Exception):
        store.set(_FAILED_KEY, f"rank {rank}: {message}")
