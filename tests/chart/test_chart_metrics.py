"""The chart's metrics objects: rendered only when asked, valid, and using only metric
names the operator really exports (checked against a real scrape in tests/cluster)."""

from __future__ import annotations

import json
import re

from tests.chart.chartlib import CHART, render

ON = {"metrics": {"enabled": True, "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
                  "prometheusRule": {"enabled": True, "savingPercent": 10}, "dashboard": {"enabled": True}}}


def metric_names_used() -> set[str]:
    """Every ingero_* series the dashboard and the alert rules read."""
    text = (CHART / "files" / "dashboard.json").read_text()
    rule = next(d for d in render(ON) if d["kind"] == "PrometheusRule")
    exprs = [t["expr"] for p in json.loads(text)["panels"] for t in p["targets"]]
    exprs += [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    return {m for e in exprs for m in re.findall(r"\bingero_[a-z_]+", e)}


def test_metrics_objects_render_only_when_enabled():
    assert not [d for d in render() if d["kind"] in ("ServiceMonitor", "PrometheusRule", "ConfigMap")
                or d["metadata"]["name"].endswith("-metrics")]
    docs = render(ON)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("Service", "ingero-operator-metrics"), ("ServiceMonitor", "ingero-operator"),
            ("PrometheusRule", "ingero-operator"), ("ConfigMap", "ingero-operator-dashboard")} <= kinds
    op = next(d for d in docs if d["kind"] == "Deployment")
    pod = op["spec"]["template"]
    c = pod["spec"]["containers"][0]
    assert "--metrics-port=9102" in c["args"] and {"name": "metrics", "containerPort": 9102,
                                                   "protocol": "TCP"} in c["ports"]
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    sm = next(d for d in docs if d["kind"] == "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "prom" and sm["spec"]["endpoints"][0]["port"] == "metrics"
    svc = next(d for d in docs if d["metadata"]["name"] == "ingero-operator-metrics")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    alert = rule["spec"]["groups"][0]["rules"][0]
    assert alert["alert"] == "StragglerDetected" and alert["expr"].endswith(">= 10")
    assert "{{ $labels.namespace }}" in alert["annotations"]["summary"]
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["ingero.json"])["uid"] == "ingero-stragglers"


def test_the_dashboard_and_alerts_read_the_operators_and_agents_metrics(tmp_path):
    from ingero_agent import metrics as agent_metrics
    from ingero_agent.api import SessionManager
    from ingero_operator import metrics

    reg, _ = agent_metrics.registry(SessionManager(tmp_path, "n1", trace_cmd=["true"]))
    exported = {m.name for m in metrics.REGISTRY.collect()} | {m.name for m in reg.collect()}
    used = metric_names_used()
    # histogram series carry _bucket/_sum/_count, counters _total; gauges their own name
    base = {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in used}
    assert base <= exported, base - exported
    assert {"ingero_straggler_saving_percent", "ingero_straggler", "ingero_sessions"} <= used
