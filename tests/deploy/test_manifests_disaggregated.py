"""deploy/k8s/overlays/disaggregated against the colocated deploy/k8s: what prefill/decode
disaggregation changes (the executor StatefulSets, the scheduler's --max-local-prefill-length, the
KV transfer network policy, the host-memory KV tier and its memory) and that nothing else drifts.
The checks every rendering passes (schemas, probes, secrets, policies) are in test_manifests.py."""

from __future__ import annotations

import argparse
import copy
import shutil
from pathlib import Path

import pytest
from harness.deploy_files import K8S, parse_npuserve, render_kustomization
from harness.k8s_objects import COLOCATED, DISAGGREGATED, ROLE_LABEL, by_kind, container_argv, quantity_bytes

GIB = 1 << 30
COLOCATED_EXECUTOR = "npuserve-executor"
ROLES = {"npuserve-executor-prefill": "prefill", "npuserve-executor-decode": "decode"}
# The flags on which a pull depends: equal on both sides (executor/kv_transfer.py).
PULL_COMPATIBLE = ("model", "dtype", "block_size", "tensor_parallel_size")
# The overlay's own objects, beside the shared base.
OVERLAY_ONLY = {
    *(("StatefulSet", name) for name in ROLES),
    *(("PodDisruptionBudget", name) for name in ROLES),
    ("NetworkPolicy", "npuserve-executor-kv-transfer"),
}
COLOCATED_ONLY = {("StatefulSet", COLOCATED_EXECUTOR), ("PodDisruptionBudget", COLOCATED_EXECUTOR)}
# deploy/k8s/kustomization.yaml, as it comes and with the host tier on.
HOST_TIER_OFF = "# components:\n#   - components/host-kv-tier\n"
HOST_TIER_ON = "components:\n  - components/host-kv-tier\n"


@pytest.fixture(scope="module")
def colocated() -> list[dict]:
    return render_kustomization(COLOCATED)


@pytest.fixture(scope="module")
def disaggregated() -> list[dict]:
    return render_kustomization(DISAGGREGATED)


def keyed(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def executor_container(statefulset: dict) -> dict:
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    return container


def executor_args(statefulset: dict) -> argparse.Namespace:
    name = statefulset["metadata"]["name"]
    return parse_npuserve(container_argv(statefulset, executor_container(statefulset)), name)


def memory(statefulset: dict, bound: str) -> int:
    return quantity_bytes(executor_container(statefulset)["resources"][bound]["memory"])


def without_role(statefulset: dict) -> dict:
    """The StatefulSet less what a role and the host tier set: its name, role label, replicas, the
    --role and --kv-host-memory flags, and its memory."""
    stripped = copy.deepcopy(statefulset)
    stripped["metadata"]["name"] = COLOCATED_EXECUTOR
    stripped["spec"].pop("replicas")
    for labels in (
        stripped["metadata"]["labels"],
        stripped["spec"]["selector"]["matchLabels"],
        stripped["spec"]["template"]["metadata"]["labels"],
    ):
        labels.pop(ROLE_LABEL, None)
    container = executor_container(stripped)
    args = container["args"]
    for flag in ("--role", "--kv-host-memory"):
        if flag in args:
            del args[args.index(flag) : args.index(flag) + 2]
    for bound in ("requests", "limits"):
        container["resources"][bound].pop("memory")
    return stripped


def test_the_overlay_changes_only_the_executors_the_scheduler_and_the_transfer_policy(
    colocated: list[dict], disaggregated: list[dict]
) -> None:
    before, after = keyed(colocated), keyed(disaggregated)
    assert set(after) - set(before) == OVERLAY_ONLY
    assert set(before) - set(after) == COLOCATED_ONLY
    changed = {key for key in set(before) & set(after) if before[key] != after[key]}
    assert changed == {("Deployment", "npuserve-scheduler")}

    scheduler = ("Deployment", "npuserve-scheduler")
    colocated_args = before[scheduler]["spec"]["template"]["spec"]["containers"][0]["args"]
    overlay_args = after[scheduler]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert overlay_args[: len(colocated_args)] == colocated_args
    assert overlay_args[len(colocated_args) :: 2] == ["--max-local-prefill-length"]
    args = parse_npuserve(overlay_args, "the overlay's scheduler")
    # NOTE: the host tier holds prefix-cache blocks: prefix caching (the scheduler's) stays on.
    assert args.max_local_prefill_length > 0 and args.enable_prefix_caching


def test_prefill_and_decode_executors_differ_from_the_mixed_one_only_in_role_and_size(
    colocated: list[dict], disaggregated: list[dict]
) -> None:
    mixed = by_kind(colocated, "StatefulSet")[COLOCATED_EXECUTOR]
    executors = by_kind(disaggregated, "StatefulSet")
    assert set(executors) == set(ROLES)
    for name, role in ROLES.items():
        assert without_role(executors[name]) == without_role(mixed), name
        assert executor_args(executors[name]).role == role
        assert executors[name]["spec"]["template"]["metadata"]["labels"][ROLE_LABEL] == role
    prefill, decode = (executor_args(executors[name]) for name in ROLES)
    for field in PULL_COMPATIBLE:
        assert getattr(prefill, field) == getattr(decode, field), field
    assert executor_args(mixed).role == "mixed" and executor_args(mixed).kv_host_memory == 0


def test_executor_memory_holds_the_host_tier_on_top_of_the_executor(
    colocated: list[dict], disaggregated: list[dict]
) -> None:
    """Each rank pins --kv-host-memory GiB of host memory: the pod's memory request and limit are
    the mixed executor's (no tier) plus that, per tensor-parallel rank."""
    mixed = by_kind(colocated, "StatefulSet")[COLOCATED_EXECUTOR]
    for name, statefulset in by_kind(disaggregated, "StatefulSet").items():
        args = executor_args(statefulset)
        assert args.kv_host_memory > 0, name
        tier = int(args.kv_host_memory * GIB) * args.tensor_parallel_size
        for bound in ("requests", "limits"):
            assert memory(statefulset, bound) - tier >= memory(mixed, bound), (name, bound)
        assert memory(statefulset, "limits") >= memory(statefulset, "requests")


def test_the_host_tier_component_applies_to_the_colocated_executors(
    tmp_path: Path, disaggregated: list[dict]
) -> None:
    """What docs/deployment.md says: uncomment the component in deploy/k8s/kustomization.yaml; the
    mixed executors then get the overlay's host tier and memory."""
    copied = tmp_path / "k8s"
    shutil.copytree(K8S, copied)
    kustomization = copied / "kustomization.yaml"
    text = kustomization.read_text()
    assert HOST_TIER_OFF in text
    kustomization.write_text(text.replace(HOST_TIER_OFF, HOST_TIER_ON))

    (executor,) = by_kind(render_kustomization(copied), "StatefulSet").values()
    decode = by_kind(disaggregated, "StatefulSet")["npuserve-executor-decode"]
    assert executor_args(executor).kv_host_memory == executor_args(decode).kv_host_memory > 0
    for bound in ("requests", "limits"):
        assert memory(executor, bound) == memory(decode, bound)
