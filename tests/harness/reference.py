"""transformers as the reference implementation: greedy continuations of the same weights."""

from __future__ import annotations

import shutil
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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def save_random_llama(path: Path, tokenizer_dir: Path, seed: int, **config: object) -> Path:
    """A seeded random-weight Llama (vocab 512, bos 1, eos 2, 512 positions unless ``config`` says
    otherwise) in Hugging Face layout at ``path``, with the tokenizer files of ``tokenizer_dir``
    (the demo model's), so `npuserve serve` can run it on text."""
    import transformers

    torch.manual_seed(seed)
    settings: dict[str, object] = {
        "vocab_size": 512,
        "max_position_embeddings": 512,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **config,
    }
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings)).save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, path / name)
    return path
