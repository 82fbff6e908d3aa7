"""Fixtures of the gateway tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def api_key() -> str:
    return "sk-npuserve-test"
