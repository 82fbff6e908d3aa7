"""The real pretrained TinyStories 260K model reproduces its recorded greedy continuation."""

from __future__ import annotations

from pathlib import Path

from harness.demo_story import ONCE, ONCE_60
from harness.step_driver import DrivenRequest, StepDriver
from tokenizers import Tokenizer

from npuserve.executor.config import ExecutorConfig
from npuserve.executor.model_runner import ModelRunner
from npuserve.proto.step_plan import SamplingOptions

PROMPT_IDS = [1, 403, 407, 261, 378]  # ONCE


def test_greedy_continuation_matches_source(stories_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(stories_dir / "tokenizer.json"))
    assert tokenizer.encode(ONCE).ids == PROMPT_IDS
    runner = ModelRunner(ExecutorConfig(model=str(stories_dir), kv_cache_memory_gib=0.01))
    request = DrivenRequest("story", PROMPT_IDS, 60, SamplingOptions(temperature=0))
    StepDriver(runner, token_budget=4).run([request])  # chunked prefill, then decode
    assert tokenizer.decode(PROMPT_IDS + request.output) == ONCE + ONCE_60
