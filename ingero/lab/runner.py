"""Run a multi-node training job on one machine: ``LabConfig`` and the ``LabRun`` context manager.

    cfg = LabConfig(scenario="lossy-link", seconds=10, out_dir=Path("out/lab"))
    with LabRun(cfg) as lab:          # network, pod cgroups, pods-<node>.json, fault
        ...                           # hook: start tracers/agents per node here
        lab.start_ranks()
        codes = lab.wait()            # {rank: exit code}
    # everything is removed again (also on errors, Ctrl-C and SIGTERM via the CLI);
    # the output directory and lab.json stay.

Ranks get torchrun's variables and run ``ingero-lab-worker`` inside their
node's network namespace and their own pod-like cgroup. Times are wall-clock
nanoseconds (``time.time_ns``) in lab.json.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

from ingero.errors import IngeroError, NotPermitted
from ingero.lab import cgroups, faults
from ingero.lab.build import LabBinaries, build_lab_binaries
from ingero.lab.load import start_background_load
from ingero.lab.netns import LabNetwork, LabNode, in_netns, tcp_counters

DEVICES = ("cpu", "gpu")
STEP_LINE = re.compile(r"^rank (\d+) step (\d+) step_ms ([\d.]+)")


@dataclass
class LabConfig:
    """One lab run. Times in seconds unless the name says ms."""

    scenario: str = "clean"
    nodes: int = 2
    ranks_per_node: int = 2
    seconds: float = 20.0          # rank 0 stops the job after this long
    steps: int = 0                 # > 0: stop after this many steps instead
    stop_file: Path | None = None  # rank 0 also stops the job at its first step after this file exists
    loss_percent: float = 5.0      # lossy-link: % of the victim node's TCP data segments dropped
    rate_mbit: float = 100.0       # slow-link: the victim node's outgoing TCP data, Mbit/s
    victim_rank: int | None = None  # default: the last rank (on the last node); hang: world // 2
    ipv6: bool = False             # rendezvous (and so all NCCL traffic) over IPv6
    out_dir: Path = Path("out/lab")
    compute_ms: float = 40.0       # GPU-like wait per step (a sleep)
    cpu_ms: float = 3.0            # host-side busy work per step
    elems: int = 262144            # float32 elements per all-reduce (1 MiB)
    io_mb: int = 8                 # io-stall: MB written and fsync'd per step by the victim
    slow_factor: float = 2.0       # slow-rank: victim's compute_ms multiplier
    hogs: int = 8                  # cpu-hog: busy loops sharing the victim's CPU (3 is too mild on 2 cores: docs/operator.md)
    hog_weight: float = 16.0       # cpu-hog: the loops together weigh this many ranks in the CPU scheduler (faults.start_hogs)
    fault_after_s: float | None = None  # start the fault this long after the ranks start (None: before they start)
    background_load: int = 0       # busy processes keeping the whole machine busy (ingero/lab/load.py)
    layout: str | None = None      # "tp=T,pp=P,dp=D": a tensor x pipeline x data parallel job (worker.c run_layout)
    microbatches: int = 4          # per step, with a layout
    schedule: str = "1f1b"         # the pipeline schedule of a layout job: 1f1b, gpipe or interleaved
    virtual_stages: int = 2        # interleaved: model chunks per rank
    sharding: str = "optimizer"    # a layout job's data parallelism: optimizer (distributed optimizer) or fsdp
    layers: int = 4                # fsdp: layers, each gathered and reduce-scattered on its own
    replicas: int = 1              # fsdp: > 1 is HSDP, dp split into this many shard groups
    stage: int = 1                 # slow-stage: the pipeline stage that computes slow_factor times longer
    imbalance: float = 1.0         # imbalance: each rank's per-step compute factor is drawn from [1, 1 + this]
    device: str = "cpu"            # "gpu": work is enqueued on device streams (INGERO_LAB_DEVICE)
    nonblocking: bool = False      # non-blocking communicators (ncclConfig_t.blocking = 0)
    elastic: bool = False          # after the steps: shrink the world without a rank, grow it back (worker.c)
    elastic_steps: int = 3         # checked steps on the shrunk and on the grown communicator each
    profiler_plugin: Path | None = None  # an NCCL profiler plugin every rank loads (NCCL_PROFILER_PLUGIN)
    probes: str | None = None      # the tracers' probe families (`ingero trace --probes`; None: its default)
    socket_sndbuf: int | None = None  # NCCL_SOCKET_SNDBUF of every rank, bytes (None: the kernel's autotuning)
    timeout_s: int | None = None   # a rank whose peer stops answering fails after this (None: 60 s; hang: 20 s)
    hang_s: float | None = None    # hang: continue the stopped victim after this long (None: for good)
    hang_mode: str = "stop"        # hang: stop (SIGSTOP) or sleep (lives, calls NCCL no more)
    master_port: int = 29500
    progress_every_s: float = 3.0

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclass
class RankProc:
    rank: int
    node: LabNode
    local_rank: int
    pod: cgroups.Pod
    proc: subprocess.Popen | None = None
    exit_code: int | None = None
    stats: dict = field(default_factory=dict)


def require_root() -> None:
    if os.geteuid() != 0:
        raise NotPermitted("needs root (network namespaces, cgroups): run as root")


class LabRun:
    """Sets up a lab run on enter and removes every trace of it on exit."""

    def __init__(self, cfg: LabConfig, binaries: LabBinaries | None = None,
                 log: Callable[[str], None] = print):
        if cfg.scenario not in faults.SCENARIOS:
            raise IngeroError(f"unknown scenario {cfg.scenario!r}: use one of {', '.join(faults.SCENARIOS)}")
        if not 0 <= cfg.background_load <= 64:
            raise IngeroError(f"--background-load {cfg.background_load} is out of range: use 0 to 64")
        if cfg.ranks_per_node < 1 or cfg.world > 64:
            raise IngeroError("--ranks-per-node must be >= 1 and nodes x ranks-per-node at most 64")
        self.layout = faults.parse_layout(cfg.layout, cfg.world)
        if cfg.scenario == "slow-stage" and (self.layout is None or self.layout[1] < 2):
            raise IngeroError("slow-stage needs a pipeline: give --layout tp=T,pp=P,dp=D with P > 1")
        if not 1 <= cfg.microbatches <= 64:
            raise IngeroError(f"--microbatches {cfg.microbatches} is out of range: use 1 to 64")
        if cfg.schedule not in faults.SCHEDULES:
            raise IngeroError(f"--schedule {cfg.schedule!r}: use one of {', '.join(faults.SCHEDULES)}")
        if cfg.schedule == "interleaved" and self.layout is not None and not (
                self.layout[1] > 1 and cfg.microbatches % self.layout[1] == 0
                and 1 <= cfg.virtual_stages and cfg.microbatches * cfg.virtual_stages <= 128):
            raise IngeroError("--schedule interleaved needs pp > 1, --microbatches a multiple of pp and "
                              "--virtual-stages >= 1 with microbatches x virtual stages <= 128")
        if cfg.sharding not in faults.SHARDINGS:
            raise IngeroError(f"--sharding {cfg.sharding!r}: use one of {', '.join(faults.SHARDINGS)}")
        if cfg.sharding == "fsdp" and (self.layout is None or self.layout[1] != 1 or self.layout[2] < 2
                                       or self.layout[2] % max(cfg.replicas, 1) or cfg.replicas < 1
                                       or not 1 <= cfg.layers <= 64):
            raise IngeroError("--sharding fsdp needs --layout tp=T,dp=D without a pipeline (pp=1) and dp >= 2, "
                              "--replicas dividing dp and --layers 1 to 64")
        if cfg.sharding != "fsdp" and (cfg.replicas != 1 or cfg.layers != 4):
            raise IngeroError("--replicas and --layers are for --sharding fsdp")
        if cfg.elastic and (cfg.world < 2 or self.layout is not None or cfg.elastic_steps < 1):
            raise IngeroError("--elastic needs at least 2 ranks, no --layout and elastic steps >= 1")
        if cfg.device not in DEVICES:
            raise IngeroError(f"--device {cfg.device!r}: use one of {', '.join(DEVICES)}")
        if cfg.scenario == "hang" and cfg.fault_after_s is None:   # a rank stops once the job runs
            cfg = replace(cfg, fault_after_s=faults.HANG_AFTER_S)
        if cfg.timeout_s is None:     # a hang ends when the others time out: sooner than a minute
            cfg = replace(cfg, timeout_s=faults.HANG_TIMEOUT_S if cfg.scenario == "hang" else faults.TIMEOUT_S)
        if cfg.hang_s is not None and (cfg.scenario != "hang" or cfg.hang_s <= 0 or cfg.hang_mode != "stop"):
            raise IngeroError("--hang-for needs --scenario hang, --hang-mode stop and a time > 0")
        if cfg.hang_mode not in faults.HANG_MODES:
            raise IngeroError(f"--hang-mode {cfg.hang_mode!r}: use one of {', '.join(faults.HANG_MODES)}")
        if cfg.timeout_s < 1:
            raise IngeroError(f"--timeout {cfg.timeout_s} is out of range: use 1 s or more")
        if cfg.profiler_plugin is not None and not Path(cfg.profiler_plugin).is_file():
            raise IngeroError(f"profiler plugin {cfg.profiler_plugin} is not a file")
        self.victim = faults.default_victim(cfg.scenario, cfg.world) if cfg.victim_rank is None else cfg.victim_rank
        if not 0 <= self.victim < cfg.world:
            raise IngeroError(f"--victim-rank {self.victim} is out of range: use 0 to {cfg.world - 1}")
        self.cfg = cfg
        self.log = log
        self.binaries = binaries
        self.run_id = secrets.token_hex(3)
        self.out = Path(cfg.out_dir).resolve()
        self.net = LabNetwork(self.run_id, cfg.nodes)
        self.ranks: list[RankProc] = []
        self.extra: list[subprocess.Popen] = []
        self.hogs: list[subprocess.Popen] = []
        self.cpu_share: dict | None = None   # cpu-hog: the run's v1 cpu group (victim, hogs)
        self.load: list[subprocess.Popen] = []   # background load (LabConfig.background_load)
        self.on_close: list[Callable[[], None]] = []  # run first during close()
        self.times: dict[str, int | None] = {"started_ns": None, "ended_ns": None, "fault_injected_ns": None}
        self.notes: dict = {}
        self._extra_pods: dict[str, list[cgroups.Pod]] = {}
        self._fault_timer: threading.Timer | None = None
        self._continue_timer: threading.Timer | None = None
        self._fault_from_ns: int | None = None
        self.ranks_started_ns: int | None = None   # when start_ranks ran (wall clock)
        self._closed = False

    # ---- set-up ------------------------------------------------------------

    @property
    def nodes(self) -> list[LabNode]:
        return self.net.nodes

    @property
    def victim_node(self) -> LabNode:
        return self.nodes[self.victim // self.cfg.ranks_per_node]

    def __enter__(self) -> "LabRun":
        require_root()
        self.times["started_ns"] = time.time_ns()
        try:
            self.binaries = self.binaries or build_lab_binaries()
            for sub in ("logs", "nodes", "io"):
                (self.out / sub).mkdir(parents=True, exist_ok=True)
            self.net.up()
            self.log(f"lab {self.run_id}: network up, {len(self.nodes)} nodes: "
                     + ", ".join(f"{n.name} {n.ipv6 if self.cfg.ipv6 else n.ipv4}" for n in self.nodes))
            self._make_pods()
            if self.cfg.background_load:
                self.load = start_background_load(self.cfg.background_load,
                                                  cgroups.make_plain(self.run_id, "background-load"))
                self.log(f"lab {self.run_id}: background load, {self.cfg.background_load} busy processes")
            self._inject_fault()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make_pods(self) -> None:
        rpn = self.cfg.ranks_per_node
        for r in range(self.cfg.world):
            node = self.nodes[r // rpn]
            pod = cgroups.make_pod(self.run_id, node.name, f"lab-{self.run_id}-rank-{r}", r,
                                   [node.ipv4, node.ipv6])
            self.ranks.append(RankProc(r, node, r % rpn, pod))
        for node in self.nodes:
            self.write_pods_file(node)

    def pods_file(self, node: LabNode | str) -> Path:
        name = node.name if isinstance(node, LabNode) else node
        return self.out / f"pods-{name}.json"

    def write_pods_file(self, node: LabNode, extra: list[cgroups.Pod] = ()) -> Path:
        pods = [rp.pod for rp in self.ranks if rp.node is node] + list(extra)
        doc = {"node": node.name, "cgroup_root": str(cgroups.node_cgroup_root(self.run_id, node.name)),
               "run_id": self.run_id, "pods": [p.as_dict() for p in pods]}
        path = self.pods_file(node)
        path.write_text(json.dumps(doc, indent=2) + "\n")
        return path

    def _inject_fault(self) -> None:
        c = self.cfg
        delayed = c.fault_after_s is not None
        self.plans = faults.plan_ranks(c.scenario, c.world, self.victim, compute_ms=c.compute_ms,
                                       slow_factor=c.slow_factor, io_mb=c.io_mb, io_dir=self.out / "io",
                                       delayed=delayed, layout=self.layout, stage=c.stage,
                                       imbalance=c.imbalance, hang_mode=c.hang_mode)
        if c.scenario == "cpu-hog":
            # the victim and the hogs in one v1 cpu group: the hogs' weight holds against the
            # victim only (faults.start_hogs); None without a v1 cpu controller
            self.cpu_share = cgroups.cpu_share_group(self.run_id, {"victim": 1024,
                                                                   "hogs": round(1024 * c.hog_weight)})
        if not delayed:
            self._fault_now()

    def _fault_now(self) -> None:
        """Install the network or CPU part of the fault (the rest is in the ranks' plans)."""
        c = self.cfg
        if self._closed:
            return
        if c.scenario == "lossy-link":
            faults.add_loss(self.net.switch, self.net.port(self.victim_node), c.loss_percent)
        elif c.scenario == "slow-link":
            faults.add_slow_link(self.victim_node.netns, "eth0", c.rate_mbit)
        elif c.scenario == "cpu-hog":
            cpu = self.plans[self.victim].cpus
            self.hogs, self.notes["cpu_hog"] = faults.start_hogs(
                c.hogs, cpu, cgroups.make_plain(self.run_id, "hogs"), c.hog_weight,
                share=self.cpu_share["hogs"] if self.cpu_share else None)
        elif c.scenario == "hang" and c.hang_mode == "stop":
            self.notes["hang"] = {"stopped_pids": faults.signal_pod(self.ranks[self.victim].pod.cgroup,
                                                                   signal.SIGSTOP),
                                  "for_s": c.hang_s, "continued_ns": None}
            if c.hang_s is not None:
                self._continue_timer = threading.Timer(c.hang_s, self._continue_victim)
                self._continue_timer.daemon = True
                self._continue_timer.start()
        if c.scenario != "clean":
            self.times["fault_injected_ns"] = time.time_ns()
            self.log(f"lab {self.run_id}: fault {c.scenario} on rank {self.victim} ({self.victim_node.name})")

    def _continue_victim(self) -> None:
        """hang with hang_s: the stopped victim runs on."""
        if self._closed:
            return
        faults.signal_pod(self.ranks[self.victim].pod.cgroup, signal.SIGCONT)
        self.notes["hang"]["continued_ns"] = time.time_ns()
        self.log(f"lab {self.run_id}: rank {self.victim} continued after {self.cfg.hang_s:g} s")

    # ---- processes -----------------------------------------------------------

    def _spawn(self, node: LabNode, cgroup: Path, argv: list[str], env: dict[str, str],
               stdout, stderr, cpus: str | None = None, share: Path | None = None) -> subprocess.Popen:
        """`share`: also a cgroup v1 cpu group to put the process in (the cpu-hog victim)."""
        if cpus:
            argv = ["taskset", "-c", cpus, *argv]
        shim = ["sh", "-c", 'echo $$ > "$0" && if [ -n "$1" ]; then echo $$ > "$1"; fi && shift && exec "$@"',
                str(cgroup / "cgroup.procs"), str(share / "cgroup.procs") if share is not None else "",
                *in_netns(node.netns, argv)]
        proc = subprocess.Popen(shim, env=env, stdout=stdout, stderr=stderr,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 5.0  # return once the process sits in its cgroup
        while proc.pid not in cgroups.procs(cgroup) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        return proc

    def rank_env(self, rp: RankProc) -> dict[str, str]:
        c, master = self.cfg, self.nodes[0]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("INGERO_LAB_", "NCCL_"))}
        env.update({
            "RANK": str(rp.rank), "WORLD_SIZE": str(c.world), "LOCAL_RANK": str(rp.local_rank),
            "LOCAL_WORLD_SIZE": str(c.ranks_per_node), "GROUP_RANK": str(rp.node.index),
            "ROLE_RANK": str(rp.rank), "TORCHELASTIC_RUN_ID": self.run_id,
            "MASTER_ADDR": master.ipv6 if c.ipv6 else master.ipv4, "MASTER_PORT": str(c.master_port),
            "INGERO_LAB_SECONDS": str(c.seconds if c.steps <= 0 else 0),
            "INGERO_LAB_STEPS": str(max(c.steps, 0)), "INGERO_LAB_COMPUTE_MS": str(c.compute_ms),
            "INGERO_LAB_CPU_MS": str(c.cpu_ms), "INGERO_LAB_ELEMS": str(c.elems),
            "INGERO_LAB_TIMEOUT_S": str(c.timeout_s), "INGERO_LAB_DEVICE": c.device,
            "INGERO_LAB_NONBLOCKING": "1" if c.nonblocking else "0", "POD_NAME": rp.pod.name,
            "INGERO_LAB_ELASTIC": "1" if c.elastic else "0", "INGERO_LAB_ELASTIC_STEPS": str(c.elastic_steps),
            "POD_NAMESPACE": rp.pod.namespace, "NODE_NAME": rp.node.name,
        })
        if c.stop_file is not None:
            env["INGERO_LAB_STOP_FILE"] = str(Path(c.stop_file).resolve())
        if c.profiler_plugin is not None:
            env["NCCL_PROFILER_PLUGIN"] = str(Path(c.profiler_plugin).resolve())
        if c.socket_sndbuf is not None:
            env["NCCL_SOCKET_SNDBUF"] = str(c.socket_sndbuf)
        if self.layout is not None:
            env["INGERO_LAB_LAYOUT"] = ",".join(map(str, self.layout))
            env["INGERO_LAB_MICROBATCHES"] = str(c.microbatches)
            env["INGERO_LAB_SCHEDULE"] = c.schedule
            env["INGERO_LAB_VIRTUAL_STAGES"] = str(c.virtual_stages)
            env["INGERO_LAB_SHARDING"] = c.sharding
            env["INGERO_LAB_LAYERS"] = str(c.layers)
            env["INGERO_LAB_REPLICAS"] = str(c.replicas)
        env.update(self.plans[rp.rank].env)
        if self._fault_from_ns is not None:
            env["INGERO_LAB_FAULT_FROM_NS"] = str(self._fault_from_ns)
        return env

    def start_ranks(self) -> None:
        """Start every rank (rank 0 first: it serves the NCCL id); with `fault_after_s`, arm the fault.

        The ranks switch to a delayed slow-rank / io-stall setting at the first step that
        starts after ``fault_injected_ns`` (wall clock, in lab.json); lossy-link, slow-link and
        cpu-hog are installed by a timer, and ``fault_injected_ns`` is when that happened."""
        c = self.cfg
        self.ranks_started_ns = time.time_ns()
        if c.fault_after_s is not None and c.scenario != "clean":
            self._fault_from_ns = self.ranks_started_ns + int(c.fault_after_s * 1e9)
            if c.scenario in ("slow-rank", "io-stall") or (c.scenario, c.hang_mode) == ("hang", "sleep"):
                self.times["fault_injected_ns"] = self._fault_from_ns
                self.log(f"lab {self.run_id}: fault {c.scenario} on rank {self.victim} "
                         f"({self.victim_node.name}) from {c.fault_after_s:g} s after the ranks start")
            else:
                self._fault_timer = threading.Timer(c.fault_after_s, self._fault_now)
                self._fault_timer.daemon = True
                self._fault_timer.start()
        for rp in self.ranks:
            out = open(self.out / "logs" / f"rank-{rp.rank}.out", "wb")
            err = open(self.out / "logs" / f"rank-{rp.rank}.err", "wb")
            share = self.cpu_share["victim"] if self.cpu_share and rp.rank == self.victim else None
            rp.proc = self._spawn(rp.node, rp.pod.cgroup, [str(self.binaries.worker)], self.rank_env(rp),
                                  out, err, self.plans[rp.rank].cpus, share=share)
            out.close()
            err.close()
            self.log(f"lab {self.run_id}: rank {rp.rank} started on {rp.node.name} "
                     f"(pid {rp.proc.pid}, pod {rp.pod.name})")

    def run_in_node(self, node: LabNode | str, argv: list[str], cgroup: Path | None = None,
                    env: dict[str, str] | None = None, name: str | None = None,
                    stdout=None, stderr=None) -> tuple[subprocess.Popen, cgroups.Pod | None]:
        """Run `argv` in `node`'s network namespace, in `cgroup` or in a new pod (added to pods-<node>.json)."""
        node = node if isinstance(node, LabNode) else self.net.node(node)
        pod = None
        if cgroup is None:
            pod = cgroups.make_pod(self.run_id, node.name, name or f"lab-{self.run_id}-extra-{len(self.extra)}",
                                   None, [node.ipv4, node.ipv6])
            cgroup = pod.cgroup
            self._extra_pods.setdefault(node.name, []).append(pod)
            self.write_pods_file(node, self._extra_pods[node.name])
        proc = self._spawn(node, cgroup, argv, env if env is not None else dict(os.environ), stdout, stderr)
        self.extra.append(proc)
        return proc, pod

    def kill_node(self, node: LabNode | str) -> None:
        """SIGKILL every lab process of `node` (its ranks and run_in_node processes)."""
        node = node if isinstance(node, LabNode) else self.net.node(node)
        cgroups.kill_tree(cgroups.node_cgroup_root(self.run_id, node.name))

    def steps_so_far(self) -> dict[int, int]:
        """Last step each rank reported (from its log)."""
        done = {}
        for rp in self.ranks:
            try:
                lines = (self.out / "logs" / f"rank-{rp.rank}.out").read_text().splitlines()
            except FileNotFoundError:
                lines = []
            done[rp.rank] = next((int(m.group(2)) for m in map(STEP_LINE.match, reversed(lines)) if m), 0)
        return done

    def wait(self, timeout_s: float | None = None, grace_s: float = 5.0) -> dict[int, int]:
        """Wait for every rank; returns {rank: exit code}. Like torchrun, once one rank
        fails the rest get `grace_s` seconds before they are killed."""
        c = self.cfg
        limit = timeout_s if timeout_s is not None else (c.seconds if c.steps <= 0 else c.steps) + c.timeout_s + 60
        start = last = time.monotonic()
        failed_at = None
        while True:
            running = [rp for rp in self.ranks if rp.proc and rp.proc.poll() is None]
            for rp in self.ranks:
                if rp.proc and rp.exit_code is None and rp.proc.returncode is not None:
                    rp.exit_code = rp.proc.returncode
                    if rp.exit_code != 0 and failed_at is None:
                        failed_at = time.monotonic()
                        self.log(f"lab {self.run_id}: rank {rp.rank} exited {rp.exit_code}: "
                                 + self._tail(rp.rank))
            if not running:
                break
            now = time.monotonic()
            if (failed_at and now - failed_at > grace_s) or now - start > limit:
                why = "a rank failed" if failed_at else f"the run exceeded {limit:.0f} s"
                self.log(f"lab {self.run_id}: {why}; killing ranks still running")
                for rp in running:
                    cgroups.kill_tree(rp.pod.cgroup)
                for rp in running:
                    rp.proc.wait()
                continue
            if now - last >= c.progress_every_s:
                last = now
                steps = self.steps_so_far()
                self.log(f"lab {self.run_id}: {now - start:.0f} s, steps " +
                         " ".join(f"r{r}={s}" for r, s in steps.items()))
            time.sleep(0.2)
        for rp in self.ranks:
            rp.stats = self._final_stats(rp.rank)
        self.notes["node_tcp"] = self.node_tcp()
        return {rp.rank: rp.exit_code for rp in self.ranks}

    def node_tcp(self) -> dict[str, dict[str, int]]:
        """Per node: TCP segments sent and retransmitted, and packets the loss rules dropped."""
        out = {}
        for n in self.nodes:
            tcp = tcp_counters(n.netns)
            out[n.name] = {"out_segs": tcp.get("OutSegs", 0), "retrans_segs": tcp.get("RetransSegs", 0)}
        out["switch"] = {"nft_dropped": faults.dropped_packets(self.net.switch)}
        return out

    def _tail(self, rank: int) -> str:
        try:
            lines = (self.out / "logs" / f"rank-{rank}.err").read_text().strip().splitlines()
        except FileNotFoundError:
            return ""
        return lines[-1] if lines else "(no message)"

    def _final_stats(self, rank: int) -> dict:
        try:
            lines = (self.out / "logs" / f"rank-{rank}.out").read_text().splitlines()
        except FileNotFoundError:
            return {}
        for line in reversed(lines):
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except ValueError:
                    return {}
        return {}

    # ---- tear-down -----------------------------------------------------------

    def close(self) -> list[str]:
        """Remove processes, cgroups and namespaces (idempotent); write lab.json; returns errors."""
        if self._closed:
            return []
        self._closed = True
        errors: list[str] = []
        for timer in (self._fault_timer, self._continue_timer):
            if timer is not None:
                timer.cancel()
                timer.join()
        for cb in self.on_close:
            try:
                cb()
            except Exception as e:  # one failing hook must not leave namespaces behind
                errors.append(f"close hook: {e}")
        faults.stop_hogs(self.hogs)
        procs = self.load + self.hogs + self.extra + [rp.proc for rp in self.ranks if rp.proc]
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.send_signal(signal.SIGCONT)   # a stopped rank (hang) dies at once either way
        for p in procs:
            p.wait()
        for rp in self.ranks:
            if rp.exit_code is None and rp.proc is not None:
                rp.exit_code = rp.proc.returncode
        errors += cgroups.remove_tree(cgroups.run_cgroup(self.run_id))
        errors += cgroups.remove_cpu_group(self.run_id)
        errors += self.net.down()
        self.times["ended_ns"] = time.time_ns()
        self.write_report()
        for e in errors:
            self.log(f"lab {self.run_id}: cleanup: {e}")
        return errors

    def report(self) -> dict:
        c = self.cfg
        return {
            "run_id": self.run_id, "scenario": c.scenario, "victim_rank": self.victim,
            "layout": None if self.layout is None else dict(zip(("tp", "pp", "dp"), self.layout)),
            "slow_stage": c.stage if c.scenario == "slow-stage" else None,
            "stage_ranks": (sorted(r for r in range(c.world) if faults.stage_of(r, self.layout) == c.stage)
                            if c.scenario == "slow-stage" else None),
            "victim_node": self.victim_node.name, "config": {k: str(v) if isinstance(v, Path) else v
                                                             for k, v in asdict(c).items()},
            "nodes": [dict(n.as_dict(), pods_file=str(self.pods_file(n))) for n in self.nodes],
            **self.times,
            "ranks": [{"rank": rp.rank, "node": rp.node.name, "local_rank": rp.local_rank,
                       "stage": faults.stage_of(rp.rank, self.layout),
                       "pod": rp.pod.name, "pod_uid": rp.pod.uid, "pid": rp.proc.pid if rp.proc else None,
                       "exit_code": rp.exit_code, "stats": rp.stats} for rp in self.ranks],
            **self.notes,
        }

    def write_report(self) -> Path:
        path = self.out / "lab.json"
        if self.out.exists():
            path.write_text(json.dumps(self.report(), indent=2) + "\n")
        return path
