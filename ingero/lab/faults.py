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
- ``cpu-hog``: the victim rank and ``hogs`` busy-loop processes share one CPU;
  every other rank is pinned to the other CPUs. The hogs live in their own lab
  cgroup, not in the victim's pod.
- ``slow-rank``: the victim's GPU-like compute wait is multiplied by
  ``slow_factor``.
- ``io-stall``: the victim writes and fsyncs ``io_mb`` MB each step.
- ``slow-stage`` (a job with a pipeline, ``--layout``): every rank of one
  pipeline stage computes ``slow_factor`` times longer (stage imbalance).
- ``imbalance``: every rank, every step, computes a factor drawn from
  [1, 1 + ``imbalance``] longer: a slowdown spread over all ranks, no culprit.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ingero.errors import IngeroError
from ingero.lab.netns import in_netns

SCENARIOS = ("clean", "lossy-link", "cpu-hog", "slow-rank", "io-stall", "slow-stage", "imbalance")


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
               stage: int = 1, imbalance: float = 1.0) -> dict[int, RankPlan]:
    """Per-rank changes for `scenario` (ranks not listed run unchanged).

    `delayed`: the slow-rank and io-stall settings go into the worker's
    INGERO_LAB_FAULT_* variables, used from INGERO_LAB_FAULT_FROM_NS on."""
    if scenario not in SCENARIOS:
        raise IngeroError(f"unknown scenario {scenario!r}: use one of {', '.join(SCENARIOS)}")
    plans = {r: RankPlan() for r in range(world)}
    prefix = "INGERO_LAB_FAULT_" if delayed else "INGERO_LAB_"
    if scenario == "slow-stage" and (layout is None or layout[1] < 2):
        raise IngeroError("slow-stage needs a pipeline: give --layout tp=T,pp=P,dp=D with P > 1")
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


def start_hogs(count: int, cpu: str, cgroup: Path) -> list[subprocess.Popen]:
    """Start `count` busy-loop processes pinned to `cpu`, in `cgroup`."""
    procs_file = cgroup / "cgroup.procs"
    argv = ["sh", "-c", 'echo $$ > "$0" && exec taskset -c "$1" sh -c "while :; do :; done"',
            str(procs_file), cpu]
    return [subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL)
            for _ in range(count)]
