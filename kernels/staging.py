"""Host staging: how a step's inputs reach the device.

A step's inputs (token ids, positions, block tables, slot mappings, lengths) are built on the host
as numpy arrays. An asynchronous host-to-device copy must start from pinned (page-locked) memory:
torch_npu enqueues a non-blocking copy from pageable memory with the raw host pointer and no
host-allocator event, so a temporary that is freed and reused before the copy runs lands on the
device as a corrupted block table (wrong tokens, or an AICore error, now and then). vllm-ascend
pins before every such copy (``attention_v1.py``); npuserve keeps one persistent pinned buffer per
input instead, reused across steps and grown when a step needs more (`HostStaging`).

Reuse is safe because each buffer's last copy is followed by an event, and a buffer is written
again only once that event has completed. A step's end synchronizes anyway (its sampled tokens
come to the host), so the wait costs nothing in steady state; it guards the steps that sample
nothing (a chunked prefill).

On the CPU a "copy to the device" is no copy at all: the arrays are handed over as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

# NOTE: torch dtypes of the inputs a step uploads, and the numpy dtype their host arrays take.
NUMPY_DTYPES: dict[torch.dtype, type[np.generic]] = {
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.float32: np.float32,
    torch.bool: np.bool_,
}


class CopyEvent(Protocol):
    """A device event: done once the work queued before `record` has run."""

    def record(self) -> None: ...

    def synchronize(self) -> None: ...


class HostTransfers(Protocol):
    """Pinned host memory and the asynchronous copies out of it, for one device family."""

    def empty_pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """[numel] pinned host memory."""

    def copy_to_device(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """Queues ``target.copy_(source)`` without waiting; ``source`` must be pinned."""

    def copy_to_host(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """Queues ``target.copy_(source)`` from the device without waiting; ``target`` must be
        pinned (and is read only once the device's stream has run the copy)."""

    def new_event(self) -> CopyEvent: ...


class DeviceTransfers:
    """Pinned memory and copies on a real accelerator (``torch.cuda`` or ``torch.npu``): torch's
    pinned allocator belongs to the accelerator torch was built (or torch_npu extends it) for."""

    def __init__(self, device_module: object) -> None:
        self.device_module = device_module  # torch.cuda or torch.npu: its Event type

    def empty_pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def copy_to_device(self, target: torch.Tensor, source: torch.Tensor) -> None:
        assert source.is_pinned(), "a non-blocking host-to-device copy must start from pinned memory"
        target.copy_(source, non_blocking=True)

    def copy_to_host(self, target: torch.Tensor, source: torch.Tensor) -> None:
        assert target.is_pinned(), "a non-blocking device-to-host copy must land in pinned memory"
        target.copy_(source, non_blocking=True)

    def new_event(self) -> CopyEvent:
        return self.device_module.Event()  # type: ignore[attr-defined]


@dataclass(slots=True)
class _Buffer:
    host: torch.Tensor  # [capacity] pinned
    device: torch.Tensor | None  # [capacity] the device twin (`to_device`), made on first use
    copied: CopyEvent | None = None  # recorded after the last copy out of ``host``


class HostStaging:
    """One persistent pinned host buffer per named input of a step (``"block_table"``, ...).

    `to_device` copies an array through its buffer into a persistent device buffer of the same
    name and returns a view of it; `copy_into` copies through the buffer into a device tensor the
    caller owns (a captured graph's static input). A name is one input: it is written once per
    forward pass. ``transfers`` None: the device is the host (CPU), and arrays go over as they are.
    """

    def __init__(self, transfers: HostTransfers | None, device: torch.device) -> None:
        self.transfers = transfers
        self.device = device
        self._buffers: dict[str, _Buffer] = {}

    def to_device(self, name: str, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """``array`` (any shape) as a device tensor of ``dtype`` (a view of buffer ``name``)."""
        if self.transfers is None:
            return torch.from_numpy(np.ascontiguousarray(array, dtype=NUMPY_DTYPES[dtype]))
        buffer = self._stage(name, array, dtype)
        if buffer.device is None or buffer.device.numel() < buffer.host.numel():
            buffer.device = torch.empty(buffer.host.numel(), dtype=dtype, device=self.device)
        target = buffer.device[: array.size]
        self._copy(buffer, target, array.size)
        return target.view(array.shape)

    def copy_into(self, target: torch.Tensor, name: str, array: np.ndarray) -> None:
        """``target[...] = array`` through buffer ``name``; shapes must match (``target``
        contiguous)."""
        assert tuple(target.shape) == array.shape and target.is_contiguous(), (target.shape, array.shape)
        if self.transfers is None:
            target.copy_(torch.from_numpy(np.ascontiguousarray(array, dtype=NUMPY_DTYPES[target.dtype])))
            return
        buffer = self._stage(name, array, target.dtype)
        self._copy(buffer, target.view(-1), array.size)

    def pinned_buffers(self) -> dict[str, torch.Tensor]:
        """The host buffer of each name (for tests and accounting)."""
        return {name: buffer.host for name, buffer in self._buffers.items()}

    def _stage(self, name: str, array: np.ndarray, dtype: torch.dtype) -> _Buffer:
        """Buffer ``name`` (grown to hold ``array``), holding ``array`` in its first elements."""
        assert self.transfers is not None
        buffer = self._buffers.get(name)
        if buffer is not None and buffer.host.dtype != dtype:
            raise ValueError(f"staging buffer {name!r} holds {buffer.host.dtype}, not {dtype}")
        if buffer is None or buffer.host.numel() < array.size:
            # NOTE: doubling, so a step that grows a little at a time reallocates rarely; the old
            # buffer's copies are ordered before the new one's on the stream.
            capacity = max(array.size, 2 * buffer.host.numel() if buffer is not None else 0, 1)
            buffer = _Buffer(self.transfers.empty_pinned(capacity, dtype), None)
            self._buffers[name] = buffer
        elif buffer.copied is not None:
            buffer.copied.synchronize()  # the last copy out of it has run: it may be written again
        host = buffer.host[: array.size].numpy()
        host[...] = array.reshape(-1)
        return buffer

    def _copy(self, buffer: _Buffer, target: torch.Tensor, numel: int) -> None:
        assert self.transfers is not None
        self.transfers.copy_to_device(target, buffer.host[:numel])
        if buffer.copied is None:
            buffer.copied = self.transfers.new_event()
        buffer.copied.record()
