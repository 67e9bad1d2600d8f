"""`helm install` on a real cluster (kind): images, chart, agents, operator, a training job.

Builds the agent, operator and lab-worker images, creates a kind cluster (one control
plane, two workers: tests/e2e/kind.yaml), loads the images, installs the chart with Helm's
engine (helm-python-sdk, no helm binary), then for each scenario applies a TraceSession,
runs a two-pod Indexed Job of two ranks each on the lab's CPU NCCL library
(tests/e2e/workload.py), waits for the session to complete and checks its status with the
same checks as the embedded-cluster flow (tests/cluster/verdict.py): no straggler on a
clean run, the slowed rank on its node with a compute cause under the fault.

Runs with `make e2e` (INGERO_E2E=1) where docker (with a daemon), kind and kubectl exist;
skips with the reason elsewhere. The host kernel needs headers for bcc under
/lib/modules/$(uname -r)/build (kind mounts the host's /lib/modules into its nodes).
INGERO_E2E_KEEP=1 leaves the cluster up (kubeconfig in the test's tmp folder).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.cluster import verdict
from tests.e2e import workload

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CLUSTER = os.environ.get("INGERO_E2E_CLUSTER", "ingero-e2e")
TAG = "e2e"
IMAGES = {"ingero-agent": "Dockerfile.agent", "ingero-operator": "Dockerfile.operator",
          "ingero-lab-worker": "tests/e2e/worker.Dockerfile"}
NAMESPACE, RELEASE, JOB_NS = "ingero-system", "ingero", "default"
RANKS, VICTIM = 4, 3      # 2 pods x 2 ranks; the last rank is slowed in the fault scenario


def skip_reason() -> str | None:
    missing = []
    if not shutil.which("docker"):
        missing.append("docker is not installed")
    elif subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode != 0:
        missing.append("the docker daemon is not reachable (`docker info` fails)")
    for tool in ("kind", "kubectl"):
        if not shutil.which(tool):
            missing.append(f"{tool} is not installed")
    try:
        import helm_python  # noqa: F401
    except ImportError:
        missing.append("helm-python-sdk is not installed")
    if missing:
        return "the kind e2e needs docker, kind and kubectl: " + "; ".join(missing)
    if os.environ.get("INGERO_E2E") != "1":
        return "the kind e2e builds three images and a cluster (minutes): run it with `make e2e` (INGERO_E2E=1)"
    return None


def run(*argv: str, timeout: float = 1800, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return proc


class Kind:
    def __init__(self, kubeconfig: Path):
        self.kubeconfig = kubeconfig

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        argv = ["kubectl", "--kubeconfig", str(self.kubeconfig), *args]
        if check:
            return run(*argv, timeout=120, input=input)
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, input=input)

    def apply(self, docs: list[dict]) -> None:
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))

    def get(self, kind: str, name: str, ns: str) -> dict:
        return json.loads(self.kubectl("get", kind, name, "-n", ns, "-o", "json").stdout)

    def diagnostics(self) -> str:
        out = []
        for args in (["get", "pods", "-A", "-o", "wide"],
                     ["-n", NAMESPACE, "logs", "deployment/ingero-operator", "--tail", "80"],
                     ["-n", NAMESPACE, "logs", "-l", "app.kubernetes.io/component=agent", "--tail", "40",
                      "--prefix"],
                     ["get", "tracesessions", "-A", "-o", "yaml"]):
            p = self.kubectl(*args, check=False)
            out.append(f"$ kubectl {' '.join(args)}\n{p.stdout[-4000:]}{p.stderr[-1000:]}")
        return "\n".join(out)


@pytest.fixture(scope="module")
def kind(tmp_path_factory):
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    import helm_python as helm

    for name, dockerfile in IMAGES.items():
        run("docker", "build", "-f", str(ROOT / dockerfile), "-t", f"{name}:{TAG}", str(ROOT))
    kubeconfig = tmp_path_factory.mktemp("kind") / "kubeconfig"
    run("kind", "delete", "cluster", "--name", CLUSTER)       # a leftover of an interrupted run
    run("kind", "create", "cluster", "--name", CLUSTER, "--config", str(HERE / "kind.yaml"),
        "--kubeconfig", str(kubeconfig), "--wait", "180s")
    k = Kind(kubeconfig)
    try:
        for name in IMAGES:
            run("kind", "load", "docker-image", f"{name}:{TAG}", "--name", CLUSTER)
        values = {"operator": {"image": {"repository": "ingero-operator", "tag": TAG, "pullPolicy": "Never"}},
                  "agent": {"image": {"repository": "ingero-agent", "tag": TAG, "pullPolicy": "Never"}},
                  "webhook": {"enabled": True}}
        with helm.Config(kubeconfig_path=str(kubeconfig), namespace=NAMESPACE) as cfg:
            try:
                cfg.install(str(ROOT / "charts" / "ingero"), RELEASE, values, namespace=NAMESPACE,
                            create_namespace=True, wait="watcher", timeout=600)
            except helm.HelmError as e:
                raise AssertionError(f"helm install failed: {e}\n{k.diagnostics()}") from e
        wait_for_webhook(k)
        yield k
    finally:
        if os.environ.get("INGERO_E2E_KEEP") != "1":
            run("kind", "delete", "cluster", "--name", CLUSTER)


def plugin_of(pod: dict) -> list[tuple]:
    """(NCCL_PROFILER_PLUGIN, its read-only mount, the volume's host path) of each container."""
    vols = {v["name"]: v for v in pod["spec"].get("volumes") or []}
    out = []
    for c in pod["spec"]["containers"]:
        env = {e["name"]: e.get("value") for e in c.get("env") or []}
        mounts = [m for m in c.get("volumeMounts") or [] if m["name"] == "ingero-profiler-plugin"]
        host = vols.get("ingero-profiler-plugin", {}).get("hostPath", {}).get("path")
        out.append((env.get("NCCL_PROFILER_PLUGIN"), [(m["mountPath"], m.get("readOnly")) for m in mounts], host))
    return out


def wait_for_webhook(k: Kind, timeout: float = 120) -> None:
    """The operator serves the webhook once kopf has scanned the API: until then pods are
    admitted unchanged (failurePolicy Ignore). A server-side dry run shows when it mutates."""
    probe = workload.job_objects("webhook-probe", JOB_NS, f"ingero-lab-worker:{TAG}")[1]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "webhook-probe", "namespace": JOB_NS,
                                                           **probe["spec"]["template"]["metadata"]},
           "spec": {"containers": probe["spec"]["template"]["spec"]["containers"], "restartPolicy": "Never"}}
    deadline, got = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        out = k.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(pod), check=False)
        if out.returncode == 0:
            got = plugin_of(json.loads(out.stdout))
            if got[0][0]:
                return
        time.sleep(2)
    raise AssertionError(f"the profiler-plugin webhook did not mutate a labelled pod: {got}\n{k.diagnostics()}")


def run_job(k: Kind, scenario: str) -> tuple[dict, dict[int, str]]:
    """Apply the session, run the job, wait for Completed; (status, pod index -> node)."""
    job = f"e2e-{scenario}"
    k.apply([workload.trace_session(job, JOB_NS, job)])
    k.apply(workload.job_objects(job, JOB_NS, f"ingero-lab-worker:{TAG}", seconds=20,
                                 slow_rank=VICTIM if scenario == "slow-rank" else None))
    deadline, status = time.monotonic() + 900, {}
    while time.monotonic() < deadline:
        status = k.get("tracesession", job, JOB_NS).get("status") or {}
        if status.get("phase") in ("Completed", "Failed"):
            break
        time.sleep(3)
    pods = json.loads(k.kubectl("get", "pods", "-n", JOB_NS, "-l", f"job-name={job}", "-o", "json").stdout)
    nodes = {int(p["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"]): p["spec"]["nodeName"]
             for p in pods["items"]}
    if status.get("phase") != "Completed":
        raise AssertionError(f"{job}: session did not complete: {json.dumps(status)[:1500]}\n{k.diagnostics()}")
    return status, nodes


def test_helm_install_runs_one_ready_agent_per_worker_and_the_operator(kind):
    ds = kind.get("daemonset", "ingero-agent", NAMESPACE)
    assert ds["status"]["numberReady"] == ds["status"]["desiredNumberScheduled"] == 2, ds["status"]
    dep = kind.get("deployment", "ingero-operator", NAMESPACE)
    assert dep["status"].get("readyReplicas") == 1, dep["status"]


def test_clean_job_completes_with_every_rank_and_no_straggler(kind):
    status, nodes = run_job(kind, "clean")
    verdict.check_no_straggler(status, RANKS, nodes=sorted(set(nodes.values())))
    # The job's pods opted in (label ingero.io/profiler=enabled): the webhook gave every
    # container the agent's plugin, from the host folder the agent's init container fills.
    pods = json.loads(kind.kubectl("get", "pods", "-n", JOB_NS, "-l", "job-name=e2e-clean", "-o", "json").stdout)
    plugin = "/var/lib/ingero/plugin"
    for p in pods["items"]:
        assert plugin_of(p) == [(f"{plugin}/libnccl-profiler-ingero.so", [(plugin, True)], plugin)], p["spec"]


def test_slowed_rank_is_named_on_its_node_with_a_compute_cause(kind):
    status, nodes = run_job(kind, "slow-rank")
    verdict.check_straggler(status, RANKS, VICTIM, nodes[VICTIM // 2], "compute/unknown")
