"""Fault scenarios of the lab, each aimed at one victim rank (or its node).

- ``clean``: nothing.
- ``lossy-link``: nftables drops ``loss_percent`` % of the victim node's
  *outgoing TCP data segments*: no SYN/FIN/RST, and only packets longer than
  any pure ACK can be (IPv4 total length > 80 bytes, IPv6 payload length > 60
  bytes: 20/40 bytes of IP header plus at most 60 of TCP header), so
  retransmits happen on the victim node's own sockets only. The rule sits on
  the ingress of the victim's switch port (netdev family, in the switch
  namespace), i.e. the packet is lost on the wire after it left the node. A
  drop in the node's own output hook would not do: TCP sees it as a local send
  error and quietly sends again, without a retransmit (measured: 321 drops,
  7 RetransSegs).
- ``slow-link``: the victim node's outgoing TCP data segments leave it at
  ``rate_mbit`` Mbit/s: a token bucket (HTB class) on the node's eth0, which
  nftables puts the segments into by their priority (``meta priority``, the
  same length test as lossy-link); ACKs and everything else go out unshaped, so
  the other nodes' sends to it are not slowed with it. Nothing is lost: TCP's
  queue on the node fills and its senders wait (a congested rail or a NIC
  that trained at a lower rate), without a retransmit.
- ``cpu-hog``: the victim rank and ``hogs`` busy-loop processes share one CPU;
  every other rank is pinned to the other CPUs. The hogs live in their own lab
  cgroup, not in the victim's pod, and weigh ``hog_weight`` times a rank in the
  CPU scheduler (a neighbour pod with a larger CPU request): see ``start_hogs``.
- ``slow-rank``: the victim's GPU-like compute wait is multiplied by
  ``slow_factor``.
- ``io-stall``: the victim writes and fsyncs ``io_mb`` MB each step.
- ``slow-stage`` (a job with a pipeline, ``--layout``): every rank of one
  pipeline stage computes ``slow_factor`` times longer (stage imbalance).
- ``imbalance``: every rank, every step, computes a factor drawn from
  [1, 1 + ``imbalance``] longer: a slowdown spread over all ranks, no culprit.
- ``hang``: the victim's process is stopped (SIGSTOP) ``fault_after_s`` after the
  ranks start, for good (or for ``hang_s``, then continued); or, ``hang_mode``
  "sleep", it lives on but computes for a day from its next step and calls NCCL no
  more. The others block in their next collective until the lab NCCL's timeout
  fails it.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from ingero.errors import IngeroError
from ingero.lab import cgroups
from ingero.lab.netns import in_netns

SCENARIOS = ("clean", "lossy-link", "slow-link", "cpu-hog", "slow-rank", "io-stall", "slow-stage", "imbalance",
             "hang")
SCHEDULES = ("1f1b", "gpipe", "interleaved")   # the pipeline schedules of a layout job (worker.c)
SHARDINGS = ("optimizer", "fsdp")   # a layout job's data parallelism: Megatron's distributed optimizer, or FSDP


def parse_layout(text: str | None, world: int | None) -> tuple[int, int, int] | None:
    """"tp=T,pp=P,dp=D" (any order, missing parts 1) -> (T, P, D); None for no layout.
    `world` None: not checked against the lab's size."""
    if not text:
        return None
    parts = {"tp": 1, "pp": 1, "dp": 1}
    for item in text.split(","):
        k, eq, v = item.strip().partition("=")
        if not eq or k not in parts or not v.isdigit() or int(v) < 1:
            raise IngeroError(f"--layout {text!r}: write it as tp=T,pp=P,dp=D with positive integers")
        parts[k] = int(v)
    t, p, d = parts["tp"], parts["pp"], parts["dp"]
    if world is not None and t * p * d != world:
        raise IngeroError(f"--layout {text!r} has {t * p * d} ranks but the lab has {world} "
                          "(--nodes x --ranks-per-node): make them equal")
    return t, p, d


def stage_of(rank: int, layout: tuple[int, int, int] | None) -> int | None:
    """The pipeline stage of a rank in Megatron's order (tensor fastest, then pipeline)."""
    if layout is None:
        return None
    t, p, _ = layout
    return (rank // t) % p
NFT_TABLE = "ingero_lab"
HANG_MODES = ("stop", "sleep")
TIMEOUT_S = 60                 # a rank whose peer stops answering fails its NCCL call after this
HANG_TIMEOUT_S = 20            # ... in the hang scenario (the waiters must have waited; the run ends sooner)
HANG_AFTER_S = 6.0              # hang without --fault-after: the victim stops this long after the start
HANG_SLEEP_MS = 86_400_000      # hang_mode "sleep": the victim's compute from the fault on (a day)


@dataclass
class RankPlan:
    """What a fault changes for one rank: extra environment and CPU pinning."""

    env: dict[str, str] = field(default_factory=dict)
    cpus: str | None = None  # taskset list, e.g. "1"


def nft_loss_ruleset(port: str, percent: float) -> str:
    """The nft ruleset that drops `percent` % of TCP data segments entering switch port `port`."""
    n = int(round(percent))
    if not 0 < n <= 100:
        raise IngeroError(f"--loss-percent {percent} is out of range: use 1 to 100")
    data = "tcp flags & (syn | fin | rst) == 0"
    return (
        f"table netdev {NFT_TABLE} {{\n"
        "  chain lossy {\n"
        f'    type filter hook ingress device "{port}" priority 0; policy accept;\n'
        f"    meta protocol ip ip protocol tcp {data} ip length > 80 numgen random mod 100 < {n} counter drop\n"
        f"    meta protocol ip6 ip6 nexthdr tcp {data} ip6 length > 60 numgen random mod 100 < {n} counter drop\n"
        "  }\n"
        "}\n"
    )


def add_loss(switch_netns: str, port: str, percent: float) -> None:
    """Install the loss ruleset on `port` of the switch namespace (removed with the namespace)."""
    netns = switch_netns
    proc = subprocess.run(in_netns(netns, ["nft", "-f", "-"]), input=nft_loss_ruleset(port, percent),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise IngeroError(f"nft in {netns} failed: {proc.stderr.strip()}; is nftables installed?")


SLOW_CLASS = "1:20"      # slow-link: the shaped HTB class; 1:10 (the default) is unshaped


def slow_link_setup(dev: str, rate_mbit: float) -> tuple[list[list[str]], str]:
    """(tc commands, nft ruleset) that send `dev`'s outgoing TCP data segments through an HTB
    class of `rate_mbit` Mbit/s and the rest through an unshaped one."""
    if not 1 <= rate_mbit <= 100_000:
        raise IngeroError(f"--rate-mbit {rate_mbit} is out of range: use 1 to 100000")
    rate = f"{rate_mbit:g}mbit"
    tc = [["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"],
          ["tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", "100gbit",
           "burst", "1mb"],
          ["tc", "class", "add", "dev", dev, "parent", "1:", "classid", SLOW_CLASS, "htb", "rate", rate,
           "ceil", rate]]
    data = "tcp flags & (syn | fin | rst) == 0"
    nft = (
        f"table inet {NFT_TABLE} {{\n"
        "  chain slow {\n"
        "    type filter hook postrouting priority 0; policy accept;\n"
        f'    oifname "{dev}" meta nfproto ipv4 ip protocol tcp {data} ip length > 80 meta priority set {SLOW_CLASS}\n'
        f'    oifname "{dev}" meta nfproto ipv6 ip6 nexthdr tcp {data} ip6 length > 60 meta priority set {SLOW_CLASS}\n'
        "  }\n"
        "}\n"
    )
    return tc, nft


def add_slow_link(node_netns: str, dev: str, rate_mbit: float) -> None:
    """Install slow_link_setup in the victim node's namespace (removed with the namespace)."""
    tc, nft = slow_link_setup(dev, rate_mbit)
    for argv in tc:
        proc = subprocess.run(in_netns(node_netns, argv), capture_output=True, text=True)
        if proc.returncode != 0:
            raise IngeroError(f"`{' '.join(argv)}` in {node_netns} failed: {proc.stderr.strip()}; the kernel "
                              "needs the HTB qdisc (CONFIG_NET_SCH_HTB)")
    proc = subprocess.run(in_netns(node_netns, ["nft", "-f", "-"]), input=nft, capture_output=True, text=True)
    if proc.returncode != 0:
        raise IngeroError(f"nft in {node_netns} failed: {proc.stderr.strip()}; is nftables installed?")


def dropped_packets(netns: str) -> int:
    """Packets dropped so far by the loss rules in (switch) `netns` (0 when none are installed)."""
    proc = subprocess.run(in_netns(netns, ["nft", "list", "table", "netdev", NFT_TABLE]),
                          capture_output=True, text=True)
    total = 0
    for line in proc.stdout.splitlines():
        words = line.split()
        if "counter" in words and "packets" in words:
            total += int(words[words.index("packets") + 1])
    return total


def cpu_split() -> tuple[str, str]:
    """(victim CPU, CPUs for everyone else) from the CPUs this process may use."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise IngeroError("cpu-hog needs at least 2 CPUs (victim and hogs on one, other ranks on the rest)")
    return str(cpus[-1]), ",".join(str(c) for c in cpus[:-1])


def plan_ranks(scenario: str, world: int, victim: int, *, compute_ms: float, slow_factor: float,
               io_mb: int, io_dir: Path, delayed: bool = False, layout: tuple | None = None,
               stage: int = 1, imbalance: float = 1.0, hang_mode: str = "stop") -> dict[int, RankPlan]:
    """Per-rank changes for `scenario` (ranks not listed run unchanged).

    `delayed`: the slow-rank and io-stall settings go into the worker's
    INGERO_LAB_FAULT_* variables, used from INGERO_LAB_FAULT_FROM_NS on."""
    if scenario not in SCENARIOS:
        raise IngeroError(f"unknown scenario {scenario!r}: use one of {', '.join(SCENARIOS)}")
    plans = {r: RankPlan() for r in range(world)}
    prefix = "INGERO_LAB_FAULT_" if delayed else "INGERO_LAB_"
    if scenario == "slow-stage" and (layout is None or layout[1] < 2):
        raise IngeroError("slow-stage needs a pipeline: give --layout tp=T,pp=P,dp=D with P > 1")
    if scenario == "hang" and hang_mode == "sleep":
        plans[victim].env["INGERO_LAB_FAULT_COMPUTE_MS"] = str(HANG_SLEEP_MS)
    if scenario == "slow-rank":
        plans[victim].env[prefix + "COMPUTE_MS"] = str(compute_ms * slow_factor)
    elif scenario == "slow-stage":
        if not 0 <= stage < layout[1]:
            raise IngeroError(f"--stage {stage} is out of range: the layout has stages 0 to {layout[1] - 1}")
        for r in range(world):
            if stage_of(r, layout) == stage:
                plans[r].env[prefix + "COMPUTE_MS"] = str(compute_ms * slow_factor)
    elif scenario == "imbalance":
        if not 0 < imbalance <= 10:
            raise IngeroError(f"--imbalance {imbalance} is out of range: use more than 0, at most 10")
        for r in range(world):
            plans[r].env["INGERO_LAB_IMBALANCE"] = str(imbalance)
    elif scenario == "io-stall":
        plans[victim].env.update({prefix + "IO_MB": str(io_mb), "INGERO_LAB_IO_DIR": str(io_dir)})
    elif scenario == "cpu-hog":
        victim_cpu, others = cpu_split()
        for r, plan in plans.items():
            plan.cpus = victim_cpu if r == victim else others
    return plans


# the kernel's weight of a task (or autogroup) per nice value, -20 .. 19 (sched_prio_to_weight)
NICE_WEIGHT = (88761, 71755, 56483, 46273, 36291, 29154, 23254, 18705, 14949, 11916,
               9548, 7620, 6100, 4904, 3906, 3121, 2501, 1991, 1586, 1277,
               1024, 820, 655, 526, 423, 335, 272, 215, 172, 137,
               110, 87, 70, 56, 45, 36, 29, 23, 18, 15)
AUTOGROUP_SWITCH = Path("/proc/sys/kernel/sched_autogroup_enabled")


def nice_for(ratio: float) -> int:
    """The nice value whose weight is closest (on a log scale) to `ratio` times nice 0's."""
    if ratio <= 0:
        raise IngeroError(f"a CPU weight ratio must be positive, not {ratio}")
    return min(range(-20, 20), key=lambda n: abs(math.log(NICE_WEIGHT[n + 20] / 1024 / ratio)))


def start_hogs(count: int, cpu: str, cgroup: Path, weight: float = 1.0,
               share: Path | None = None) -> tuple[list[subprocess.Popen], dict]:
    """Start `count` busy loops pinned to `cpu`, in `cgroup`, that together weigh `weight`
    times one rank in the CPU scheduler; returns ([their session leader], what was set).

    `share`: the hogs' child of the run's cgroup v1 cpu group (`cgroups.cpu_share_group`),
    whose other child holds the victim: its `cpu.shares` already is `weight` times the
    victim's, so the weight holds between the hogs and the victim only, and the lab as a
    whole weighs one session on the machine. Without it (a machine with no v1 cpu
    controller) the weight is the session's and the loops' nice, relative to every other
    session on the machine: a CI run beside a cpu-hog lab then gets 1/17 of the victim's
    CPU (measured: a CI run beside such a lab took 25:44 instead of ~19 min).

    Why a weight: the hogs must make the victim a straggler in any layout and beside other
    work. The victim sleeps most of a step (its compute is a sleep) and needs a few ms of CPU
    per step; every other rank shares the remaining CPU(s), with the machine's background
    load (which the scheduler keeps off the hogged CPU). A fixed number of loops cannot
    outweigh a crowd that grows with the layout (8 loops of their own weigh 8 ranks: on the
    3D job, tp=2, pp=2, dp=2, the victim then gets 1/9 of its CPU and its 7 peers on the
    other CPU about as little, and nobody is named); a weight can. On the 3D job (load
    average ~14 from other work) weight 12 names rank 1, cpu-contention, 25.8% (15.7% beside
    2 busy processes); 16: 31.7% (29.1%); 32: 48.5% (46.9%), with steps twice as long. 16 is
    the default (LabConfig.hog_weight): a margin over the 5% floor without making the lab's
    runs much longer. The other ranks are kept off the victim's CPU: the scheduler would
    keep them off a CPU this loaded, and one that sat there would be starved like the
    victim. This is the field's noisy neighbour: a pod with a larger CPU request
    (cpu.shares / cpu.weight) on the victim's cores, while the other ranks have cores of
    their own.

    The weight is set for each way the kernel may weigh them, so it holds wherever the lab
    runs: all loops are in one session (one autogroup, whose nice is set: the scheduler's
    unit when the tasks sit in the root cpu cgroup with autogroup on, as here), each loop's
    nice makes `count` of them weigh `weight` together (the unit when autogroup is off),
    and the cgroup's cpu.weight, when the cgroup v2 cpu controller reaches it, is
    `weight` x the default 100. Stop them with `stop_hogs` (the loops are the leader's
    children; the run's cgroup removal kills them too)."""
    procs_file = cgroup / "cgroup.procs"
    task_nice, group_nice = nice_for(weight / count), nice_for(weight)
    if share is not None:
        task_nice = 0             # the share group carries the weight
    script = ('echo $$ > "$0" || exit 1; if [ -n "$4" ]; then echo $$ > "$4" || exit 1; fi; i=0; '
              'while [ "$i" -lt "$1" ]; do '
              'taskset -c "$2" nice -n "$3" sh -c "while :; do :; done" & i=$((i + 1)); done; wait')
    leader = subprocess.Popen(["sh", "-c", script, str(procs_file), str(count), cpu, str(task_nice),
                               str(share / "cgroup.procs") if share is not None else ""],
                              start_new_session=True, stdin=subprocess.DEVNULL)
    done = {"loops": count, "cpu": cpu, "weight": weight, "task_nice": task_nice}
    deadline = time.monotonic() + 5.0
    while len(cgroups.procs(cgroup)) < count + 1 and leader.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    if share is not None:
        done["cpu_shares"] = int((share / "cpu.shares").read_text())
        done["share_group"] = str(share)
        return [leader], done
    try:
        if AUTOGROUP_SWITCH.read_text().strip() == "1":
            Path(f"/proc/{leader.pid}/autogroup").write_text(str(group_nice))
            done["autogroup_nice"] = group_nice
    except OSError as e:
        done["autogroup_error"] = str(e)
    if (cgroup / "cpu.weight").exists():
        w = min(10000, max(1, round(100 * weight)))
        (cgroup / "cpu.weight").write_text(str(w))
        done["cpu_weight"] = w
    return [leader], done


def default_victim(scenario: str, world: int) -> int:
    """The victim rank when none is given: the last rank, but for a hang a middle one (a job
    rarely hangs on its last rank, and rank 0 serves the bootstrap)."""
    return world // 2 if scenario == "hang" else world - 1


def signal_pod(cgroup: Path, sig: int) -> list[int]:
    """Send `sig` to every process of a pod's cgroup; returns the pids signalled."""
    done = []
    for pid in cgroups.procs(cgroup):
        try:
            os.kill(pid, sig)
            done.append(pid)
        except ProcessLookupError:
            pass
    return done


def stop_hogs(procs: list[subprocess.Popen]) -> None:
    """SIGKILL the hogs' session leaders and their busy loops (one process group each)."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
