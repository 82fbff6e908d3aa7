"""The host-memory tier of the paged KV cache (`--kv-host-memory`, vLLM's --kv-offloading-size).

Host blocks have the device blocks' layout, one ``[2, num_host_blocks, block_size, Hkv, D]``
tensor per layer in host memory. The scheduler decides what they hold (`scheduler.core.host_tier`);
this executor runs the copies a step's plan lists (`StepPlan.block_copies`), in order, before
anything else of the step: each run of consecutive copies in one direction is one gather and one
scatter per layer. The copies wait for the device: a step with copies waits for them (a step
without pays nothing).
"""

from __future__ import annotations

from itertools import groupby

import torch

from npuserve.executor.transfer_tally import TransferTally
from npuserve.proto.plan_checks import check_block_copies
from npuserve.proto.step_plan import KV_TRANSFER_HOST_TIER, BlockCopy

GIB = 1 << 30


class HostKvTier:
    def __init__(self, kv_caches: list[torch.Tensor], num_blocks: int) -> None:
        """kv_caches: the device cache, [2, num_device_blocks, block_size, Hkv, D] per layer."""
        self.num_blocks = num_blocks
        self.block_bytes = sum(cache[:, 0].numel() * cache.element_size() for cache in kv_caches)
        self.tally = TransferTally(KV_TRANSFER_HOST_TIER)
        self.layers = [
            torch.zeros(
                (cache.shape[0], num_blocks, *cache.shape[2:]), dtype=cache.dtype
            )  # [2, H, bs, Hkv, D]
            for cache in kv_caches
        ]

    @classmethod
    def for_budget(cls, budget_gib: float, kv_caches: list[torch.Tensor], block_bytes: int) -> HostKvTier:
        """As many host blocks as ``budget_gib`` holds (``block_bytes``: one block, every layer)."""
        return cls(kv_caches, max(1, int(budget_gib * GIB) // block_bytes))

    def run(self, copies: list[BlockCopy], kv_caches: list[torch.Tensor], num_device_blocks: int) -> None:
        """Runs ``copies`` in order (a `PlanError` for an id out of range, before any copy)."""
        check_block_copies(copies, num_device_blocks, self.num_blocks)
        with self.tally.timed():
            for to_host, run in groupby(copies, key=lambda copy: copy.to_host):
                pairs = list(run)
                src = torch.tensor([copy.src for copy in pairs], dtype=torch.int64)  # [n]
                dst = torch.tensor([copy.dst for copy in pairs], dtype=torch.int64)  # [n]
                for cache, host in zip(kv_caches, self.layers, strict=True):
                    if to_host:
                        blocks = cache.index_select(1, src.to(cache.device)).cpu()  # [2, n, bs, Hkv, D]
                        host.index_copy_(1, dst, blocks)
                    else:
                        blocks = host.index_select(1, src).to(cache.device)  # [2, n, bs, Hkv, D]
                        cache.index_copy_(1, dst.to(cache.device), blocks)
        self.tally.num_bytes += len(copies) * self.block_bytes
