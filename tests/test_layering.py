"""The data path's layering: the scheduler, gateway and contracts never load torch, transformers or
the executor and kernel packages."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest

import npuserve.gateway
import npuserve.proto
import npuserve.scheduler

pytestmark = pytest.mark.slow  # a fresh interpreter that imports every module


def _modules(package: object) -> list[str]:
    return [m.name for m in pkgutil.walk_packages(package.__path__, f"{package.__name__}.")]  # type: ignore[attr-defined]


def test_scheduler_gateway_and_proto_load_neither_torch_nor_the_executor() -> None:
    modules = [*_modules(npuserve.scheduler), *_modules(npuserve.gateway), *_modules(npuserve.proto)]
    assert len(modules) > 20
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'transformers', 'npuserve.executor', 'npuserve.kernels')))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_command_line_parser_loads_no_torch() -> None:
    """Every `npuserve` command builds the whole parser: the scheduler and gateway processes must
    not pay torch's import for it."""
    code = (
        "import sys\n"
        "from npuserve.deploy.cli import build_parser\n"
        "build_parser().parse_args(['gateway', '--scheduler', '127.0.0.1:1'])\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
