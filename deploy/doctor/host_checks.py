"""Checks of the machine: Python, torch, the Ascend stack, its version set and the visible NPUs.

Every problem is a `Check` with the fix an operator can apply. With ``--device npu`` an Ascend
problem fails the verdict; with ``auto`` it only warns (npuserve falls back to another device).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from npuserve.deploy.doctor.facts import AUTOLOAD_ENV, NETWORK_ENV, HostFacts, VersionFile
from npuserve.deploy.doctor.npu_smi import NpuChip
from npuserve.deploy.doctor.report import Check, fail, ok, warn
from npuserve.executor.version_matrix import (
    RECOMMENDED,
    VersionSet,
    cann_fit,
    describe,
    release,
    sets_for_cann,
)

MIN_PYTHON = (3, 10)
DEVICE_NODES = "/dev/davinci<N> (with /dev/davinci_manager, /dev/devmm_svm and /dev/hisi_hdc)"
UNSUPPORTED_CHIPS = ("310",)  # the fused attention runs on Atlas A2/A3 (910B, 910_93) only


def python_check() -> Check:
    version = ".".join(map(str, sys.version_info[:3]))
    if sys.version_info[:2] < MIN_PYTHON:
        return fail("python", f"Python {version}", "use Python 3.10 or newer")
    return ok("python", f"Python {version}")


def torch_check(facts: HostFacts) -> Check:
    version = facts.packages.get("torch")
    if version is None:
        return fail("torch", "torch is not installed", f"pip install torch=={RECOMMENDED.torch}")
    return ok("torch", f"torch {version}")


def autoload_check(facts: HostFacts) -> Check:
    shown = _setting(facts, AUTOLOAD_ENV)
    if facts.packages.get("torch_npu") is None or facts.env.get(AUTOLOAD_ENV) == "0":
        return ok("torch autoload", shown)
    return warn(
        "torch autoload",
        f"{shown}: `import torch` also imports torch_npu, so a mismatched set fails inside torch "
        "before any version check can explain it",
        f"export {AUTOLOAD_ENV}=0 in other tools that import torch",
    )


class AscendChecks:
    """The Ascend checks; ``strict`` (--device npu) makes their problems failures."""

    def __init__(self, facts: HostFacts, strict: bool) -> None:
        self.facts = facts
        self.problem: Callable[[str, str, str], Check] = fail if strict else warn
        self.root = facts.ascend_root

    def all(self) -> list[Check]:
        return [
            self.driver(),
            self.firmware(),
            self.cann(),
            self.driver_cann(),
            self.nnal(),
            self.torch_npu(),
            self.version_set(),
            self.devices(),
            self.network(),
        ]

    def driver(self) -> Check:
        driver = self.facts.driver
        if driver is None:
            return self.problem(
                "driver",
                f"no Ascend driver: {self.root / 'driver' / 'version.info'} is missing",
                "install the Ascend HDK driver and firmware for your NPUs (`npu-smi info` must list "
                f"them); in a container, mount {self.root / 'driver'}, npu-smi and {DEVICE_NODES}",
            )
        return ok("driver", f"driver {driver.get('Version')} ({driver.family or 'no Innerversion'})")

    def firmware(self) -> Check:
        firmware = self.facts.firmware
        if firmware is None:
            # NOTE: containers usually mount only the driver; the firmware lives on the host.
            return ok("firmware", f"{self.root / 'firmware' / 'version.info'} not present (host side)")
        return ok(
            "firmware", f"firmware {firmware.get('Version')} (package {firmware.get('package_version')})"
        )

    def cann(self) -> Check:
        cann = self.facts.cann
        if cann is None:
            return self.problem(
                "cann",
                f"no CANN toolkit under {self.root} (ascend-toolkit/latest, cann, cann-*)",
                f"install the CANN toolkit of your set ({describe(RECOMMENDED)}), then "
                f"source {self.root / 'ascend-toolkit' / 'set_env.sh'} (CANN 8.5+: cann/set_env.sh)",
            )
        detail = f"CANN {cann.get('version')} ({cann.path.parent})"
        if not (self.facts.env.get("ASCEND_HOME_PATH") or self.facts.env.get("ASCEND_TOOLKIT_HOME")):
            return self.problem(
                "cann",
                f"{detail} is installed but its environment is not set (ASCEND_HOME_PATH is unset)",
                f"source {_set_env(cann)} in the shell that starts npuserve",
            )
        return ok("cann", detail)

    def driver_cann(self) -> Check:
        driver, cann = self.facts.driver, self.facts.cann
        if driver is None or cann is None or not driver.family or not cann.family:
            return ok("driver+cann", "not checked (driver or CANN version unknown)")
        if driver.family in cann.compatible or cann.family in driver.compatible:
            return ok("driver+cann", f"driver {driver.get('Version')} runs CANN {cann.get('version')}")
        return self.problem(
            "driver+cann",
            f"driver {driver.get('Version')} ({driver.family}) and CANN {cann.get('version')} "
            f"({cann.family}) do not list each other as compatible (CANN runs on "
            f"{', '.join(cann.compatible) or 'unknown'})",
            f"install the driver release your CANN {cann.get('version')} names, or the CANN release "
            f"your driver {driver.get('Version')} supports",
        )

    def nnal(self) -> Check:
        nnal = self.facts.nnal
        set_env = self.root / "nnal" / "atb" / "set_env.sh"
        if nnal is None:
            return self.problem(
                "nnal",
                "NNAL (the ATB library, libatb.so) is not installed; the paged-attention and "
                "cache operators need it",
                f"install Ascend-cann-nnal of your CANN release, then source {set_env}",
            )
        version = nnal.get("Ascend-cann-atb") or "unknown"
        if not self.facts.env.get("ATB_HOME_PATH"):
            return self.problem(
                "nnal",
                f"NNAL {version} is installed but not sourced (ATB_HOME_PATH is unset)",
                f"source {set_env}",
            )
        cann = self.facts.cann.get("version") if self.facts.cann else None
        if cann is not None and release(version) != release(cann):
            return warn("nnal", f"NNAL {version} with CANN {cann}", f"install the NNAL of CANN {cann}")
        return ok("nnal", f"NNAL {version}")

    def torch_npu(self) -> Check:
        version = self.facts.packages.get("torch_npu")
        torch = self.facts.packages.get("torch")
        if version is None:
            return self.problem(
                "torch_npu",
                "torch_npu is not installed",
                f"pip install 'npuserve[ascend]' torch=={RECOMMENDED.torch} "
                f"torch_npu=={RECOMMENDED.torch_npu} (the set for CANN {RECOMMENDED.cann}; "
                "take the torch_npu of your CANN release)",
            )
        if torch is not None and _major_minor(torch) != _major_minor(version):
            return self.problem(
                "torch_npu",
                f"torch {torch} and torch_npu {version} are not one version set (major.minor differ)",
                f"pip install 'torch=={'.'.join(map(str, _major_minor(version)))}.*', or the torch_npu "
                f"built for torch {release(torch)}",
            )
        return ok("torch_npu", f"torch_npu {version} (read from package metadata, not imported)")

    def version_set(self) -> Check:
        npu, torch = self.facts.packages.get("torch_npu"), self.facts.packages.get("torch")
        cann = self.facts.cann.get("version") if self.facts.cann else None
        if npu is None or cann is None:
            return ok("version set", "not checked (torch_npu or CANN missing)")
        fit = cann_fit(npu, cann)
        if not fit.sets:
            options = "; ".join(describe(s) for s in sets_for_cann(cann)) or describe(RECOMMENDED)
            return warn(
                "version set",
                f"torch_npu {npu} is not in npuserve's table of known sets",
                f"use a known set for CANN {cann}: {options}",
            )
        known = fit.sets[0]
        problems = []
        if fit.status == "mismatch":
            problems.append(f"CANN {cann} (torch_npu {npu} is built for CANN {_canns(fit.sets)})")
        if torch is not None and release(torch) != known.torch:
            problems.append(f"torch {torch} (torch_npu {npu} is built for torch {known.torch})")
        if problems:
            options = "; ".join(describe(s) for s in sets_for_cann(cann))
            return self.problem(
                "version set",
                "; ".join(problems),
                f"install one set: {options or describe(known)} ({known.source})",
            )
        if fit.status == "rc_only":
            return warn(
                "version set",
                f"{fit.message}; npuserve serves it",
                f"if an operator fails, install one set: {'; '.join(describe(s) for s in fit.sets)}",
            )
        return ok("version set", f"{describe(known)} ({known.source})")

    def visible_chips(self) -> list[NpuChip]:
        """The chips this process would see, in torch_npu's device order."""
        chips = self.facts.npu_smi.chips if self.facts.npu_smi else []
        visible = self.facts.env.get("ASCEND_RT_VISIBLE_DEVICES")
        if visible is None:
            return chips
        indices = [int(i) for i in visible.split(",") if i.strip().isdigit()]
        return [chips[i] for i in indices if i < len(chips)]

    def devices(self) -> Check:
        facts = self.facts
        shown = _setting(facts, "ASCEND_RT_VISIBLE_DEVICES")
        chips = self.visible_chips()
        if not chips or not facts.davinci:
            seen = (
                facts.npu_smi_error
                or f"npu-smi lists {len(facts.npu_smi.chips) if facts.npu_smi else 0} chip(s)"
            )
            return self.problem(
                "npus",
                f"no NPU is visible: {seen}; {len(facts.davinci)} /dev/davinci* device(s); {shown}",
                "check the driver with `npu-smi info`; in a container pass --device for "
                f"{DEVICE_NODES}; and make ASCEND_RT_VISIBLE_DEVICES name existing devices (or unset it)",
            )
        names = sorted({c.name for c in chips})
        unsupported = [n for n in names if n.startswith(UNSUPPORTED_CHIPS)]
        if unsupported:
            return self.problem(
                "npus",
                f"{', '.join(unsupported)}: npuserve's fused attention runs on Atlas A2/A3 (910B, 910_93) only",
                "serve on an Atlas A2/A3 NPU",
            )
        listed = ", ".join(
            f"{i}: {c.name} {c.health} {c.memory_free_mb / 1024:.1f}/{c.memory_total_mb / 1024:.1f} GiB free"
            for i, c in enumerate(chips)
        )
        unhealthy = [str(i) for i, c in enumerate(chips) if c.health != "OK"]
        if unhealthy:
            return warn(
                "npus", f"{listed}; {shown}", f"NPU(s) {', '.join(unhealthy)} are not OK: see `npu-smi info`"
            )
        return ok("npus", f"{len(chips)} visible ({listed}); {shown}")

    def network(self) -> Check:
        env = self.facts.env
        set_vars = {name: env[name] for name in NETWORK_ENV if name in env}
        missing = [
            f"{name}={env[name]}"
            for name in ("HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
            if name in env and not Path("/sys/class/net", env[name].split(",")[0].lstrip("=^")).exists()
        ]
        if missing:
            return warn(
                "network",
                f"{', '.join(missing)}: no such interface on this host",
                "name an interface `ip addr` lists (only multi-node tensor parallelism needs these)",
            )
        shown = ", ".join(f"{k}={v}" for k, v in set_vars.items()) or "none set (one node needs none)"
        return ok("network", shown)


def _setting(facts: HostFacts, name: str) -> str:
    """``NAME=value`` as set, or that it is unset."""
    value = facts.env.get(name)
    return f"{name}={value}" if value is not None else f"{name} is unset"


def _canns(sets: tuple[VersionSet, ...]) -> str:
    return " or ".join(dict.fromkeys(s.cann for s in sets))


def _major_minor(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in release(version).split(".")[:2] if p.isdigit())


def _set_env(cann: VersionFile) -> Path:
    """The set_env.sh next to the toolkit (`<home>/<arch>-linux/...info` -> `<home>/set_env.sh`)."""
    home = cann.path.parent.parent
    return (home.parent if home.name == "latest" else home) / "set_env.sh"
