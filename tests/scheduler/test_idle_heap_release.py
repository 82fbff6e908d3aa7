"""A scheduler's processes give back the memory of a large request once they have gone idle
(`gc_heap.IdleHeapRelease`): the front (its engine's requests) and its scheduler worker (its
lanes' steps), over a simulated executor, so that the request's work is the scheduler's alone.
The request is 128 prompts of 4,000 tokens over one GenerateMany call, as the gateway sends a
completion's prompts.

What a request allocates and frees stays the process's unless the heap is released (glibc keeps
freed memory for later allocations): without the release both processes stay at their peak for
good. Released, they keep only what they still use and what Python's own small-object arenas
keep (arenas of which a few objects live on), a small part here: the prompts' token ids are
below 257, ints Python shares, so what the prompts take sits in the C allocator's heap; prefix
caching is off, so no block of the prompts stays cached (and mirrored in the front)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from harness.cluster import processes
from harness.serve import Served, complete_many, greedy_request, start_scheduler, worker_pids

from npuserve.deploy.launcher import python_module

pytestmark = pytest.mark.slow  # starts npuserve processes

NUM_REQUESTS = 128
PROMPT_LEN = 4000  # tokens each, in a context of 8192: 512k prompt tokens in all
MIN_GROWTH_MIB = 8.0  # the request grows each process at least this much (else it tests nothing)
KEPT_FRACTION = 2 / 3  # of that growth, at most this much stays once the process is idle
RELEASE_WAIT_S = 10.0  # a bound: the release comes `IDLE_RELEASE_DELAY_S` after the work ends


def memory_mib(pid: int) -> tuple[float, float]:
    """(resident memory now, its peak since the process started) of process ``pid``."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def test_the_front_and_its_worker_give_back_a_large_requests_memory_once_idle(
    stories_dir: Path, tmp_path: Path
) -> None:
    rng = random.Random(0)
    requests = [
        greedy_request([1] + [rng.randrange(3, 257) for _ in range(PROMPT_LEN)], 2)
        for _ in range(NUM_REQUESTS)
    ]
    with processes(tmp_path) as procs:
        fleet = procs.launcher.start(
            "simulated",
            ["--port", "0", "--block-size", "16", "--num-blocks", "40000", "--max-num-batched-tokens", "65536",
             "--base-ms", "0", "--per-token-ms", "0", "--per-seq-ms", "0"],
            command=python_module("npuserve.deploy.bench.simulated_fleet"),
            log_path=tmp_path / "simulated.log",
        )  # fmt: skip
        (executor,) = procs.launcher.wait_ready([fleet], 60)
        scheduler = start_scheduler(
            procs, stories_dir, executor["address"], "--scheduler-workers", "1", "--no-enable-prefix-caching"
        )
        address = scheduler.wait_ready()["address"]
        pids = {"front": scheduler.pid, "worker": worker_pids(scheduler)[0]}
        baseline = {role: memory_mib(pid)[0] for role, pid in pids.items()}

        _, reasons = complete_many(address, requests)
        assert reasons == ["length"] * NUM_REQUESTS
        peak = {role: memory_mib(pid)[1] for role, pid in pids.items()}
        assert all(peak[role] - baseline[role] >= MIN_GROWTH_MIB for role in pids), (baseline, peak)

        def kept() -> dict[str, float]:
            """Of each process's growth, the part it still holds."""
            return {
                role: (memory_mib(pid)[0] - baseline[role]) / (peak[role] - baseline[role])
                for role, pid in pids.items()
            }

        deadline = time.monotonic() + RELEASE_WAIT_S
        while max((held := kept()).values()) > KEPT_FRACTION and time.monotonic() < deadline:
            time.sleep(0.1)
        assert max(held.values()) <= KEPT_FRACTION, f"baseline {baseline} MiB, peak {peak} MiB, kept {held}"

        integrity = Served(address, None).integrity(expect_idle=True)
        assert integrity.ok, integrity.message
