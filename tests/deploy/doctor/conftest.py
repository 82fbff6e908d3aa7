"""Fixture trees of Ascend version files, a fake `npu-smi` replaying real outputs, and a
model directory whose head_dim the NPU kernels take."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

FIXTURES = Path(__file__).parent / "fixtures"
NPU_SMI_OUTPUTS = FIXTURES / "npu_smi"
ASCEND_TREES = FIXTURES / "ascend"


@pytest.fixture
def fake_npu_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``use(name)`` puts an `npu-smi` on PATH that prints ``fixtures/npu_smi/<name>.txt``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "npu-smi"

    def use(name: str) -> Path:
        output = NPU_SMI_OUTPUTS / f"{name}.txt"
        assert output.is_file(), output
        script.write_text(f'#!/bin/sh\n[ "$1" = info ] || exit 2\ncat "{output}"\n')
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        return bin_dir

    return use


@pytest.fixture
def dev_root(tmp_path: Path) -> Path:
    """A /dev with eight NPU device nodes (plain files: only their names are read)."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in [*(f"davinci{i}" for i in range(8)), "davinci_manager", "devmm_svm", "hisi_hdc"]:
        (dev / name).touch()
    return dev


@pytest.fixture(scope="session")
def head_dim_64_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with head_dim 64 (2 heads of 64), in Hugging Face layout."""
    path = tmp_path_factory.mktemp("llama-hd64")
    hidden, inter, vocab, layers = 128, 256, 512, 2
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": True,
    }
    (path / "config.json").write_text(json.dumps(config))
    tensors = {"model.embed_tokens.weight": torch.zeros(vocab, hidden, dtype=torch.bfloat16)}
    for i in range(layers):
        tensors[f"model.layers.{i}.mlp.up_proj.weight"] = torch.zeros(inter, hidden, dtype=torch.bfloat16)
    save_file(tensors, str(path / "model.safetensors"))
    return path
