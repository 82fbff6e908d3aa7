"""The host-memory tier of the paged KV cache (`--kv-host-memory`, vLLM's --kv-offloading-size).

Each layer's host blocks are one ``[num_host_blocks, 2, block_size, Hkv, D]`` tensor in host
memory (pinned on an accelerator), block-major so that a run of consecutive host blocks is one
contiguous range. The scheduler decides what they hold (`scheduler.core.host_tier`, which hands
out host blocks in order, so a step's copies mostly form a few runs); this executor runs the
copies a step's plan lists (`StepPlan.block_copies`), in order, before anything else of the step.

Copies are batched and asynchronous. Each run of consecutive copies in one direction is, per
layer, one gather or scatter on the device (its block ids staged through pinned memory) and one
copy per run of consecutive host blocks: device -> pinned host for a spill, pinned host -> device
for a load. Every copy is queued on the device's stream without waiting, so the step's forward
pass is queued right behind them and the host never waits for a copy: stream order alone keeps a
spill's read of a device block before the step that overwrites it, and a load's read of a host
block after the spill that wrote it. Only the device touches the host blocks. On the CPU the
"device" is the host, and the copies run as they are issued.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import groupby
from math import prod

import numpy as np
import torch

from npuserve.executor.transfer_tally import TransferTally
from npuserve.kernels.staging import HostStaging
from npuserve.proto.plan_checks import check_block_copies
from npuserve.proto.step_plan import KV_TRANSFER_HOST_TIER, BlockCopy


def consecutive_runs(block_ids: list[int]) -> Iterator[tuple[int, int, int]]:
    """(position in ``block_ids``, first id, length) of each run of consecutive ids."""
    start = 0
    for position in range(1, len(block_ids) + 1):
        if position == len(block_ids) or block_ids[position] != block_ids[position - 1] + 1:
            yield start, block_ids[start], position - start
            start = position


class HostKvTier:
    def __init__(self, kv_caches: list[torch.Tensor], num_blocks: int, staging: HostStaging) -> None:
        """kv_caches: the device cache, [2, num_device_blocks, block_size, Hkv, D] per layer;
        ``staging``: the runner's pinned staging (its transfers None on the CPU)."""
        self.num_blocks = num_blocks
        self.staging = staging
        self.block_bytes = sum(cache[:, 0].numel() * cache.element_size() for cache in kv_caches)
        self.tally = TransferTally(KV_TRANSFER_HOST_TIER)
        transfers = staging.transfers
        self.layers: list[torch.Tensor] = []
        for cache in kv_caches:
            shape = (num_blocks, cache.shape[0], *cache.shape[2:])  # [H, 2, bs, Hkv, D]
            if transfers is None:
                self.layers.append(torch.zeros(shape, dtype=cache.dtype))
            else:
                self.layers.append(transfers.empty_pinned(prod(shape), cache.dtype).view(shape))

    def run(self, copies: list[BlockCopy], kv_caches: list[torch.Tensor], num_device_blocks: int) -> None:
        """Queues ``copies`` in order (a `PlanError` for an id out of range, before any copy)."""
        check_block_copies(copies, num_device_blocks, self.num_blocks)
        with self.tally.timed():
            for number, (to_host, run) in enumerate(groupby(copies, key=lambda copy: copy.to_host)):
                pairs = list(run)
                device_ids = [copy.src if to_host else copy.dst for copy in pairs]
                host_ids = [copy.dst if to_host else copy.src for copy in pairs]
                # NOTE: one staging buffer per run of the step: each is written once per step.
                index = np.asarray(device_ids, dtype=np.int64)
                device_index = self.staging.to_device(f"host_tier_{number}", index, torch.int64)  # [n]
                for cache, host in zip(kv_caches, self.layers, strict=True):
                    if to_host:
                        self._spill(cache, host, device_index, host_ids)
                    else:
                        self._load(cache, host, device_index, host_ids)
        self.tally.add(len(copies) * self.block_bytes)

    def _spill(
        self, cache: torch.Tensor, host: torch.Tensor, device_index: torch.Tensor, host_ids: list[int]
    ) -> None:
        """cache: [2, N, bs, Hkv, D]; host: [H, 2, bs, Hkv, D]; device_index: [n] device blocks
        copied to host blocks ``host_ids``."""
        blocks = cache.index_select(1, device_index).transpose(0, 1).contiguous()  # [n, 2, bs, Hkv, D]
        transfers = self.staging.transfers
        for position, first, count in consecutive_runs(host_ids):
            target = host[first : first + count]  # [count, 2, bs, Hkv, D], contiguous
            if transfers is None:
                target.copy_(blocks[position : position + count])
            else:
                transfers.copy_to_host(target, blocks[position : position + count])

    def _load(
        self, cache: torch.Tensor, host: torch.Tensor, device_index: torch.Tensor, host_ids: list[int]
    ) -> None:
        """cache: [2, N, bs, Hkv, D]; host: [H, 2, bs, Hkv, D]; host blocks ``host_ids`` copied
        to device blocks device_index: [n]."""
        transfers = self.staging.transfers
        if transfers is None:
            blocks = host[torch.tensor(host_ids, dtype=torch.int64)]  # [n, 2, bs, Hkv, D]
        else:
            blocks = torch.empty((len(host_ids), *host.shape[1:]), dtype=host.dtype, device=cache.device)
            for position, first, count in consecutive_runs(host_ids):
                transfers.copy_to_device(blocks[position : position + count], host[first : first + count])
        cache.index_copy_(1, device_index, blocks.transpose(0, 1))
