"""`kubectl ingero` end to end: real kubectl, the real operator serving artifacts, no root.

kubectl finds the plugin on PATH (a `kubectl-ingero` that runs ingero.kubectl_plugin,
as the package's console script does) and the plugin runs kubectl for every API
call; artifacts come from the operator's artifact server through the embedded API
server's service proxy (the chart's Service: ingero-operator, port `artifacts`,
selecting the operator's Pod). The flow is tests/unit/operator_flow.py's: fake-traced
agents whose job has rank 3 late at every all-reduce.

What cannot be tested here: a user whose RBAC forbids services/proxy. The embedded
API server authorizes nothing; the plugin's calls are instead checked against the
chart's artifact-reader role with Kubernetes' RBAC rules (the last test).
"""

from __future__ import annotations

import http.server
import importlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import threading
import tomllib
from pathlib import Path

import pytest

from ingero_operator import cluster_objects as objs
from tests.unit.operator_flow import ROOT, TRS, started

JOB = "jobk"


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    yield from started(tmp_path_factory, "kubectl-plugin", serve_artifacts=True)


@pytest.fixture(scope="module")
def plugin(flow):
    """Run `kubectl ingero ARGS` (with `path`: the plugin alone, with that PATH)."""
    bin_dir = flow.tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "kubectl-ingero"
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m ingero.kubectl_plugin \"$@\"\n")
    shim.chmod(0o755)

    def run(*args, path=None, cwd=None, timeout=120) -> subprocess.CompletedProcess:
        env = dict(flow.env, PATH=path if path is not None else f"{bin_dir}:{flow.env['PATH']}",
                   PYTHONPATH=str(ROOT))
        argv = ["kubectl", "ingero", *args] if path is None else [sys.executable, "-m", "ingero.kubectl_plugin", *args]
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd or flow.tmp)
    return run


@pytest.fixture(scope="module")
def done(flow, plugin):
    """A session traced and followed to the end with `kubectl ingero trace --wait`."""
    for r in range(4):
        flow.rank_pod(JOB, r, "node-a" if r < 2 else "node-b")
    return plugin("trace", "--selector", f"job-name={JOB}", "--name", "k1", "--duration", "5s", "--wait")


def one_line_error(out: subprocess.CompletedProcess) -> str:
    assert out.returncode != 0, out.stdout
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("kubectl-ingero: "), out.stderr
    return out.stderr.strip()


def test_the_plugin_is_the_packages_kubectl_ingero_console_script():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kubectl-ingero"] == "ingero.kubectl_plugin:main"
    module, func = scripts["kubectl-ingero"].split(":")
    assert importlib.import_module(module).main is getattr(importlib.import_module(module), func)
    assert importlib.import_module(module).main([]) == 2          # no command: the help, exit 2


def test_trace_wait_follows_the_session_to_completed_and_prints_the_verdict(flow, done):
    assert done.returncode == 0, done.stderr + flow.operator_log()
    lines = done.stdout.splitlines()
    assert lines[0] == "tracesessions.ingero.io/k1 created in namespace default"
    body = [ln.split(" ", 1)[1] for ln in lines[1:-2]]          # without the HH:MM:SS stamps
    phases = [ln.split(":", 1)[0] for ln in body if ln.split(":", 1)[0] in
              ("Pending", "Running", "Gathering", "Completed", "Failed")]
    assert phases[0] in ("Pending", "Running") and phases[-2:] == ["Gathering", "Completed"], done.stdout
    assert any(ln.startswith("progress: ") and "nodes tracing" in ln for ln in body), done.stdout
    assert any(ln.startswith("straggler: rank 3 (pod job-rank-3, node node-b)") for ln in body), done.stdout
    assert lines[-2].startswith("verdict: rank 3 (pod job-rank-3, node node-b) is the straggler: "
                                "cause compute/unknown"), done.stdout
    assert lines[-1] == "report: kubectl ingero report k1 -n default"
    st = flow.status("k1")
    assert st["phase"] == "Completed" and st["straggler"]["rank"] == 3
    doc = flow.cluster.get(f"{TRS}/k1")
    assert doc["spec"] == {"selector": {"matchLabels": {"job-name": JOB}}, "durationSeconds": 5,
                           "probes": ["nccl", "tcp", "sched"]}


def test_trace_without_wait_creates_a_generated_name_and_returns(flow, plugin):
    out = plugin("trace", "-l", "job-name=never-runs,team=a", "--probes", "nccl,tcp", "--retention-hours", "2")
    assert out.returncode == 0, out.stderr
    created = out.stdout.splitlines()[0]
    name = created.split("/", 1)[1].split()[0]
    assert name.startswith("never-runs-") and len(name) == len("never-runs-") + 5, created
    spec = flow.cluster.get(f"{TRS}/{name}")["spec"]
    assert spec["selector"]["matchLabels"] == {"job-name": "never-runs", "team": "a"}
    assert spec["probes"] == ["nccl", "tcp"] and spec["artifact"] == {"retentionHours": 2}


def test_report_through_the_service_proxy_is_what_ingero_report_prints_of_the_artifact(flow, plugin, done):
    out = plugin("report", "trs/k1")
    assert out.returncode == 0, out.stderr
    st = flow.status("k1")
    local = subprocess.run([sys.executable, "-m", "ingero", "report", str(Path(st["artifact"]["path"]).parent)],
                           capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert local.returncode == 0, local.stderr

    def verdict(text):     # the operator's report.json carries its own warnings (bounded), not the local run's
        return [ln for ln in text.splitlines() if not ln.startswith("warning: ")]
    assert verdict(out.stdout) == verdict(local.stdout)
    assert "straggler: rank 3 (job-rank-3), cause compute/unknown" in out.stdout
    report = json.loads(Path(st["artifact"]["report"]).read_text())
    assert [ln[len("warning: "):] for ln in out.stdout.splitlines() if ln.startswith("warning: ")] == report["warnings"]
    raw = plugin("report", "k1", "-n", "default", "--json")
    assert json.loads(raw.stdout) == report


def test_get_artifact_downloads_the_folder_that_ingero_reads(flow, plugin, done, tmp_path):
    out = plugin("get-artifact", "tracesession/k1", "-o", str(tmp_path / "k1"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"wrote {tmp_path / 'k1'}: trace.duckdb, report.json and ")
    src = Path(flow.status("k1")["artifact"]["path"]).parent
    got = sorted(p.relative_to(tmp_path / "k1").as_posix() for p in (tmp_path / "k1").rglob("*") if p.is_file())
    segments = sorted(p.relative_to(src).as_posix() for p in (src / "work" / "nodes").rglob("*.parquet"))
    assert got == sorted(["report.json", "trace.duckdb", *segments]) and len(segments) >= 2
    for f in got:       # byte for byte; never the read key or the live database
        assert (tmp_path / "k1" / f).read_bytes() == (src / f).read_bytes(), f
    q = "SELECT count(*) FROM nccl_events"
    counts = [subprocess.run([sys.executable, "-m", "ingero", "query", str(d), q, "--format", "csv"],
                             capture_output=True, text=True, cwd=ROOT, timeout=60) for d in (tmp_path / "k1", src)]
    assert counts[0].returncode == 0 and counts[0].stdout == counts[1].stdout and counts[0].stdout.split()[-1] != "0"
    again = plugin("get-artifact", "k1", "-o", str(tmp_path / "k1"))      # never into a folder with files
    assert "exists and is not an empty folder" in one_line_error(again)


def test_export_perfetto_writes_the_timeline_of_the_downloaded_trace(flow, plugin, done, tmp_path):
    out = plugin("export", "perfetto", "k1", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    doc = json.loads((tmp_path / "k1.perfetto.json").read_text())
    names = {e.get("name") for e in doc["traceEvents"]}
    assert "ALL_REDUCE" in names and out.stderr.startswith("wrote k1.perfetto.json (")
    threads = {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    assert threads == {f"rank {r} · job-rank-{r}" for r in range(4)}
    assert doc["otherData"]["source"] == "TraceSession default/k1"


def test_bad_input_gets_one_line_naming_the_fix_and_a_non_zero_exit(flow, plugin, done):
    assert "no TraceSession nope in the current namespace; list them: kubectl get trs" in \
        one_line_error(plugin("report", "nope"))
    assert "'pods/x' is not a TraceSession" in one_line_error(plugin("report", "pods/x"))
    assert "--selector term 'a!=b' is not KEY=VALUE" in one_line_error(plugin("trace", "-l", "a!=b"))
    flow.apply("waiting", selector={"matchLabels": {"job-name": "nobody-yet"}})
    flow.wait_for("waiting", lambda s: s.get("phase") == "Pending")
    msg = one_line_error(plugin("get-artifact", "waiting"))
    assert "TraceSession default/waiting is Pending: its artifact exists once it completes; wait for it: " \
           "kubectl wait --for=condition=Completed trs/waiting -n default" in msg
    assert not (flow.tmp / "waiting").exists()           # no -o folder made for nothing
    flow.apply("refused", selector={"matchLabels": {"bad key!": "b"}})
    flow.wait_for("refused", lambda s: s.get("phase") == "Failed")
    msg = one_line_error(plugin("report", "refused"))
    assert "failed, so it has no artifact: " in msg and "label key" in msg
    trace = plugin("trace", "-l", "job-name=x", "--name", "k1")
    assert "AlreadyExists" in one_line_error(trace) and "pick another --name" in trace.stderr
    missing = plugin("report", "k1", path="")             # no kubectl on PATH
    assert "kubectl is not installed (not on PATH): install kubectl" in one_line_error(missing)


def test_a_lost_expired_or_misdirected_artifact_is_named_as_such(flow, plugin):
    """Sessions completed for this test alone: their artifacts are damaged on purpose."""
    for r in range(2):
        flow.rank_pod("jobm", r, "node-a")
    for name in ("gone", "expired", "elsewhere"):
        flow.apply(name, selector={"matchLabels": {"job-name": "jobm"}}, durationSeconds=2)
    for name in ("gone", "expired", "elsewhere"):
        flow.wait_for(name, lambda s: s.get("phase") == "Completed", timeout=60)
    shutil.rmtree(Path(flow.status("gone")["artifact"]["path"]).parent)
    assert "(NotFound): no artifact of TraceSession default/gone with this key" in \
        (msg := one_line_error(plugin("report", "gone"))) and "operator.artifacts.existingClaim" in msg
    (flow.tmp / "mine").mkdir()                  # a failed download leaves the user's folder as it was ...
    assert "no artifact of TraceSession" in one_line_error(plugin("get-artifact", "gone", "-o", "mine"))
    assert (flow.tmp / "mine").is_dir() and not any((flow.tmp / "mine").iterdir())
    one_line_error(plugin("get-artifact", "gone", "-o", "new"))
    assert not (flow.tmp / "new").exists()       # ... and makes none
    flow.cluster.patch(f"{TRS}/expired/status", {"status": {"artifact": {"deleted": True,
                                                                         "expiresAt": "2030-01-01T00:00:00Z"}}})
    assert "expired at 2030-01-01T00:00:00Z (spec.artifact.retentionHours) and was deleted" in \
        one_line_error(plugin("get-artifact", "expired"))
    proxy = flow.status("elsewhere")["artifact"]["proxy"]
    flow.cluster.patch(f"{TRS}/elsewhere/status", {"status": {"artifact": {
        "proxy": proxy.replace(f"services/{objs.OPERATOR_SERVICE}:", "services/nothing-here:")}}})
    msg = one_line_error(plugin("report", "elsewhere"))
    assert 'services "nothing-here" not found' in msg and "is the operator running?" in msg
    flow.cluster.patch(f"{TRS}/elsewhere/status", {"status": {"artifact": {
        "proxy": "/api/v1/namespaces/kube-system/secrets/x"}}})
    assert "is not the service proxy path of this session's artifact; not fetching it" in \
        one_line_error(plugin("report", "elsewhere"))


def test_names_outside_the_artifacts_folder_are_refused_through_the_proxy(flow, plugin, done):
    st = flow.status("k1")
    proxy, key = st["artifact"]["proxy"], st["artifact"]["readKey"]
    base = proxy.rsplit("/v1/artifacts/", 1)[0]
    for path in (f"{base}/v1/artifacts/default/..%2F..%2Fdefault%2Fk1/report.json?key={key}",
                 f"{base}/v1/artifacts/default/k1/artifact.key?key={key}",
                 f"{base}/v1/artifacts/default/k1/..%2Fwork%2Flive.duckdb?key={key}",
                 f"{base}/v1/artifacts/..%2Fdefault/k1/report.json?key={key}"):
        out = flow.kubectl("get", "--raw", path, check=False)
        assert out.returncode != 0 and out.stdout == "", (path, out.stdout[:200])
    ok = flow.kubectl("get", "--raw", f"{proxy}/report.json?key={key}")
    assert json.loads(ok.stdout)["sessionId"] == st["sessionId"]


def test_the_plugins_api_calls_are_what_the_charts_artifact_reader_role_allows(flow, plugin, done, tmp_path):
    """Each request the plugin made for `report` and `get-artifact`, as the authorizer sees it,
    against the chart's <release>-artifact-reader role plus `get` on TraceSessions in the
    session's namespace (what the user needs anyway): the role's resourceNames must be the
    proxy id the plugin uses, in the namespace and Service the chart installs."""
    pytest.importorskip("helm_python", reason="helm-python-sdk is not installed: pip install -e '.[test]'")
    from tests.chart.chartlib import NAMESPACE, find, render
    from tests.chart.test_rbac import rule_allows, to_call

    docs = render()
    svc = find(docs, "Service", objs.OPERATOR_SERVICE)
    assert svc["metadata"]["namespace"] == NAMESPACE == objs.SYSTEM_NS
    assert [(p["name"], p["targetPort"]) for p in svc["spec"]["ports"]] == \
        [(p["name"], p["targetPort"]) for p in objs.operator_service()["spec"]["ports"]]
    role = find(docs, "ClusterRole", "ingero-artifact-reader")
    seen = len(list(flow.cluster.emulator))
    assert plugin("report", "k1").returncode == 0
    assert plugin("get-artifact", "k1", "-o", str(tmp_path / "a")).returncode == 0
    # kubectl sends no bearer token over plain http: its requests are told by their User-Agent
    calls = [to_call(str(getattr(r.method, "value", r.method)), r.url.path, dict(r.params))
             for r in list(flow.cluster.emulator)[seen:]
             if {k.lower(): v for k, v in r.headers.items()}.get("user-agent", "").startswith("kubectl/")]
    calls = [c for c in calls if c.group is not None]            # discovery is open to everyone
    proxied = [c for c in calls if c.resource == "services/proxy"]
    assert len(proxied) == 2 and {(c.verb, c.namespace, c.name) for c in proxied} == \
        {("get", objs.SYSTEM_NS, f"{objs.OPERATOR_SERVICE}:artifacts")}
    user = [{"apiGroups": ["ingero.io"], "resources": ["tracesessions"], "verbs": ["get"]}]
    denied = [c for c in calls if not any(rule_allows(r, c) for r in role["rules"] + user)]
    assert denied == []
    other = to_call("GET", f"/api/v1/namespaces/{objs.SYSTEM_NS}/services/{objs.OPERATOR_SERVICE}:8082/proxy/x", {})
    assert not any(rule_allows(r, other) for r in role["rules"])       # the rule names one exact id


# ---- following a session, without a cluster ---------------------------------------------------

def test_kubectl_watch_output_splits_into_its_json_documents():
    from ingero.session_follow import json_docs

    docs = [{"metadata": {"name": "a"}, "status": {"phase": p, "nested": {"x": [1, {"y": "}"}]}}}
            for p in ("Pending", "Running")]
    text = "".join(json.dumps(d, indent=4) + "\n" for d in docs)     # as `kubectl get -w -o json` prints
    assert list(json_docs(io.StringIO(text))) == docs


def test_each_change_is_printed_once_and_progress_at_most_every_ten_seconds():
    from ingero.session_follow import PROGRESS_EVERY_S, Lines

    now = [0.0]
    lines = Lines(clock=lambda: now[0])
    cond = [{"type": "StragglerDetected", "status": "True", "message": "rank 3 (pod p) is the straggler: cause io"}]
    run = {"phase": "Running", "message": "tracing 4 pods", "ranks": 4, "stepMs": 55.04,
           "nodes": [{"state": "running", "events": 1000}, {"state": "starting", "events": 0}]}
    assert lines.update({"phase": "Pending", "message": "waiting"}) == ["Pending: waiting"]
    assert lines.update(run) == ["Running: tracing 4 pods",
                                 "progress: 4 ranks, 1/2 nodes tracing, 1,000 events, step ~55.0 ms"]
    assert lines.update(run) == []
    now[0] += PROGRESS_EVERY_S / 2
    more = dict(run, nodes=[{"state": "running", "events": 5000}, {"state": "running", "events": 10}])
    assert lines.update(dict(more, conditions=cond)) == ["straggler: " + cond[0]["message"]]   # progress waits
    now[0] += PROGRESS_EVERY_S / 2
    assert lines.update(more) == ["progress: 4 ranks, 2/2 nodes tracing, 5,010 events, step ~55.0 ms"]
    assert lines.update({"phase": "Completed", "message": "done", "conditions": cond}) == ["Completed: done"]


def hostile_tar() -> bytes:
    """A tar whose member `x` (a file) is followed by `x/y`, as no folder can hold."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (("report.json", b"{}"), ("x", b"file"), ("x/y", b"below a file")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_a_hostile_artifact_or_one_over_max_bytes_is_one_line_and_leaves_no_folder(flow, plugin, done, tmp_path):
    """The artifact comes through the real service proxy from a server that is not the operator's."""
    body = hostile_tar()

    class Hostile(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    ns = objs.SYSTEM_NS
    flow.cluster.create(f"/api/v1/namespaces/{ns}/services", {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "hostile", "namespace": ns},
        "spec": {"ports": [{"name": "artifacts", "port": 80, "targetPort": srv.server_address[1]}]}})
    flow.cluster.create(f"/api/v1/namespaces/{ns}/endpoints", {
        "apiVersion": "v1", "kind": "Endpoints", "metadata": {"name": "hostile", "namespace": ns},
        "subsets": [{"addresses": [{"ip": "127.0.0.1"}],
                     "ports": [{"name": "artifacts", "port": srv.server_address[1]}]}]})
    proxy = flow.status("k1")["artifact"]["proxy"]
    try:
        flow.cluster.patch(f"{TRS}/k1/status", {"status": {"artifact": {
            "proxy": proxy.replace(f"services/{objs.OPERATOR_SERVICE}:", "services/hostile:")}}})
        msg = one_line_error(plugin("get-artifact", "k1", "-o", str(tmp_path / "x")))
        assert "'x/y'" in msg and "refusing it" in msg, msg
        assert not (tmp_path / "x").exists()
    finally:
        flow.cluster.patch(f"{TRS}/k1/status", {"status": {"artifact": {"proxy": proxy}}})
        srv.shutdown()
    msg = one_line_error(plugin("get-artifact", "k1", "-o", str(tmp_path / "small"), "--max-bytes", "1000"))
    assert "larger than --max-bytes 1000" in msg, msg
    assert not (tmp_path / "small").exists()


def test_list_logs_and_delete_against_the_api_server(flow, plugin, done):
    out = plugin("list")
    assert out.returncode == 0, out.stderr
    header, *rows = out.stdout.splitlines()
    assert header.split()[:4] == ["NAME", "PHASE", "RANKS", "STRAGGLER"]
    assert any(r.split()[:2] == ["k1", "Completed"] for r in rows), out.stdout
    assert plugin("ls", "-A").stdout.splitlines()[0].split()[:2] == ["NAMESPACE", "NAME"]
    none = plugin("list", "-l", "team in (nobody)")                 # a set-based selector
    assert none.returncode == 0 and none.stdout == "" and "no TraceSessions in" in none.stderr

    out = plugin("logs", "k1")
    assert out.returncode == 0, out.stderr
    reasons = [ln.split()[2] for ln in out.stdout.splitlines() if ln[:4].isdigit()]
    assert reasons[0] == "Tracing" and reasons[-1] == "Completed" and "Gathered" in reasons, out.stdout
    assert "now: Completed: completed" in out.stdout
    # the embedded API server answers pods/log with the Pod object: no line names the session
    assert out.stdout.endswith("\noperator log, 0 lines about default/k1:\n"), out.stdout

    created = plugin("trace", "--selector", "job-name=nobody", "--name", "kdel")
    assert created.returncode == 0, created.stderr
    out = plugin("delete", "trs/kdel")
    assert out.returncode == 0 and out.stdout.strip() == 'tracesession.ingero.io "kdel" deleted', out
    flow.wait_for("kdel", lambda s: not flow.cluster.get(f"{TRS}/kdel"), timeout=30)
    assert "no TraceSession kdel in " in one_line_error(plugin("delete", "kdel"))
    assert one_line_error(plugin("logs", "kdel")).startswith("kubectl-ingero: no TraceSession kdel")
