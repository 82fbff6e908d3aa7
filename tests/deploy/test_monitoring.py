"""deploy/grafana and deploy/prometheus: every query parses as PromQL, and every metric the
dashboard and the alert rules query exists in a live `npuserve serve`'s /metrics, where the
per-executor series name every executor the scheduler serves on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import yaml
from harness.deploy_files import COMPOSE, DEPLOY, K8S, render_kustomization
from harness.serve import Served
from prometheus_client.parser import text_string_to_metric_families

from npuserve.deploy.demo_model import DEMO_MODEL_NAME
from npuserve.proto import scheduler_pb2 as pb

promql = pytest.importorskip("promql_parser")

DASHBOARD = DEPLOY / "grafana" / "dashboards" / "npuserve.json"
RULES = DEPLOY / "prometheus" / "rules.yaml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
PROMETHEUS_OWN = {"up"}  # series Prometheus writes itself for every target
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$model_name": "model", "$executor": "executor"}
EXECUTOR_PANELS = (
    "Executors up",
    "Executor restarts",
    "KV cache usage per executor",
    "Prefix cache hit rate per executor",
    "Requests per executor",
    "Step time per executor",
)
EXECUTOR_ALERTS = ("NpuserveNoExecutor", "NpuserveExecutorDown", "NpuserveExecutorCrashLoop",
                   "NpuserveExecutorKVCacheFull")  # fmt: skip
JOB = "npuserve-gateway"


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries() -> list[str]:
    return [target["expr"] for panel in dashboard()["panels"] for target in panel["targets"]]


def rule_queries() -> list[str]:
    return [rule["expr"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def parse(query: str):
    for variable, value in GRAFANA_VARIABLES.items():
        query = query.replace(variable, value)
    assert "$" not in query, f"an unknown Grafana variable in {query}"
    return promql.parse(query)


def metric_names(query: str) -> set[str]:
    names: set[str] = set()

    def visit(node) -> None:
        if isinstance(node, promql.VectorSelector):
            names.add(node.name)

    promql.walk(parse(query), visit)
    return names


def queried_metrics() -> set[str]:
    names = set().union(*(metric_names(q) for q in dashboard_queries() + rule_queries()))
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            names |= set(re.findall(r"label_values\(([^,)]+)", variable["definition"]))
    return names


def test_every_query_parses_as_promql() -> None:
    queries = dashboard_queries() + rule_queries()
    assert len(queries) > 20
    for query in queries:
        assert metric_names(query), f"{query} selects no metric"


def test_the_dashboard_covers_the_serving_story() -> None:
    board = dashboard()
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    titles = {p["title"] for p in panels}
    for wanted in (
        "Token throughput",
        "Time to first token",
        "Inter-token latency",
        "KV cache usage",
        "Prefix cache hit rate",
        "Scheduler queue",
        "Preemptions",
        "HTTP errors",
        "Requests by executor role",
        "KV transfer throughput",
        *EXECUTOR_PANELS,
    ):
        assert wanted in titles
    datasource = {"type": "prometheus", "uid": "${datasource}"}
    for panel in panels:
        assert panel["datasource"] == datasource and all(
            t["datasource"] == datasource for t in panel["targets"]
        )
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
    ttft = next(p for p in panels if p["title"] == "Time to first token")
    assert [t["legendFormat"] for t in ttft["targets"]] == ["p50", "p90", "p99"]
    for panel in panels:
        if panel["title"] in EXECUTOR_PANELS:  # one line per executor, narrowed by $executor
            for target in panel["targets"]:
                assert "{{executor}}" in target["legendFormat"], panel["title"]
                assert 'executor=~"$executor"' in target["expr"] and "npuserve:executor_" in target["expr"]


def test_alert_rules_are_complete() -> None:
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    assert len({r["alert"] for r in rules}) == len(rules)
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["for"]
    by_name = {r["alert"]: r for r in rules}
    for name in EXECUTOR_ALERTS:
        assert "npuserve:executor_" in by_name[name]["expr"]
        if name != "NpuserveNoExecutor":  # the others name the executor
            assert "{{ $labels.executor }}" in by_name[name]["annotations"]["summary"]


def test_prometheus_job_matches_compose_and_the_cluster() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    (job,) = config["scrape_configs"]
    assert job["job_name"] == JOB
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    (target,) = job["static_configs"][0]["targets"]
    host, port = target.split(":")
    gateway = services[host]["command"]
    assert gateway[1] == "gateway" and gateway[gateway.index("--port") + 1] == port
    mounts = dict(v.split(":")[:2] for v in services["prometheus"]["volumes"])
    assert mounts["./prometheus/rules.yaml"] in config["rule_files"]
    # NOTE: the Prometheus operator names a ServiceMonitor's job after the Service.
    (monitor,) = [o for o in render_kustomization(K8S) if o["kind"] == "ServiceMonitor"]
    assert monitor["metadata"]["name"] == JOB
    for query in rule_queries() + dashboard_queries():
        for job_name in re.findall(r'job="([^"]+)"', query):
            assert job_name == JOB, query
    source = yaml.safe_load(DATASOURCES.read_text())["datasources"][0]
    assert source["url"] == "http://prometheus:9090" and "prometheus" in services


def exported_samples(text: str) -> list:
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def exported_names(text: str) -> set[str]:
    """Every series name in a Prometheus text exposition (histograms' _bucket/_sum/_count too)."""
    return {sample.name for sample in exported_samples(text)}


def test_every_queried_metric_is_exported_by_a_live_server(served_stories: Served, stories_dir: Path) -> None:
    wanted = queried_metrics() - PROMETHEUS_OWN
    assert wanted
    with httpx.Client(base_url=served_stories.url, timeout=60) as client:
        body = {"model": DEMO_MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 8}
        assert client.post("/v1/completions", json=body).status_code == 200
        exported = exported_names(client.get("/metrics").text)
    missing = sorted(wanted - exported)
    assert not missing, f"queried but not exported: {missing}"


def test_per_executor_series_name_every_executor(served_stories: Served) -> None:
    """`npuserve:executor_*` has one series per executor the scheduler serves on (as
    CheckIntegrity names them), up at 1; their steps add up to the aggregate's."""
    check = served_stories.stub().CheckIntegrity(pb.CheckIntegrityRequest(), timeout=10)
    assert check.ok, check.message
    executors = {e.executor_id for e in check.executors}
    assert executors
    with httpx.Client(base_url=served_stories.url, timeout=60) as client:
        body = {"model": DEMO_MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 8}
        assert client.post("/v1/completions", json=body).status_code == 200
        samples = exported_samples(client.get("/metrics").text)
    up = {s.labels["executor"]: s.value for s in samples if s.name == "npuserve:executor_up"}
    assert up == dict.fromkeys(executors, 1.0)
    steps = {
        s.labels["executor"]: s.value for s in samples if s.name == "npuserve:executor_step_seconds_count"
    }
    (total,) = [s.value for s in samples if s.name == "npuserve:step_seconds_count"]
    assert set(steps) == executors and sum(steps.values()) == total > 0
    restarts = {
        s.labels["executor"]: s.value for s in samples if s.name == "npuserve:executor_restarts_total"
    }
    assert restarts == dict.fromkeys(executors, 0.0)
