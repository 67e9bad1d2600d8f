"""The whole operator flow without root, shared by the tests that need it.

The real kopf operator (`ingero operator run`, a process) against the embedded API
server, real agent HTTP servers on two nodes (their tracer is tests/unit/fake_tracer.py,
which writes a job whose rank 3 arrives late at every all-reduce), a third node whose
agent does not answer, and the real kubectl. Import `flow` into a test module for a
flow of its own (module scope), or build a fixture on `started`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.unit.trace_fixture import TOKEN, serve_agent

ROOT = Path(__file__).resolve().parents[2]
TRS = "/apis/ingero.io/v1alpha1/namespaces/default/tracesessions"
PODS = "/api/v1/namespaces/default/pods"
FAKE_TRACER = Path(__file__).with_name("fake_tracer.py")


def skip_reason() -> str | None:
    if not shutil.which("kubectl"):
        return "kubectl is not installed (the tests run kubectl wait, describe and get)"
    for mod in ("kmock", "kopf", "jsonschema"):
        try:
            __import__(mod)
        except ImportError:
            return f"{mod} is not installed: pip install -e '.[test]'"
    return None


class Flow:
    """The embedded API server, two fake-traced agents and an unreachable one, the real
    operator (a process). With `serve_artifacts`, the operator also serves artifacts
    (--artifact-port) behind the chart's operator Service, registered with its Pod;
    `operator_args` are more flags of `ingero operator run`."""

    def __init__(self, tmp: Path, serve_artifacts: bool = False, operator_args: tuple = ()):
        from ingero_operator import cluster_objects as objs
        from ingero_operator.embedded import EmbeddedCluster

        self.tmp = tmp
        self.cluster = EmbeddedCluster(ROOT / "crds" / "tracesession.yaml", tmp / "api").start()
        self.env = {"KUBECONFIG": str(self.cluster.kubeconfig), "PATH": "/usr/bin:/bin", "HOME": str(tmp),
                    "KUBECACHEDIR": str(tmp / "kube-cache")}
        self.cluster.create(f"/api/v1/namespaces/{objs.SYSTEM_NS}/secrets", objs.token_secret(TOKEN))
        self.agents = []
        for node, ranks in (("node-a", "0,1"), ("node-b", "2,3")):
            srv, _ = serve_agent(tmp / node, node, trace_cmd=[sys.executable, str(FAKE_TRACER), "--ranks", ranks])
            self.agents.append(srv)
            self.cluster.create(f"/api/v1/namespaces/{objs.SYSTEM_NS}/pods",
                                objs.agent_pod(node, srv.server_address[1]))
        # node-c's agent Pod exists, but nothing answers at its address
        self.cluster.create(f"/api/v1/namespaces/{objs.SYSTEM_NS}/pods", objs.agent_pod("node-c", objs.free_port()))
        serve = []
        if serve_artifacts:
            port = objs.free_port()
            serve = ["--artifact-port", str(port), "--artifact-address", "127.0.0.1",
                     "--artifact-service", f"{objs.OPERATOR_SERVICE}:artifacts"]
            self.cluster.create(f"/api/v1/namespaces/{objs.SYSTEM_NS}/pods", objs.operator_pod(port))
            self.cluster.create(f"/api/v1/namespaces/{objs.SYSTEM_NS}/services", objs.operator_service())
        self.log = open(tmp / "operator.log", "wb")
        self.operator = subprocess.Popen(
            [sys.executable, "-m", "ingero", "operator", "run", "--standalone", "--namespace", objs.SYSTEM_NS,
             "--artifacts", str(tmp / "artifacts"), "--refresh-interval", "0.5", *serve, *operator_args],
            cwd=ROOT, env=dict(os.environ, KUBECONFIG=str(self.cluster.kubeconfig)),
            stdout=self.log, stderr=subprocess.STDOUT)

    def close(self):
        self.operator.terminate()
        try:
            self.operator.wait(15)
        except subprocess.TimeoutExpired:
            self.operator.kill()
        self.log.close()
        for srv in self.agents:
            srv.shutdown()
            srv.server_close()
        self.cluster.stop()

    def operator_log(self) -> str:
        return (self.tmp / "operator.log").read_text(errors="replace")[-4000:]

    def kubectl(self, *args, check=True) -> subprocess.CompletedProcess:
        out = subprocess.run(["kubectl", *args], env=self.env, capture_output=True, text=True, timeout=60)
        if check:
            assert out.returncode == 0, out.stderr
        return out

    def apply(self, name: str, **spec):
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"apiVersion": "ingero.io/v1alpha1", "kind": "TraceSession",
                                        "metadata": {"name": name, "namespace": "default"}, "spec": spec}))
        self.kubectl("apply", "--validate=false", "-f", str(path))

    def status(self, name: str) -> dict:
        return (self.cluster.get(f"{TRS}/{name}") or {}).get("status") or {}

    def wait_for(self, name: str, what, timeout: float = 60.0, every=None) -> dict:
        """Poll the status until what(status) holds; `every(status)` is checked on each poll."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.status(name)
            if every is not None:
                every(st)
            if what(st):
                return st
            assert self.operator.poll() is None, f"the operator exited:\n{self.operator_log()}"
            time.sleep(0.1)
        raise AssertionError(f"{name}: timed out; status {json.dumps(self.status(name))[-2500:]}\n"
                             f"{self.operator_log()}")

    def events(self, name: str) -> list[dict]:
        _, doc = self.cluster.request("GET", f"/api/v1/namespaces/default/events?fieldSelector="
                                             f"involvedObject.name%3D{name}")
        return sorted(doc.get("items") or [], key=lambda e: int(e["metadata"]["resourceVersion"]))

    def wait_events(self, name: str, reasons: set, timeout: float = 20.0) -> list[dict]:
        """kopf posts Events in the background, shortly after the handler queued them."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            evs = self.events(name)
            if reasons <= {e["reason"] for e in evs}:
                return evs
            time.sleep(0.2)
        raise AssertionError(f"{name}: events {[(e['reason'], e['message']) for e in self.events(name)]} "
                             f"lack {reasons}")

    def rank_pod(self, job: str, rank: int, node: str) -> dict:
        return self.cluster.create(PODS, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{job}-rank-{rank}", "namespace": "default", "labels": {"job-name": job}},
            "spec": {"nodeName": node, "containers": [{"name": "trainer", "image": "trainer"}]},
            "status": {"phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}],
                       "containerStatuses": [{"name": "trainer", "ready": True,
                                              "containerID": f"containerd://{job}{rank:060d}"}]}})


def started(tmp_path_factory, name: str, **kw):
    """A Flow for a module's tests (a generator for a fixture), or a skip naming what is missing."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    f = Flow(tmp_path_factory.mktemp(name), **kw)
    yield f
    f.close()


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    yield from started(tmp_path_factory, "lifecycle")
