"""The doctor's findings: one `Check` per fact, a verdict over them, and how they are printed.

JSON shape: ``{"verdict": "ok" | "fail", "checks": [{"name", "status", "detail", "fix"}]}``,
status ``ok`` | ``warn`` | ``fail``; ``fix`` is empty when there is nothing to do.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Literal

Status = Literal["ok", "warn", "fail"]
MARKS: dict[str, str] = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""


def ok(name: str, detail: str) -> Check:
    return Check(name, "ok", detail)


def warn(name: str, detail: str, fix: str) -> Check:
    return Check(name, "warn", detail, fix)


def fail(name: str, detail: str, fix: str) -> Check:
    return Check(name, "fail", detail, fix)


def verdict(checks: list[Check]) -> Literal["ok", "fail"]:
    return "fail" if any(c.status == "fail" for c in checks) else "ok"


def to_json(checks: list[Check]) -> str:
    return json.dumps({"verdict": verdict(checks), "checks": [asdict(c) for c in checks]}, indent=2)


def to_text(checks: list[Check], device: str) -> str:
    """One line per check, then the verdict and one fix line per problem."""
    width = max(len(c.name) for c in checks)
    lines = [f"[{MARKS[c.status]}] {c.name.ljust(width)}  {c.detail}" for c in checks]
    problems = [c for c in checks if c.status != "ok"]
    if verdict(checks) == "ok":
        lines.append(f"\nverdict: ok: this machine can serve on --device {device}")
    else:
        failed = sum(c.status == "fail" for c in checks)
        lines.append(f"\nverdict: fail: {failed} problem(s) keep --device {device} from serving")
    lines += [f"  fix {c.name}: {c.fix}" for c in problems if c.fix]
    return "\n".join(lines)
