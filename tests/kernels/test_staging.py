"""Host staging: a step's inputs reach the device through persistent pinned buffers, reused
across steps and grown when a step needs more, and the copy race cannot happen: the emulated NPU
refuses a non-blocking copy from pageable memory (as the device would corrupt it), and a buffer
is written again only once its last copy is done."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from npuserve.kernels import build_attention_metadata, slot_mapping
from npuserve.kernels.npu_emulation.host_memory import EmulatedHostMemory, UnpinnedCopyError
from npuserve.kernels.staging import HostStaging

CPU = torch.device("cpu")


def step_arrays(num_reqs: int, block_size: int = 16) -> tuple[np.ndarray, ...]:
    """query_lens, seq_lens, block_table, slot_mapping of ``num_reqs`` 3-token prefills."""
    query_lens = np.full(num_reqs, 3, dtype=np.int32)
    table = np.arange(1, num_reqs + 1, dtype=np.int32).reshape(num_reqs, 1)
    rows = np.repeat(np.arange(num_reqs), 3)
    positions = np.tile(np.arange(3), num_reqs)
    return query_lens, query_lens, table, slot_mapping(table, rows, positions, block_size)


def test_the_emulation_refuses_a_non_blocking_copy_from_pageable_memory() -> None:
    memory = EmulatedHostMemory()
    target = torch.zeros(4, dtype=torch.int32)
    pageable = torch.from_numpy(np.arange(4, dtype=np.int32))
    with pytest.raises(UnpinnedCopyError, match="pageable"):
        memory.copy_to_device(target, pageable)
    assert not target.any()
    pinned = memory.empty_pinned(8, torch.int32)
    pinned[:4] = pageable
    memory.copy_to_device(target, pinned[:4])
    assert torch.equal(target, pageable)
    assert memory.is_pinned(pinned[2:5]) and not memory.is_pinned(pageable)


def test_a_freed_pinned_buffer_is_pinned_no_more() -> None:
    memory = EmulatedHostMemory()
    pinned = memory.empty_pinned(4, torch.int64)
    view = pinned[:2]
    assert memory.is_pinned(view)
    del pinned, view
    assert not memory._pinned


def test_metadata_reaches_the_device_only_through_pinned_buffers_reused_across_steps() -> None:
    memory = EmulatedHostMemory()
    staging = HostStaging(memory, CPU)
    first = build_attention_metadata(*step_arrays(2), 16, CPU, staging)
    buffers = {name: tensor.data_ptr() for name, tensor in staging.pinned_buffers().items()}
    assert set(buffers) == {"query_start_loc", "seq_lens", "block_table", "slot_mapping"}
    assert all(memory.is_pinned(t) for t in staging.pinned_buffers().values())
    assert memory.num_copies == 4
    assert first.slot_mapping.tolist() == [16, 17, 18, 32, 33, 34]

    # A smaller step reuses every buffer; a larger one grows those that need it.
    second = build_attention_metadata(*step_arrays(1), 16, CPU, staging)
    assert {n: t.data_ptr() for n, t in staging.pinned_buffers().items()} == buffers
    assert second.slot_mapping.tolist() == [16, 17, 18] and second.seq_lens.tolist() == [3]
    third = build_attention_metadata(*step_arrays(5), 16, CPU, staging)
    grown = {n: t.data_ptr() for n, t in staging.pinned_buffers().items()}
    assert grown["slot_mapping"] != buffers["slot_mapping"] and grown["block_table"] != buffers["block_table"]
    assert third.block_table[:, 0].tolist() == [1, 2, 3, 4, 5]
    assert memory.num_copies == 12
    # The device tensors are the device's, not views of the host buffers.
    host = staging.pinned_buffers()["slot_mapping"]
    assert third.slot_mapping.data_ptr() != host.data_ptr()


class RecordingTransfers:
    """Pinned memory and copies that log what happens, in order."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.memory = EmulatedHostMemory()

    def empty_pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.memory.empty_pinned(numel, dtype)

    def copy_to_device(self, target: torch.Tensor, source: torch.Tensor) -> None:
        self.log.append(f"copy {source.tolist()}")
        self.memory.copy_to_device(target, source)

    def copy_to_host(self, target: torch.Tensor, source: torch.Tensor) -> None:
        self.memory.copy_to_host(target, source)

    def new_event(self) -> RecordingEvent:
        return RecordingEvent(self.log)


class RecordingEvent:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def record(self) -> None:
        self.log.append("record")

    def synchronize(self) -> None:
        self.log.append("wait")


def test_a_buffer_is_written_again_only_after_its_last_copy_is_done() -> None:
    transfers = RecordingTransfers()
    staging = HostStaging(transfers, CPU)
    target = torch.zeros(3, dtype=torch.int64)
    staging.copy_into(target, "positions", np.array([1, 2, 3]))
    staging.copy_into(target, "positions", np.array([4, 5, 6]))
    assert transfers.log == ["copy [1, 2, 3]", "record", "wait", "copy [4, 5, 6]", "record"]
    assert target.tolist() == [4, 5, 6]


def test_on_the_cpu_arrays_go_over_as_they_are() -> None:
    staging = HostStaging(None, CPU)
    array = np.arange(6, dtype=np.int32).reshape(2, 3)
    tensor = staging.to_device("block_table", array, torch.int32)
    assert tensor.data_ptr() == array.ctypes.data and not staging.pinned_buffers()
