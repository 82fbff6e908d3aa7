"""ACL graphs on the emulated NPU: ``torch.npu.NPUGraph``, ``torch.npu.graph`` and the task calls.

What the emulation keeps of a real graph is its contract. Capture records the operations in
order, with the tensors they touch (every aten operator through a dispatch mode, every torch_npu
operator as one opaque task); replay runs them again against those same tensors, so a replay
reads its inputs only from the captured tensors, as a device's would. What breaks a capture on a
device is refused here, with the reason:

* a host sync while capturing (``Tensor.item``, ``.cpu``, ``.tolist``, ``.numpy``, an operator
  with a host result, a stream or device synchronize): the device cannot wait on the host inside
  a graph (CANN: "operation not permitted when stream is capturing");
* an allocation outside the graph's pool: a tensor made from host data, pinned host memory,
  a pool handle no ``graph_pool_handle`` made, or the fused attention's ``.out`` without its
  precomputed workspace (the operator would allocate one at replay);
* the fused attention captured without a task group, or a replay whose task groups (the
  attention's host-side lengths) were not updated since the last replay: the device would run
  the last step's lengths (vllm-ascend ``compilation/acl_graph.py``, ``attention_v1.py``:
  ``graph_task_group_begin/end`` at capture, ``graph_task_update_begin/end`` and an
  ``ExternalEvent`` before each replay);
* a replay that would wait on an ``ExternalEvent`` nobody recorded since the last (a hang).

Capture runs each operation once, on the capture's inputs, to get the tensors the Python code
goes on with; afterwards every floating-point tensor the capture allocated is filled with NaN,
as a device's capture leaves its outputs unwritten, so nothing may read them before a replay.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from npuserve.kernels.npu_emulation.contracts import OpContractError

aten = torch.ops.aten
# Tensor methods that bring device data to the host.
HOST_SYNC_METHODS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy}
# Allocations that hold no data yet: nothing to run again at replay.
ALLOCATIONS = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default}
_SCALAR_RESULTS = ("bool", "int", "float", "Scalar", "SymInt", "SymFloat", "SymBool")

_local = threading.local()
_pools: weakref.WeakSet[PoolHandle] = weakref.WeakSet()


class GraphCaptureError(OpContractError):
    """What a capture on a device refuses (or would record wrongly)."""


class GraphReplayError(OpContractError):
    """A replay a device would run wrongly, or never finish."""


def _capture() -> _Capture | None:
    return getattr(_local, "capture", None)


def capturing() -> bool:
    """Whether this thread is capturing a graph."""
    return _capture() is not None


def _tensors(tree: object) -> list[torch.Tensor]:
    """The tensors among the leaves of ``tree`` (an operator's arguments, or its result)."""
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _storages(tree: object) -> set[int]:
    """The storages of the tensors in ``tree``, by address."""
    return {t.untyped_storage().data_ptr() for t in _tensors(tree)}


# -- Tasks: what a graph runs at replay ------------------------------------------------------------


def _copy_results(outputs: list[torch.Tensor], result: object) -> None:
    fresh = _tensors(result)
    assert len(fresh) == len(outputs), (len(fresh), len(outputs))
    for captured, value in zip(outputs, fresh, strict=True):
        if captured.data_ptr() != value.data_ptr():
            captured.copy_(value)


@dataclass(slots=True)
class AtenTask:
    """One aten operator. ``kind``: ``functional`` (run, then copy into the captured results),
    ``mutating`` (writes its inputs in place: run), ``view`` or ``allocation`` (nothing to run:
    the captured tensor is the view or the memory), ``collective`` (a c10d operator: run, wait)."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[torch.Tensor]
    kind: str

    def run(self) -> None:
        if self.kind in ("view", "allocation"):
            return
        result = self.func(*self.args, **self.kwargs)
        if self.kind == "functional":
            _copy_results(self.outputs, result)
        elif self.kind == "collective":
            for item in tree_flatten(result)[0]:
                if hasattr(item, "wait") and not isinstance(item, torch.Tensor):
                    item.wait()


@dataclass(slots=True)
class OperatorTask:
    """One torch_npu operator, run as one task (it reads its tensors when it runs)."""

    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[torch.Tensor]

    def run(self) -> None:
        _copy_results(self.outputs, self.fn(*self.args, **self.kwargs))


@dataclass(eq=False)
class TaskGroupHandle:
    """``torch_npu._C._NPUTaskGroupHandle``: the tasks one ``graph_task_group_begin/end`` pair
    captured, whose arguments ``graph_task_update_begin/end`` may replace before a replay."""

    tasks: list[OperatorTask] = field(default_factory=list)
    updated: bool = False  # since the last replay


# -- Capture ---------------------------------------------------------------------------------------


@dataclass(eq=False)
class PoolHandle:
    """A graph memory pool (``graph_pool_handle()``): graphs captured into one may share memory."""

    bytes: int = 0  # what graphs captured into it allocated


class _Capture:
    """One capture in progress: the graph's tasks, the pool's tensors, and the modes that see them."""

    def __init__(self, graph: NPUGraph) -> None:
        self.graph = graph
        self.suspended = 0  # > 0 while a torch_npu operator runs: its insides are one task
        self.group: TaskGroupHandle | None = None
        self.pool_storages: dict[int, torch.Tensor] = {}  # storage data_ptr -> a tensor on it
        self.external_storages: set[int] = set()
        self._dispatch = _RecordingMode(self)
        self._functions = _HostSyncGuard(self)

    def __enter__(self) -> _Capture:
        self._functions.__enter__()
        self._dispatch.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._dispatch.__exit__(None, None, None)
        self._functions.__exit__(None, None, None)

    def add(self, task: Any) -> None:
        self.graph._tasks.append(task)
        if self.group is not None and isinstance(task, OperatorTask):
            self.group.tasks.append(task)

    @contextmanager
    def suspend(self) -> Iterator[None]:
        """Runs the block unrecorded and unguarded, with neither mode in the way (cheap guards:
        an operator's insides are thousands of small calls)."""
        self.suspended += 1
        try:
            with torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
                yield
        finally:
            self.suspended -= 1

    def note_inputs(self, input_storages: set[int]) -> None:
        self.external_storages |= input_storages - self.pool_storages.keys()

    def note_outputs(self, outputs: list[torch.Tensor]) -> None:
        """Outputs on storage no input had before: the pool's."""
        for tensor in outputs:
            ptr = tensor.untyped_storage().data_ptr()
            if ptr not in self.external_storages and ptr not in self.pool_storages:
                self.pool_storages[ptr] = tensor

    def record_operator(
        self,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        at_capture: Callable[..., Any] | None = None,
    ) -> Any:
        self.note_inputs(_storages((args, kwargs)))
        with self.suspend():
            result = (at_capture or fn)(*args, **kwargs)
        outputs = _tensors(result)
        self.note_outputs(outputs)
        self.add(OperatorTask(name, fn, args, kwargs, outputs))
        return result

    def poison(self) -> None:
        with torch.inference_mode():
            for tensor in self.pool_storages.values():
                if tensor.dtype.is_floating_point:
                    storage = tensor.untyped_storage()
                    whole = torch.empty(0, dtype=tensor.dtype).set_(
                        storage, 0, (storage.nbytes() // tensor.element_size(),), (1,)
                    )
                    whole.fill_(float("nan"))


def _task_kind(func: Any) -> str:
    if func in ALLOCATIONS:
        return "allocation"
    if func.namespace == "c10d":
        return "collective"
    schema = func._schema
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return "mutating"
    if any(r.alias_info is not None for r in schema.returns):
        return "view"
    return "functional"


class _RecordingMode(TorchDispatchMode):
    """Records every aten operator of the capture as a task (and runs it once)."""

    def __init__(self, capture: _Capture) -> None:
        super().__init__()
        self.capture = capture

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # NOTE: nothing here is ever compiled; wrapping `__torch_dispatch__` to skip dynamo
        # imports torch._dynamo, which takes seconds (torch.utils._python_dispatch).
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        capture = self.capture
        if capture.suspended:
            return func(*args, **kwargs)
        if func is aten.lift_fresh.default:
            raise GraphCaptureError(
                "a tensor made from host data while capturing: its allocation and host-to-device copy "
                "are outside the graph's pool and are not replayed; make it before capturing"
            )
        if any(str(r.type) in _SCALAR_RESULTS for r in func._schema.returns):
            raise GraphCaptureError(f"host sync while capturing: {func} returns a value to the host")
        input_storages = _storages((args, kwargs))
        capture.note_inputs(input_storages)
        result = func(*args, **kwargs)
        outputs = _tensors(result)
        kind = _task_kind(func)
        if kind == "view" and not _storages(outputs) <= input_storages:
            kind = "functional"  # NOTE: "may alias" (reshape, contiguous): this call copied
        if kind in ("functional", "allocation"):
            capture.note_outputs(outputs)
        capture.add(AtenTask(func, tuple(args), dict(kwargs), outputs, kind))
        return result


class _HostSyncGuard(TorchFunctionMode):
    """Refuses the Tensor methods that copy device data to the host while capturing."""

    def __init__(self, capture: _Capture) -> None:
        super().__init__()
        self.capture = capture

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in HOST_SYNC_METHODS and not self.capture.suspended:
            raise GraphCaptureError(
                f"host sync while capturing: Tensor.{func.__name__}() waits for the device"
            )
        return func(*args, **(kwargs or {}))


def refuse_host_sync(what: str) -> None:
    """For the runtime's synchronize calls."""
    capture = _capture()
    if capture is not None and not capture.suspended:
        raise GraphCaptureError(f"host sync while capturing: {what}")


def graph_operator(
    name: str, fn: Callable[..., Any], at_capture: Callable[..., Any] | None = None
) -> Callable[..., Any]:
    """``fn``, a torch_npu operator, captured as one task while a graph captures. An operator
    that writes only into tensors it is given may name ``at_capture``, which checks its
    arguments and returns what it would: a capture computes nothing, as on a device."""

    @functools.wraps(fn, updated=())
    def call(*args: Any, **kwargs: Any) -> Any:
        update = getattr(_local, "update", None)
        if update is not None:
            return _update_task(update, name, fn, args, kwargs)
        capture = _capture()
        if capture is None or capture.suspended:
            return fn(*args, **kwargs)
        return capture.record_operator(name, fn, args, kwargs, at_capture)

    return call


def host_query(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, a torch_npu call that sizes and allocates memory but launches nothing (a workspace
    query): while a graph captures, its allocation is the pool's, and no task is recorded."""

    @functools.wraps(fn, updated=())
    def call(*args: Any, **kwargs: Any) -> Any:
        capture = _capture()
        if capture is None or capture.suspended:
            return fn(*args, **kwargs)
        with capture.suspend():
            result = fn(*args, **kwargs)
        capture.note_outputs(_tensors(result))
        return result

    return call


# -- Task updates (the calls around them: `graph_api`) --------------------------------------------


@dataclass(slots=True)
class _Update:
    handle: TaskGroupHandle
    num_updated: int = 0


def _data_ptrs(tree: object) -> list[int]:
    return [t.data_ptr() for t in _tensors(tree)]


def _update_task(
    update: _Update, name: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Inside ``graph_task_update_begin/end``: the operator call replaces the arguments of the
    group's next task (the same operator writing the same outputs); nothing runs now."""
    tasks = update.handle.tasks
    task = tasks[update.num_updated] if update.num_updated < len(tasks) else None
    problem = None
    if task is None:
        problem = f"a task update calls {name} more often than its group captured it"
    elif task.name != name:
        problem = f"a task update calls {name} where its group captured {task.name}"
    elif _data_ptrs(task.kwargs.get("out")) != _data_ptrs(kwargs.get("out")):
        problem = f"a task update of {name} writes other tensors than the captured task"
    if problem is not None or task is None:
        _local.update = None  # the update is abandoned; its group stays as it was
        raise GraphCaptureError(problem)
    task.args, task.kwargs = tuple(args), dict(kwargs)
    update.num_updated += 1
    return kwargs.get("out")


# -- NPUGraph, torch.npu.graph, graph_pool_handle --------------------------------------------------


def graph_pool_handle() -> PoolHandle:
    handle = PoolHandle()
    _pools.add(handle)
    return handle


def reserved_bytes() -> int:
    """What the live graph pools hold (``torch.npu.memory_reserved`` on the emulated NPU)."""
    return sum(pool.bytes for pool in _pools)


class NPUGraph:
    """``torch.npu.NPUGraph``: ``capture_begin``/``capture_end`` (or ``torch.npu.graph``),
    ``replay``, ``reset``."""

    def __init__(self) -> None:
        self._tasks: list[Any] = []
        self._groups: list[TaskGroupHandle] = []
        self._capture: _Capture | None = None
        self._pool: PoolHandle | None = None
        self.captured = False

    def capture_begin(self, pool: PoolHandle | None = None, capture_error_mode: str = "global") -> None:
        if self.captured or self._capture is not None:
            raise GraphCaptureError("capture_begin on a graph that holds a capture: reset() it first")
        if capturing():
            raise GraphCaptureError("capture_begin while another graph captures on this thread")
        if pool is not None and not isinstance(pool, PoolHandle):
            raise GraphCaptureError(f"pool {pool!r} is no graph pool: pass graph_pool_handle()")
        self._pool = pool or graph_pool_handle()
        self._capture = _Capture(self)
        _local.capture = self._capture
        self._capture.__enter__()

    def capture_end(self) -> None:
        capture = self._stop_capture()
        if capture is None:
            raise GraphCaptureError("capture_end without capture_begin")
        if capture.group is not None:
            raise GraphCaptureError("capture ended inside an open task group")
        assert self._pool is not None
        self._pool.bytes += sum(t.untyped_storage().nbytes() for t in capture.pool_storages.values())
        capture.poison()
        self.captured = True

    def replay(self) -> None:
        if not self.captured:
            raise GraphReplayError("replay of a graph that captured nothing")
        if capturing():
            raise GraphCaptureError("replay while capturing")
        stale = [index for index, group in enumerate(self._groups) if not group.updated]
        if stale:
            raise GraphReplayError(
                f"task groups {stale} of {len(self._groups)} were not updated since the last replay: "
                "the captured attention would run with the lengths of the step before "
                "(graph_task_update_begin/end before each replay)"
            )
        with torch.inference_mode():
            for task in self._tasks:
                task.run()
        for group in self._groups:
            group.updated = False

    def reset(self) -> None:
        self._tasks, self._groups, self.captured = [], [], False

    def _stop_capture(self) -> _Capture | None:
        """Ends this graph's capture in progress (None if none): its modes leave the thread."""
        capture, self._capture = self._capture, None
        if capture is not None:
            capture.__exit__(None, None, None)
            _local.capture = None
        return capture


@contextmanager
def graph(
    npu_graph: NPUGraph,
    pool: PoolHandle | None = None,
    stream: object = None,
    capture_error_mode: str = "global",
) -> Iterator[None]:
    """``torch.npu.graph(npu_graph, pool=None, stream=None, capture_error_mode="global")``."""
    npu_graph.capture_begin(pool, capture_error_mode=capture_error_mode)
    try:
        yield
    except BaseException:
        if npu_graph._stop_capture() is not None:
            npu_graph.reset()  # the error propagates; the graph holds nothing
        raise
    npu_graph.capture_end()
