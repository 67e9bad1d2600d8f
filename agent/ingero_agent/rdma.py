"""The RDMA NICs' port counters, sampled from sysfs, and the ports each rank uses.

NCCL's InfiniBand/RoCE transport (NET/IB) bypasses the kernel's TCP stack, so no
TCP tracepoint sees its loss; the NIC counts it. Every port's counters are read
from sysfs (Documentation/ABI/stable/sysfs-class-infiniband)::

    <sysfs>/class/infiniband/<device>/ports/<port>/counters/<name>      IB PortCounters (PMA)
    <sysfs>/class/infiniband/<device>/ports/<port>/hw_counters/<name>   the driver's (mlx5: Q and
                                                                       congestion counters)
    <sysfs>/class/infiniband/<device>/hw_counters/<name>                the device's, as port 0
    <sysfs>/class/infiniband/<device>/ports/<port>/{state,phys_state,rate,link_layer}

and handed on as deltas per interval. The PortCounters of the PMA stop at their
maximum instead of wrapping (IB spec; their widths as the kernel reads them,
drivers/infiniband/core/sysfs.c): a counter at its maximum is reported as
saturated, its delta a lower bound. mlx5's Q counters are 32-bit firmware
counters that wrap (drivers/infiniband/hw/mlx5/counters.c reads them as be32).
A counter that goes down otherwise was cleared (perfquery -R, a driver reload):
its delta is its new value. A port that disappears starts over from a new
baseline when it comes back. port_xmit_data and port_rcv_data count 4-byte
words: their deltas are written in bytes.

The ports a rank uses: NCCL_IB_HCA from its environment (NCCL's grammar,
src/misc/utils.cc parseStringList/matchIfList, src/transport/net_ib/init.cc),
else the RDMA devices it holds open (/dev/infiniband/uverbsN in /proc/<pid>/fd,
named by /sys/class/infiniband_verbs/uverbsN/ibdev), else the NICs nearest its
GPU in the PCI tree (/sys/class/infiniband/<dev>/device, /sys/bus/pci/devices)
or on the NUMA nodes its CPUs are confined to (`nearest_ports`). The NIC each
channel used, from the profiler plugin, is joined in the analysis.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

# sysfs's class folder: in a pod, the container's own read-only sysfs, which shows the RDMA
# devices of the pod's network namespace (every device, in RDMA's default shared mode)
SYS_CLASS = Path("/sys/class")

# IB PortCounters as the kernel reads them (PORT_PMA_ATTR widths, bits): they saturate.
# The data and packet counters are 64-bit where the port has the extended counters.
PMA_WIDTH = {
    "symbol_error": 16, "link_error_recovery": 8, "link_downed": 8, "port_rcv_errors": 16,
    "port_rcv_remote_physical_errors": 16, "port_rcv_switch_relay_errors": 16,
    "port_xmit_discards": 16, "port_xmit_constraint_errors": 8, "port_rcv_constraint_errors": 8,
    "local_link_integrity_errors": 4, "excessive_buffer_overrun_errors": 4, "VL15_dropped": 16,
    "port_xmit_data": 32, "port_rcv_data": 32, "port_xmit_packets": 32, "port_rcv_packets": 32,
    "port_xmit_wait": 32,
}
WORD_COUNTERS = ("port_xmit_data", "port_rcv_data")     # octets divided by 4
# mlx5's Q counters (query_q_counter_out, 32-bit, wrapping); "vport_" + name in switchdev mode
Q_COUNTERS_32 = frozenset((
    "rx_write_requests", "rx_read_requests", "rx_atomic_requests", "rx_dct_connect", "out_of_buffer",
    "out_of_sequence", "duplicate_request", "rnr_nak_retry_err", "packet_seq_err", "implied_nak_seq_err",
    "local_ack_timeout_err", "resp_local_length_error", "resp_cqe_error", "req_cqe_error",
    "req_remote_invalid_request", "req_remote_access_errors", "resp_remote_access_errors",
    "resp_cqe_flush_error", "req_cqe_flush_error", "req_transport_retries_exceeded",
    "req_rnr_retries_exceeded", "roce_adp_retrans", "roce_adp_retrans_to", "roce_slow_restart",
    "roce_slow_restart_cnps", "roce_slow_restart_trans",
))
NOT_COUNTERS = ("lifespan",)   # hw_counters/lifespan: the driver's refresh period (ms), writable
MAX_IB_DEVS = 32               # NCCL reads at most this many NCCL_IB_HCA entries (net_ib/common.h)
PREFIX_MAX = 63                # ... each name cut to this (struct netIf prefix[64])


def counter_delta(name: str, kind: str, prev: int, cur: int) -> int:
    """The increase of counter `name` (in folder `kind`: counters | hw_counters) from `prev`
    to `cur`: across a 32-bit Q counter's wrap, or from zero after a clear."""
    if cur >= prev:
        return cur - prev
    if kind == "hw_counters" and name.removeprefix("vport_") in Q_COUNTERS_32 \
            and prev < 1 << 32 and prev - cur > 1 << 31:
        return cur + (1 << 32) - prev                   # wrapped
    return cur                                          # cleared (PortCounters never wrap)


def saturated(name: str, kind: str, value: int) -> bool:
    """A PortCounter at its maximum: it stopped counting, its increases are lower bounds."""
    w = PMA_WIDTH.get(name) if kind == "counters" else None
    return w is not None and value == (1 << w) - 1


def _read_int(path: Path) -> int | None:
    try:
        with open(path, "rb") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):          # "N/A (no PMA)", EINVAL, gone
        return None


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


@dataclass
class Port:
    device: str
    port: int
    state: str | None          # "4: ACTIVE"
    phys_state: str | None     # "5: LinkUp"
    rate: str | None           # "200 Gb/sec (4X HDR)"
    link_layer: str | None     # InfiniBand | Ethernet

    @property
    def active(self) -> bool:
        """Whether NCCL would use it (net_ib/init.cc): ACTIVE (not ACTIVE_DEFER), with an
        InfiniBand or Ethernet link layer."""
        return (self.state or "").split(":")[-1].strip() == "ACTIVE" and \
            self.link_layer in ("InfiniBand", "Ethernet")


class RdmaSampler:
    """Reads every port's counters; `sample()` returns the increases since the last read."""

    def __init__(self, sysfs: Path | None = None):
        self.sysfs = Path(sysfs) if sysfs is not None else SYS_CLASS.parent   # the sysfs root
        self.root = self.sysfs / "class" / "infiniband"
        self.last: dict[tuple[str, int], tuple[int, dict[tuple[str, str], int]]] = {}
        self.saturated: dict[tuple[str, int], set[str]] = {}
        self.ports: dict[tuple[str, int], Port] = {}     # as first seen (state, rate: once)
        self.reads = 0
        self.read_s = 0.0
        self._uses: dict[int, tuple[list[Port], str]] = {}   # pid -> its ports, once found

    def _folders(self) -> list[tuple[str, int, Path]]:
        """(device, port, folder holding counters/ and hw_counters/); the device's own
        hw_counters as port 0."""
        out = []
        try:
            devices = sorted(os.listdir(self.root))
        except OSError:
            return out
        for dev in devices:
            d = self.root / dev
            if (d / "hw_counters").is_dir():
                out.append((dev, 0, d))
            try:
                ports = sorted(int(p) for p in os.listdir(d / "ports") if p.isdigit())
            except OSError:
                continue
            for p in ports:
                out.append((dev, p, d / "ports" / str(p)))
                if (dev, p) not in self.ports:
                    f = d / "ports" / str(p)
                    self.ports[(dev, p)] = Port(dev, p, _read_text(f / "state"), _read_text(f / "phys_state"),
                                                _read_text(f / "rate"), _read_text(f / "link_layer"))
        return out

    def _read(self, folder: Path) -> dict[tuple[str, str], int]:
        vals = {}
        for kind in ("counters", "hw_counters"):
            try:
                names = os.listdir(folder / kind)
            except OSError:
                continue
            for name in names:
                if name in NOT_COUNTERS:
                    continue
                v = _read_int(folder / kind / name)
                if v is not None:
                    vals[(kind, name)] = v
        return vals

    def sample(self, mono_ns: int | None = None) -> list[tuple[str, int, str, int, int]]:
        """[(device, port, counter, increase, interval_ns)] since the last read of each port,
        increases above zero only (bytes for the data counters); nothing on the first read."""
        t0 = time.perf_counter()
        now = time.clock_gettime_ns(time.CLOCK_MONOTONIC) if mono_ns is None else mono_ns
        rows = []
        seen = set()
        for dev, port, folder in self._folders():
            key = (dev, port)
            seen.add(key)
            vals = self._read(folder)
            prev = self.last.get(key)
            sat = set()
            for (kind, name), cur in vals.items():
                if saturated(name, kind, cur):
                    sat.add(name)
                if prev is not None and (kind, name) in prev[1]:
                    d = counter_delta(name, kind, prev[1][(kind, name)], cur)
                    if d > 0:
                        rows.append((dev, port, name, d * 4 if name in WORD_COUNTERS else d, now - prev[0]))
            self.last[key] = (now, vals)
            self.saturated[key] = sat
        for key in set(self.last) - seen:          # gone: a new baseline when it returns
            del self.last[key]
            self.saturated.pop(key, None)
        self.reads += 1
        self.read_s += time.perf_counter() - t0
        return rows

    def port_rows(self) -> list[dict]:
        """The ports as first seen, and the counters now at their maximum."""
        return [{"device": p.device, "port": p.port, "state": p.state, "phys_state": p.phys_state,
                 "rate": p.rate, "link_layer": p.link_layer,
                 "saturated": ",".join(sorted(self.saturated.get(k, ()))) or None}
                for k, p in sorted(self.ports.items())]


    def rank_rows(self, procs: list[tuple[int, int | None, dict]], proc: Path) -> list[dict]:
        """The ports each of `procs` ((pid, rank, environment)) uses, with how that was found;
        a process whose ports are not known yet is looked at again on the next call."""
        rows = []
        for pid, rank, env in procs:
            if pid not in self._uses:
                got, how = rank_ports(pid, env, list(self.ports.values()), proc, self.sysfs)
                if how is None:
                    continue
                self._uses[pid] = (got, how)
            got, how = self._uses[pid]
            rows += [{"pid": pid, "rank": rank, "device": p.device, "port": p.port, "source": how} for p in got]
        return rows


# ---- the ports a rank uses -------------------------------------------------------------

@dataclass(frozen=True)
class HcaFilter:
    """NCCL_IB_HCA parsed as NCCL does: [^][=]<hca>[:<port>[:<rail>[:<plane>]]][,...]."""

    exclude: bool
    exact: bool
    entries: tuple[tuple[str, int], ...]      # (name or prefix, port or -1 for every port)

    def matches(self, device: str, port: int) -> bool:
        """NCCL's matchIfList, then the exclusion: an empty list matches every port."""
        hit = not self.entries or any(
            (device == name if self.exact else device.startswith(name)) and (p == -1 or p == port)
            for name, p in self.entries)
        return hit != self.exclude


def _atoi(s: str) -> int:
    """C's atoi: leading blanks, a sign, digits; 0 when none."""
    s = s.lstrip(" \t\n\v\f\r")
    i = 1 if s[:1] in "+-" else 0
    j = i
    while j < len(s) and s[j].isdigit():
        j += 1
    n = int(s[i:j]) if j > i else 0
    return -n if s[:1] == "-" else n


def parse_ib_hca(text: str) -> HcaFilter:
    """NCCL_IB_HCA's value as NCCL reads it: a leading ^ excludes, then a leading = asks for
    exact names (else prefixes); comma-separated entries, empty ones skipped, at most
    MAX_IB_DEVS; in each, the fields after the name are separated by ':' and only the port
    matters here (empty: every port)."""
    exclude = text.startswith("^")
    text = text[1:] if exclude else text
    exact = text.startswith("=")
    text = text[1:] if exact else text
    entries = []
    for entry in text.split(","):
        if len(entries) >= MAX_IB_DEVS:
            break
        fields = entry.split(":")
        if not fields[0]:
            continue
        port = _atoi(fields[1]) if len(fields) > 1 and fields[1] != "" else -1
        entries.append((fields[0][:PREFIX_MAX], port))
    return HcaFilter(exclude, exact, tuple(entries))


def uverbs_devices(pid: int, proc: Path, sysfs: Path) -> list[str]:
    """The RDMA devices process `pid` holds open: the .../infiniband/uverbsN among its fds,
    named by /sys/class/infiniband_verbs/uverbsM/ibdev of the same device number (a
    container's /dev may name them differently), else of the same name."""
    verbs = sysfs / "class" / "infiniband_verbs"
    by_rdev, by_name = {}, {}
    try:
        for name in os.listdir(verbs):
            dev, ibdev = _read_text(verbs / name / "dev"), _read_text(verbs / name / "ibdev")
            if not ibdev:
                continue
            by_name[name] = ibdev
            if dev and dev.count(":") == 1 and all(x.isdigit() for x in dev.split(":")):
                by_rdev[os.makedev(*map(int, dev.split(":")))] = ibdev
    except OSError:
        return []
    out = set()
    fd_dir = proc / str(pid) / "fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return []
    for fd in fds:
        try:
            target = PurePosixPath(os.readlink(fd_dir / fd))
        except OSError:
            continue
        if target.parent.name != "infiniband" or not target.name.startswith("uverbs"):
            continue
        try:
            ibdev = by_rdev.get(os.stat(fd_dir / fd).st_rdev)
        except OSError:
            ibdev = None
        ibdev = ibdev or by_name.get(target.name)
        if ibdev:
            out.add(ibdev)
    return sorted(out)


def rank_ports(pid: int, env: dict, ports: list[Port], proc: Path, sysfs: Path) -> tuple[list[Port], str | None]:
    """(the active ports process `pid` uses, how that was found: NCCL_IB_HCA | uverbs |
    gpu-pci | cpu-numa), or ([], None) when nothing says."""
    active = [p for p in ports if p.active]
    if "NCCL_IB_HCA" in env:
        flt = parse_ib_hca(env["NCCL_IB_HCA"])
        return [p for p in active if flt.matches(p.device, p.port)], "NCCL_IB_HCA"
    devs = uverbs_devices(pid, proc, sysfs)
    if devs:
        return [p for p in active if p.device in devs], "uverbs"
    return nearest_ports(pid, env, active, proc, sysfs)


# ---- the nearest NIC by PCI and NUMA topology ----------------------------------------------

NVIDIA_PCI_VENDOR = "0x10de"
GPU_PCI_CLASSES = ("0x0300", "0x0302")       # VGA and 3D controllers (class code's first 2 bytes)


def _pci_path(folder: Path) -> tuple[str, ...]:
    """A PCI device's place in the tree: the folders from /sys/devices down to it
    (pci<domain>:<bus> root, bridges, the device); () when it is not a PCI device."""
    try:
        parts = folder.resolve().parts
    except OSError:
        return ()
    for i, part in enumerate(parts):
        if part.startswith("pci") and ":" in part and i and parts[i - 1] == "devices":
            return parts[i:]
    return ()


def _numa(folder: Path) -> int:
    n = _read_int(folder / "numa_node")
    return -1 if n is None else n


def _cpulist(text: str | None) -> set[int]:
    """A kernel CPU list ("0-3,8,10-11") as a set; empty for None or a bad list."""
    out: set[int] = set()
    for part in (text or "").split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return set() if part.strip() else out
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def nic_places(ports: list[Port], sysfs: Path) -> dict[str, tuple[tuple[str, ...], int]]:
    """{RDMA device: (its PCI path, its NUMA node or -1)}, from <dev>/device."""
    root = sysfs / "class" / "infiniband"
    return {p.device: (_pci_path(root / p.device / "device"), _numa(root / p.device / "device")) for p in ports}


def host_gpus(sysfs: Path, proc: Path) -> list[tuple[str, str | None, Path]]:
    """NVIDIA GPUs of the host in PCI bus order: [(PCI address, UUID or None, sysfs folder)].
    The UUID comes from the driver's /proc/driver/nvidia/gpus/<address>/information."""
    bus = sysfs / "bus" / "pci" / "devices"
    out = []
    try:
        names = sorted(os.listdir(bus))
    except OSError:
        return out
    for addr in names:
        d = bus / addr
        if _read_text(d / "vendor") != NVIDIA_PCI_VENDOR or \
                not (_read_text(d / "class") or "").startswith(GPU_PCI_CLASSES):
            continue
        info = _read_text(proc / "driver" / "nvidia" / "gpus" / addr / "information") or ""
        uuid = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("GPU UUID:")), None)
        out.append((addr, uuid, d))
    return out


def _pick(gpus: list, text: str | None) -> list | None:
    """The GPUs a CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES value leaves, in its order:
    indices or UUIDs (a prefix, as CUDA takes it); None (all) when unset or "all"; the list
    stops at the first entry that names nothing, as CUDA's does."""
    if text is None or text.strip() in ("", "all"):
        return None
    out = []
    for item in text.split(","):
        item = item.strip()
        if item.isdigit() and int(item) < len(gpus):
            got = gpus[int(item)]
        else:
            got = next((g for g in gpus if g[1] and item.startswith("GPU-") and g[1].startswith(item)), None)
        if got is None:
            break
        out.append(got)
    return out


def rank_gpu(env: dict, sysfs: Path, proc: Path) -> Path | None:
    """The sysfs folder of the GPU a rank drives: the host's GPUs in PCI bus order (CUDA's
    order with CUDA_DEVICE_ORDER=PCI_BUS_ID), narrowed by NVIDIA_VISIBLE_DEVICES (the container
    runtime's) then CUDA_VISIBLE_DEVICES, and the LOCAL_RANK-th of those (torchrun's
    convention: each rank calls cuda.set_device(LOCAL_RANK)); one GPU left is the rank's
    whatever its LOCAL_RANK. None when that cannot be told."""
    gpus = host_gpus(sysfs, proc)
    for var in ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        got = _pick(gpus, env.get(var))
        gpus = gpus if got is None else got
    if len(gpus) == 1:
        return gpus[0][2]
    local = env.get("LOCAL_RANK", "")
    return gpus[int(local)][2] if local.isdigit() and int(local) < len(gpus) else None


def nearest_ports(pid: int, env: dict, active: list[Port], proc: Path, sysfs: Path) -> tuple[list[Port], str | None]:
    """The ports of the NICs nearest the rank, as NCCL would pick them when nothing restricts
    it (graph/topo.cc ranks paths PIX < PXB < PHB < NODE < SYS): "gpu-pci", the NICs whose
    PCI path shares the most bridges with the rank's GPU's, then on its NUMA node; else
    "cpu-numa", the NICs on the NUMA nodes the process's CPU affinity is confined to.
    ([], None) when neither narrows the choice down (no GPU known, CPUs on every node)."""
    if not active:
        return [], None
    places = nic_places(active, sysfs)
    gpu = rank_gpu(env, sysfs, proc)
    if gpu is not None and _pci_path(gpu):
        g, gn = _pci_path(gpu), _numa(gpu)

        def near(dev: str) -> tuple[int, bool]:
            path, numa = places[dev]
            shared = next((i for i, (a, b) in enumerate(zip(g, path)) if a != b), min(len(g), len(path)))
            return shared, numa == gn and numa >= 0
        best = max(near(p.device) for p in active)
        if best != (0, False):
            return [p for p in active if near(p.device) == best], "gpu-pci"
    status = _read_text(proc / str(pid) / "status") or ""
    cpus = _cpulist(next((ln.split(":", 1)[1] for ln in status.splitlines() if ln.startswith("Cpus_allowed_list:")),
                         None))
    nodes_dir = sysfs / "devices" / "system" / "node"
    try:
        node_cpus = {int(n[4:]): _cpulist(_read_text(nodes_dir / n / "cpulist"))
                     for n in os.listdir(nodes_dir) if n.startswith("node") and n[4:].isdigit()}
    except OSError:
        node_cpus = {}
    mine = {n for n, c in node_cpus.items() if c & cpus}
    if cpus and mine and len(mine) < len(node_cpus):
        got = [p for p in active if places[p.device][1] in mine]
        if got:
            return got, "cpu-numa"
    return [], None
