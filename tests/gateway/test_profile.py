"""Profiling through the gateway: POST /start_profile and /stop_profile on a real `npuserve serve`."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from harness.serve import serve

pytestmark = pytest.mark.slow  # starts npuserve processes

COMPLETION = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}


@contextmanager
def gateway(model: Path, *flags: str) -> Iterator[httpx.Client]:
    with serve(model, "--kv-cache-memory", "0.05", *flags) as served:
        client = httpx.Client(base_url=served.url, timeout=120)
        try:
            yield client
        finally:
            client.close()


def _self_cpu_ops(table: str) -> dict[str, int]:
    """Operator name -> number of calls, from the top-ops table the executor writes."""
    calls = {}
    for line in table.splitlines():
        match = re.match(r"\s*(aten::\S+|\S+)\s+.*?\s(\d+)\s*$", line)
        if match and match.group(1).startswith("aten::"):
            calls[match.group(1)] = int(match.group(2))
    return calls


def test_a_profile_taken_through_the_gateway_holds_the_models_ops(stories_dir: Path, tmp_path: Path) -> None:
    profile_dir = tmp_path / "profiles"
    with gateway(stories_dir, "--profile-dir", str(profile_dir)) as client:
        conflict = client.post("/stop_profile")
        assert conflict.status_code == 409, conflict.text
        assert "no profile is running" in conflict.json()["error"]["message"]

        started = client.post("/start_profile")
        assert started.status_code == 200, started.text
        assert len(started.json()["executors"]) == 1
        again = client.post("/start_profile")
        assert again.status_code == 409 and "already running" in again.json()["error"]["message"]

        for _ in range(2):
            assert (
                client.post("/v1/completions", json={"model": served_model(client), **COMPLETION}).status_code
                == 200
            )

        stopped = client.post("/stop_profile")
        assert stopped.status_code == 200, stopped.text
    (files,) = stopped.json()["traces"].values()
    traces = [Path(f) for f in files if f.endswith(".pt.trace.json")]
    tables = [Path(f) for f in files if f.endswith(".top_ops.txt")]
    assert len(traces) == 1 and len(tables) == 1
    assert traces[0].parent == profile_dir and '"traceEvents"' in traces[0].read_text()
    ops = _self_cpu_ops(tables[0].read_text())
    assert ops.keys() & {"aten::mm", "aten::linear", "aten::addmm", "aten::matmul"}, ops
    assert "aten::embedding" in ops or "aten::index_select" in ops, ops
    print(tables[0].read_text())


def test_profiling_is_off_without_profile_dir(stories_dir: Path) -> None:
    with gateway(stories_dir, "--no-warmup") as client:
        for route in ("/start_profile", "/stop_profile"):
            response = client.post(route)
            assert response.status_code == 400, response.text
            assert "--profile-dir" in response.json()["error"]["message"]


def served_model(client: httpx.Client) -> str:
    return client.get("/v1/models").json()["data"][0]["id"]
