"""The e2e training job: the lab's CPU NCCL library and worker, two pods of two ranks each.

Each pod is one "node" of torchrun: an Indexed Job gives pod i the index i
(GROUP_RANK), and a small POSIX shell script (RANK_SCRIPT) starts
LOCAL_WORLD_SIZE workers in it with the torchrun variables, one of them
slowed down when the fault is on, and fails the pod if any rank fails. Rank 0
serves the NCCL id at MASTER_ADDR, the DNS name of pod 0 behind a headless
Service. The same script runs on this machine in tests/e2e/test_workload.py,
so it is exercised where no cluster exists.
"""

from __future__ import annotations

WORKER = "/opt/lab/ingero-lab-worker"
LIBNCCL = "/opt/lab/libnccl.so.2"
MASTER_PORT = 29500

# POSIX sh (dash in the image). Before the ranks start, a sleeper process maps libnccl
# (the dynamic loader's --preload), so the node agent finds the library in /proc/<pid>/maps
# and attaches its uprobes before any rank creates a communicator.
RANK_SCRIPT = r"""
set -u
n="$LOCAL_WORLD_SIZE"
g="${JOB_COMPLETION_INDEX:-0}"
if [ -n "${INGERO_E2E_PRELOAD_SECONDS:-}" ]; then
  "$INGERO_E2E_LOADER" --preload "$INGERO_E2E_LIBNCCL" /bin/sleep "$INGERO_E2E_PRELOAD_SECONDS"
fi
i=0
until getent hosts "$MASTER_ADDR" >/dev/null; do
  i=$((i + 1))
  if [ "$i" -gt 600 ]; then echo "rank script: $MASTER_ADDR does not resolve" >&2; exit 2; fi
  sleep 0.1
done
pids=""
l=0
while [ "$l" -lt "$n" ]; do
  r=$((g * n + l))
  c="$INGERO_LAB_COMPUTE_MS"
  if [ "$r" = "${INGERO_E2E_SLOW_RANK:--1}" ]; then c=$((c * ${INGERO_E2E_SLOW_FACTOR:-2})); fi
  RANK="$r" LOCAL_RANK="$l" GROUP_RANK="$g" ROLE_RANK="$r" INGERO_LAB_COMPUTE_MS="$c" "$INGERO_E2E_WORKER" &
  pids="$pids $!"
  l=$((l + 1))
done
rc=0
for p in $pids; do
  wait "$p" || rc=1
done
exit "$rc"
"""


def rank_env(*, world: int, ranks_per_pod: int, master_addr: str, run_id: str, seconds: float,
             slow_rank: int | None, slow_factor: int = 2, compute_ms: int = 40,
             worker: str = WORKER, libnccl: str = LIBNCCL, preload_seconds: float | None = 5.0,
             loader: str = "/lib64/ld-linux-x86-64.so.2") -> dict[str, str]:
    """Environment of every pod (the script adds RANK, LOCAL_RANK, GROUP_RANK per rank)."""
    env = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(ranks_per_pod), "MASTER_ADDR": master_addr,
           "MASTER_PORT": str(MASTER_PORT), "TORCHELASTIC_RUN_ID": run_id,
           "INGERO_LAB_SECONDS": f"{seconds:g}", "INGERO_LAB_STEPS": "0", "INGERO_LAB_COMPUTE_MS": str(compute_ms),
           "INGERO_LAB_CPU_MS": "3", "INGERO_LAB_TIMEOUT_S": "120", "INGERO_E2E_WORKER": worker,
           "INGERO_E2E_LIBNCCL": libnccl, "INGERO_E2E_LOADER": loader}
    if preload_seconds:
        env["INGERO_E2E_PRELOAD_SECONDS"] = f"{preload_seconds:g}"
    if slow_rank is not None:
        env.update(INGERO_E2E_SLOW_RANK=str(slow_rank), INGERO_E2E_SLOW_FACTOR=str(slow_factor))
    return env


PROFILER_LABEL = {"ingero.io/profiler": "enabled"}


def job_objects(name: str, namespace: str, image: str, *, pods: int = 2, ranks_per_pod: int = 2,
                seconds: float = 20, slow_rank: int | None = None, preload_seconds: float = 20,
                profiler: bool = True) -> list[dict]:
    """A headless Service and an Indexed Job of `pods` pods, each on its own node. With
    `profiler`, the pods opt in to the chart's webhook (webhook.enabled), which gives them
    NCCL_PROFILER_PLUGIN and the agent's plugin folder, mounted read-only."""
    labels = {"job-name": name, "app.kubernetes.io/name": "ingero-e2e-worker"}
    master = f"{name}-0.{name}.{namespace}.svc.cluster.local"
    env = rank_env(world=pods * ranks_per_pod, ranks_per_pod=ranks_per_pod, master_addr=master, run_id=name,
                   seconds=seconds, slow_rank=slow_rank, preload_seconds=preload_seconds)
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": namespace},
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": labels,
                        "ports": [{"name": "store", "port": MASTER_PORT}]}}
    job = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "completions": pods, "parallelism": pods, "completionMode": "Indexed", "backoffLimit": 0,
            "template": {
                "metadata": {"labels": {**labels, **(PROFILER_LABEL if profiler else {})}},
                "spec": {
                    "subdomain": name, "restartPolicy": "Never",
                    "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                        {"labelSelector": {"matchLabels": labels}, "topologyKey": "kubernetes.io/hostname"}]}},
                    "containers": [{
                        "name": "trainer", "image": image, "imagePullPolicy": "Never",
                        "command": ["/bin/sh", "-c", RANK_SCRIPT],
                        "env": [{"name": k, "value": v} for k, v in env.items()],
                        "ports": [{"name": "store", "containerPort": MASTER_PORT}],
                        "resources": {"requests": {"cpu": "250m", "memory": "128Mi"}},
                    }],
                },
            },
        },
    }
    return [service, job]


def trace_session(name: str, namespace: str, job: str) -> dict:
    """The TraceSession for the job: its pods by the Job's label, until they finish."""
    return {"apiVersion": "ingero.io/v1alpha1", "kind": "TraceSession",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"selector": {"matchLabels": {"job-name": job}}, "durationSeconds": 600,
                     "probes": ["nccl", "tcp", "sched"], "thresholds": {"slowCollectiveMs": 50}}}
