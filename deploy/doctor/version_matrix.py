"""The CANN / torch / torch_npu sets known to work together, as data, each with its source.

CANN, torch and torch_npu are released as one set: torch_npu is built against one torch release
and one CANN release. A row names the set; `find_set` looks an installed torch_npu up.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ASCEND_PYTORCH_README = "Ascend/pytorch README, version matching table"
ASCEND_PYTORCH_720_NOTES = "hiascend Ascend Extension for PyTorch 7.2.0 release notes, version table"


@dataclass(frozen=True, slots=True)
class VersionSet:
    cann: str
    torch: str
    torch_npu: str
    source: str


VERSION_SETS: tuple[VersionSet, ...] = (
    VersionSet("9.0.0", "2.10.0", "2.10.0", ASCEND_PYTORCH_README + " (branch v2.10.0-26.0.0)"),
    VersionSet("9.0.0", "2.9.0", "2.9.0.post2", ASCEND_PYTORCH_README + " (branch v2.9.0-26.0.0)"),
    VersionSet(
        "8.5.0", "2.8.0", "2.8.0.post2", "vllm-ascend v0.13.0 installation guide; " + ASCEND_PYTORCH_README
    ),
    VersionSet("8.5.0", "2.9.0", "2.9.0", ASCEND_PYTORCH_README + " (branch v2.9.0-7.3.0)"),
    VersionSet("8.5.0", "2.7.1", "2.7.1.post2", ASCEND_PYTORCH_README + " (branch v2.7.1-7.3.0)"),
    VersionSet("8.5.0", "2.6.0", "2.6.0.post5", ASCEND_PYTORCH_README + " (branch v2.6.0-7.3.0)"),
    VersionSet("8.3.RC1", "2.8.0", "2.8.0", ASCEND_PYTORCH_720_NOTES),
    VersionSet("8.3.RC1", "2.7.1", "2.7.1", ASCEND_PYTORCH_720_NOTES),
    VersionSet("8.3.RC1", "2.6.0", "2.6.0.post3", ASCEND_PYTORCH_720_NOTES),
    VersionSet("8.2.RC1", "2.6.0", "2.6.0", ASCEND_PYTORCH_720_NOTES),
    VersionSet("8.2.RC1", "2.5.1", "2.5.1.post1", ASCEND_PYTORCH_720_NOTES),
    VersionSet("8.1.RC1", "2.5.1", "2.5.1", ASCEND_PYTORCH_720_NOTES),
    VersionSet("8.1.RC1", "2.4.0", "2.4.0.post4", ASCEND_PYTORCH_720_NOTES),
    VersionSet("8.0.0", "2.4.0", "2.4.0.post2", ASCEND_PYTORCH_720_NOTES),
    VersionSet("8.0.0", "2.3.1", "2.3.1.post4", ASCEND_PYTORCH_720_NOTES),
)
RECOMMENDED = VERSION_SETS[2]  # the set vllm-ascend v0.13.0 pairs, which the README names


def release(version: str) -> str:
    """``2.8.0+cpu`` -> ``2.8.0``; ``2.8.0.post2.dev2025`` -> ``2.8.0.post2``; ``8.5.0.B120`` -> ``8.5.0``."""
    match = re.match(r"\s*(\d+(?:\.\d+)*(?:\.(?:post\d+|RC\d+))?)", version, re.IGNORECASE)
    return match.group(1) if match else version.strip()


def find_set(torch_npu: str) -> VersionSet | None:
    """The known set of this torch_npu release, if any."""
    wanted = release(torch_npu).lower()
    return next((s for s in VERSION_SETS if s.torch_npu.lower() == wanted), None)


def sets_for_cann(cann: str) -> list[VersionSet]:
    wanted = release(cann).lower()
    return [s for s in VERSION_SETS if s.cann.lower() == wanted]


def describe(version_set: VersionSet) -> str:
    return f"CANN {version_set.cann} + torch {version_set.torch} + torch_npu {version_set.torch_npu}"
