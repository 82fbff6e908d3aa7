"""The bundled demo model: every command that takes --model serves it by default, under its name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from npuserve.deploy.cli import build_parser
from npuserve.deploy.demo_model import DEMO_MODEL_DIR, DEMO_MODEL_NAME, default_served_name

SHIPPED = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "LICENSE",
    "NOTICE",
)


def test_the_demo_model_ships_weights_tokenizer_template_and_license() -> None:
    assert DEMO_MODEL_DIR.name == DEMO_MODEL_NAME == "stories260K"
    missing = [name for name in SHIPPED if not (DEMO_MODEL_DIR / name).is_file()]
    assert not missing
    assert "MIT License" in (DEMO_MODEL_DIR / "LICENSE").read_text()


@pytest.mark.parametrize("command", ["serve", "executor", "scheduler", "bench"])
def test_model_defaults_to_the_demo_model(command: str) -> None:
    args = build_parser().parse_args([command])
    assert args.model == str(DEMO_MODEL_DIR)
    assert build_parser().parse_args([command, "--model", "/m"]).model == "/m"


def test_bench_preset_needs_no_model() -> None:
    args = build_parser().parse_args(["bench", "--preset", "llama-150m"])
    assert args.preset == "llama-150m"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--preset", "llama-150m", "--model", "/m"])


def test_served_name_is_the_demo_name_however_the_path_is_spelled(tmp_path: Path) -> None:
    link = tmp_path / "elsewhere"
    link.symlink_to(DEMO_MODEL_DIR)
    relative = os.path.relpath(DEMO_MODEL_DIR)
    for spelling in (str(DEMO_MODEL_DIR), str(link), relative, str(DEMO_MODEL_DIR) + "/"):
        assert default_served_name(spelling) == DEMO_MODEL_NAME, spelling
    copy = tmp_path / DEMO_MODEL_NAME
    copy.mkdir()
    assert default_served_name(str(copy)) == str(copy)  # any other directory: --model as given
