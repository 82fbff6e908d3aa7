"""Where the scheduler's time goes under load: py-spy samples of the thread holding the GIL,
summarised by cost category and by function."""

from __future__ import annotations

import asyncio
import re
import shutil
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from npuserve.deploy.bench.scale_config import ScaleConfig

if TYPE_CHECKING:
    from npuserve.deploy.bench.scale_measure import Result


# Where a sample's time goes: the innermost frame whose file matches names the cost.
PROFILE_CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("metrics: per-step gauges over all lanes, histograms",
     ("scheduler/engine/engine_metrics.py", "prometheus_client/", "scheduler/engine/metrics.py")),
    ("detokenize (tokenizers)", ("detokenizer.py", "scheduler/text/tokenizer.py", "tokenizers/")),
    ("scheduling loop (scheduler, KV blocks, requests)",
     ("scheduler/core/scheduler.py", "kv_cache_manager.py", "block_pool.py", "block_hash.py", "scheduler/core/request.py")),
    ("routing (choose_lane)", ("scheduler/core/router.py",)),
    ("step plan/result <-> protobuf", ("step_codec.py", "executor_pb2")),
    ("executor gRPC client", ("scheduler/lanes/aio_executor_client.py",)),
    ("Generate response encode", ("api_codec.py", "scheduler_pb2")),
    ("public gRPC server (grpc.aio Python parts)", ("grpc/aio/", "grpc/_cython", "cygrpc")),
    ("logging (structlog)", ("structlog/", "logging/")),
    ("request streams (outputs)", ("scheduler/engine/outputs.py",)),
    ("engine: admission, dispatch, Generate handler", ("scheduler/engine/engine.py", "scheduler/engine/client_entry.py",
                                                     "scheduler/engine/failover.py", "scheduler/lanes/worker_relay.py",
                                                     "scheduler/server.py")),
    ("lanes: step loops (commands, events, pacing)",
     ("scheduler/lanes/async_lane.py", "scheduler/lanes/step_joining.py", "scheduler/lanes/step_pacing.py")),
    ("asyncio event loop", ("asyncio/",)),
    ("threads, queues, locks", ("threading.py", "queue.py", "concurrent/futures")),
]  # fmt: skip


async def profile_scheduler(pid: int, config: ScaleConfig, output: Path) -> dict[str, Any] | None:
    """py-spy on ``pid`` for ``profile_s``, sampling the thread that holds the GIL; summarised."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        print(
            "npuserve bench-scale: py-spy is not installed (pip install py-spy); no profile", file=sys.stderr
        )
        return None
    seconds = str(max(1, round(config.profile_s)))
    command = [py_spy, "record", "--pid", str(pid), "--duration", seconds, "--rate", "250",
               "--format", "raw", "--gil", "--output", str(output)]  # fmt: skip
    # NOTE: --native must pause the process to unwind C stacks; without it sampling never pauses.
    command.append("--native" if config.profile_native else "--nonblocking")
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    _, stderr = await process.communicate()
    if not output.exists():
        print(
            f"npuserve bench-scale: py-spy failed: {stderr.decode(errors='replace')[-500:]}", file=sys.stderr
        )
        return None
    return summarize_profile(output.read_text())


def _frame_name(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (file.py)``."""
    match = re.match(r"(.*) \((.*?)(?::\d+)?\)$", frame)
    if match is None:
        return frame
    return f"{match.group(1)} ({match.group(2).rsplit('/', 2)[-2:][-1]})"


def _category(frames: list[str]) -> str:
    """The first category, in `PROFILE_CATEGORIES` order, that any frame of the stack falls in:
    specific costs come before the loops that call them (engine, lane, asyncio, threads)."""
    if frames[-1].startswith("Handle._run "):
        # NOTE: C and Cython code has no Python frame: grpc.aio's internals (Cython coroutines:
        # accepting calls, sending messages, completion-queue events) and asyncio's C Task steps.
        return "grpc.aio Cython internals + asyncio C tasks (no Python frame)"
    for name, patterns in PROFILE_CATEGORIES:
        if any(p in frame for frame in frames for p in patterns):
            return name
    return "other"


# Frames nearly every sample passes through: left out of the inclusive ranking.
_GENERIC_FRAMES = ("<frozen runpy>", "deploy/cli.py", "asyncio/runners.py", "asyncio/base_events.py",
                   "asyncio/events.py", "threading.py", "scheduler/lanes/async_lane.py")  # fmt: skip


def summarize_profile(raw: str, top: int = 15) -> dict[str, Any]:
    """Shares of GIL-holding samples by category and by function (self and inclusive)."""
    by_category: Counter[str] = Counter()
    by_self: Counter[str] = Counter()
    by_total: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [f for f in stack.split(";") if f]
        total += count
        by_category[_category(frames)] += count
        by_self[_frame_name(frames[-1])] += count
        for name in {_frame_name(f) for f in frames if not any(g in f for g in _GENERIC_FRAMES)}:
            by_total[name] += count
    if not total:
        return {"samples": 0}

    def shares(counter: Counter[str], n: int) -> list[tuple[str, float]]:
        return [(name, round(100 * count / total, 1)) for name, count in counter.most_common(n)]

    return {
        "samples": total,
        "categories": shares(by_category, len(by_category)),
        "self": shares(by_self, top),
        "inclusive": shares(by_total, top),
    }


def format_profile(result: Result) -> str:
    profile = result.profile or {}
    if not profile.get("samples"):
        return "no profile samples"
    lines = [
        f"scheduler profile (py-spy --gil, {profile['samples']} samples) at {result.executors} executors x "
        f"{result.concurrency} streams",
        "  by cost:",
        *(f"    {share:5.1f}%  {name}" for name, share in profile["categories"]),
        "  top functions, self:",
        *(f"    {share:5.1f}%  {name}" for name, share in profile["self"]),
        "  top functions, inclusive:",
        *(f"    {share:5.1f}%  {name}" for name, share in profile["inclusive"]),
    ]
    return "\n".join(lines)
