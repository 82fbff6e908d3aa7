"""Profiling the executor's steps on demand (``--profile-dir``), the way vLLM's profiler works.

`StepProfiler.start()` begins a trace, `stop()` ends it and writes, under the profile dir, a
Chrome trace (``*.pt.trace.json``, open in chrome://tracing or Perfetto) and ``*.top_ops.txt``,
the operators by self time. On NPU it is torch_npu.profiler (CPU and NPU activities, shapes and
memory; its handler writes the Ascend profiling folder with the trace inside); elsewhere
torch.profiler (CPU, plus CUDA on a CUDA device).

While a profile runs, the step timings a runner reports (`StepTimings`) are device times:
`StepClock` waits for the device before each reading. Otherwise they are host times, and on NPU
or CUDA a forward's is how long the host took to queue its kernels; the serving path never
synchronizes for a timing.

NOTE: torch's profiler records the thread that starts it; the server therefore runs every step
and both calls on one thread of its own while profiling is enabled (`ExecutorServicer`).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import structlog
import torch

from npuserve.executor.platform import Target, synchronize
from npuserve.proto.step_plan import EMULATED_NPU_DEVICE

log = structlog.get_logger(__name__)

TOP_OPS_ROWS = 40


class ProfilingDisabled(RuntimeError):
    """Profiling was asked of an executor started without --profile-dir (gRPC UNIMPLEMENTED)."""


class ProfilerStateError(RuntimeError):
    """Start while a profile runs, or stop while none does (gRPC FAILED_PRECONDITION)."""


def _profiler(profile_dir: Path, worker_name: str, device_type: str) -> Any:
    """torch_npu's profiler on an NPU, torch's elsewhere (the module's docstring says what each records)."""
    extra: dict[str, Any] = {}
    if device_type == "npu":
        import torch_npu

        profiler: Any = torch_npu.profiler
        activities = [profiler.ProfilerActivity.CPU, profiler.ProfilerActivity.NPU]
        extra["experimental_config"] = profiler._ExperimentalConfig(
            export_type=profiler.ExportType.Text,
            profiler_level=profiler.ProfilerLevel.Level1,
            aic_metrics=profiler.AiCMetrics.AiCoreNone,
        )
    else:
        profiler = torch.profiler
        activities = [profiler.ProfilerActivity.CPU]
        if device_type == "cuda":
            activities.append(profiler.ProfilerActivity.CUDA)
    return profiler.profile(
        activities=activities,
        record_shapes=True,
        profile_memory=True,
        with_stack=False,
        on_trace_ready=profiler.tensorboard_trace_handler(str(profile_dir), worker_name=worker_name),
        **extra,
    )


class StepClock:
    """The clock a runner's step timings read: `time.perf_counter`, after the device has finished
    the work queued so far while ``synchronized`` (set while a profile runs, `StepProfiler`)."""

    def __init__(self, target: Target | torch.device) -> None:
        self.target = target
        self.synchronized = False

    def __call__(self) -> float:
        if self.synchronized:
            synchronize(self.target)  # NOTE: a no-op on the CPU
        return time.perf_counter()


class StepProfiler:
    """One profile at a time, written under ``profile_dir`` (None: profiling is off). ``clock``:
    the runner's step clock, synchronized while a profile runs."""

    def __init__(
        self, profile_dir: Path | None, device: str, worker_name: str, clock: StepClock | None = None
    ) -> None:
        self.profile_dir = profile_dir
        self.clock = clock
        # "npu:0" -> "npu"; an emulated NPU and "simulated" profile the host with torch's profiler
        self.device_type = "cpu" if device == EMULATED_NPU_DEVICE else device.split(":", 1)[0]
        self.worker_name = re.sub(r"[^A-Za-z0-9_.-]", "_", worker_name)
        self._profile: Any = None

    @property
    def enabled(self) -> bool:
        return self.profile_dir is not None

    @property
    def running(self) -> bool:
        return self._profile is not None

    def _require_enabled(self) -> Path:
        if self.profile_dir is None:
            raise ProfilingDisabled(
                "profiling is off on this executor: start it with --profile-dir DIR to allow profiles"
            )
        return self.profile_dir

    def start(self) -> Path:
        profile_dir = self._require_enabled()
        if self._profile is not None:
            raise ProfilerStateError("a profile is already running; stop it first (POST /stop_profile)")
        profile_dir.mkdir(parents=True, exist_ok=True)
        profile = _profiler(profile_dir, self.worker_name, self.device_type)
        profile.start()
        self._profile = profile
        if self.clock is not None:
            self.clock.synchronized = True
        log.info("profile started", profile_dir=str(profile_dir), device=self.device_type)
        return profile_dir

    def stop(self) -> list[Path]:
        """Ends the profile; returns the files it wrote (the trace export runs here)."""
        profile_dir = self._require_enabled()
        if self._profile is None:
            raise ProfilerStateError("no profile is running; start one first (POST /start_profile)")
        profile, self._profile = self._profile, None
        if self.clock is not None:
            self.clock.synchronized = False
        before = set(profile_dir.rglob("*"))
        started = time.perf_counter()
        profile.stop()  # NOTE: calls on_trace_ready, which exports the trace
        if hasattr(profile, "key_averages"):  # NOTE: torch_npu's profiler parses offline instead
            top_ops = profile_dir / f"{self.worker_name}.{time.time_ns()}.top_ops.txt"
            table = profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=TOP_OPS_ROWS)
            top_ops.write_text(table + "\n")
        written = sorted(p for p in set(profile_dir.rglob("*")) - before if p.is_file())
        log.info(
            "profile written",
            files=[str(p) for p in written],
            seconds=round(time.perf_counter() - started, 2),
        )
        return written
