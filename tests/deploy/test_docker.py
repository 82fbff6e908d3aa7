"""deploy/docker: what can be checked without a Docker daemon. The files the images COPY exist and
survive .dockerignore, the pinned versions lie inside pyproject's ranges and match the README's
version set, and the entry point loads the Ascend environment (or names what is missing)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from harness.deploy_files import DEPLOY, DOCKERFILES, REPO, dockerfile_args, dockerfile_instructions
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

ENTRYPOINT = DEPLOY / "docker" / "entrypoint.sh"
CONSTRAINTS = DEPLOY / "docker" / "constraints.txt"
ASCEND = DEPLOY / "docker" / "Dockerfile.ascend"
CPU = DEPLOY / "docker" / "Dockerfile.cpu"


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def requirements(names: list[str]) -> dict[str, Requirement]:
    return {Requirement(r).name.lower().replace("_", "-"): Requirement(r) for r in names}


def _pattern(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex: `*` and `?` within one folder, `**` across folders."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            out += {"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i]))
            i += 1
    return re.compile(out + r"\Z")


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore drops ``path`` (or a folder above it) from the build context;
    the last matching pattern wins, and `!` brings a path back."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        regex = _pattern(pattern.removeprefix("!"))
        if any(regex.match(prefix) for prefix in prefixes):
            excluded = not pattern.startswith("!")
    return excluded


def dockerignore() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_copied_file_exists_and_reaches_the_build_context(dockerfile: Path) -> None:
    patterns = dockerignore()
    copied = []
    for instruction in dockerfile_instructions(dockerfile):
        if instruction.keyword != "COPY":
            continue
        *sources, _ = instruction.value.split()
        for source in sources:
            assert (REPO / source).exists(), f"{dockerfile.name} copies {source}, which is missing"
            assert not ignored(source, patterns), (
                f".dockerignore drops {source}, which {dockerfile.name} copies"
            )
            copied.append(source.rstrip("/"))
    # NOTE: `pip install .` needs every package folder pyproject names.
    package_dirs = set(pyproject()["tool"]["setuptools"]["package-dir"].values())
    assert package_dirs <= set(copied), package_dirs - set(copied)
    assert {"pyproject.toml", "README.md"} <= set(copied)


def test_dockerignore_keeps_the_context_small() -> None:
    patterns = dockerignore()
    for heavy in (".git", ".venv", "tests", "proto/__pycache__", "deploy/benchmarks/runner-decode.png"):
        assert ignored(heavy, patterns), heavy
    for needed in ("proto/executor_pb2.py", "deploy/docker/entrypoint.sh", "README.md"):
        assert not ignored(needed, patterns), needed


def test_constraints_pin_every_runtime_dependency_inside_its_range() -> None:
    wanted = requirements(pyproject()["project"]["dependencies"])
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            pin = Requirement(line)
            (spec,) = pin.specifier
            assert spec.operator == "==" and not pin.extras, f"{line}: pins are exact, without extras"
            pins[pin.name.lower().replace("_", "-")] = Version(spec.version)
    assert set(pins) == set(wanted) - {"torch"}  # torch is pinned per image
    for name, version in pins.items():
        assert wanted[name].specifier.contains(version), f"{name}=={version} is outside {wanted[name]}"


def test_the_cpu_image_pins_the_torch_that_ci_and_the_readme_install() -> None:
    version = dockerfile_args(CPU)["TORCH_VERSION"]
    for text in ((REPO / ".ci" / "run").read_text(), (REPO / "README.md").read_text()):
        assert f"torch=={version}" in text
    assert requirements(pyproject()["project"]["dependencies"])["torch"].specifier.contains(Version(version))


def test_the_ascend_image_is_the_readme_version_set() -> None:
    args = dockerfile_args(ASCEND)
    cann = re.fullmatch(r"quay\.io/ascend/cann:(\d+\.\d+\.\d+)-910b-ubuntu22\.04-py3\.11", args["CANN_IMAGE"])
    assert cann, args["CANN_IMAGE"]
    readme = " ".join((REPO / "README.md").read_text().split())
    version_set = (
        f"CANN {cann.group(1)} with torch {args['TORCH_VERSION']} and torch_npu {args['TORCH_NPU_VERSION']}"
    )
    assert version_set in readme
    ascend = requirements(pyproject()["project"]["optional-dependencies"]["ascend"])
    assert ascend["torch-npu"].specifier.contains(Version(args["TORCH_NPU_VERSION"]))
    # torch_npu X.Y.Z(.postN) is built against torch X.Y.Z.
    assert Version(args["TORCH_NPU_VERSION"]).base_version == args["TORCH_VERSION"]
    env = " ".join(i.value for i in dockerfile_instructions(ASCEND) if i.keyword == "ENV")
    assert "NPUSERVE_ASCEND_ENV=required" in env


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_run_as_their_own_user(dockerfile: Path) -> None:
    users = [i.value for i in dockerfile_instructions(dockerfile) if i.keyword == "USER"]
    assert users and users[-1] not in ("root", "0")


def fake_ascend(root: Path, layout: str, nnal: bool = True) -> None:
    """set_env.sh files that export a marker and, as Ascend's do, read an unset variable."""
    toolkit = root / layout / "set_env.sh"
    toolkit.parent.mkdir(parents=True)
    toolkit.write_text('export ASCEND_TOOLKIT_LOADED="$NOT_SET_ANYWHERE:toolkit"\n')
    if nnal:
        atb = root / "nnal" / "atb" / "set_env.sh"
        atb.parent.mkdir(parents=True)
        atb.write_text('export ATB_LOADED="$NOT_SET_ANYWHERE:nnal"\n')


def run_entrypoint(env: dict[str, str], *command: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("NPUSERVE_ASCEND_ENV", "ASCEND_HOME")}
    return subprocess.run(
        ["bash", str(ENTRYPOINT), *command], env={**base, **env}, capture_output=True, text=True, timeout=30
    )


@pytest.mark.parametrize("layout", ["ascend-toolkit", "cann"])
def test_entrypoint_sources_the_toolkit_and_nnal_then_runs_the_command(tmp_path: Path, layout: str) -> None:
    fake_ascend(tmp_path, layout)
    result = run_entrypoint(
        {"NPUSERVE_ASCEND_ENV": "required", "ASCEND_HOME": str(tmp_path)},
        "sh", "-c", 'echo "$ASCEND_TOOLKIT_LOADED $ATB_LOADED"',
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [":toolkit", ":nnal"]


def test_entrypoint_names_a_missing_nnal(tmp_path: Path) -> None:
    fake_ascend(tmp_path, "cann", nnal=False)
    result = run_entrypoint({"NPUSERVE_ASCEND_ENV": "required", "ASCEND_HOME": str(tmp_path)}, "true")
    assert result.returncode == 1
    assert f"{tmp_path}/nnal/atb/set_env.sh does not exist" in result.stderr


def test_entrypoint_names_a_missing_toolkit(tmp_path: Path) -> None:
    result = run_entrypoint({"NPUSERVE_ASCEND_ENV": "required", "ASCEND_HOME": str(tmp_path)}, "true")
    assert result.returncode == 1 and "no CANN toolkit" in result.stderr


def test_entrypoint_without_ascend_runs_the_command_as_is(tmp_path: Path) -> None:
    result = run_entrypoint(
        {"ASCEND_HOME": str(tmp_path)}, "sh", "-c", "echo $$ ${ASCEND_TOOLKIT_LOADED:-none}"
    )
    assert result.returncode == 0 and result.stdout.split()[1] == "none"
