"""Lab network: one network namespace per node, joined by a bridge in a "switch" namespace.

Layout for run <run> with nodes lab-node-a, lab-node-b, …::

    ingero-<run>-lab-node-a (eth0 10.213.<k>.1/24, fd00:1a6e:<k>::1/64)
          │ veth
    ingero-<run>-sw  (bridge br0, ports p0, p1, …)
          │ veth
    ingero-<run>-lab-node-b (eth0 10.213.<k>.2/24, fd00:1a6e:<k>::2/64)

Every veth is created inside a lab namespace, so the host's root namespace
networking is never touched. <k> (1–250) comes from the run id.
"""

from __future__ import annotations

import os
import string
import subprocess
from dataclasses import dataclass

from ingero.errors import IngeroError

NETNS_PREFIX = "ingero-"
NETNS_DIR = "/run/netns"


@dataclass(frozen=True)
class LabNode:
    """One lab node: its index (GROUP_RANK), name, namespace and addresses."""

    index: int
    name: str
    netns: str
    ipv4: str
    ipv6: str

    def as_dict(self) -> dict:
        return {"index": self.index, "name": self.name, "netns": self.netns,
                "ipv4": self.ipv4, "ipv6": self.ipv6}


def node_name(index: int) -> str:
    """``lab-node-a`` for 0, ``lab-node-b`` for 1, …, ``lab-node-z``, then ``lab-node-26``."""
    return f"lab-node-{string.ascii_lowercase[index]}" if index < 26 else f"lab-node-{index}"


def subnet_index(run_id: str) -> int:
    """The third IPv4 octet (and IPv6 group) of a run: 1–250, from the run id."""
    return int(run_id, 16) % 250 + 1


def ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``ip`` (inside `netns` when given); a failure raises IngeroError with ip's message."""
    argv = ["ip", "-n", netns, *args] if netns else ["ip", *args]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise IngeroError(f"`{' '.join(argv)}` failed: {proc.stderr.strip()}")
    return proc


def in_netns(netns: str, argv: list[str]) -> list[str]:
    """argv that runs `argv` inside `netns` (nsenter keeps the mount namespace, unlike ip netns exec)."""
    return ["nsenter", f"--net={NETNS_DIR}/{netns}", "--", *argv]


class LabNetwork:
    """Creates and removes the namespaces, bridge and veths of one run."""

    def __init__(self, run_id: str, nodes: int):
        if not 1 <= nodes <= 200:
            raise IngeroError(f"--nodes {nodes} is out of range: use 1 to 200")
        self.run_id = run_id
        self.k = subnet_index(run_id)
        self.switch = f"{NETNS_PREFIX}{run_id}-sw"
        self.nodes = [
            LabNode(i, node_name(i), f"{NETNS_PREFIX}{run_id}-{node_name(i)}",
                    f"10.213.{self.k}.{i + 1}", f"fd00:1a6e:{self.k:x}::{i + 1:x}")
            for i in range(nodes)
        ]
        self._created: list[str] = []

    def up(self) -> None:
        """Create everything; on failure, what was created so far is removed by down()."""
        self._add_ns(self.switch)
        ip("link", "add", "br0", "type", "bridge", netns=self.switch)
        ip("link", "set", "br0", "up", netns=self.switch)
        ip("link", "set", "lo", "up", netns=self.switch)
        for node in self.nodes:
            self._add_ns(node.netns)
            port = self.port(node)
            ip("link", "add", "eth0", "type", "veth", "peer", "name", port,
               "netns", self.switch, netns=node.netns)
            ip("link", "set", port, "master", "br0", netns=self.switch)
            ip("link", "set", port, "up", netns=self.switch)
            ip("link", "set", "lo", "up", netns=node.netns)
            ip("addr", "add", f"{node.ipv4}/24", "dev", "eth0", netns=node.netns)
            ip("-6", "addr", "add", f"{node.ipv6}/64", "dev", "eth0", "nodad", netns=node.netns)
            ip("link", "set", "eth0", "up", netns=node.netns)
            no_offloads(node.netns, "eth0")
            no_offloads(self.switch, port)

    def _add_ns(self, name: str) -> None:
        ip("netns", "add", name)
        self._created.append(name)

    def down(self) -> list[str]:
        """Delete the namespaces (their veths and nft tables go with them); returns errors."""
        errors = []
        for name in reversed(self._created):
            proc = ip("netns", "del", name, check=False)
            if proc.returncode != 0 and os.path.exists(f"{NETNS_DIR}/{name}"):
                errors.append(f"netns {name}: {proc.stderr.strip()}")
        self._created.clear()
        return errors

    @staticmethod
    def port(node: LabNode) -> str:
        """The switch-side veth of `node`."""
        return f"p{node.index}"

    def node(self, name_or_index: str | int) -> LabNode:
        for n in self.nodes:
            if name_or_index in (n.name, n.index):
                return n
        raise IngeroError(f"no lab node {name_or_index!r}: nodes are {', '.join(n.name for n in self.nodes)}")


# Segmentation and receive offloads off on both ends of every lab veth: with them on, TCP
# hands veths 64 KB super-packets, and the lossy-link rule (one packet in N dropped) drops
# ~50 KB at once instead of one segment, which is not how a lossy link loses data.
OFFLOADS = ("gso", "tso", "gro")


def no_offloads(netns: str, dev: str) -> None:
    """Turn OFFLOADS off on `dev` in `netns` (ethtool -K); a failure raises IngeroError."""
    argv = in_netns(netns, ["ethtool", "-K", dev] + [x for o in OFFLOADS for x in (o, "off")])
    try:
        proc = subprocess.run(argv, capture_output=True, text=True)
    except FileNotFoundError:
        raise IngeroError("ethtool is not installed: run `make setup` (or apt-get install ethtool)") from None
    if proc.returncode != 0:
        raise IngeroError(f"`ethtool -K {dev}` in {netns} failed: {proc.stderr.strip() or proc.stdout.strip()}")


def offloads(netns: str, dev: str) -> dict[str, bool]:
    """The state of OFFLOADS on `dev` in `netns`, from `ethtool -k`."""
    names = {"generic-segmentation-offload": "gso", "tcp-segmentation-offload": "tso",
             "generic-receive-offload": "gro"}
    proc = subprocess.run(in_netns(netns, ["ethtool", "-k", dev]), capture_output=True, text=True)
    out = {}
    for line in proc.stdout.splitlines():
        key, _, val = line.partition(":")
        if key.strip() in names:
            out[names[key.strip()]] = val.split()[0] == "on"
    return out


def leftover_netns() -> list[str]:
    """Names of namespaces left by earlier runs (``ingero-*``)."""
    try:
        return sorted(n for n in os.listdir(NETNS_DIR) if n.startswith(NETNS_PREFIX))
    except FileNotFoundError:
        return []


def netns_pids(netns: str) -> list[int]:
    """Pids of processes living in `netns` (``ip netns pids``)."""
    proc = ip("netns", "pids", netns, check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def tcp_counters(netns: str) -> dict[str, int]:
    """The Tcp: counters of /proc/net/snmp inside `netns` (e.g. RetransSegs, OutSegs)."""
    proc = subprocess.run(in_netns(netns, ["cat", "/proc/net/snmp"]), capture_output=True, text=True)
    rows = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("Tcp:")]
    if len(rows) < 2:
        return {}
    return {k: int(v) for k, v in zip(rows[0], rows[1]) if v.lstrip("-").isdigit()}
