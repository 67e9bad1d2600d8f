"""`ingero demo`: the whole flow on one machine, CR in, status out.

    ingero demo --scenario lossy-link --seconds 20

An embedded API server (kmock's emulator, see embedded.py), a lab training
job (network namespaces, pod cgroups, a fault), one `ingero agent serve` per
lab node registered as an agent Pod, the lab's ranks registered as Pods, the
operator (`ingero operator run`, a kopf process with only a kubeconfig), then
`kubectl apply -f examples/tracesession.yaml`. As the chart's default install does, the
agents serve HTTPS with a certificate for their Service name signed by a CA made for the
run, and the operator verifies it against that CA and name (agents are reached by IP). When the ranks exit their
Pods are marked Succeeded, the operator gathers, and the demo prints
`kubectl get tracesessions` and `kubectl ingero report` of the merged trace
(fetched from the operator through the API server's service proxy).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

from ingero.errors import IngeroError
from ingero.http_client import describe, request_sync
from ingero_operator import cluster_objects as objs
from ingero_operator.embedded import EmbeddedCluster
from ingero_operator.tables import custom_columns

REPO = Path(__file__).resolve().parents[2]
TERMINAL = ("Completed", "Failed")
GRACE_S = 5.0          # once a rank failed, the others get this long before they are killed (as torchrun)


@dataclass
class DemoConfig:
    scenario: str = "lossy-link"
    seconds: float = 20.0
    nodes: int = 2
    ranks_per_node: int = 2
    out: Path = Path("out/demo")
    loss_percent: float = 5.0
    victim_rank: int | None = None
    hogs: int = 8                          # cpu-hog: busy loops sharing the victim's CPU
    background_load: int = 0               # busy processes keeping the whole machine busy (lab --background-load)
    shape: dict = field(default_factory=dict)   # LabConfig's layout, microbatches, stage, imbalance, slow_factor
    fault_after_s: float | None = None     # the fault starts this long after the ranks (None: before)
    attach_late_s: float | None = None     # apply the session this long after the ranks started (None: before)
    nccl_timeout_s: int | None = None      # a rank whose peers stop answering fails after this (lab --timeout)
    kill_agent_node: str | None = None     # tests: SIGKILL this node's agent ...
    kill_agent_after_s: float = 5.0        # ... this long after the ranks started
    restart_agent_after_s: float | None = None    # ... and start it again (same port and data)
    restart_operator_after_s: float | None = None  # tests: SIGKILL the operator and start it again
    crd: Path = REPO / "crds" / "tracesession.yaml"
    example: Path = REPO / "examples" / "tracesession.yaml"
    timeout_s: float = 180.0               # for the session to complete after the ranks exit
    attach_timeout_s: float = 180.0        # for every agent to compile and attach its probes (bcc, on the node:
                                           # 3.5 s of CPU each: two took 40 s beside CI at load 30, 90 s at load 43)
    operator_args: tuple[str, ...] = ("--standalone",)   # e.g. ("--peering", NAME) with extra_crds
    extra_crds: tuple[Path, ...] = ()      # more CRDs the embedded API server serves
    metrics_out: Path | None = None        # save the operator's and agents' /metrics here (see Demo.save_scrapes)
    images: dict = field(default_factory=dict)   # "agent"/"operator" -> image: run it with docker (container_argv)


DATA_MAX_BYTES = 1 << 30      # each agent's data folder cap, as the DaemonSet sets one (agent.dataMaxBytes)


@dataclass
class DemoResult:
    status: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)    # seconds; see Demo.run
    codes: dict = field(default_factory=dict)      # rank -> exit code
    lab: dict = field(default_factory=dict)
    kubectl_wait: str = ""                         # what `kubectl wait --for=condition=Completed` said
    agent_metrics: dict = field(default_factory=dict)   # node -> its agent's /metrics, scraped while tracing
    operator_metrics: str = ""                     # the operator's /metrics, last scraped with a straggler named


class Demo:
    """Set up on enter, tear down (every process, namespace and cgroup) on exit."""

    def __init__(self, cfg: DemoConfig, log=print):
        self.cfg = cfg
        self.log = log
        self.out = Path(cfg.out).resolve()
        self.procs: dict[str, subprocess.Popen] = {}
        self.argv: dict[str, list[str]] = {}
        self.cluster: EmbeddedCluster | None = None
        self.lab = None
        self.session_name = None
        self.t_ranks = 0.0                   # when the ranks started (monotonic)
        self._first_failure: float | None = None   # when a rank first exited non-zero (monotonic)
        self.agent_metrics_ports: dict[str, int] = {}
        self.extra_env: dict[str, dict[str, str]] = {}

    # ---- set-up ----------------------------------------------------------------------
    def __enter__(self) -> "Demo":
        from ingero.lab.runner import LabConfig, LabRun

        for p in (self.cfg.crd, self.cfg.example):
            if not p.is_file():
                raise IngeroError(f"{p} is missing; run `ingero demo` from a checkout of the repository")
        if not shutil.which("kubectl"):
            raise IngeroError("kubectl is not installed; install kubectl (v1.28 or newer)")
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        try:
            self.cluster = EmbeddedCluster(self.cfg.crd, self.out, self.cfg.extra_crds).start()
            self.log(f"demo: embedded API server at {self.cluster.url} (KUBECONFIG={self.cluster.kubeconfig})")
            self.kubectl("apply", "--validate=false", "-f", str(self.cfg.crd))
            token = objs.new_token()
            (self.out / "agent-token").write_text(token)
            os.chmod(self.out / "agent-token", 0o600)
            self.cluster.create(f"/api/v1/namespaces/{objs.SYSTEM_NS}/secrets", objs.token_secret(token))
            self.tls_dir = make_agent_certs(self.out / "tls", AGENT_SERVER_NAME)
            lab_cfg = LabConfig(scenario=self.cfg.scenario, nodes=self.cfg.nodes,
                                ranks_per_node=self.cfg.ranks_per_node, seconds=self.cfg.seconds,
                                loss_percent=self.cfg.loss_percent, victim_rank=self.cfg.victim_rank,
                                hogs=self.cfg.hogs, fault_after_s=self.cfg.fault_after_s,
                                background_load=self.cfg.background_load, out_dir=self.out / "lab",
                                timeout_s=self.cfg.nccl_timeout_s, **self.cfg.shape)
            self.lab = LabRun(lab_cfg, log=self.log).__enter__()
            self._start_agents()
            for rp in self.lab.ranks:
                self.cluster.create("/api/v1/namespaces/default/pods", objs.rank_pod(self.lab, rp))
            self.metrics_port, artifact_port = _free_port(), _free_port()
            # the operator's Pod and Service as the chart makes them: `kubectl ingero` reaches
            # its artifact server through the API server's service proxy
            self.cluster.create(f"/api/v1/namespaces/{objs.SYSTEM_NS}/pods", objs.operator_pod(artifact_port))
            self.cluster.create(f"/api/v1/namespaces/{objs.SYSTEM_NS}/services", objs.operator_service())
            if self.cfg.images.get("operator"):
                # its container's user reads its kubeconfig and CA in the folder and writes the
                # merged traces in artifacts/
                os.chmod(self.out, os.stat(self.out).st_mode | 0o011)
                (self.out / "artifacts").mkdir(exist_ok=True)
                os.chown(self.out / "artifacts", OPERATOR_UID, OPERATOR_UID)
            self._start("operator", [sys.executable, "-m", "ingero", "operator", "run", *self.cfg.operator_args,
                                     "--namespace", objs.SYSTEM_NS, "--artifacts", str(self.out / "artifacts"),
                                     "--metrics-port", str(self.metrics_port), "--metrics-address", "127.0.0.1",
                                     "--artifact-port", str(artifact_port), "--artifact-address", "127.0.0.1",
                                     "--artifact-service", f"{objs.OPERATOR_SERVICE}:artifacts"],
                        # the chart's operator environment for tls.enabled (its default)
                        extra_env={"INGERO_AGENT_TLS": "1", "INGERO_AGENT_CA_FILE": str(self.tls_dir / "ca.crt"),
                                   "INGERO_AGENT_TLS_SERVER_NAME": AGENT_SERVER_NAME})
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self, name: str, argv: list[str], extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        self.argv[name] = argv
        if extra_env is not None:
            self.extra_env[name] = extra_env
        # Each component with its own identity, as its service account in a cluster.
        own = dict(KUBECONFIG=str(self.cluster.kubeconfig_as(objs.identity(name))), **self.extra_env.get(name, {}))
        env = dict(os.environ, **own)
        image = self.cfg.images.get(name.split("-")[0])
        if image:
            argv = container_argv(self.container(name), image, name.split("-")[0], argv[3:], own, self.out)
        with open(self.out / "logs" / f"{name}.log", "ab") as f:
            proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=REPO, start_new_session=True)
        self.procs[name] = proc
        return proc

    def _start_agents(self) -> None:
        """Start every node's agent, then wait for them all (they start side by side)."""
        from ingero.lab.cgroups import node_cgroup_root

        started, taken = [], set()

        def new_port() -> int:    # no agent has bound its ports yet: none may get another's
            while (p := objs.free_port()) in taken:
                pass
            taken.add(p)
            return p

        for node in self.lab.nodes:
            api_port, mport = new_port(), new_port()
            self.agent_metrics_ports[node.name] = mport
            ready = self.out / "agents" / f"{node.name}.ready"
            ready.parent.mkdir(parents=True, exist_ok=True)
            ready.unlink(missing_ok=True)
            started.append((node, api_port, ready))
            self._start(f"agent-{node.name}", [
                sys.executable, "-m", "ingero", "agent", "serve", "--node", node.name,
                "--listen", f"127.0.0.1:{api_port}", "--data-dir", str(self.out / "agents" / node.name),
                "--token-file", str(self.out / "agent-token"), "--ready-file", str(ready),
                "--cgroup-root", str(node_cgroup_root(self.lab.run_id, node.name)), "--quiet",
                "--tls-cert", str(self.tls_dir / "tls.crt"), "--tls-key", str(self.tls_dir / "tls.key"),
                "--metrics-port", str(mport), "--metrics-address", "127.0.0.1",
                "--data-max-bytes", str(DATA_MAX_BYTES)])
        deadline = time.monotonic() + 30 * len(started)      # 30 s each, as when one started after another
        for node, api_port, ready in started:
            while not ready.exists():
                if self.procs[f"agent-{node.name}"].poll() is not None or time.monotonic() > deadline:
                    raise IngeroError(f"agent for {node.name} did not start; see {self.out / 'logs'}")
                time.sleep(0.05)
            self.cluster.create(f"/api/v1/namespaces/{objs.SYSTEM_NS}/pods", objs.agent_pod(node.name, api_port))

    # ---- the flow --------------------------------------------------------------------
    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """kubectl ARGS; `ingero ...` runs the kubectl-ingero plugin installed beside this Python."""
        env = dict(os.environ, KUBECONFIG=str(self.cluster.kubeconfig), KUBECACHEDIR=str(self.out / "kube-cache"),
                   PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
        proc = subprocess.run(["kubectl", *args], env=env, capture_output=True, text=True, timeout=60)
        if check and proc.returncode:
            raise IngeroError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip() or proc.stdout.strip()}")
        return proc

    def apply_session(self) -> Path:
        doc = yaml.safe_load(self.cfg.example.read_text())
        doc["spec"]["selector"]["matchLabels"] = {"job-name": objs.job_name(self.lab)}
        doc["spec"]["ncclLibPath"] = str(self.lab.binaries.libnccl)
        path = self.out / "tracesession.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        self.session_name = doc["metadata"]["name"]
        self.log(self.kubectl("apply", "--validate=false", "-f", str(path)).stdout.strip())
        return path

    def status(self, name: str | None = None) -> dict:
        doc = self.cluster.get(f"/apis/ingero.io/v1alpha1/namespaces/default/tracesessions/{name or self.session_name}")
        return (doc or {}).get("status") or {}

    def wait_for(self, pred, timeout_s: float, what: str) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = self.status()
            if pred(st):
                return st
            if self.procs["operator"].poll() is not None:
                raise IngeroError(f"the operator exited ({self.procs['operator'].returncode}); "
                                  f"see {self.out / 'logs' / 'operator.log'}")
            time.sleep(0.25)
        raise IngeroError(f"timed out after {timeout_s:.0f} s waiting for {what}; status: {json.dumps(st)[:400]}")

    def run(self) -> DemoResult:
        """Apply the session, run the job, wait for the verdict. Timings in seconds.
        `kubectl wait --for=condition=Completed` runs from the start beside it; its answer
        and when it came (timings["kubectl_wait"], from the job's end) are in the result."""
        res, t0 = DemoResult(), time.monotonic()
        if self.cfg.attach_late_s is not None:
            # what a user does first: the job is already running (and slow) when the session is applied
            self.lab.start_ranks()
            self.t_ranks = time.monotonic()
            self.log(f"demo: the job runs; the TraceSession comes {self.cfg.attach_late_s:g} s later")
            time.sleep(self.cfg.attach_late_s)
        self.apply_session()
        env = dict(os.environ, KUBECONFIG=str(self.cluster.kubeconfig), KUBECACHEDIR=str(self.out / "kube-cache"))
        waiter = subprocess.Popen(["kubectl", "wait", "--for=condition=Completed", f"tracesession/{self.session_name}",
                                   f"--timeout={int(self.cfg.timeout_s + self.cfg.seconds + 300)}s"],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            return self._run(res, t0, waiter)
        finally:
            if waiter.poll() is None:
                waiter.kill()
            waiter.wait()

    def _run(self, res: DemoResult, t0: float, waiter: subprocess.Popen) -> DemoResult:
        nodes = len(self.lab.nodes)
        self.wait_for(lambda s: s.get("phase") in TERMINAL or (
            s.get("phase") == "Running" and sum(n.get("state") == "running" for n in s.get("nodes", [])) == nodes),
            self.cfg.attach_timeout_s, "the agents to attach their probes")
        res.timings["tracing_ready"] = time.monotonic() - t0
        if self.cfg.attach_late_s is None:
            self.lab.start_ranks()
            self.t_ranks = time.monotonic()
        t_ranks = self.t_ranks
        events = self._disruptions()
        t_saved = t_live = t_ranks
        while any(rp.proc.poll() is None for rp in self.lab.ranks) and not self._failed_for(GRACE_S):
            st = self.status()
            if st.get("straggler") and "first_straggler" not in res.timings:
                res.timings["first_straggler"] = time.monotonic() - t_ranks
                res.timings["first_straggler_pod"] = st["straggler"].get("pod")
            if st.get("straggler") and time.monotonic() - t_live >= 2.0:
                t_live = time.monotonic()
                scraped = self.scrape()
                if "\ningero_straggler_saving_ratio{" in scraped:    # (the gauge follows the status patch)
                    res.operator_metrics = scraped
            if (st.get("verdict") or {}).get("kind") == "hang" and "first_hang" not in res.timings:
                res.timings["first_hang"] = time.monotonic() - t_ranks
                res.timings["first_hang_who"] = st["verdict"].get("who")
            while events and time.monotonic() - t_ranks >= events[0][0]:
                events.pop(0)[1]()
            if "error" in res.agent_metrics or (not res.agent_metrics and time.monotonic() - t_ranks >= 3.0):
                try:                          # once while tracing; again while an agent a test killed is down
                    res.agent_metrics = self.scrape_agents()
                except IngeroError as e:
                    res.agent_metrics = {"error": str(e)}
            if self.cfg.metrics_out and time.monotonic() - t_saved >= 2.0:
                t_saved = time.monotonic()
                self.save_scrapes(t_saved - t_ranks)
            time.sleep(0.25)
        res.codes = self.lab.wait(grace_s=0.0 if self._failed_for(GRACE_S) else GRACE_S)
        res.timings["training"] = time.monotonic() - t_ranks
        for rp in self.lab.ranks:
            phase = "Succeeded" if res.codes[rp.rank] == 0 else "Failed"
            self.cluster.patch(f"/api/v1/namespaces/default/pods/{rp.pod.name}/status", {"status": {"phase": phase}})
        t_end = time.monotonic()
        res.status = self.wait_for(lambda s: s.get("phase") in TERMINAL, self.cfg.timeout_s, "the session to complete")
        res.timings["gather"] = time.monotonic() - t_end
        if self.cfg.metrics_out:              # with the session's result in the operator's gauges
            self.save_scrapes(time.monotonic() - t_ranks)
        if res.status.get("phase") == "Completed":
            try:
                res.kubectl_wait = waiter.communicate(timeout=30)[0].strip()
                res.timings["kubectl_wait"] = time.monotonic() - t_end
            except subprocess.TimeoutExpired:
                res.kubectl_wait = "kubectl wait did not return within 30 s of the Completed status"
        res.timings["total"] = time.monotonic() - t0
        res.lab = {"run_id": self.lab.run_id, "victim_rank": self.lab.victim, "victim_node": self.lab.victim_node.name,
                   "node_tcp": self.lab.notes.get("node_tcp")}
        return res

    def _failed_for(self, seconds: float) -> bool:
        """Has a rank exited non-zero at least `seconds` ago? (A hung rank never exits by itself:
        like torchrun, the lab then kills the rest.)"""
        now = time.monotonic()
        for rp in self.lab.ranks:
            if rp.proc.poll() not in (None, 0):
                self._first_failure = self._first_failure or now
        return self._first_failure is not None and now - self._first_failure >= seconds

    def _disruptions(self) -> list:
        """(seconds after the ranks start, action) for the failure tests, in time order."""
        c, out = self.cfg, []

        def kill(name):
            self.log(f"demo: killing {name}")
            self.procs[name].kill()
            self.procs[name].wait()
            self._remove_container(name)

        def restart(name):
            self.log(f"demo: starting {name} again")
            self._start(name, self.argv[name])

        if c.kill_agent_node:
            name = f"agent-{c.kill_agent_node}"
            out.append((c.kill_agent_after_s, lambda: kill(name)))
            if c.restart_agent_after_s is not None:
                out.append((c.restart_agent_after_s, lambda: restart(name)))
        if c.restart_operator_after_s is not None:
            out.append((c.restart_operator_after_s, lambda: (kill("operator"), restart("operator"))))
        return sorted(out, key=lambda e: e[0])

    def scrape(self, port: int | None = None, what: str = "the operator") -> str:
        """The operator's /metrics (or another port's), as Prometheus would scrape it."""
        address = f"127.0.0.1:{port or self.metrics_port}"
        try:
            status, body = request_sync("GET", f"http://{address}/metrics", timeout_s=10)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:   # a killed agent, a slow one
            raise IngeroError(f"{what}'s /metrics: {describe(e, address, 10)}") from None
        if status != 200:
            raise IngeroError(f"{what}'s /metrics answered {status}")
        return body.decode()

    def scrape_agents(self) -> dict[str, str]:
        """Every lab node's agent /metrics, by node."""
        return {n: self.scrape(p, f"the agent on {n}") for n, p in sorted(self.agent_metrics_ports.items())}

    def save_scrapes(self, t: float) -> None:
        """Write the operator's and every agent's /metrics, as scraped now, into cfg.metrics_out:
        t<seconds since the ranks started>-operator.prom and -agent-<node>.prom (Prometheus text).
        A scrape that fails (an agent a test killed) is left out."""
        folder, stamp = Path(self.cfg.metrics_out), f"t{t:07.2f}"
        ports = {"operator": self.metrics_port} | {f"agent-{n}": p for n, p in self.agent_metrics_ports.items()}
        for what, port in sorted(ports.items()):
            try:
                text = self.scrape(port, what)
            except IngeroError:
                continue
            (folder / f"{stamp}-{what}.prom").write_text(text)

    def printer_rows(self) -> str:
        """The default printer columns (priority 0; Message is priority 1, for -o wide)."""
        cols = yaml.safe_load(self.cfg.crd.read_text())["spec"]["versions"][0]["additionalPrinterColumns"]
        cols = [c for c in cols if not c.get("priority")]      # what `kubectl get` shows without -o wide
        return self.kubectl("get", "tracesessions", "-o", custom_columns(cols)).stdout

    # ---- components in containers (cfg.images) -----------------------------------------
    def container(self, name: str) -> str:
        return f"ingero-demo-{self.lab.run_id}-{name}"

    def _remove_container(self, name: str) -> None:
        if self.cfg.images.get(name.split("-")[0]):
            subprocess.run(["docker", "rm", "-f", self.container(name)], capture_output=True, timeout=60)

    # ---- tear-down -------------------------------------------------------------------
    def close(self) -> None:
        # The operator first (it must not see its agents go), then every agent at once.
        first = [n for n in self.procs if n == "operator"]
        for group in (first, [n for n in self.procs if n not in first]):
            procs = [self.procs[n] for n in group if self.procs[n].poll() is None]
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 20
            for proc in procs:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for name in list(self.procs):
            self._remove_container(name)
        self.procs.clear()
        if self.lab is not None:
            self.lab.close()
        if self.cluster is not None:
            self.cluster.stop()


# The agent's capabilities in its container: the chart's (templates/_agent_security.tpl) where
# docker knows them by name; docker 20.10 does not know BPF and PERFMON, which SYS_ADMIN holds.
AGENT_CAPS = ("SYS_ADMIN", "SYS_PTRACE")
# The agent's host mounts, as the chart's DaemonSet has them: (host path, read-only).
AGENT_MOUNTS = (("/sys/kernel/tracing", False), ("/sys/fs/cgroup", True), ("/lib/modules", True),
                ("/usr/src", True))
OPERATOR_UID = 65532      # Dockerfile.operator's USER


def container_argv(name: str, image: str, component: str, args: list[str], env: dict[str, str],
                   out: Path) -> list[str]:
    """`docker run` of `ingero ARGS` from `image` as the chart runs that component: the host's
    network (the demo's API server and agents listen on loopback), a read-only root with a
    /tmp, the demo's folder at its own path (certificates, kubeconfigs, data); the agent as root
    with the host's PIDs, its capabilities and host mounts, the operator as the image's user."""
    argv = ["docker", "run", "--rm", "--init", "--name", name, "--network", "host", "--read-only",
            "--tmpfs", "/tmp", "-v", f"{out}:{out}"]
    for k, v in sorted(env.items()):
        argv += ["-e", f"{k}={v}"]
    if component == "agent":
        argv += ["--pid", "host", "--user", "0", "--cap-drop", "ALL",
                 "-e", "HOME=/tmp"]      # bcc's and DuckDB's scratch files (the chart's HOME)
        argv += [a for cap in AGENT_CAPS for a in ("--cap-add", cap)]
        argv += [a for path, ro in AGENT_MOUNTS for a in ("-v", f"{path}:{path}{':ro' if ro else ''}")]
    return [*argv, image, *args]


# The name the chart's default install puts in the agents' certificate (release "ingero").
AGENT_SERVER_NAME = f"ingero-agent.{objs.SYSTEM_NS}.svc"


def make_agent_certs(folder: Path, server_name: str) -> Path:
    """A CA and one agent certificate for `server_name` (DNS name only, no IP: the operator
    checks the name, as with the chart's generated certificate), with openssl; the folder."""
    if not shutil.which("openssl"):
        raise IngeroError("openssl is not installed (the demo's agents serve HTTPS): apt-get install openssl")
    folder.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    (folder / "agent.ext").write_text(f"subjectAltName=DNS:{server_name}\nbasicConstraints=critical,CA:FALSE\n"
                                      "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n")
    for argv in (["req", "-x509", *ec, "-days", "2", "-subj", "/CN=ingero-demo-agent-ca", "-keyout", "ca.key",
                  "-out", "ca.crt", "-addext", "basicConstraints=critical,CA:TRUE",
                  "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
                 ["req", *ec, "-subj", f"/CN={server_name}", "-keyout", "tls.key", "-out", "agent.csr"],
                 ["x509", "-req", "-in", "agent.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                  "-days", "2", "-extfile", "agent.ext", "-out", "tls.crt"]):
        proc = subprocess.run(["openssl", *argv], cwd=folder, capture_output=True, text=True)
        if proc.returncode:
            raise IngeroError(f"openssl {argv[0]} failed making the demo's agent certificate: {proc.stderr.strip()}")
    for key in ("ca.key", "tls.key"):
        os.chmod(folder / key, 0o600)
    return folder


def _free_port() -> int:
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def add_parser(sub):
    from ingero.lab.job_args import add_job_shape_args
    from ingero.lab.faults import SCENARIOS

    p = sub.add_parser("demo", help="the whole flow on this machine: API server, operator, agents, lab job",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=SCENARIOS, default="lossy-link")
    p.add_argument("--seconds", type=float, default=20.0, help="training time; default 20")
    p.add_argument("--nodes", type=int, default=2, help="lab nodes; default 2")
    p.add_argument("--ranks-per-node", type=int, default=None, help="default 2, or what --layout needs")
    p.add_argument("--loss-percent", type=float, default=5.0, help="lossy-link drop rate; default 5")
    p.add_argument("--victim-rank", type=int, default=None, help="default: the last rank")
    p.add_argument("--hogs", type=int, default=8, help="cpu-hog: busy loops on the victim's CPU; default 8")
    p.add_argument("--background-load", type=int, default=0, metavar="N",
                   help="N busy processes keep the whole machine busy (as on a shared node); default 0")
    p.add_argument("--attach-late", type=float, default=None, metavar="SECONDS",
                   help="start the job first and apply the TraceSession SECONDS later, as a user does on "
                        "a job that is already slow (default: the session before the job)")
    p.add_argument("--timeout", type=int, default=None, metavar="SECONDS",
                   help="a rank whose peers stop answering fails its NCCL call after this; default 60 (hang: 20)")
    add_job_shape_args(p)
    p.add_argument("--out", type=Path, default=Path("out/demo"), help="default out/demo")
    p.add_argument("--agent-image", metavar="IMAGE", help="run the agents from this image with docker, as the "
                   "chart's DaemonSet would (`make images` builds it)")
    p.add_argument("--operator-image", metavar="IMAGE", help="run the operator from this image with docker")
    p.add_argument("--metrics-out", type=Path, default=None, metavar="DIR",
                   help="save the operator's and each agent's /metrics every 2 s while the job runs, and once "
                        "with the verdict in, as DIR/t<seconds>-<operator|agent-NODE>.prom "
                        "(scripts/dashboard_picture.py draws them)")
    p.add_argument("--keep-running", action="store_true",
                   help="keep the API server, operator and agents up afterwards (Ctrl-C ends)")
    return p


def grep_transcript(port, text: str, pattern: str, what: str, drop_zero: bool = False) -> str:
    """A `curl | grep -E` command and the lines it prints from `text`, matched here by the
    same pattern (and `grep -v ' 0.0$'` when drop_zero)."""
    lines = [ln for ln in text.splitlines() if re.search(pattern, ln) and not (drop_zero and ln.endswith(" 0.0"))]
    cmd = f"curl -s http://127.0.0.1:{port}/metrics | grep -E '{pattern}'" + (" | grep -v ' 0.0$'" if drop_zero else "")
    return f"\n$ {cmd}   # {what}\n" + "\n".join(lines)


def _interrupt(*_):
    raise KeyboardInterrupt


def run(args) -> int:
    from ingero.lab.job_args import job_shape, ranks_per_node

    if args.seconds <= 0:
        raise IngeroError("--seconds must be > 0")
    if args.nodes < 1:
        raise IngeroError("--nodes must be >= 1")
    if args.attach_late is not None and not 0 <= args.attach_late < args.seconds:
        raise IngeroError(f"--attach-late must be >= 0 and less than --seconds ({args.seconds:g}): the job "
                          "would end before the session starts")
    if args.metrics_out is not None:
        try:
            args.metrics_out.mkdir(parents=True, exist_ok=True)
            (args.metrics_out / ".write-check").touch()
            (args.metrics_out / ".write-check").unlink()
        except OSError as e:
            raise IngeroError(f"--metrics-out {args.metrics_out}: cannot write there ({e.strerror or e})") from None
    cfg = DemoConfig(scenario=args.scenario, seconds=args.seconds, nodes=args.nodes,
                     ranks_per_node=ranks_per_node(args), out=args.out, loss_percent=args.loss_percent,
                     victim_rank=args.victim_rank, hogs=args.hogs, background_load=args.background_load,
                     shape=job_shape(args), metrics_out=args.metrics_out, attach_late_s=args.attach_late,
                     nccl_timeout_s=args.timeout,
                     images={k: v for k, v in (("agent", args.agent_image), ("operator", args.operator_image)) if v})
    old = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with Demo(cfg, log=lambda m: print(m, flush=True)) as demo:
            res = demo.run()
            print(f"\n$ kubectl wait --for=condition=Completed tracesession/{demo.session_name}  "
                  f"# started with the session\n{res.kubectl_wait}")
            print(f"\n$ kubectl get tracesessions\n{demo.kubectl('get', 'tracesessions').stdout}")
            described = demo.kubectl("describe", "tracesession", demo.session_name).stdout
            print(f"$ kubectl describe tracesession {demo.session_name} | sed -n '/^Events:/,$p'\n"
                  f"Events:{described.split(chr(10) + 'Events:', 1)[-1]}")
            print(f"$ kubectl ingero report {demo.session_name}   # report.json through the API server", flush=True)
            if shutil.which("kubectl-ingero", path=str(Path(sys.executable).parent)):
                shown = demo.kubectl("ingero", "report", demo.session_name, check=False)
                print(shown.stdout + shown.stderr, end="", flush=True)
            else:      # report.json's warnings are the status' ones: shown here without the plugin
                print("(kubectl-ingero is not installed beside this Python: pip install -e . installs it)")
                for w in res.status.get("warnings") or []:
                    print(f"warning: {w}")
            if res.operator_metrics:
                print(grep_transcript(demo.metrics_port, res.operator_metrics, "^ingero_straggler_saving_ratio",
                                      "the operator, while the job runs"))
            print(grep_transcript(demo.metrics_port, demo.scrape(), r'^ingero_(verdict|sessions)\{',
                                  "after the verdict", drop_zero=True))
            for node, text in sorted(res.agent_metrics.items())[:1]:    # one agent, scraped while tracing
                print(grep_transcript(demo.agent_metrics_ports.get(node), text,
                                      r"^ingero_agent_(sessions|events_total|lost_events_total)\{",
                                      f"the agent on {node}, while tracing", drop_zero=True))
            t = res.timings
            print(f"\ndemo: tracing ready {t['tracing_ready']:.1f} s, training {t['training']:.1f} s, "
                  f"gather {t['gather']:.1f} s"
                  + (f", straggler in status {t['first_straggler']:.1f} s after the ranks started"
                     if "first_straggler" in t else "")
                  + (f", hang in status {t['first_hang']:.1f} s after the ranks started" if "first_hang" in t else ""))
            if args.keep_running:
                print(f"demo: still running; export KUBECONFIG={demo.cluster.kubeconfig}; Ctrl-C to stop",
                      flush=True)
                while True:
                    time.sleep(3600)
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)
    return 0 if res.status.get("phase") == "Completed" else 1
