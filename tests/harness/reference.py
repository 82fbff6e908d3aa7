"""transformers as the reference implementation: greedy continuations of the same weights."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch


def transformers_greedy(model_dir: Path, prompts: Sequence[Sequence[int]], num_new: int) -> list[list[int]]:
    """Exactly ``num_new`` greedy tokens after each prompt (EOS does not stop it), float32."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    for prompt in prompts:
        generated = model.generate(
            torch.tensor([list(prompt)]),
            max_new_tokens=num_new,
            min_new_tokens=num_new,
            do_sample=False,
            pad_token_id=0,
        )
        outputs.append(generated[0, len(prompt) :].tolist())
    return outputs
