"""Host memory as the emulated NPU sees it: pinned buffers, and copies to the device out of them.

The emulation keeps "device" tensors in host memory, so torch cannot tell a host-to-device copy
from any other, and torch's CPU build has no pinned allocator (``pin_memory=True`` raises without
an accelerator). The emulation therefore models both itself: `EmulatedHostMemory.empty_pinned`
hands out host buffers it remembers as page-locked, and `copy_to_device` refuses a copy from any
other memory, as the device would corrupt it: torch_npu enqueues a non-blocking copy from
pageable memory with the raw host pointer, and nothing keeps that memory from being freed and
reused before the copy runs (Ascend/pytorch ``CopyKernel``: only pinned memory gets a
host-allocator event). The real path (`npuserve.kernels.staging.DeviceTransfers`) asserts the same
rule with ``Tensor.is_pinned``.
"""

from __future__ import annotations

import threading
import weakref

import torch

from npuserve.kernels.npu_emulation import contracts, graphs


class UnpinnedCopyError(contracts.OpContractError):
    """A non-blocking host-to-device copy from pageable memory: a race on a device."""


class PinnedAllocationInCapture(graphs.GraphCaptureError):
    """Pinned host memory allocated while a graph captures."""


class _CopyDone:
    """The event after an emulated copy: the emulation copies at once, so it is always done."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class EmulatedHostMemory:
    """The emulated machine's pinned host memory, and its host-to-device copies."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pinned: dict[int, int] = {}  # first byte -> bytes, of every live pinned buffer
        self.num_copies = 0  # host-to-device copies made (tests read it)
        self.num_copies_to_host = 0  # device-to-host copies made

    def empty_pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """[numel] host memory the emulation treats as pinned until the tensor is freed."""
        if graphs.capturing():
            raise PinnedAllocationInCapture(
                "pinned host memory allocated while a graph captures: the allocation is outside the "
                "graph's pool and cannot be replayed; stage inputs before capturing"
            )
        tensor = torch.empty(numel, dtype=dtype)
        start = tensor.untyped_storage().data_ptr()
        with self._lock:
            self._pinned[start] = tensor.untyped_storage().nbytes()
        weakref.finalize(tensor, self._unpin, start)
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether all of ``tensor``'s bytes lie in one live pinned buffer."""
        first = tensor.data_ptr()
        last = first + tensor.numel() * tensor.element_size()
        with self._lock:
            return any(start <= first and last <= start + size for start, size in self._pinned.items())

    def copy_to_device(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """``target.copy_(source, non_blocking=True)`` on the emulated NPU."""
        if not self.is_pinned(source):
            raise UnpinnedCopyError(
                "non-blocking host-to-device copy from pageable (unpinned) host memory: the device "
                "reads the host pointer when the copy runs, after the memory may have been freed and "
                "reused; copy from a pinned buffer (npuserve.kernels.staging.HostStaging) or block"
            )
        target.copy_(source)
        self.num_copies += 1

    def copy_to_host(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """``target.copy_(source, non_blocking=True)`` from the emulated NPU. Into pageable
        memory such a copy either waits for the device or races with the host, so the emulation
        refuses it: npuserve's copies out of the device land in pinned memory."""
        if not self.is_pinned(target):
            raise UnpinnedCopyError(
                "non-blocking device-to-host copy into pageable (unpinned) host memory: it would "
                "run synchronously; copy into a pinned buffer"
            )
        target.copy_(source)
        self.num_copies_to_host += 1

    def new_event(self) -> _CopyDone:
        return _CopyDone()

    def _unpin(self, start: int) -> None:
        with self._lock:
            self._pinned.pop(start, None)
