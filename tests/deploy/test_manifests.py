"""deploy/k8s (both layouts: every executor mixed, and the disaggregated overlay's prefill and
decode executors) and deploy/compose.yaml: rendered by the real tools, checked against the
Kubernetes schemas, and every npuserve command line in them (and in the Dockerfiles) parsed by the
real CLI."""

from __future__ import annotations

import re

import pytest
import yaml
from harness.deploy_files import (
    COMPOSE,
    DEPLOY,
    DOCKERFILES,
    dockerfile_instructions,
    exec_form,
    parse_npuserve,
    parse_probe,
    render_kustomization,
)
from harness.k8s_objects import (
    LAYOUTS,
    ROLE_LABEL,
    allowed,
    by_kind,
    container_argv,
    npuserve_containers,
    pod_labels,
    selects,
    workloads,
)

kubernetes_validate = pytest.importorskip("kubernetes_validate")

# Custom resources have no schema in kubernetes-validate: checked by hand below instead.
CUSTOM_KINDS = {"ServiceMonitor": "monitoring.coreos.com/v1 (Prometheus operator CRD)"}
ASCEND_DEVICE = "huawei.com/Ascend910"
GRACE_MARGIN_S = 5  # between the end of the drain and SIGKILL
# Each layout's executor StatefulSets and the --role each runs.
EXECUTOR_ROLES = {
    "colocated": {"npuserve-executor": "mixed"},
    "disaggregated": {"npuserve-executor-prefill": "prefill", "npuserve-executor-decode": "decode"},
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def rendered(layout: str) -> list[dict]:
    return render_kustomization(LAYOUTS[layout])


def test_the_kustomization_renders_the_whole_deployment(layout: str, rendered: list[dict]) -> None:
    kinds = {(o["kind"], o["metadata"]["name"]) for o in rendered}
    executors = EXECUTOR_ROLES[layout]
    assert {
        ("Namespace", "npuserve"),
        ("Secret", "npuserve-secrets"),
        ("Deployment", "npuserve-redis"),
        ("Service", "npuserve-redis"),
        ("Deployment", "npuserve-scheduler"),
        ("Service", "npuserve-scheduler"),
        ("Service", "npuserve-executor"),
        ("Deployment", "npuserve-gateway"),
        ("Service", "npuserve-gateway"),
        ("HorizontalPodAutoscaler", "npuserve-gateway"),
        ("PodDisruptionBudget", "npuserve-gateway"),
        ("ServiceMonitor", "npuserve-gateway"),
        *(("StatefulSet", name) for name in executors),
        *(("PodDisruptionBudget", name) for name in executors),
    } <= kinds
    assert set(by_kind(rendered, "StatefulSet")) == set(executors)
    assert len(by_kind(rendered, "NetworkPolicy")) >= 4
    namespaced = [o for o in rendered if o["kind"] != "Namespace"]
    assert {o["metadata"].get("namespace") for o in namespaced} == {"npuserve"}


def test_every_object_validates_against_the_kubernetes_schemas(rendered: list[dict]) -> None:
    version = kubernetes_validate.latest_version()
    checked = 0
    for obj in rendered:
        if obj["kind"] in CUSTOM_KINDS:
            continue
        kubernetes_validate.validate(obj, version, strict=True)
        checked += 1
    assert checked == len(rendered) - sum(o["kind"] in CUSTOM_KINDS for o in rendered)


def test_the_service_monitor_scrapes_the_gateway_metrics_port(rendered: list[dict]) -> None:
    (monitor,) = by_kind(rendered, "ServiceMonitor").values()
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    services = [
        s
        for s in by_kind(rendered, "Service").values()
        if selects(monitor["spec"]["selector"], s["metadata"]["labels"])
    ]
    assert [s["metadata"]["name"] for s in services] == ["npuserve-gateway"]
    port_names = {p["name"] for p in services[0]["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"


def test_every_npuserve_command_line_parses(rendered: list[dict]) -> None:
    seen = set()
    for workload, container in npuserve_containers(rendered):
        where = f"{workload['kind']}/{workload['metadata']['name']}"
        args = parse_npuserve(container_argv(workload, container), where)
        seen.add(args.command)
        ports = {p["containerPort"] for p in container["ports"]}
        assert args.port in ports, f"{where}: serves on {args.port}, declares {ports}"
        assert args.log_format == "json", f"{where}: logs for a collector are JSON"
    assert seen == {"executor", "scheduler", "gateway"}


def test_every_npuserve_container_has_probes_on_its_health_endpoints(rendered: list[dict]) -> None:
    for workload, container in npuserve_containers(rendered):
        where = f"{workload['kind']}/{workload['metadata']['name']}"
        kind = container["args"][1]
        port = container["ports"][0]["containerPort"]
        for name in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = container[name]
            if kind == "gateway":
                expected = "/health" if name == "readinessProbe" else "/version"
                assert probe["httpGet"]["path"] == expected, f"{where} {name}"
                assert probe["httpGet"]["port"] == container["ports"][0]["name"]
                continue
            parsed = parse_probe(probe["exec"]["command"], f"{where} {name}")
            assert (parsed.kind, parsed.target) == (kind, f"127.0.0.1:{port}"), f"{where} {name}"
            # NOTE: readiness wants `serving`; liveness and start-up only an answer (a process
            # waiting for executors or draining is alive, not broken).
            assert parsed.live == (name != "readinessProbe"), f"{where} {name}"


def test_termination_grace_covers_the_drain(rendered: list[dict]) -> None:
    """The preStop pause, then the process's --shutdown-timeout drain, end before the SIGKILL."""
    for workload, container in npuserve_containers(rendered):
        where = f"{workload['kind']}/{workload['metadata']['name']}"
        drain_s = parse_npuserve(container_argv(workload, container), where).shutdown_timeout
        spec = workload["spec"]["template"]["spec"]
        pause = 0
        if "lifecycle" in container:
            command = container["lifecycle"]["preStop"]["exec"]["command"]
            assert command[0] == "sleep"
            pause = int(command[1])
        assert spec["terminationGracePeriodSeconds"] >= pause + drain_s + GRACE_MARGIN_S, where


def test_npuserve_pods_run_unprivileged_with_resource_requests(rendered: list[dict]) -> None:
    for workload in workloads(rendered):
        spec = workload["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        for container in spec["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
            assert {"cpu", "memory"} <= set(container["resources"]["requests"])
            assert "memory" in container["resources"]["limits"]


def test_executors_get_their_npus_role_and_a_stable_dns_name(layout: str, rendered: list[dict]) -> None:
    for name, executor in by_kind(rendered, "StatefulSet").items():
        (container,) = executor["spec"]["template"]["spec"]["containers"]
        resources = container["resources"]
        args = parse_npuserve(container_argv(executor, container), name)
        devices = int(resources["limits"][ASCEND_DEVICE])
        assert int(resources["requests"][ASCEND_DEVICE]) == devices == args.tensor_parallel_size
        assert args.device == "npu" and args.registry.startswith("redis://npuserve-redis:")
        role = EXECUTOR_ROLES[layout][name]
        assert args.role == role and pod_labels(executor).get(ROLE_LABEL, "mixed") == role, name

        service = by_kind(rendered, "Service")[executor["spec"]["serviceName"]]
        assert service["spec"]["clusterIP"] == "None"  # headless: one DNS name per pod
        assert service["spec"]["publishNotReadyAddresses"] is True  # resolvable as soon as it registers
        assert selects({"matchLabels": service["spec"]["selector"]}, pod_labels(executor))
        raw = dict(zip(container["args"][2::2], container["args"][3::2], strict=False))
        port = container["ports"][0]["containerPort"]
        service_name = executor["spec"]["serviceName"]
        expected = f"$(POD_NAME).{service_name}.$(POD_NAMESPACE).svc.cluster.local:{port}"
        assert raw["--advertise-address"] == expected
        assert raw["--executor-id"] == "$(POD_NAME)"
        fields = {
            e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
            for e in container["env"]
            if "fieldRef" in e.get("valueFrom", {})
        }
        assert fields == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}


def test_secrets_are_read_through_secret_key_refs(rendered: list[dict]) -> None:
    secrets = by_kind(rendered, "Secret")
    wanted = {
        "executor": {"NPUSERVE_CLUSTER_TOKEN"},
        "scheduler": {"NPUSERVE_CLUSTER_TOKEN"},
        "gateway": {"NPUSERVE_API_KEY"},
    }
    for workload, container in npuserve_containers(rendered):
        refs = {}
        for env in container.get("env", []):
            assert "value" not in env or not env["name"].startswith("NPUSERVE_"), (
                "secrets stay out of manifests"
            )
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["key"] in secrets[ref["name"]]["stringData"], ref
                refs[env["name"]] = ref["key"]
        assert wanted[container["args"][1]] <= set(refs), workload["metadata"]["name"]
        if "NPUSERVE_CLUSTER_TOKEN" in refs:
            # NOTE: the same secret on every end: the scheduler's steps, and a decode executor's
            # pulls from a prefill executor.
            assert refs["NPUSERVE_CLUSTER_TOKEN"] == "cluster-token"


def test_services_select_their_pods_and_name_declared_ports(rendered: list[dict]) -> None:
    """Each Service selects the workload of its name, or the StatefulSets it names the pods of."""
    pods = {w["metadata"]["name"]: w for w in workloads(rendered)}
    for name, service in by_kind(rendered, "Service").items():
        matching = [
            w for w in pods.values() if selects({"matchLabels": service["spec"]["selector"]}, pod_labels(w))
        ]
        governed = [w for w in pods.values() if name in (w["metadata"]["name"], w["spec"].get("serviceName"))]
        assert matching and matching == governed, name
        for workload in matching:
            declared = {
                p["name"] for c in workload["spec"]["template"]["spec"]["containers"] for p in c["ports"]
            }
            for port in service["spec"]["ports"]:
                assert port["targetPort"] in declared, (name, port)


def test_autoscaler_and_disruption_budgets_target_the_workloads(rendered: list[dict]) -> None:
    (hpa,) = by_kind(rendered, "HorizontalPodAutoscaler").values()
    gateway = by_kind(rendered, "Deployment")["npuserve-gateway"]
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "npuserve-gateway",
    }
    assert "replicas" not in gateway["spec"]  # the autoscaler owns it
    assert hpa["spec"]["minReplicas"] >= 2
    scheduler = by_kind(rendered, "Deployment")["npuserve-scheduler"]
    assert scheduler["spec"]["replicas"] == 1 and scheduler["spec"]["strategy"]["type"] == "Recreate"
    for name, budget in by_kind(rendered, "PodDisruptionBudget").items():
        selected = [w for w in workloads(rendered) if selects(budget["spec"]["selector"], pod_labels(w))]
        assert [w["metadata"]["name"] for w in selected] == [name]
    for name in by_kind(rendered, "StatefulSet"):
        assert by_kind(rendered, "PodDisruptionBudget")[name]["spec"]["maxUnavailable"] == 1, name


def test_network_policies_let_only_the_listed_clients_in(rendered: list[dict]) -> None:
    policies = list(by_kind(rendered, "NetworkPolicy").values())
    pods = {w["metadata"]["name"].removeprefix("npuserve-"): pod_labels(w) for w in workloads(rendered)}
    executors = {name for name in pods if name.startswith("executor")}
    outsider = {"app": "something-else"}
    client = {"npuserve.io/scheduler-client": "true"}
    sources = {**pods, "client": client, "outsider": outsider}
    expected = {
        ("scheduler", 50051): {"gateway", "client"},
        ("redis", 6379): {"scheduler", *executors},
        ("gateway", 8000): set(sources),
    }
    for executor in executors:
        # NOTE: a decode executor pulls the KV blocks a prefill executor computed from its gRPC
        # port (executor/kv_transfer.py); no other executor dials another.
        pullers = {"executor-decode"} if executor == "executor-prefill" else set()
        expected[(executor, 50061)] = {"scheduler", *pullers}
    for (target, port), who in expected.items():
        got = {name for name, labels in sources.items() if allowed(policies, labels, pods[target], port)}
        assert got == who, (target, got)


def compose_services() -> dict[str, dict]:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_compose_command_lines_and_health_checks_parse() -> None:
    commands = set()
    for name, service in compose_services().items():
        command = service.get("command", [])
        if command[:1] != ["npuserve"]:
            continue
        args = parse_npuserve(command, f"compose {name}")
        commands.add(args.command)
        grace = re.fullmatch(r"(\d+)s", service["stop_grace_period"])
        assert grace is not None and int(grace[1]) >= args.shutdown_timeout + GRACE_MARGIN_S, name
        check = service["healthcheck"]["test"]
        assert check[0] == "CMD"
        probe = parse_probe(check[1:], f"compose {name} healthcheck")
        assert probe.kind == args.command
        local = f"127.0.0.1:{args.port}"
        assert probe.target in (local, f"http://{local}/health"), name
    assert commands == {"executor", "scheduler", "gateway"}


def test_compose_gives_each_executor_one_npu_and_the_driver() -> None:
    services = compose_services()
    executors = {n: s for n, s in services.items() if s.get("command", [None, None])[1] == "executor"}
    assert len(executors) == 8
    npus = []
    for name, service in executors.items():
        devices = service["devices"]
        assert set(devices[1:]) == {"/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"}
        npus.append(devices[0])
        # NOTE: bound to 0.0.0.0 without --advertise-address, an executor registers as
        # HOSTNAME:PORT, so the host name must be the service name the scheduler can resolve.
        assert service["hostname"] == name
        assert "--advertise-address" not in service["command"]
        mounts = {v.split(":")[1] for v in service["volumes"]}
        assert {
            "/usr/local/dcmi",
            "/usr/local/bin/npu-smi",
            "/usr/local/Ascend/driver/lib64",
            "/usr/local/Ascend/driver/version.info",
            "/etc/ascend_install.info",
        } <= mounts
        assert "NPUSERVE_CLUSTER_TOKEN" in service["environment"]
    assert sorted(npus) == [f"/dev/davinci{i}" for i in range(8)]
    assert "NPUSERVE_CLUSTER_TOKEN" in services["scheduler"]["environment"]


def test_the_disaggregated_compose_file_gives_two_executors_prefill_and_six_decode() -> None:
    """Its commands replace the base file's: each must be the base one with only the role added,
    so the two cannot drift apart."""
    base = compose_services()
    over = yaml.safe_load((DEPLOY / "compose.disaggregated.yaml").read_text())["services"]
    assert set(over) == {n for n in base if n.startswith("executor-")}
    roles = []
    for name, service in over.items():
        command = service["command"]
        assert command == [*base[name]["command"], "--role", command[-1]], name
        roles.append(parse_npuserve(command, f"compose.disaggregated {name}").role)
    assert sorted(roles) == ["decode"] * 6 + ["prefill"] * 2


def test_compose_files_and_build_context_exist() -> None:
    for name, service in compose_services().items():
        if "build" in service:
            context = (DEPLOY / service["build"]["context"]).resolve()
            assert (context / service["build"]["dockerfile"]).is_file(), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DEPLOY / source).exists(), f"{name} mounts {source}, which is missing"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_default_command_parses(dockerfile) -> None:
    instructions = dockerfile_instructions(dockerfile)
    (entrypoint,) = [exec_form(i) for i in instructions if i.keyword == "ENTRYPOINT"]
    (command,) = [exec_form(i) for i in instructions if i.keyword == "CMD"]
    assert entrypoint == ["/usr/local/bin/npuserve-entrypoint"]
    args = parse_npuserve(command, dockerfile.name)
    assert args.command == "serve" and args.host == "0.0.0.0"
    assert args.device == ("npu" if dockerfile.name.endswith("ascend") else "cpu")
