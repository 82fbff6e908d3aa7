"""Shared test fixtures."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from harness.npu_emulation import emulate_npu

from npuserve.deploy.demo_model import DEMO_MODEL_DIR
from npuserve.deploy.grpc_env import set_grpc_environment

# `python -m pytest` puts the working directory, the repository's root, first on sys.path, where
# its `kernels/` (installed as `npuserve.kernels`) shadows the PyPI package `kernels` that
# transformers imports (a dependency of it since 5.25). The root goes last instead of away: the
# tests' own modules (`tests.*`, which spawned children import by name) are found there.
REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != REPO_ROOT]
sys.path.append(str(REPO_ROOT))

# NOTE: the tests launch processes (`Launcher`) while their own gRPC clients run, as `serve` does,
# and run gRPC as npuserve's processes do.
set_grpc_environment()
# One torch thread per process (this one and those it starts) unless the caller sets it: the
# suite runs two test files at once, each with executors and a reference model, all on tiny
# models, and threads of several processes spinning against each other for the same cores
# cost more CPU than they save (three process-heavy files: 233 s with the default, 180 s so).
torch.set_num_threads(int(os.environ.setdefault("OMP_NUM_THREADS", "1")))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A `slow` test (processes, deadlines) runs once more if it fails: the suite runs on every
    core, and a scenario that waits on processes can miss a deadline when two run at once. One
    that fails twice fails the run."""
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.flaky(reruns=1, reruns_delay=1))


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    """The bundled demo model, stories260K (it has a chat template)."""
    return DEMO_MODEL_DIR


@pytest.fixture
def emulated_npu(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """``NPUSERVE_EMULATE_NPU=1`` for this test (and the processes it starts); the torch_npu
    stand-in that ``--device npu`` then installs is removed again afterwards. Yields the
    monkeypatch, to set the emulated machine's variables."""
    emulate_npu(monkeypatch)
    yield monkeypatch
