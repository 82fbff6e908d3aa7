"""Which CANN releases each torch_npu release is built for: the Ascend version sets, as data.

Torch-free, so `npuserve doctor` can read it without importing torch. Every row names its source.
CANN, torch and torch_npu are released together; a torch_npu wheel loads only the CANN libraries
of its own set, and a mismatch is the most common Ascend failure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

# The "昇腾辅助软件" (Ascend auxiliary software) table of the Ascend Extension for PyTorch README
# (gitcode.com/Ascend/pytorch, README.zh.md, branch v2.9.0): CANN version, torch, torch_npu, branch.
PTA_README = "Ascend/pytorch README.zh.md, table 昇腾辅助软件"
# vllm-ascend v0.13.0 (docs and Dockerfile) pairs CANN 8.5.0 + torch 2.8.0 + torch_npu 2.8.0.post2.
VLLM_ASCEND_0_13 = "vllm-ascend v0.13.0 installation docs"
# vllm-ascend's images build on quay.io/ascend/cann:8.3.rc2 from v0.11.0 to v0.13.0rc1 (Dockerfile
# FROM), with the torch-npu its pyproject.toml pins; docs/source/community/versioning_policy.md
# (tag v0.13.0) lists v0.11.0 with torch_npu 2.7.1.post1.
VLLM_ASCEND_0_12 = "vllm-ascend v0.12.0rc1 and v0.13.0rc1 (Dockerfile, pyproject.toml)"
VLLM_ASCEND_0_11 = "vllm-ascend v0.11.0 (Dockerfile, pyproject.toml)"
VLLM_ASCEND_POLICY = "vllm-ascend versioning_policy.md, release v0.11.0"


@dataclass(frozen=True, slots=True)
class VersionSet:
    cann: str
    torch: str
    torch_npu: str
    source: str


VERSION_SETS: tuple[VersionSet, ...] = (
    VersionSet("9.0.0", "2.10.0", "2.10.0", f"{PTA_README} (branch v2.10.0-26.0.0)"),
    VersionSet("9.0.0", "2.9.0", "2.9.0.post2", f"{PTA_README} (branch v2.9.0-26.0.0)"),
    VersionSet("8.5.0", "2.9.0", "2.9.0", PTA_README),
    VersionSet("8.5.0", "2.8.0", "2.8.0.post2", f"{PTA_README}; {VLLM_ASCEND_0_13}"),
    VersionSet("8.5.0", "2.7.1", "2.7.1.post2", PTA_README),
    VersionSet("8.5.0", "2.6.0", "2.6.0.post5", PTA_README),
    VersionSet("8.3.RC2", "2.8.0", "2.8.0", VLLM_ASCEND_0_12),
    VersionSet("8.3.RC2", "2.7.1", "2.7.1.post1", VLLM_ASCEND_POLICY),
    VersionSet("8.3.RC2", "2.7.1", "2.7.1", VLLM_ASCEND_0_11),
    VersionSet("8.3.RC1", "2.8.0", "2.8.0", PTA_README),
    VersionSet("8.3.RC1", "2.7.1", "2.7.1", PTA_README),
    VersionSet("8.3.RC1", "2.6.0", "2.6.0.post3", PTA_README),
    VersionSet("8.3.RC1", "2.1.0", "2.1.0.post17", PTA_README),
    VersionSet("8.2.RC1", "2.6.0", "2.6.0", PTA_README),
    VersionSet("8.2.RC1", "2.5.1", "2.5.1.post1", PTA_README),
    VersionSet("8.2.RC1", "2.1.0", "2.1.0.post13", PTA_README),
    VersionSet("8.1.RC1", "2.5.1", "2.5.1", PTA_README),
    VersionSet("8.1.RC1", "2.4.0", "2.4.0.post4", PTA_README),
    VersionSet("8.1.RC1", "2.3.1", "2.3.1.post6", PTA_README),
    VersionSet("8.1.RC1", "2.1.0", "2.1.0.post12", PTA_README),
    VersionSet("8.0.0", "2.4.0", "2.4.0.post2", PTA_README),
    VersionSet("8.0.0", "2.3.1", "2.3.1.post4", PTA_README),
    VersionSet("8.0.0", "2.1.0", "2.1.0.post10", PTA_README),
)
# The set the README names and images ship: vllm-ascend v0.13.0's.
RECOMMENDED = next(row for row in VERSION_SETS if row.source.endswith(VLLM_ASCEND_0_13))


def release(version: str) -> str:
    """The release a version string names: ``2.8.0+cpu`` -> ``2.8.0``; ``2.8.0.post2.dev2025`` ->
    ``2.8.0.post2``; ``CANN-8.3.rc1`` and ``8.3.RC1.alpha002`` -> ``8.3.RC1``; ``8.5.0.B120`` ->
    ``8.5.0``. Unreadable text comes back stripped."""
    match = re.search(r"\d+(?:\.\d+)*(?:\.(?:post\d+|rc\d+))?", version, re.IGNORECASE)
    if match is None:
        return version.strip()
    return re.sub(r"rc(\d+)$", r"RC\1", match.group(0), flags=re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class CannFit:
    """How an installed CANN release goes with a torch_npu release (`cann_fit`).

    ``status``: ``known`` (one of the torch_npu's sets), ``rc_only`` (it differs from a known set
    in its RC number only: served, with a warning), ``mismatch`` (refused), ``unchecked`` (the
    table does not list the torch_npu, or the CANN release is unknown).
    """

    status: Literal["known", "rc_only", "mismatch", "unchecked"]
    sets: tuple[VersionSet, ...]  # the torch_npu's known sets
    message: str = ""  # why, for rc_only and mismatch


def cann_fit(torch_npu_version: str, cann_version: str | None) -> CannFit:
    """Whether this CANN goes with this torch_npu: the one decision the executor and
    `npuserve doctor` both take."""
    sets = sets_for_torch_npu(torch_npu_version)
    if not sets or cann_version is None:
        return CannFit("unchecked", sets)  # a release the table does not list: nothing to check against
    cann = release(cann_version).upper()
    same = tuple(row for row in sets if row.cann.upper() == cann)
    if same:
        return CannFit("known", same)
    built_for = " or ".join(row.cann for row in sets)
    sources = "; ".join(dict.fromkeys(row.source for row in sets))
    what = f"CANN {cann_version} is not the CANN torch_npu {release(torch_npu_version)} is built for"
    line = _rc_line(cann)
    if line is not None and any(_rc_line(row.cann) == line for row in sets):
        return CannFit(
            "rc_only", sets, f"{what} ({built_for}; source: {sources}); it differs in the RC number only"
        )
    return CannFit("mismatch", sets, f"{what} ({built_for}; source: {sources})")


def _rc_line(cann: str) -> str | None:
    """``8.3`` of ``8.3.RC2``; None for a release that is not an RC (``8.5.0``)."""
    match = re.fullmatch(r"(\d+\.\d+)\.RC\d+", cann, re.IGNORECASE)
    return match.group(1) if match else None


def sets_for_torch_npu(torch_npu_version: str) -> tuple[VersionSet, ...]:
    """The known sets of this torch_npu release (several CANN releases may carry one)."""
    wanted = release(torch_npu_version).lower()
    return tuple(row for row in VERSION_SETS if row.torch_npu.lower() == wanted)


def sets_for_cann(cann_version: str) -> list[VersionSet]:
    wanted = release(cann_version).lower()
    return [row for row in VERSION_SETS if row.cann.lower() == wanted]


def describe(version_set: VersionSet) -> str:
    return f"CANN {version_set.cann} + torch {version_set.torch} + torch_npu {version_set.torch_npu}"
