"""`--cpu-threads`: how many threads torch computes with where the model runs on the host's CPU
(the cpu device, or the npu backend emulated on it).

An executor on the CPU keeps one torch thread per core busy for the length of a step, and a
parallel region waits for its slowest thread. Where the scheduler and the gateway share the host
(`npuserve serve`, `npuserve bench`'s gRPC variants), their bursts preempt those threads in the
middle of regions (`deploy/cpu_priority`). vLLM's CPU backend keeps cores for its serving
processes for the same reason. `auto` (what `serve` gives its executors) leaves one core
(`SPARE_CORES`) to them when that costs the model little: after the warm-up the executor times a
decode step with torch's threads and with one fewer, interleaved, best of `TIMING_ROUNDS` each,
and keeps the fewer unless the step then takes more than `MAX_SLOWDOWN` times as long.

NOTE: on 2 cores, stories260K over gRPC (`npuserve bench --mode grpc`, three interleaved rounds
each) made 3,391, 3,390 and 3,651 tokens/s on one thread against 3,111, 3,293 and 2,946 on two,
and its decode step of 32 sequences takes 2.4-2.5 ms on either (it moves to one). The ~150M
Llama preset's takes 100 ms on two threads and 142 on one, and on one its gRPC split made 99
tokens/s against 153 in process on two: it keeps both. The split's gain from the spare core was
about 10%, so a step up to `MAX_SLOWDOWN` slower is worth it.
"""

from __future__ import annotations

import time

import structlog

from npuserve.executor.warmup import decode_step, warmup_plans
from npuserve.proto.step_plan import PlanRunner

log = structlog.get_logger(__name__)

AUTO_CPU_THREADS = 0  # the config value of `--cpu-threads auto`
SPARE_CORES = 1  # the cores `auto` leaves to the processes beside the executor, when it can
MAX_SLOWDOWN = 1.10  # the longest a decode step may take on the fewer threads, against all of them
TIMING_ROUNDS = 8  # NOTE: with 4, a busy moment made the ~150M Llama's two threads look slow
TIMED_BATCH = 32  # sequences in the timed decode step (fewer if the executor holds fewer)
FIRST_TIMING_STEP_ID = -1_000_000  # below the warm-up's step ids


def choose_cpu_threads(runner: PlanRunner) -> int:
    """`auto`: sets torch's threads to one core fewer than it has (`SPARE_CORES`) when a decode
    step then takes at most `MAX_SLOWDOWN` times as long, else leaves them; returns them."""
    import torch  # NOTE: here, so the flags (`AUTO_CPU_THREADS`) load without it

    threads = torch.get_num_threads()
    fewer = max(1, threads - SPARE_CORES)
    if fewer == threads:
        return threads
    info = runner.info()
    batch = decode_step(info, TIMED_BATCH)
    best = {threads: float("inf"), fewer: float("inf")}
    step_id = FIRST_TIMING_STEP_ID
    for _ in range(TIMING_ROUNDS):
        for count in best:
            torch.set_num_threads(count)
            decode, drop = warmup_plans(info, [batch], step_id)
            step_id -= 2
            start = time.perf_counter()
            runner.execute(decode)
            best[count] = min(best[count], time.perf_counter() - start)
            runner.execute(drop)
    chosen = fewer if best[fewer] <= MAX_SLOWDOWN * best[threads] else threads
    torch.set_num_threads(chosen)
    log.info(
        "cpu threads chosen",
        threads=chosen,
        decode_ms={count: round(seconds * 1e3, 2) for count, seconds in best.items()},
    )
    return chosen
