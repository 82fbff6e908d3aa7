"""Hosts on one machine for multi-host tests: each a Linux network namespace joined to the root
namespace by a veth pair on a /24 of its own (10.213.N.0/24: the root end .1, the host .2), so
processes in it talk to the root namespace over real TCP, and its link can be cut and restored.

Needs root and `ip` (iproute2); `hosts` skips the test, naming the reason, where namespaces cannot
be made. Namespaces are named after the test process's pid, so those left by a test process that
was killed before its cleanup are removed by the next run.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

NAMESPACE_PREFIX = "npuserve-test-"
SUBNET_PREFIX = "10.213"
HOST_INTERFACE = "eth0"  # the host's end of its link, inside its namespace


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


@dataclass(frozen=True)
class Host:
    namespace: str
    link: str  # the root namespace's end of the veth pair
    address: str  # the host's address, e.g. 10.213.7.2
    gateway: str  # the root namespace's address on the same /24, e.g. 10.213.7.1

    @property
    def command_prefix(self) -> list[str]:
        """Runs a command inside the host (`ip netns exec` execs it: same pid, same signals)."""
        return ["ip", "netns", "exec", self.namespace]

    def cut(self) -> None:
        """The host's network link goes down: its packets are dropped, nothing answers."""
        ip("-n", self.namespace, "link", "set", HOST_INTERFACE, "down")

    def restore(self) -> None:
        ip("-n", self.namespace, "link", "set", HOST_INTERFACE, "up")


def _namespaces() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()]


def _remove_stale_namespaces() -> None:
    """Namespaces of test processes that no longer run (killed before they cleaned up)."""
    for name in _namespaces():
        match = re.fullmatch(rf"{NAMESPACE_PREFIX}(\d+)-\w+", name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            ip("netns", "del", name, check=False)


def _free_subnets(count: int) -> list[int]:
    """``count`` third octets N with no address of 10.213.N.0/24 on this machine."""
    used = set(re.findall(rf"inet {re.escape(SUBNET_PREFIX)}\.(\d+)\.", ip("-o", "-4", "addr").stdout))
    free = [n for n in range(1, 255) if str(n) not in used]
    if len(free) < count:
        pytest.skip(f"no {count} free subnets under {SUBNET_PREFIX}.0.0/16")
    return random.sample(free, count)


def _link(host: Host) -> None:
    """The host's veth pair, addressed and up, and a command run inside it."""
    veth = ["type", "veth", "peer", "name", HOST_INTERFACE, "netns", host.namespace]
    ip("link", "add", host.link, *veth)
    ip("addr", "add", f"{host.gateway}/24", "dev", host.link)
    ip("link", "set", host.link, "up")
    ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", HOST_INTERFACE)
    ip("-n", host.namespace, "link", "set", HOST_INTERFACE, "up")
    ip("-n", host.namespace, "link", "set", "lo", "up")
    subprocess.run([*host.command_prefix, "true"], capture_output=True, text=True, timeout=10, check=True)


@contextmanager
def hosts(count: int) -> Iterator[list[Host]]:
    """``count`` hosts, removed again at the end (their links with them), even on failure."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("`ip` (iproute2) is not installed")
    _remove_stale_namespaces()
    tag = uuid.uuid4().hex[:6]
    made: list[Host] = []
    try:
        for n in _free_subnets(count):
            host = Host(f"{NAMESPACE_PREFIX}{os.getpid()}-{tag}{n}", f"npt{tag}{n}",
                        f"{SUBNET_PREFIX}.{n}.2", f"{SUBNET_PREFIX}.{n}.1")  # fmt: skip
            created = ip("netns", "add", host.namespace, check=False)
            if created.returncode != 0:
                pytest.skip(f"cannot create a network namespace: {created.stderr.strip()}")
            made.append(host)
            try:
                _link(host)
            except subprocess.CalledProcessError as exc:
                pytest.skip(f"cannot link a network namespace: {' '.join(exc.cmd)}: {exc.stderr.strip()}")
        yield made
    finally:
        for host in made:
            ip("link", "del", host.link, check=False)  # gone already if the namespace took it along
            ip("netns", "del", host.namespace, check=False)
