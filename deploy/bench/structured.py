"""Structured outputs: step time at batch 32 with 0%, 50% and 100% constrained rows, and grammar
compile time cached vs not, in-process on the demo model (scheduler + ModelRunner, no gRPC).

    python -m npuserve.deploy.bench.structured [--steps 40] [--device cpu]

A step is measured whole, as the lane runs it, and by part: schedule (bitmasks packed), execute
(masks applied before sampling), update (tokens accepted, next masks computed). The scheduler's
share per constrained row is what a constrained row adds to the step (and so to every row of
it). "100pct_closing" runs the constrained rows in their last tokens, where each looks for its
closing path (`scheduler.grammar_closing`); the others have budgets far from their end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from npuserve.deploy.demo_model import DEMO_MODEL_DIR
from npuserve.executor.config import ExecutorConfig
from npuserve.executor.model_runner import ModelRunner
from npuserve.proto.structured_outputs import StructuredOutputs
from npuserve.scheduler.core.request import Request, RequestStatus, SamplingParams
from npuserve.scheduler.core.scheduler import Scheduler
from npuserve.scheduler.core.scheduler_config import SchedulerConfig
from npuserve.scheduler.structured.grammar_compiler import GrammarCompiler
from npuserve.scheduler.text.tokenizer import Tokenizer

BATCH = 32
WORDS = {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 100}
SCHEMA = {"type": "object", "properties": {"words": WORDS}, "required": ["words"]}


PHASES = ("step", "schedule", "execute", "update")


def step_times(
    runner: ModelRunner, grammars: GrammarCompiler, fraction: float, steps: int, closing: bool = False
) -> dict[str, list[float]]:
    """Seconds of each decode step and of its phases (PHASES)."""
    info = runner.info()
    scheduler = Scheduler(SchedulerConfig.for_executor(info))
    grammar = grammars.compile_now(StructuredOutputs.json_schema(SCHEMA))
    max_tokens = steps + 8 if closing else 100 * steps
    for i in range(BATCH):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        request = Request(
            f"r{i}",
            [1, 300 + i, 400, 401],
            params,
            params.to_options(tuple(info.eos_token_ids)),
            tuple(info.eos_token_ids),
            info.max_model_len,
            info.block_size,
        )
        if i < fraction * BATCH:
            request.grammar = grammar.new_state(request.max_output_tokens)
        scheduler.add_request(request)
    times: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for _ in range(steps + 1):
        start = time.perf_counter()
        plan, _ = scheduler.schedule()
        scheduled = time.perf_counter()
        result = runner.execute(plan)
        executed = time.perf_counter()
        scheduler.update_from_output(plan, result)
        updated = time.perf_counter()
        seconds = (updated - start, scheduled - start, executed - scheduled, updated - executed)
        for phase, value in zip(PHASES, seconds, strict=True):
            times[phase].append(value)
    scheduler.finish_requests(list(scheduler.requests), RequestStatus.FINISHED_ABORTED)
    return {phase: values[1:] for phase, values in times.items()}  # the first step is the prefill


async def compile_times(grammars: GrammarCompiler, count: int) -> tuple[float, float]:
    schemas = [
        {"type": "object", "properties": {f"k{i}": WORDS}, "required": [f"k{i}"]} for i in range(count)
    ]
    constraints = [StructuredOutputs.json_schema(schema) for schema in schemas]
    start = time.perf_counter()
    for c in constraints:
        await grammars.compile(c)
    uncached = (time.perf_counter() - start) / count
    start = time.perf_counter()
    for c in constraints:
        await grammars.compile(c)
    return uncached, (time.perf_counter() - start) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    runner = ModelRunner(
        ExecutorConfig(str(DEMO_MODEL_DIR), device=args.device, kv_cache_memory_gib=0.05, warmup=False)
    )
    tokenizer = Tokenizer.from_pretrained(DEMO_MODEL_DIR)
    grammars = GrammarCompiler(tokenizer.to_json(), runner.info().vocab_size, tokenizer.eos_token_ids)
    results: dict[str, object] = {}
    runs = [("0pct", 0.0, False), ("50pct", 0.5, False), ("100pct", 1.0, False)]
    runs += [("100pct_closing", 1.0, True), ("0pct_again", 0.0, False)]  # warm-up shows as a difference
    scheduler_ms: dict[str, float] = {}
    for name, fraction, closing in runs:
        times = step_times(runner, grammars, fraction, args.steps, closing)
        medians = {phase: statistics.median(values) * 1000 for phase, values in times.items()}
        results[name] = {f"{phase}_ms": round(ms, 3) for phase, ms in medians.items()}
        scheduler_ms[name] = medians["schedule"] + medians["update"]
        if fraction:
            extra = (scheduler_ms[name] - scheduler_ms["0pct"]) / (fraction * BATCH)
            results[name]["scheduler_ms_per_constrained_row"] = round(extra, 4)  # type: ignore[index]
    uncached, cached = asyncio.run(compile_times(grammars, 20))
    results["compile_ms_uncached"] = round(uncached * 1000, 3)
    results["compile_ms_cached"] = round(cached * 1000, 4)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
