"""Shared test fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from npuserve.deploy.demo_model import DEMO_MODEL_DIR


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    """The bundled demo model, stories260K (it has a chat template)."""
    return DEMO_MODEL_DIR
