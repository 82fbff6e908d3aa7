"""Shared test fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED_MODELS = Path(__file__).resolve().parents[2] / "shared" / "models"
STORIES_260K = SHARED_MODELS / "stories260K-hf"


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    if not (STORIES_260K / "config.json").is_file():
        pytest.skip(f"the shared model {STORIES_260K} is not on this machine")
    return STORIES_260K
