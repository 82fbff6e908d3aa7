"""A tensor-parallel group's configuration, and the checks that run before any weight is loaded.

`ParallelConfig` is this process's part of a group (size, rank, rank 0's address, the rendezvous
and collective timeouts), from the command line and environment, validated as it is built. `check_model_split`
refuses a group size that does not split the model's heads and MLP evenly, and `check_devices` a
single-node group that needs more devices than the node shows (`VISIBLE_DEVICES_ENV`: the
variable that pins a process to its devices). `npuserve.executor.parallel` runs the group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from npuserve.executor.config import ConfigError, ModelConfig
from npuserve.executor.parallel_defaults import DEFAULT_DISTRIBUTED_TIMEOUT_S, DEFAULT_TP_CONNECT_TIMEOUT_S

VISIBLE_DEVICES_ENV = {"npu": "ASCEND_RT_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES"}


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """This process's part of a tensor-parallel group, from the command line and environment."""

    size: int = 1
    rank: int | None = None  # None: rank 0, which starts ranks 1..size-1 on this node
    master_addr: str | None = None
    master_port: int | None = None
    connect_timeout_s: float = DEFAULT_TP_CONNECT_TIMEOUT_S  # the rendezvous
    collective_timeout_s: float = DEFAULT_DISTRIBUTED_TIMEOUT_S  # each collective, once formed
    worker_flags: tuple[str, ...] = ()  # extra flags for the ranks this process starts

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ConfigError(f"--tensor-parallel-size must be >= 1, got {self.size}")
        if self.rank is not None and not 0 <= self.rank < self.size:
            raise ConfigError(
                f"--tp-rank {self.rank} is outside 0..{self.size - 1} for --tensor-parallel-size {self.size}"
            )
        if self.connect_timeout_s <= 0:
            raise ConfigError(f"--tp-connect-timeout must be > 0 s, got {self.connect_timeout_s}")
        if self.collective_timeout_s <= 0:
            raise ConfigError(f"--distributed-timeout-seconds must be > 0, got {self.collective_timeout_s}")
        if self.master_port is not None and not 0 <= self.master_port < 65536:
            raise ConfigError(f"--master-port must be in 0..65535, got {self.master_port}")
        if self.rank is not None and self.size > 1 and (self.master_addr is None or not self.master_port):
            raise ConfigError(
                f"--tp-rank {self.rank} joins a group started elsewhere and needs rank 0's address: "
                "pass --master-addr and --master-port (or set MASTER_ADDR and MASTER_PORT), the same "
                "on every rank; omit --tp-rank to start all ranks on this node"
            )

    @property
    def this_rank(self) -> int:
        return self.rank or 0

    @property
    def starts_ranks(self) -> bool:
        """Rank 0 of a single-node group: it starts the other ranks itself."""
        return self.rank is None and self.size > 1


def check_model_split(model: ModelConfig, size: int) -> None:
    """ConfigError unless ``size`` ranks can split the model's heads and MLP evenly."""
    if size == 1:
        return
    name = model.model_dir.name
    divisors = [n for n in range(1, model.num_heads + 1) if model.num_heads % n == 0]
    fix = f"choose a --tensor-parallel-size in {divisors}"
    if model.num_heads % size:
        raise ConfigError(
            f"--tensor-parallel-size {size} does not divide num_attention_heads ({model.num_heads}) "
            f"of {name}: {fix}"
        )
    kv = model.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        raise ConfigError(
            f"--tensor-parallel-size {size} and num_key_value_heads ({kv}) of {name}: the size must "
            f"divide the KV heads or be a multiple of them (KV heads are then replicated); {fix}"
        )
    if model.intermediate_size % size:
        raise ConfigError(
            f"--tensor-parallel-size {size} does not divide intermediate_size "
            f"({model.intermediate_size}) of {name}: {fix}"
        )


def device_count(device: torch.device) -> int:
    """Devices of ``device``'s type this process sees (1 for the CPU: ranks share it)."""
    module = getattr(torch, device.type, None) if device.type in VISIBLE_DEVICES_ENV else None
    return int(module.device_count()) if module is not None else 1


def check_devices(device: torch.device, size: int) -> None:
    """ConfigError when a single-node group needs more devices than this node shows."""
    count = device_count(device)
    if device.type in VISIBLE_DEVICES_ENV and size > count:
        variable = VISIBLE_DEVICES_ENV[device.type]
        raise ConfigError(
            f"--tensor-parallel-size {size} needs {size} {device.type} devices on this node but "
            f"{count} are visible ({variable}={os.environ.get(variable)!r}); lower "
            f"--tensor-parallel-size, make more devices visible, or spread the ranks over nodes "
            "with --tp-rank/--master-addr/--master-port"
        )
