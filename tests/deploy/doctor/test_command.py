"""`npuserve doctor` as a user runs it, on this NPU-less machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_doctor(argv: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """The real command, with an empty Ascend root and /dev (whatever this machine has)."""
    child_env = {
        **os.environ,
        "NPUSERVE_ASCEND_ROOT": str(tmp_path / "no-ascend"),
        "NPUSERVE_DEV_ROOT": str(tmp_path),
        **env,
    }
    for name in ("ASCEND_RT_VISIBLE_DEVICES", "ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ATB_HOME_PATH"):
        child_env.pop(name, None)
    command = [sys.executable, "-m", "npuserve.deploy.cli", "doctor", *argv]
    return subprocess.run(command, capture_output=True, text=True, env=child_env, timeout=120, check=False)


def test_npu_on_a_machine_without_one_fails_with_a_fix_for_each_problem(
    tmp_path: Path, stories_dir: Path
) -> None:
    done = run_doctor(["--device", "npu", "--model", str(stories_dir), "--json"], tmp_path)
    assert done.returncode != 0, done.stderr
    report = json.loads(done.stdout)
    assert report["verdict"] == "fail"
    checks = {c["name"]: c for c in report["checks"]}
    assert all(set(c) == {"name", "status", "detail", "fix"} for c in report["checks"])
    assert {c["status"] for c in report["checks"]} <= {"ok", "warn", "fail"}
    for name in ("driver", "cann", "torch_npu", "head_dim", "npus"):
        assert checks[name]["status"] == "fail" and checks[name]["fix"], checks[name]
    assert "head_dim 8" in checks["head_dim"]["detail"]
    assert "pip install" in checks["torch_npu"]["fix"] and "set_env.sh" in checks["cann"]["fix"]
    npus = checks["npus"]["fix"]
    assert "npu-smi info" in npus and "/dev/davinci" in npus and "ASCEND_RT_VISIBLE_DEVICES" in npus
    assert "GPU" not in done.stdout.replace("--gpu-memory-utilization", "")


def test_cpu_passes(tmp_path: Path, stories_dir: Path) -> None:
    done = run_doctor(["--device", "cpu", "--model", str(stories_dir), "--json"], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["verdict"] == "ok"
    assert {c["name"] for c in report["checks"]} >= {
        "python",
        "torch",
        "model",
        "head_dim",
        "weights",
        "kv cache",
    }


def test_the_human_report_ends_with_one_fix_line_per_problem(tmp_path: Path, stories_dir: Path) -> None:
    done = run_doctor(["--device", "npu", "--model", str(stories_dir)], tmp_path)
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    verdict_at = next(i for i, line in enumerate(lines) if line.startswith("verdict: fail"))
    fixes = lines[verdict_at + 1 :]
    failed = [line for line in lines[:verdict_at] if line.startswith("[FAIL]")]
    assert len(fixes) >= len(failed) >= 5
    assert all(line.startswith("  fix ") for line in fixes)
    assert any(line.startswith("  fix head_dim: ") for line in fixes)
