"""The emulated ``torch.npu`` graph calls around a capture: task groups and their updates
(``graph_task_group_begin/end``, ``graph_task_update_begin/end``) and ``ExternalEvent``, as
vllm-ascend's ``acl_graph.py`` uses them. The capture and replay they act on are `graphs`'."""

from __future__ import annotations

from dataclasses import dataclass

from npuserve.kernels.npu_emulation.graphs import (
    GraphCaptureError,
    GraphReplayError,
    TaskGroupHandle,
    _capture,
    _local,
    _Update,
    capturing,
)


def graph_task_group_begin(stream: object = None) -> None:
    capture = _capture()
    if capture is None:
        raise GraphCaptureError("graph_task_group_begin outside a capture")
    if capture.group is not None:
        raise GraphCaptureError("graph_task_group_begin inside an open task group")
    capture.group = TaskGroupHandle()


def graph_task_group_end(stream: object = None) -> TaskGroupHandle:
    capture = _capture()
    if capture is None or capture.group is None:
        raise GraphCaptureError("graph_task_group_end without graph_task_group_begin")
    handle, capture.group = capture.group, None
    if not handle.tasks:
        raise GraphCaptureError("an empty task group: no operator ran between its begin and end")
    capture.graph._groups.append(handle)
    return handle


def graph_task_update_begin(stream: object, handle: TaskGroupHandle) -> None:
    if capturing():
        raise GraphCaptureError("graph_task_update_begin while capturing")
    if getattr(_local, "update", None) is not None:
        raise GraphCaptureError("graph_task_update_begin inside an open update")
    _local.update = _Update(handle)


def graph_task_update_end(stream: object = None) -> None:
    update = getattr(_local, "update", None)
    if update is None:
        raise GraphCaptureError("graph_task_update_end without graph_task_update_begin")
    _local.update = None
    if update.num_updated != len(update.handle.tasks):
        raise GraphCaptureError(
            f"a task update gave {update.num_updated} of its group's {len(update.handle.tasks)} operators"
        )
    update.handle.updated = True


@dataclass(slots=True)
class _EventTask:
    """A captured ``ExternalEvent.wait`` (``reset`` False) or ``reset``."""

    event: ExternalEvent
    reset: bool

    def run(self) -> None:
        if self.reset:
            self.event.recorded = False
        elif not self.event.recorded:
            raise GraphReplayError(
                "the graph waits on an ExternalEvent that was not recorded since the last replay: "
                "on a device the replay would hang (update the captured tasks, then record the event)"
            )


class ExternalEvent:
    """``torch.npu.ExternalEvent``: captured ``wait``/``reset`` make a replay wait until
    ``record`` (outside the graph, on the update stream), then re-arm for the next replay."""

    def __init__(self) -> None:
        self.recorded = False

    def wait(self, stream: object = None) -> None:
        capture = _capture()
        if capture is not None:
            capture.add(_EventTask(self, reset=False))

    def reset(self, stream: object = None) -> None:
        capture = _capture()
        if capture is not None:
            capture.add(_EventTask(self, reset=True))
        else:
            self.recorded = False

    def record(self, stream: object = None) -> None:
        if capturing():
            raise GraphCaptureError("ExternalEvent.record while capturing: record it on the update stream")
        self.recorded = True
