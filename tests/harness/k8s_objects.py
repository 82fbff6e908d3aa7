"""Rendered Kubernetes objects as the manifest tests read them: by kind, workloads and their
npuserve containers, label selectors and NetworkPolicy ingress evaluated, quantities in bytes."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from harness.deploy_files import K8S, K8S_VAR

# The kustomizations an operator applies: every executor mixed, or prefill and decode executors.
COLOCATED = K8S
DISAGGREGATED = K8S / "overlays" / "disaggregated"
LAYOUTS: dict[str, Path] = {"colocated": COLOCATED, "disaggregated": DISAGGREGATED}

WORKLOAD_KINDS = ("Deployment", "StatefulSet")
ROLE_LABEL = "npuserve.io/executor-role"
_QUANTITY = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?")
_UNIT_BYTES = {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
_UNIT_BYTES |= {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def workloads(objects: list[dict]) -> Iterator[dict]:
    return (o for o in objects if o["kind"] in WORKLOAD_KINDS)


def npuserve_containers(objects: list[dict]) -> Iterator[tuple[dict, dict]]:
    """(workload, container) for every container that runs npuserve."""
    for workload in workloads(objects):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            if container.get("args", [""])[0] == "npuserve":
                yield workload, container


def pod_labels(workload: dict) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels selectors are evaluated: {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def expand_k8s_vars(argv: list[str], env_names: set[str], where: str) -> list[str]:
    """Replaces `$(NAME)` as the kubelet does; each NAME must be in the container's env."""

    def value(match: re.Match[str]) -> str:
        assert match.group(1) in env_names, f"{where}: $({match.group(1)}) is not in the container's env"
        return f"{match.group(1).lower()}-value"

    return [K8S_VAR.sub(value, arg) for arg in argv]


def container_argv(workload: dict, container: dict) -> list[str]:
    """The container's npuserve command line, `$(NAME)`s expanded (checked against its env)."""
    where = f"{workload['kind']}/{workload['metadata']['name']}"
    return expand_k8s_vars(container["args"], {e["name"] for e in container.get("env", [])}, where)


def allowed(policies: list[dict], source: dict[str, str], target: dict[str, str], port: int) -> bool:
    """Whether NetworkPolicies let a pod labelled ``source`` (same namespace) reach ``target``."""
    applying = [p for p in policies if selects(p["spec"]["podSelector"] or {}, target)]
    assert applying, f"no policy isolates {target}"
    for policy in applying:
        for rule in policy["spec"].get("ingress", []):
            ports = [p["port"] for p in rule.get("ports", [])]
            peers = rule.get("from")
            if ports and port not in ports:
                continue
            if peers is None or any(selects(peer.get("podSelector", {}), source) for peer in peers):
                return True
    return False


def quantity_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity ("96Gi", "512Mi", "8G", "1024") in bytes."""
    match = _QUANTITY.fullmatch(str(quantity))
    assert match is not None, f"not a memory quantity this test reads: {quantity!r}"
    return int(float(match.group(1)) * _UNIT_BYTES[match.group(2)])
