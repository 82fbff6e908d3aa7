"""`python3 -m npuserve.deploy.probe`, the health probe of the containers, against real processes."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from harness.serve import Served, npuserve_process

from npuserve.deploy.launcher import Launcher

pytestmark = pytest.mark.slow  # starts npuserve processes

PROBE_RUN_TIMEOUT_S = 30


def probe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "npuserve.deploy.probe", *args],
        capture_output=True,
        text=True,
        timeout=PROBE_RUN_TIMEOUT_S,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_serving_executor_passes_both_probes(stories_dir: Path) -> None:
    flags = ["--model", str(stories_dir), "--device", "cpu", "--kv-cache-memory", "0.02", "--port", "0"]
    with npuserve_process("executor", *flags) as (_, ready):
        address = ready["address"]
        for extra in ([], ["--live"]):
            result = probe("executor", address, *extra)
            assert result.returncode == 0, result.stderr
            assert "is serving" in result.stdout


def test_nothing_listening_fails_both_probes() -> None:
    address = f"127.0.0.1:{free_port()}"
    for kind, target in (
        ("executor", address),
        ("scheduler", address),
        ("gateway", f"http://{address}/health"),
    ):
        for extra in ([], ["--live"]):
            result = probe(kind, target, "--timeout", "1", *extra)
            assert result.returncode == 1
            assert f"{kind} at {target} did not answer" in result.stderr


def test_a_gateway_without_its_scheduler_is_alive_but_not_ready() -> None:
    port = free_port()
    scheduler = f"127.0.0.1:{free_port()}"  # nothing listens there
    launcher = Launcher(Path(tempfile.mkdtemp(prefix="npuserve-test-")))
    gateway = launcher.start("gateway", ["gateway", "--scheduler", scheduler, "--port", str(port)])
    url = f"http://127.0.0.1:{port}/health"
    try:
        deadline = time.monotonic() + 60
        while (live := probe("gateway", url, "--live")).returncode != 0:
            assert gateway.exited() is None and time.monotonic() < deadline, live.stderr
            time.sleep(0.2)
        assert "is up" in live.stdout
        ready = probe("gateway", url)
        assert ready.returncode == 1
        assert "up but not serving: HTTP 503" in ready.stderr
    finally:
        launcher.stop()


def test_a_serving_scheduler_and_gateway_pass_readiness(served_stories: Served) -> None:
    for kind, target in (("scheduler", served_stories.address), ("gateway", f"{served_stories.url}/health")):
        result = probe(kind, target)
        assert result.returncode == 0, result.stderr
        assert "is serving" in result.stdout
