"""What the doctor reads from the machine: version files, packages, devices and environment.

Nothing here imports torch_npu (a mismatched one dies at import) or touches an NPU: versions come
from the files the Ascend installers write and from package metadata. The Ascend root
(``/usr/local/Ascend``) and the device directory (``/dev``) are arguments, so tests point them at
fixture trees; the CLI takes them from ``$NPUSERVE_ASCEND_ROOT`` / ``$NPUSERVE_DEV_ROOT``.

Version files (formats as the installers write them):
- ``driver/version.info``: ``Version=24.1.rc3``, ``Innerversion=V100R001C19SPC001B124``,
  ``compatible_version=[V100R001C13],...`` (the CANN releases this driver runs).
- ``firmware/version.info``: ``Version=7.5.0.1.129``, ``package_version=24.1.rc3``.
- CANN toolkit ``<arch>-linux/ascend_toolkit_install.info``: ``version=8.5.0``,
  ``innerversion=V100R001C25SPC001B232``, ``compatible_version=[V100R001C15],...`` (the drivers
  it runs on). Up to CANN 8.3 it lives under ``ascend-toolkit/latest/``; CANN 8.5 installs to
  ``cann-<version>/`` with ``cann/`` as its link (hiascend CANN 8.5.0 install guide, "File Paths").
- NNAL ``nnal/atb/latest/version.info``: ``Ascend-cann-atb : 8.2.RC2``.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from npuserve.deploy.doctor.npu_smi import NpuSmiInfo, parse_npu_smi_info, run_npu_smi

DEFAULT_ASCEND_ROOT = Path("/usr/local/Ascend")
ASCEND_ROOT_ENV = "NPUSERVE_ASCEND_ROOT"
DEV_ROOT_ENV = "NPUSERVE_DEV_ROOT"
AUTOLOAD_ENV = "TORCH_DEVICE_BACKEND_AUTOLOAD"
NETWORK_ENV = (
    "HCCL_IF_IP", "HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "HCCL_CONNECT_TIMEOUT", "HCCL_BUFFSIZE",
    "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip
PACKAGES = ("torch", "torch_npu", "transformers", "npuserve")
_FAMILY = re.compile(r"V\d+R\d+C\d+")


@dataclass(frozen=True, slots=True)
class VersionFile:
    path: Path
    fields: dict[str, str]

    def get(self, *names: str) -> str | None:
        for name in names:
            for key, value in self.fields.items():
                if key.lower() == name.lower():
                    return value
        return None

    @property
    def family(self) -> str | None:
        """``V100R001C19`` of ``Innerversion=V100R001C19SPC001B124``."""
        inner = self.get("innerversion")
        match = _FAMILY.match(inner or "")
        return match.group(0) if match else None

    @property
    def compatible(self) -> list[str]:
        """The release families listed in ``compatible_version=[...],[...]``."""
        return _FAMILY.findall(self.get("compatible_version") or "")


@dataclass(slots=True)
class HostFacts:
    ascend_root: Path
    packages: dict[str, str | None]  # distribution -> version (None: not installed)
    env: dict[str, str]  # the variables the checks read, as set
    driver: VersionFile | None = None
    firmware: VersionFile | None = None
    cann: VersionFile | None = None
    nnal: VersionFile | None = None
    davinci: list[str] = field(default_factory=list)  # /dev/davinci<N> present
    npu_smi: NpuSmiInfo | None = None
    npu_smi_error: str = ""


def read_version_file(path: Path) -> VersionFile | None:
    """``key=value`` or ``key : value`` lines; None when the file is absent or unreadable."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        match = re.match(r"\s*([^=:#]+?)\s*[=:]\s*(.*?)\s*$", line)
        if match and match.group(1) not in fields:
            fields[match.group(1)] = match.group(2)
    return VersionFile(path, fields)


def _cann_candidates(root: Path, env: Mapping[str, str]) -> list[Path]:
    arch = f"{platform.machine() or '*'}-linux"
    homes = [Path(env[v]) for v in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH") if env.get(v)]
    homes += [root / "ascend-toolkit" / "latest", root / "cann", *sorted(root.glob("cann-*"), reverse=True)]
    found = []
    for home in homes:
        found += [
            home / arch / "ascend_toolkit_install.info",
            *sorted(home.glob("*-linux/ascend_toolkit_install.info")),
        ]
    return found


def _nnal_candidates(root: Path, env: Mapping[str, str]) -> list[Path]:
    candidates = [root / "nnal" / "atb" / "latest" / "version.info"]
    atb_home = Path(env.get("ATB_HOME_PATH", ""))  # .../nnal/atb/latest/atb/cxx_abi_1
    if len(atb_home.parents) > 2:
        candidates.insert(0, atb_home.parents[1] / "version.info")
    return candidates


def _first_naming(paths: list[Path], key: str) -> VersionFile | None:
    """The first of ``paths`` that is a version file giving ``key``."""
    for path in paths:
        found = read_version_file(path)
        if found is not None and found.get(key):
            return found
    return None


def installed_packages(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """Versions from package metadata; nothing is imported."""
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def collect_facts(
    ascend_root: Path,
    dev_root: Path,
    env: Mapping[str, str],
    packages: dict[str, str | None] | None = None,
) -> HostFacts:
    """Everything the checks need. ``packages`` default to this machine's."""
    watched = (
        AUTOLOAD_ENV, "ASCEND_RT_VISIBLE_DEVICES", "ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ATB_HOME_PATH",
    )  # fmt: skip
    facts = HostFacts(
        ascend_root=ascend_root,
        packages=packages if packages is not None else installed_packages(),
        env={name: env[name] for name in (*watched, *NETWORK_ENV) if name in env},
        driver=read_version_file(ascend_root / "driver" / "version.info"),
        firmware=read_version_file(ascend_root / "firmware" / "version.info"),
        cann=_first_naming(_cann_candidates(ascend_root, env), "version"),
        nnal=_first_naming(_nnal_candidates(ascend_root, env), "Ascend-cann-atb"),
        davinci=sorted(p.name for p in dev_root.glob("davinci[0-9]*")),
    )
    output, error = run_npu_smi()
    if output is not None:
        facts.npu_smi = parse_npu_smi_info(output)
    facts.npu_smi_error = error
    return facts


def facts_from_environment() -> HostFacts:
    env = dict(os.environ)
    root = Path(env.get(ASCEND_ROOT_ENV) or DEFAULT_ASCEND_ROOT)
    dev = Path(env.get(DEV_ROOT_ENV) or "/dev")
    return collect_facts(root, dev, env)
