"""Decode throughput of the ModelRunner against transformers' `generate` on the same weights.

Each case runs a static batch: ``batch_size`` prompts of ``prompt_len`` random tokens, prefilled
in one step, then ``output_len - 1`` greedy decode steps. Decode throughput counts the tokens of
the decode steps over their time; transformers' decode time is `generate(output_len)` minus
`generate(1)`, so both sides exclude prefill.
"""

from __future__ import annotations

import itertools
import json
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from npuserve.executor.config import ExecutorConfig
from npuserve.executor.model_runner import ModelRunner
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
    engine: str  # "npuserve" or "transformers"
    dtype: str
    batch_size: int
    prompt_len: int
    output_len: int
    prefill_s: float
    decode_s: float
    decode_tokens_per_s: float
    output_token_ids: list[list[int]]

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
    outputs: list[list[int]] = [[] for _ in req_ids]
    start = time.perf_counter()
    result = runner.execute(
        StepPlan(next(step_ids), new_requests, num_scheduled_tokens=dict.fromkeys(req_ids, int(prompt_len)))
    )
    prefilled = time.perf_counter()
    for _ in range(output_len - 1):
        for out, token in zip(outputs, result.sampled_token_ids, strict=True):
            out.append(token)
        result = runner.execute(StepPlan(next(step_ids), num_scheduled_tokens=dict.fromkeys(req_ids, 1)))
    decoded = time.perf_counter()
    for out, token in zip(outputs, result.sampled_token_ids, strict=True):
        out.append(token)
    runner.execute(StepPlan(next(step_ids), finished_req_ids=req_ids))
    decode_s = decoded - prefilled
    return CaseResult(
        "npuserve",
        dtype,
        batch_size,
        prompt_len,
        output_len,
        prefilled - start,
        decode_s,
        batch_size * (output_len - 1) / decode_s,
        outputs,
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
    decode_s = total_s - prefill_s
    return CaseResult(
        "transformers",
        dtype,
        batch_size,
        prompt_len,
        output_len,
        prefill_s,
        decode_s,
        batch_size * (output_len - 1) / decode_s,
        out[:, prompt_len:].tolist(),
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
            runner = ModelRunner(
                ExecutorConfig(
                    model=str(model_dir),
                    dtype=dtype,
                    load_format=load_format,
                    max_model_len=config.prompt_len + config.output_len,
                    max_num_seqs=max(config.batch_sizes),
                    max_num_batched_tokens=max(config.batch_sizes) * config.prompt_len,
                    kv_cache_memory_gib=config.kv_cache_memory_gib,
                    seed=config.seed,
                )
            )
            vocab_size = runner.model_config.vocab_size
            step_ids = itertools.count()
            reference = _load_transformers(model_dir, dtype) if config.compare_transformers else None
            for batch_size in config.batch_sizes:
                prompt_ids = prompts(batch_size, config.prompt_len, vocab_size, config.seed)
                run_npuserve(runner, prompts(batch_size, 8, vocab_size, 1), 4, dtype, step_ids)  # warm-up
                cases = [run_npuserve(runner, prompt_ids, config.output_len, dtype, step_ids)]
                if reference is not None:
                    run_transformers(reference, prompt_ids[:, :8], 4, dtype)  # warm-up
                    cases.append(run_transformers(reference, prompt_ids, config.output_len, dtype))
                for case in cases:
                    log.info("benchmark case", **case.row())
                results += cases
            del runner, reference
    return results


def _load_transformers(model_dir: Path, dtype: str) -> torch.nn.Module:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    return model.eval()


def report_table(results: list[CaseResult]) -> str:
    """One line per (dtype, batch size): both engines' decode tokens/s, the ratio, and whether
    the greedy tokens agree."""
    header = (
        f"{'dtype':<9} {'batch':>5} {'npuserve tok/s':>15} {'transformers tok/s':>19} "
        f"{'speed-up':>9} {'same tokens':>12}"
    )
    lines = [header, "-" * len(header)]
    ours = {(r.dtype, r.batch_size): r for r in results if r.engine == "npuserve"}
    theirs = {(r.dtype, r.batch_size): r for r in results if r.engine == "transformers"}
    for key, mine in ours.items():
        other = theirs.get(key)
        ref_tps = f"{other.decode_tokens_per_s:19.1f}" if other else f"{'-':>19}"
        ratio = f"{mine.decode_tokens_per_s / other.decode_tokens_per_s:8.2f}x" if other else f"{'-':>9}"
        same = _agreement(mine, other) if other else "-"
        lines.append(f"{key[0]:<9} {key[1]:>5} {mine.decode_tokens_per_s:15.1f} {ref_tps} {ratio} {same:>12}")
    return "\n".join(lines)


def _agreement(a: CaseResult, b: CaseResult) -> str:
    """Share of requests whose greedy tokens are identical (bf16 rounding may split ties)."""
    same = sum(x == y for x, y in zip(a.output_token_ids, b.output_token_ids, strict=True))
    return f"{same}/{len(a.output_token_ids)}"


def plot(results: list[CaseResult], path: Path) -> None:
    """Decode tokens/s against batch size, one line per engine and dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for engine in ("npuserve", "transformers"):
        for dtype in sorted({r.dtype for r in results}):
            points = sorted(
                (r.batch_size, r.decode_tokens_per_s)
                for r in results
                if r.engine == engine and r.dtype == dtype
            )
            if points:
                xs, ys = zip(*points, strict=True)
                style = "-o" if engine == "npuserve" else "--s"
                axes.plot(xs, ys, style, label=f"{engine} {dtype}")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("batch size (concurrent requests)")
    axes.set_ylabel("decode tokens / s")
    axes.set_title("ModelRunner decode throughput vs transformers generate")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
