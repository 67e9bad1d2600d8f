"""The agents' Prometheus metrics on a cluster (metrics.agent): the DaemonSet serves them on
a named port that its annotations, its PodMonitor and its NetworkPolicy all name alike,
and an agent started with the rendered arguments really answers a scrape without the token."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from ingero_operator.cluster_objects import free_port
from tests.chart.chartlib import CHART, NAMESPACE, args_of, container, find, helm, render
from tests.chart.test_chart_security import pod_labels, policies, selects

ON = {"metrics": {"agent": {"enabled": True, "podMonitor": {"enabled": True, "labels": {"release": "prom"}}}}}


def agent_policy(docs: list[dict]) -> dict:
    [spec] = [p for p in policies(docs).values() if selects(p["podSelector"], pod_labels(docs, "DaemonSet"))]
    return spec


def metrics_port(docs: list[dict]) -> int | None:
    return next((p["containerPort"] for p in container(docs, "DaemonSet", "agent")["ports"]
                 if p["name"] == "metrics"), None)


@pytest.mark.parametrize("values", [
    ON,
    # metrics.agent.enabled unset (null) follows metrics.enabled, on by default
    {"metrics": {}},
    # names and labels the user may change, another port, IPv6
    {"fullnameOverride": "tracer", "commonLabels": {"team": "ml"}, "agent": {"podLabels": {"tier": "node"},
     "listenAddress": "[::]"}, "metrics": {"agent": {"enabled": True, "port": 9500, "podMonitor": {"enabled": True}}}},
], ids=["on", "default", "renamed"])
def test_the_daemonset_serves_metrics_on_the_port_its_annotations_podmonitor_and_policy_name(values):
    docs = render(values)
    c = container(docs, "DaemonSet", "agent")
    port = metrics_port(docs)
    args = args_of(c)
    assert port is not None and args["--metrics-port"] == [str(port)]
    # The agent's metrics listen where its API does (all addresses of the pod, v4 or v6).
    listen = args["--listen"][0].rsplit(":", 1)[0]
    assert args["--metrics-address"] == [listen.strip("[]")]
    assert port != int(args["--listen"][0].rsplit(":", 1)[1])
    ann = find(docs, "DaemonSet")["spec"]["template"]["metadata"]["annotations"]
    assert (ann["prometheus.io/scrape"], ann["prometheus.io/port"], ann["prometheus.io/path"]) == \
        ("true", str(port), "/metrics")
    # The policy admits metricsFrom (default: the monitoring namespace) on that port, the operator
    # alone on the API.
    rules = {r["ports"][0]["port"]: r for r in agent_policy(docs)["ingress"]}
    assert rules[port] == {"ports": [{"port": port, "protocol": "TCP"}], "from": [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]}
    assert len(rules) == 2
    if not values["metrics"].get("agent", {}).get("podMonitor", {}).get("enabled"):
        assert not [d for d in docs if d["kind"] == "PodMonitor"]
        return
    pm = find(docs, "PodMonitor")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1" and pm["metadata"]["namespace"] == NAMESPACE
    # The PodMonitor selects the agent pods, not the operator's, on a port the container has.
    assert selects(pm["spec"]["selector"], pod_labels(docs, "DaemonSet"))
    assert not selects(pm["spec"]["selector"], pod_labels(docs, "Deployment"))
    [ep] = pm["spec"]["podMetricsEndpoints"]
    assert ep["port"] in {p["name"] for p in c["ports"]} and ep["port"] == "metrics"
    assert ep["path"] == "/metrics" and ep["interval"] == "30s"
    assert ep["relabelings"] == [{"targetLabel": "job", "replacement": "ingero-agent"}]    # IngeroAgentDown's job
    assert pm["metadata"]["labels"].get("release") == ("prom" if values is ON else None)


@pytest.mark.parametrize("values", [{"metrics": {"enabled": False}},
                                    {"metrics": {"enabled": True, "agent": {"enabled": False}}},
                                    {"metrics": {"agent": {"enabled": False, "podMonitor": {"enabled": False}}}}],
                         ids=["metrics-off", "operator-only", "off"])
def test_agent_metrics_off_serve_nothing_and_open_nothing(values):
    docs = render(values)
    c = container(docs, "DaemonSet", "agent")
    assert metrics_port(docs) is None and not [a for a in c["args"] if a.startswith("--metrics")]
    ann = find(docs, "DaemonSet")["spec"]["template"]["metadata"]["annotations"]
    assert not [k for k in ann if k.startswith("prometheus.io/")]
    assert not [d for d in docs if d["kind"] == "PodMonitor"]
    [rule] = agent_policy(docs)["ingress"]
    assert [p["port"] for p in rule["ports"]] == [int(args_of(c)["--listen"][0].rsplit(":", 1)[1])]


def test_the_agents_metrics_peers_are_networkpolicy_metricsfrom():
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
              "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]
    docs = render({"metrics": {"enabled": True}, "networkPolicy": {"metricsFrom": peers}})
    rules = {r["ports"][0]["port"]: r for r in agent_policy(docs)["ingress"]}
    assert rules[metrics_port(docs)]["from"] == peers
    # the same peers as the operator's metrics port
    op = policies(docs)["ingero-operator"]["ingress"]
    assert {"ports": [{"port": 9102, "protocol": "TCP"}], "from": peers} in op
    # An empty list: any source on the metrics port (and still only the operator on the API).
    docs = render({"metrics": {"agent": {"enabled": True}}, "networkPolicy": {"metricsFrom": []}})
    rules = {r["ports"][0]["port"]: r for r in agent_policy(docs)["ingress"]}
    assert "from" not in rules[metrics_port(docs)]
    assert len(rules) == 2 and all("from" in r for p, r in rules.items() if p != metrics_port(docs))


def test_the_agent_metrics_objects_are_valid_kubernetes_and_lint_clean():
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    docs = render(ON)
    for doc in docs:
        if doc["kind"] in ("DaemonSet", "NetworkPolicy"):
            kv.validate(doc, kv.latest_version(), strict=True)
    report = helm().lint(str(CHART), ON, strict=True, namespace=NAMESPACE)
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] > 1] == []


@pytest.mark.parametrize("values,message", [
    ({"metrics": {"agent": {"enabled": True, "port": 9464}}},
     "metrics.agent.port 9464 is also agent.port: the agent serves its API and its metrics in one pod"),
    ({"metrics": {"enabled": True}, "agent": {"port": 9465}}, "metrics.agent.port 9465 is also agent.port"),
    ({"metrics": {"enabled": False, "agent": {"podMonitor": {"enabled": True}}}},
     "metrics.agent.podMonitor.enabled=true but the agents serve no metrics"),
])
def test_a_port_clash_or_a_podmonitor_without_metrics_fails_with_one_line(values, message):
    with pytest.raises(helm().HelmRenderError, match=message.replace(".", r"\.")) as e:
        render(values)
    msg = str(e.value).strip().splitlines()
    assert len([ln for ln in msg if "metrics.agent" in ln]) == 1


def test_a_port_clash_is_no_error_while_agent_metrics_are_off():
    assert metrics_port(render({"metrics": {"agent": {"enabled": False, "port": 9464}}})) is None


@pytest.mark.parametrize("values,where", [
    ({"metrics": {"agent": {"enable": True}}}, "/metrics/agent"),
    ({"metrics": {"agent": {"enabled": "yes"}}}, "/metrics/agent/enabled"),
    ({"metrics": {"agent": {"port": 0}}}, "/metrics/agent/port"),
    ({"metrics": {"agent": {"podMonitor": {"scrapeTimeout": "10s"}}}}, "/metrics/agent/podMonitor"),
    ({"metrics": {"agent": {"podMonitor": {"interval": "30 seconds"}}}}, "/metrics/agent/podMonitor/interval"),
])
def test_the_schema_rejects_unknown_or_bad_agent_metrics_values(values, where):
    with pytest.raises(helm().HelmValuesError) as e:
        render(values)
    assert where in str(e.value)


# ---- a real agent, started as the DaemonSet says --------------------------------------------

def _get(url: str, token: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("listen", ["0.0.0.0", "[::]"])
def test_an_agent_started_with_the_rendered_args_answers_a_scrape_without_the_token(tmp_path, listen):
    if listen == "[::]" and not _has_ipv6_loopback():
        pytest.skip("no IPv6 on this host")
    mport = free_port()
    docs = render({"tls": {"enabled": False}, "agent": {"listenAddress": listen},
                   "metrics": {"agent": {"enabled": True, "port": mport}}})
    c = container(docs, "DaemonSet", "agent")
    assert metrics_port(docs) == mport
    token = "scrape-test-token-0123456789abcdef"
    (tmp_path / "token").write_text(token)
    api = free_port()
    # The rendered arguments, with what names the pod's world (node, host paths) made local.
    local = {"--node": "n1", "--listen": f"127.0.0.1:{api}", "--data-dir": str(tmp_path / "data"),
             "--token-file": str(tmp_path / "token")}
    args = []
    for a in c["args"]:
        flag = a.partition("=")[0]
        if flag == "--cgroup-root":            # /host/sys/fs/cgroup is the pod's mount
            continue
        args.append(f"{flag}={local[flag]}" if flag in local else a)
    assert f"--metrics-port={mport}" in args and args[:2] == ["agent", "serve"]
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-m", "ingero", *args, "--ready-file", str(ready), "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, \
                proc.stderr.read() if proc.poll() is not None else "slow start"
            time.sleep(0.05)
        base = f"http://127.0.0.1:{api}"
        assert _get(f"{base}/v1/time")[0] == 401                     # the API needs the token ...
        assert _get(f"{base}/v1/time", token)[0] == 200
        assert _get(f"{base}/v1/sessions/team-a.secret-job.0000", token)[0] == 404
        scrape = "[::1]" if listen == "[::]" else "127.0.0.1"
        code, text = _get(f"http://{scrape}:{mport}/metrics")        # ... its metrics do not
        assert code == 200, text
        series = [ln for ln in text.splitlines() if ln.startswith("ingero_")]
        assert any(ln.startswith('ingero_agent_sessions{node="n1",state="running"} 0') for ln in series), series
        cap = int(args_of(c)["--data-max-bytes"][0])
        [line] = [ln for ln in series if ln.startswith('ingero_agent_data_max_bytes{node="n1"} ')]
        assert float(line.rsplit(" ", 1)[1]) == cap > 0
        # Requests are counted by route pattern: neither the token nor a path's session id shows.
        assert 'ingero_agent_requests_total{node="n1",route="/v1/sessions/{sid}",status="404"} 1.0' in series
        assert 'ingero_agent_requests_total{node="n1",route="/v1/time",status="200"} 1.0' in series
        assert token not in text and "secret-job" not in text
    finally:
        proc.terminate()
        proc.wait(10)
