"""deploy/grafana and deploy/prometheus: every query parses as PromQL, and every metric the
dashboard and the alert rules query exists in a live `npuserve serve`'s /metrics."""

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

promql = pytest.importorskip("promql_parser")

DASHBOARD = DEPLOY / "grafana" / "dashboards" / "npuserve.json"
RULES = DEPLOY / "prometheus" / "rules.yaml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
PROMETHEUS_OWN = {"up"}  # series Prometheus writes itself for every target
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$model_name": "model"}
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


def test_alert_rules_are_complete() -> None:
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    assert len({r["alert"] for r in rules}) == len(rules)
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["for"]


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


def exported_names(text: str) -> set[str]:
    """Every series name in a Prometheus text exposition (histograms' _bucket/_sum/_count too)."""
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def test_every_queried_metric_is_exported_by_a_live_server(served_stories: Served, stories_dir: Path) -> None:
    wanted = queried_metrics() - PROMETHEUS_OWN
    assert wanted
    with httpx.Client(base_url=served_stories.url, timeout=60) as client:
        body = {"model": DEMO_MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 8}
        assert client.post("/v1/completions", json=body).status_code == 200
        exported = exported_names(client.get("/metrics").text)
    missing = sorted(wanted - exported)
    assert not missing, f"queried but not exported: {missing}"
