"""Fixtures of the gateway tests."""

from __future__ import annotations

from typing import Any

import pytest
from harness.serve import Served, openai_client


@pytest.fixture(scope="session")
def api_key() -> str:
    return "sk-npuserve-test"


@pytest.fixture(scope="module")
def client(served: Served) -> Any:
    """The official `openai` client on the gateway of the module's ``served``."""
    return openai_client(served)


@pytest.fixture(scope="module")
def model(client: Any) -> str:
    return str(client.models.list().data[0].id)
