"""Every YAML file under deploy/ is yamllint-clean under the repository's .yamllint, strictly."""

from __future__ import annotations

import subprocess
import sys

import pytest
from harness.deploy_files import DEPLOY, REPO

pytest.importorskip("yamllint")


def test_deploy_yaml_is_yamllint_clean() -> None:
    files = sorted({*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml"), REPO / ".yamllint"})
    assert len(files) > 10
    result = subprocess.run(
        [sys.executable, "-m", "yamllint", "--strict", "-c", str(REPO / ".yamllint"), *map(str, files)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
