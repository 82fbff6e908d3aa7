"""`npuserve bench-runner`: decode throughput of the ModelRunner against transformers' `generate`
on the same weights.

Each case runs a static batch: ``batch_size`` prompts of ``prompt_len`` random tokens, prefilled
in one step, then ``output_len - 1`` greedy decode steps. Decode throughput counts the tokens of
the decode steps over their time; transformers' decode time is `generate(output_len)` minus
`generate(1)`, so both sides exclude prefill. The table, JSON and plot are `report`'s.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from npuserve.deploy.bench import report
from npuserve.deploy.flag_table import same_named
from npuserve.deploy.flags import command_error
from npuserve.executor.config import ConfigError, ExecutorConfig
from npuserve.executor.model_runner import ModelRunner
from npuserve.executor.platform import PlatformError
from npuserve.kernels import cdiv
from npuserve.proto.step_plan import NewRequest, SamplingOptions, StepPlan

log = structlog.get_logger(__name__)

# A ~150M-parameter Llama: hidden 1024, 8 layers, 16 heads, 4 KV heads, vocab 32000.
PRESETS: dict[str, dict[str, Any]] = {
    "llama-150m": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
}


@dataclass
class CaseResult:
    engine: str  # "npuserve", "npuserve-eager" (--enforce-eager) or "transformers"
    dtype: str
    batch_size: int
    prompt_len: int
    output_len: int
    prefill_s: float
    decode_s: float
    decode_tokens_per_s: float = field(init=False)  # the decode steps' tokens over their time
    output_token_ids: list[list[int]]

    def __post_init__(self) -> None:
        self.decode_tokens_per_s = self.batch_size * (self.output_len - 1) / self.decode_s

    def row(self) -> dict[str, object]:
        row = asdict(self)
        del row["output_token_ids"]
        return row


def materialise_preset(name: str, directory: Path, with_weights: bool, seed: int) -> Path:
    """Writes the preset's config.json (and, for comparisons, random weights) to ``directory``."""
    config = PRESETS[name]
    directory.mkdir(parents=True, exist_ok=True)
    if not with_weights:
        (directory / "config.json").write_text(json.dumps(config, indent=2))
        return directory
    import transformers

    torch.manual_seed(seed)
    hf_config = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    hf_config.architectures = list(config["architectures"])
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    log.info("saving random weights", preset=name, directory=str(directory))
    model.save_pretrained(directory)
    return directory


def prompts(batch_size: int, prompt_len: int, vocab_size: int, seed: int) -> np.ndarray:
    """[B, P] random token ids (no special tokens)."""
    return np.random.default_rng(seed).integers(3, vocab_size, size=(batch_size, prompt_len))


def run_npuserve(
    runner: ModelRunner, prompt_ids: np.ndarray, output_len: int, dtype: str, step_ids: Iterator[int]
) -> CaseResult:
    batch_size, prompt_len = prompt_ids.shape
    blocks_per_req = cdiv(prompt_len + output_len, runner.block_size)
    req_ids = [f"bench-{i}" for i in range(batch_size)]
    greedy = SamplingOptions(temperature=0)
    new_requests = [
        NewRequest(
            req_id=req_id,
            token_ids=prompt_ids[i].tolist(),
            num_prompt_tokens=prompt_len,
            sampling=greedy,
            block_ids=list(range(1 + i * blocks_per_req, 1 + (i + 1) * blocks_per_req)),
            num_computed_tokens=0,
        )
        for i, req_id in enumerate(req_ids)
    ]
    start = time.perf_counter()
    prefill = StepPlan(
        next(step_ids), new_requests, num_scheduled_tokens=dict.fromkeys(req_ids, int(prompt_len))
    )
    steps = [runner.execute(prefill).sampled_token_ids]  # each step's token per request
    prefilled = time.perf_counter()
    for _ in range(output_len - 1):
        plan = StepPlan(next(step_ids), num_scheduled_tokens=dict.fromkeys(req_ids, 1))
        steps.append(runner.execute(plan).sampled_token_ids)
    decoded = time.perf_counter()
    outputs = [list(tokens) for tokens in zip(*steps, strict=True)]
    runner.execute(StepPlan(next(step_ids), finished_req_ids=req_ids))
    return CaseResult(
        "npuserve", dtype, batch_size, prompt_len, output_len, prefilled - start, decoded - prefilled, outputs
    )


def run_transformers(
    model: torch.nn.Module, prompt_ids: np.ndarray, output_len: int, dtype: str
) -> CaseResult:
    batch_size, prompt_len = prompt_ids.shape
    inputs = torch.from_numpy(prompt_ids)

    def generate(num_tokens: int) -> tuple[float, torch.Tensor]:
        start = time.perf_counter()
        out = model.generate(  # type: ignore[operator]
            inputs,
            attention_mask=torch.ones_like(inputs),
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        return time.perf_counter() - start, out

    prefill_s = min(generate(1)[0] for _ in range(2))
    total_s, out = generate(output_len)
    outputs = out[:, prompt_len:].tolist()
    return CaseResult(
        "transformers", dtype, batch_size, prompt_len, output_len, prefill_s, total_s - prefill_s, outputs
    )


@dataclass
class BenchmarkConfig:
    preset: str = "llama-150m"
    model: str | None = None  # a model directory instead of the preset
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    prompt_len: int = 128
    output_len: int = 128
    compare_transformers: bool = True
    # Also each case with --enforce-eager ("npuserve-eager"), against decode graphs ("npuserve"),
    # which npu and cuda devices capture by default.
    compare_eager: bool = False
    seed: int = 0
    kv_cache_memory_gib: float = 2.0


def run_benchmark(config: BenchmarkConfig) -> list[CaseResult]:
    """Every (dtype, batch size) case on npuserve, then on transformers when compared."""
    results: list[CaseResult] = []
    with tempfile.TemporaryDirectory(prefix="npuserve-bench-") as scratch:
        model_dir = (
            Path(config.model)
            if config.model
            else materialise_preset(config.preset, Path(scratch), config.compare_transformers, config.seed)
        )
        load_format = "auto" if config.model or config.compare_transformers else "dummy"
        for dtype in config.dtypes:
            runners = {
                engine: ModelRunner(
                    ExecutorConfig(
                        model=str(model_dir),
                        dtype=dtype,
                        load_format=load_format,
                        max_model_len=config.prompt_len + config.output_len,
                        max_num_seqs=max(config.batch_sizes),
                        max_num_batched_tokens=max(config.batch_sizes) * config.prompt_len,
                        kv_cache_memory_gib=config.kv_cache_memory_gib,
                        seed=config.seed,
                        enforce_eager=engine == "npuserve-eager",
                    )
                )
                for engine in ("npuserve", "npuserve-eager")[: 2 if config.compare_eager else 1]
            }
            vocab_size = runners["npuserve"].model_config.vocab_size
            step_ids = itertools.count()
            reference = _load_transformers(model_dir, dtype) if config.compare_transformers else None
            for batch_size in config.batch_sizes:
                prompt_ids = prompts(batch_size, config.prompt_len, vocab_size, config.seed)
                cases = []
                for engine, runner in runners.items():
                    run_npuserve(runner, prompts(batch_size, 8, vocab_size, 1), 4, dtype, step_ids)  # warm-up
                    case = run_npuserve(runner, prompt_ids, config.output_len, dtype, step_ids)
                    case.engine = engine
                    cases.append(case)
                if reference is not None:
                    run_transformers(reference, prompt_ids[:, :8], 4, dtype)  # warm-up
                    cases.append(run_transformers(reference, prompt_ids, config.output_len, dtype))
                for case in cases:
                    log.info("benchmark case", **case.row())
                results += cases
            del runners, reference
    return results


def _load_transformers(model_dir: Path, dtype: str) -> torch.nn.Module:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    return model.eval()


# -- command line -------------------------------------------------------------------------------


def run_runner_bench(args: argparse.Namespace) -> int:
    config = BenchmarkConfig(
        **same_named(BenchmarkConfig, args),
        dtypes=args.dtype,
        compare_transformers=not args.no_compare,
        kv_cache_memory_gib=args.kv_cache_memory,
    )
    try:
        results = run_benchmark(config)
    except (ConfigError, PlatformError) as exc:
        return command_error("bench-runner", exc)
    print(report.format_runner_table(results))
    report.save_json(args.output_json, "bench-runner", [r.row() for r in results])
    if args.plot:
        report.plot_runner(results, args.plot)
    return 0
