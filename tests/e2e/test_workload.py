"""The kind e2e job's pieces, checked on this machine: the rank script runs two "pods" of two
ranks of the lab's CPU NCCL worker over loopback, its preload step maps libnccl before any
rank starts, the fault slows exactly one rank, and the manifests are valid Kubernetes
objects and a valid TraceSession."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.e2e import workload

ROOT = Path(__file__).resolve().parents[2]
LOADER = "/lib64/ld-linux-x86-64.so.2"


@pytest.fixture(scope="module")
def lab_binaries(tmp_path_factory):
    if not shutil.which(os.environ.get("CC", "gcc")):
        pytest.skip("gcc is not installed (the lab compiles its NCCL library and worker)")
    from ingero.lab.build import build_lab_binaries
    return build_lab_binaries()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_pod(index: int, env: dict, out: Path) -> subprocess.Popen:
    pod_env = dict(os.environ, JOB_COMPLETION_INDEX=str(index), **env)
    with open(out / f"pod-{index}.out", "wb") as f, open(out / f"pod-{index}.err", "wb") as e:
        return subprocess.Popen(["/bin/sh", "-c", workload.RANK_SCRIPT], env=pod_env, stdout=f, stderr=e,
                                start_new_session=True)


def finals(out: Path) -> list[dict]:
    rows = []
    for p in sorted(out.glob("pod-*.out")):
        rows += [json.loads(ln) for ln in p.read_text().splitlines() if ln.startswith("{")]
    return sorted(rows, key=lambda r: r["rank"])


def test_two_pods_of_two_ranks_train_together_and_the_fault_slows_one_rank(lab_binaries, tmp_path):
    env = workload.rank_env(world=4, ranks_per_pod=2, master_addr="127.0.0.1", run_id="e2e-local", seconds=2,
                            slow_rank=3, slow_factor=3, compute_ms=20, worker=str(lab_binaries.worker),
                            libnccl=str(lab_binaries.libnccl), preload_seconds=None)
    env["MASTER_PORT"] = str(free_port())
    pods = [start_pod(i, env, tmp_path) for i in (1, 0)]     # the non-master pod first: it waits
    compute = {}   # RANK -> INGERO_LAB_COMPUTE_MS, read from the running workers' environment
    while any(p.poll() is None for p in pods):
        for p in pods:
            try:
                children = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
                for c in children:
                    e = dict(kv.split("=", 1) for kv in Path(f"/proc/{c}/environ").read_text().split("\0") if "=" in kv)
                    if "RANK" in e:
                        compute[int(e["RANK"])] = float(e["INGERO_LAB_COMPUTE_MS"])
            except OSError:
                pass
        time.sleep(0.05)
    codes = [p.wait(60) for p in pods]
    assert codes == [0, 0], [(tmp_path / f"pod-{i}.err").read_text()[-500:] for i in (0, 1)]
    rows = finals(tmp_path)
    assert [(r["rank"], r["node"], r["local_rank"], r["world_size"]) for r in rows] == \
        [(0, 0, 0, 4), (1, 0, 1, 4), (2, 1, 0, 4), (3, 1, 1, 4)]
    assert len({r["steps"] for r in rows}) == 1 and rows[0]["steps"] > 3   # rank 0 decides, all follow
    assert compute == {0: 20, 1: 20, 2: 20, 3: 60}
    # Data parallel: every rank waits for the slow one at each all-reduce.
    assert all(r["mean_step_ms"] > 60 for r in rows), rows


def test_a_failing_rank_fails_its_pod(lab_binaries, tmp_path):
    env = workload.rank_env(world=2, ranks_per_pod=2, master_addr="127.0.0.1", run_id="e2e-bad", seconds=1,
                            slow_rank=None, worker=str(lab_binaries.worker), libnccl=str(lab_binaries.libnccl),
                            preload_seconds=None)
    env.update(MASTER_PORT=str(free_port()), INGERO_LAB_ELEMS="not-a-number")
    assert start_pod(0, env, tmp_path).wait(60) != 0


def test_the_preload_step_maps_libnccl_before_the_ranks_start(lab_binaries, tmp_path):
    if not Path(LOADER).exists():
        pytest.skip(f"{LOADER} is not the dynamic loader here")
    env = workload.rank_env(world=2, ranks_per_pod=2, master_addr="127.0.0.1", run_id="e2e-pre", seconds=1,
                            slow_rank=None, worker=str(lab_binaries.worker), libnccl=str(lab_binaries.libnccl),
                            preload_seconds=2, loader=LOADER)
    env["MASTER_PORT"] = str(free_port())
    pod = start_pod(0, env, tmp_path)
    try:
        deadline, mapped = time.monotonic() + 2, None
        while time.monotonic() < deadline and mapped is None:
            for child in Path(f"/proc/{pod.pid}/task/{pod.pid}/children").read_text().split():
                maps = Path(f"/proc/{child}/maps").read_text()
                if str(lab_binaries.libnccl.resolve()) in maps:
                    argv = Path(f"/proc/{child}/cmdline").read_text().split("\0")
                    mapped = (argv, finals(tmp_path))
            time.sleep(0.05)
        assert mapped is not None, "no process of the pod mapped libnccl during the preload"
        assert mapped[0][:4] == [LOADER, "--preload", env["INGERO_E2E_LIBNCCL"], "/bin/sleep"]
        assert mapped[1] == []      # the sleeper, before any rank ran
        assert pod.wait(60) == 0
    finally:
        if pod.poll() is None:
            pod.kill()


def test_job_service_and_session_manifests_are_valid():
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    for doc in workload.job_objects("e2e-slow", "default", "ingero-lab-worker:e2e", slow_rank=3):
        kv.validate(doc, kv.latest_version(), strict=True)
    job = workload.job_objects("e2e-slow", "default", "img")[1]
    env = {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["MASTER_ADDR"].startswith("e2e-slow-0.e2e-slow.default.svc")
    crd = yaml.safe_load((ROOT / "crds" / "tracesession.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    session = workload.trace_session("e2e", "default", "e2e-slow")
    jsonschema.Draft7Validator(schema).validate(session)
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert session["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_jobs_pods_opt_in_to_the_charts_webhook_and_get_the_agents_plugin_folder():
    """Without a cluster: the chart's webhook selectors pick the job's pods, and the
    operator's injection points NCCL at the folder the agent's init container fills."""
    pytest.importorskip("helm_python", reason="helm-python-sdk is not installed")
    from ingero_operator import webhook
    from tests.chart.chartlib import args_of, find, render
    from tests.chart.test_webhook import called

    docs = render({"webhook": {"enabled": True}})
    template = workload.job_objects("e2e-clean", "default", "img")[1]["spec"]["template"]
    assert called(find(docs, "MutatingWebhookConfiguration"), "default", {},
                  template["metadata"]["labels"]) == ["/profiler-pod"]
    pod = {"metadata": template["metadata"], "spec": json.loads(json.dumps(template["spec"]))}
    assert webhook.inject(pod, webhook.DEFAULT_PLUGIN_DIR)
    ds = find(docs, "DaemonSet")["spec"]["template"]["spec"]
    init = next(c for c in ds["initContainers"] if c["name"] == "profiler-plugin")
    host = next(v for v in ds["volumes"] if v["name"] == init["volumeMounts"][0]["name"])["hostPath"]["path"]
    assert args_of(find(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0])[
        "--profiler-plugin-dir"] == [host]
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env["NCCL_PROFILER_PLUGIN"] == f"{host}/libnccl-profiler-ingero.so"
    no = workload.job_objects("e2e-clean", "default", "img", profiler=False)[1]["spec"]["template"]
    assert called(find(docs, "MutatingWebhookConfiguration"), "default", {}, no["metadata"]["labels"]) == []
