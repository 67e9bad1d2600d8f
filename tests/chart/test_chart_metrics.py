"""The chart's metrics objects: rendered when asked, valid, using only metric names the
operator and the agents really export (checked against a real scrape in tests/cluster),
every rule and dashboard query parsed by Prometheus' own parser and the alerts evaluated
by `promtool test rules` over series of the demo's real scrapes."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from tests.chart.chartlib import CHART, render

ON = {"metrics": {"enabled": True, "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
                  "prometheusRule": {"enabled": True, "savingRatio": 0.1}, "dashboard": {"enabled": True},
                  "agent": {"podMonitor": {"enabled": True}}}}
SCRAPES = CHART.parents[1] / "tests" / "unit" / "fixtures" / "dashboard-scrapes"


def metric_names_used() -> set[str]:
    """Every ingero_* series the dashboard and the alert rules read."""
    text = (CHART / "files" / "dashboard.json").read_text()
    rule = next(d for d in render(ON) if d["kind"] == "PrometheusRule")
    exprs = [t["expr"] for p in json.loads(text)["panels"] for t in p["targets"]]
    exprs += [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    return {m for e in exprs for m in re.findall(r"\bingero_[a-z_]+", e)}


def dashboard_exprs() -> list[str]:
    """Every query of the dashboard, its variables as "All" (`.*`); of Grafana's
    `label_values(selector, label)` the PromQL selector."""
    doc = json.loads((CHART / "files" / "dashboard.json").read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    exprs += [re.fullmatch(r"label_values\((.+), *\w+\)", v["query"]["query"]).group(1)
              for v in doc["templating"]["list"] if v["type"] == "query"]
    return [re.sub(r"\$\{?\w+\}?", ".*", e) for e in exprs]


def promtool():
    return shutil.which("promtool") or pytest.skip("promtool is not installed: `make setup` installs Debian's "
                                                     "prometheus")


def test_metrics_are_on_by_default_and_the_monitoring_objects_render_only_when_asked():
    docs = render()
    assert {d["metadata"]["name"] for d in docs if d["metadata"]["name"].endswith("-metrics")} == {
        "ingero-operator-metrics"}
    assert not [d for d in docs if d["kind"] in ("ServiceMonitor", "PodMonitor", "PrometheusRule")]
    agent = next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    assert any(a.startswith("--metrics-port=") for a in agent["args"])
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
    assert alert["alert"] == "StragglerDetected" and alert["expr"] == "ingero_straggler_saving_ratio >= 0.1"
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
    assert {"ingero_straggler_saving_ratio", "ingero_agent_lost_events_total", "ingero_sessions"} <= used


@pytest.mark.parametrize("switch", ["serviceMonitor", "prometheusRule", "dashboard"])
def test_a_monitoring_switch_without_metrics_fails_with_the_fix(switch):
    with pytest.raises(Exception, match=f"metrics.{switch}.enabled=true but metrics.enabled=false: .*"
                                        "set metrics.enabled=true"):
        render({"metrics": {"enabled": False, switch: {"enabled": True}}})


def test_the_dashboard_has_namespace_and_session_variables_the_cap_and_rates():
    doc = json.loads((CHART / "files" / "dashboard.json").read_text())
    assert [v["name"] for v in doc["templating"]["list"]] == ["datasource", "namespace", "session"]
    panels = {p["title"]: [t["expr"] for t in p["targets"]] for p in doc["panels"]}
    assert panels["Agent: data folder vs its cap (bytes)"] == ["ingero_agent_data_bytes",
                                                               "ingero_agent_data_max_bytes > 0"]
    for exprs in panels.values():           # a counter is plotted as a rate, never as a raw total
        for e in exprs:
            for counter in re.findall(r"\bingero_\w+_total\b", e):
                assert f"rate({counter}" in e, e
            if "name=" in e or "namespace=" in e:
                assert 'namespace=~"$namespace"' in e and 'name=~"$session"' in e, e


def test_every_rule_and_dashboard_query_is_valid_promql(tmp_path):
    tool = promtool()
    rule = next(d for d in render(ON) if d["kind"] == "PrometheusRule")
    groups = rule["spec"]["groups"] + [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": e} for i, e in enumerate(dashboard_exprs())]}]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    got = subprocess.run([tool, "check", "rules", str(tmp_path / "rules.yaml")], capture_output=True, text=True)
    assert got.returncode == 0, got.stdout + got.stderr


def live_straggler() -> tuple[dict, float]:
    """The straggler series of the demo's operator, scraped while the job ran."""
    from prometheus_client.parser import text_string_to_metric_families
    for f in sorted(SCRAPES.glob("*-operator.prom")):
        for fam in text_string_to_metric_families(f.read_text()):
            if fam.name == "ingero_straggler_saving_ratio" and fam.samples:
                return dict(fam.samples[0].labels), fam.samples[0].value
    raise AssertionError(f"no live straggler series in {SCRAPES}")


def series(name: str, labels: dict) -> str:
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def test_the_alerts_fire_during_the_fault_and_resolve_after(tmp_path):
    """StragglerDetected on the demo's real straggler series: pending, firing with who and
    why, resolved once the session completed (the series goes, a staleness marker as in a
    real scrape); TrainingJobHung while the hung job's session runs; the agent alerts on an
    agent that stops answering and one losing events."""
    tool = promtool()
    rule = next(d for d in render(ON) if d["kind"] == "PrometheusRule")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule["spec"]))
    labels, saving = live_straggler()
    assert labels["kind"] == "rank" and labels["pod"] == labels["who"] and labels["cause"] == "network"
    ns, name = labels["namespace"], labels["name"]
    fired = {"exp_labels": {**labels, "severity": "warning"}, "exp_annotations": {
        "summary": f"TraceSession {ns}/{name}: {labels['who']} is the straggler (network); its fix would save "
                   f"{saving * 100:.4g}% of the step",
        "description": f"Kind rank, ranks {labels['ranks']}. kubectl describe tracesession -n {ns} {name} gives "
                       "the evidence."}}
    agent = {"job": "ingero-agent", "instance": "10.0.0.7:9465"}
    hung = {"namespace": "team-a", "name": "hung-job"}
    lost = {"node": "n7", "session": "default.job.1", "ring": "nccl"}
    test = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [
            # running 6 minutes with the straggler named, then Completed: the series goes
            {"series": series("ingero_straggler_saving_ratio", labels), "values": f"{saving}x5 stale"},
            {"series": series("up", agent), "values": "1 1 0x8"},
            {"series": series("ingero_agent_lost_events_total", lost), "values": "0x3 0+50x6"},
            # a hung job: its session Running 6 minutes, then the job is stopped and it completes
            {"series": series("ingero_verdict", {**hung, "verdict": "hang"}), "values": "1x10"},
            {"series": series("ingero_session_phase", {**hung, "phase": "Running"}), "values": "1x5 0x5"}],
        "alert_rule_test": [
            {"eval_time": "1m", "alertname": "StragglerDetected", "exp_alerts": []},      # pending (for 2m)
            {"eval_time": "4m", "alertname": "StragglerDetected", "exp_alerts": [fired]},
            {"eval_time": "8m", "alertname": "StragglerDetected", "exp_alerts": []},      # 2 min after Completed
            {"eval_time": "2m", "alertname": "TrainingJobHung", "exp_alerts": [{
                "exp_labels": {**hung, "severity": "critical"}, "exp_annotations": {
                    "summary": "TraceSession team-a/hung-job: the job is hung in NCCL",
                    "description": "kubectl describe tracesession -n team-a hung-job: its Hung condition names the "
                                   "rank the others wait for and the call."}}]},
            {"eval_time": "7m", "alertname": "TrainingJobHung", "exp_alerts": []},       # the session completed
            {"eval_time": "3m", "alertname": "IngeroAgentDown", "exp_alerts": []},
            {"eval_time": "5m", "alertname": "IngeroAgentDown", "exp_alerts": [{
                "exp_labels": {**agent, "severity": "warning"}, "exp_annotations": {
                    "summary": "The Ingero agent at 10.0.0.7:9465 does not answer its metrics scrape",
                    "description": "kubectl -n ingero-system get pods -l app.kubernetes.io/component=agent -o wide: "
                                   "a node without a running agent cannot be traced."}}]},
            {"eval_time": "3m", "alertname": "IngeroAgentLosingEvents", "exp_alerts": []},
            {"eval_time": "8m", "alertname": "IngeroAgentLosingEvents", "exp_alerts": [{
                "exp_labels": {"node": "n7", "severity": "warning"}, "exp_annotations": {
                    "summary": "The Ingero agent on n7 loses 0.67 events/s (a ring buffer is full)",
                    "description": "Traces of that node miss events (ingero_agent_lost_events_total by ring names "
                                   "the probe family); the node's CPU is saturated or the ring is too small."}}]},
        ]}]}
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test, sort_keys=False))
    got = subprocess.run([tool, "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert got.returncode == 0, got.stdout + got.stderr
