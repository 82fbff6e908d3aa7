"""npuserve's layering.

The services (scheduler/, executor/, gateway/, kernels/, proto/) import from deploy/ only its ground
floor: `npuserve.deploy.runtime` (process plumbing) and `npuserve.deploy.demo_model` (the shipped
demo model), never the CLI, the benches, the launcher, the supervisor or the flag tables; the
ground floor imports no service and nothing else from deploy (proto, the contracts, it may). No
import cycle spans two top-level folders. The scheduler, gateway and contracts import neither the
executor nor the kernels, and never load torch or transformers.

The static checks read the source (`harness.import_graph`): an import counts wherever it stands,
inside a function or under ``if TYPE_CHECKING:`` too, except for cycles: a TYPE_CHECKING import
never runs, so it closes no cycle.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness.import_graph import (
    PACKAGE_FOLDERS,
    Import,
    ImportGraph,
    cycle_through,
    installed_packages,
    read_import_graph,
    strongly_connected,
)

import npuserve.gateway
import npuserve.proto
import npuserve.scheduler

SERVICES = ("scheduler", "executor", "gateway", "kernels", "proto")
GROUND_FLOOR = ("npuserve.deploy.runtime", "npuserve.deploy.demo_model")
WITHOUT_TORCH = ("scheduler", "gateway", "proto")
EXECUTION = ("executor", "kernels")


def _folder(module: str) -> str:
    """The top-level folder of a module: "scheduler" for npuserve.scheduler.server."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == package or module.startswith(f"{package}.") for package in packages)


def services_importing_deploy(graph: ImportGraph) -> list[Import]:
    """Imports of a deploy module other than the ground floor's, by a service."""
    return [
        imp
        for imp in graph.imports
        if _folder(imp.source) in SERVICES
        and _folder(imp.target) == "deploy"
        and not _within(imp.target, GROUND_FLOOR)
    ]


def ground_floor_escapes(graph: ImportGraph) -> list[Import]:
    """Imports by the ground floor of anything but itself and proto."""
    return [
        imp
        for imp in graph.imports
        if _within(imp.source, GROUND_FLOOR)
        and not (_within(imp.target, GROUND_FLOOR) or _folder(imp.target) == "proto")
    ]


def execution_imports(graph: ImportGraph) -> list[Import]:
    """Imports of the executor or the kernels by the scheduler, the gateway or proto."""
    return [
        imp
        for imp in graph.imports
        if _folder(imp.source) in WITHOUT_TORCH and _folder(imp.target) in EXECUTION
    ]


def cross_folder_cycles(graph: ImportGraph) -> list[list[str]]:
    """One cycle [a, b, ..., a] for each strongly connected component of the modules' runtime
    imports that spans more than one top-level folder."""
    edges = graph.runtime_edges()
    cycles = []
    for component in strongly_connected(edges):
        if len({_folder(module) for module in component}) > 1:
            start, end = next(
                (a, b)
                for a in component
                for b in sorted(edges[a])
                if b in component and _folder(a) != _folder(b)
            )
            cycles.append(cycle_through(edges, start, end, component))
    return cycles


def _listed(imports: list[Import]) -> str:
    return "\n".join(map(str, imports))


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    graph = read_import_graph(installed_packages())
    assert {_folder(module) for module in graph.modules} == set(PACKAGE_FOLDERS)
    return graph


def test_services_import_only_the_ground_floor_of_deploy(graph: ImportGraph) -> None:
    offenders = services_importing_deploy(graph)
    assert not offenders, (
        "services may import from deploy only npuserve.deploy.runtime and npuserve.deploy.demo_model; "
        "pass what else they need in as a parameter:\n" + _listed(offenders)
    )


def test_the_ground_floor_imports_no_service_and_nothing_else_from_deploy(graph: ImportGraph) -> None:
    offenders = ground_floor_escapes(graph)
    assert not offenders, "the ground floor imports only itself and proto:\n" + _listed(offenders)


def test_scheduler_gateway_and_proto_import_neither_the_executor_nor_the_kernels(graph: ImportGraph) -> None:
    offenders = execution_imports(graph)
    assert not offenders, "the scheduler, gateway and proto run without torch:\n" + _listed(offenders)


def test_no_import_cycle_spans_two_folders(graph: ImportGraph) -> None:
    cycles = cross_folder_cycles(graph)
    assert not cycles, "import cycles across folders:\n" + "\n".join(" -> ".join(c) for c in cycles)


PLANTED = {
    "scheduler/__init__.py": "",
    "scheduler/plan.py": """
from typing import TYPE_CHECKING

from npuserve.deploy.runtime import logs

if TYPE_CHECKING:
    from npuserve.deploy.flags import Flag


def run() -> None:
    from npuserve.deploy import cli
    import npuserve.executor.runner
""",
    "executor/__init__.py": "",
    "executor/runner.py": "from npuserve.scheduler.plan import run\n",
    "gateway/__init__.py": "",
    "gateway/app.py": "import typing\nif typing.TYPE_CHECKING:\n    from npuserve.kernels import ops\n",
    "kernels/__init__.py": "",
    "kernels/ops.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from npuserve.gateway.app import App\n",
    "proto/__init__.py": "",
    "proto/step.py": "",
    "deploy/__init__.py": "",
    "deploy/cli.py": "",
    "deploy/flags.py": "",
    "deploy/runtime/__init__.py": "",
    "deploy/runtime/logs.py": "from . import process_name\nfrom ..flags import Flag\n",
    "deploy/runtime/process_name.py": "from npuserve.proto.step import Step\n",
}


def test_each_check_finds_a_planted_violation(tmp_path: Path) -> None:
    """A tree with one violation of each rule, in each form an import takes (in a function,
    relative, from a package, under TYPE_CHECKING), and a TYPE_CHECKING-only circle that is none."""
    for name, text in PLANTED.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    planted = read_import_graph({f"npuserve.{folder}": tmp_path / folder for folder in PACKAGE_FOLDERS})

    def pairs(imports: list[Import]) -> set[tuple[str, str, bool]]:
        return {(imp.source, imp.target, imp.type_only) for imp in imports}

    assert pairs(services_importing_deploy(planted)) == {
        ("npuserve.scheduler.plan", "npuserve.deploy.flags", True),
        ("npuserve.scheduler.plan", "npuserve.deploy.cli", False),
    }
    assert pairs(ground_floor_escapes(planted)) == {
        ("npuserve.deploy.runtime.logs", "npuserve.deploy.flags", False)
    }
    assert pairs(execution_imports(planted)) == {
        ("npuserve.scheduler.plan", "npuserve.executor.runner", False),
        ("npuserve.gateway.app", "npuserve.kernels.ops", True),
    }
    assert cross_folder_cycles(planted) == [
        ["npuserve.executor.runner", "npuserve.scheduler.plan", "npuserve.executor.runner"]
    ]


def _modules(package: object) -> list[str]:
    return [m.name for m in pkgutil.walk_packages(package.__path__, f"{package.__name__}.")]  # type: ignore[attr-defined]


@pytest.mark.slow  # a fresh interpreter that imports every module
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


@pytest.mark.slow  # a fresh interpreter
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
