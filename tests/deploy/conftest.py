"""Fixtures of the deployment tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.serve import Served, serve


@pytest.fixture(scope="session")
def served_stories(stories_dir: Path) -> Iterator[Served]:
    """One `npuserve serve` of the shared stories260K model, shared by the tests that only read
    from it (its probes and its /metrics), since each start costs tens of seconds here."""
    with serve(stories_dir, "--kv-cache-memory", "0.02") as served:
        yield served
