"""Structured outputs: step time at batch 32 with 0%, 50% and 100% constrained rows, and grammar
compile time cached vs not, in-process on the demo model (scheduler + ModelRunner, no gRPC).

    python -m npuserve.deploy.bench.structured [--steps 40] [--device cpu]

A step is measured whole, as the lane runs it: schedule (bitmasks packed), execute (masks
applied before sampling), update (tokens accepted, next masks computed).
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
from npuserve.scheduler.request import Request, SamplingParams
from npuserve.scheduler.scheduler import Scheduler, SchedulerConfig
from npuserve.scheduler.structured import GrammarCompiler
from npuserve.scheduler.tokenizer import Tokenizer

BATCH = 32
WORDS = {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 100}
SCHEMA = {"type": "object", "properties": {"words": WORDS}, "required": ["words"]}


def _schema(i: int) -> dict[str, object]:
    return {"type": "object", "properties": {f"k{i}": WORDS}, "required": [f"k{i}"]}


def step_times(runner: ModelRunner, grammars: GrammarCompiler, fraction: float, steps: int) -> list[float]:
    info = runner.info()
    scheduler = Scheduler(SchedulerConfig.for_executor(info))
    grammar = grammars.compile_now(StructuredOutputs.json_schema(SCHEMA))
    for i in range(BATCH):
        params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
        scheduler.add_request(
            Request(
                f"r{i}",
                [1, 300 + i, 400, 401],
                params,
                params.to_options(tuple(info.eos_token_ids)),
                tuple(info.eos_token_ids),
                info.max_model_len,
                info.block_size,
                grammar=grammar.new_state() if i < fraction * BATCH else None,
            )
        )
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        plan, _ = scheduler.schedule()
        scheduler.update_from_output(plan, runner.execute(plan))
        times.append(time.perf_counter() - start)
    scheduler.finish_requests(list(scheduler.requests), scheduler.requests["r0"].status.FINISHED_ABORTED)
    return times[1:]  # the first step is the prefill


async def compile_times(grammars: GrammarCompiler, count: int) -> tuple[float, float]:
    constraints = [StructuredOutputs.json_schema(_schema(i)) for i in range(count)]
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
    for fraction in (0.0, 0.5, 1.0, 0.0):  # 0% again last: warm-up effects show as a difference
        times = step_times(runner, grammars, fraction, args.steps)
        results[f"step_ms_{int(fraction * 100)}pct"] = round(statistics.median(times) * 1000, 3)
    uncached, cached = asyncio.run(compile_times(grammars, 20))
    results["compile_ms_uncached"] = round(uncached * 1000, 3)
    results["compile_ms_cached"] = round(cached * 1000, 4)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
