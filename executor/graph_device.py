"""The graph API of a device family: ``torch.npu`` (ACL graphs) or ``torch.cuda`` (CUDA graphs).

Both follow torch.cuda's: a graph object, a ``graph(g, pool=...)`` context manager that captures
into it, ``graph_pool_handle()`` for a pool several graphs share, and ``memory_reserved()``,
whose growth over the captures is what the pool holds. The emulated NPU implements the same
calls (`npuserve.kernels.npu_emulation.graphs`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch


class DeviceGraph(Protocol):
    """``torch.npu.NPUGraph`` / ``torch.cuda.CUDAGraph``: what npuserve calls of one."""

    def replay(self) -> None: ...


class GraphDevice:
    """Captures on one device family; ``kind`` is "npu" or "cuda"."""

    def __init__(self, kind: str) -> None:
        assert kind in ("npu", "cuda"), kind
        self.kind = kind
        self.module: Any = getattr(torch, kind)

    def new_graph(self) -> DeviceGraph:
        graph: DeviceGraph = self.module.NPUGraph() if self.kind == "npu" else self.module.CUDAGraph()
        return graph

    def pool_handle(self) -> object:
        return self.module.graph_pool_handle()

    def capture(self, graph: DeviceGraph, pool: object) -> AbstractContextManager[Any]:
        """Captures the work queued inside the block into ``graph``, its memory from ``pool``."""
        context: AbstractContextManager[Any] = self.module.graph(graph, pool=pool)
        return context

    def memory_reserved(self) -> int:
        return int(self.module.memory_reserved())

    def synchronize(self) -> None:
        self.module.synchronize()
