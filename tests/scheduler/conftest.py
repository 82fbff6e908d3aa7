"""Fixtures of the scheduler's tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from npuserve.scheduler.text.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer(stories_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(stories_dir)
