"""The RDMA counter sampler on sysfs trees laid out as the kernel lays out an mlx5 device
(Documentation/ABI/stable/sysfs-class-infiniband; the class entry a link into
/sys/devices), with counters the test changes between reads; NCCL_IB_HCA as NCCL
parses it; the ports a process uses."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from ingero_agent.rdma import (RdmaSampler, counter_delta, nearest_ports, parse_ib_hca, rank_ports, saturated,
                               uverbs_devices)

PMA = ("symbol_error", "link_error_recovery", "link_downed", "port_rcv_errors",
       "port_rcv_remote_physical_errors", "port_rcv_switch_relay_errors", "port_xmit_discards",
       "port_xmit_constraint_errors", "port_rcv_constraint_errors", "local_link_integrity_errors",
       "excessive_buffer_overrun_errors", "VL15_dropped", "port_xmit_data", "port_rcv_data",
       "port_xmit_packets", "port_rcv_packets", "unicast_rcv_packets", "unicast_xmit_packets",
       "multicast_rcv_packets", "multicast_xmit_packets", "port_xmit_wait")
HW = ("out_of_sequence", "packet_seq_err", "local_ack_timeout_err", "implied_nak_seq_err",
      "rnr_nak_retry_err", "duplicate_request", "out_of_buffer", "np_cnp_sent", "rp_cnp_handled",
      "rp_cnp_ignored", "np_ecn_marked_roce_packets", "rx_icrc_encapsulated", "req_cqe_error")
MS = 1_000_000_000


class Sysfs:
    """A /sys with /sys/class/infiniband/<dev> -> ../../devices/pci.../infiniband/<dev>."""

    def __init__(self, root: Path):
        self.root = root

    def device(self, dev: str, ports=(1,), link_layer="InfiniBand", state="4: ACTIVE", pci="0000:3b:00.0",
               bus="pci0000:3a", numa=0):
        """`pci`: the device's address, after the bridges above it ("0000:3a:00.0/0000:3b:00.0")."""
        real = self.root / "devices" / bus / pci / "infiniband" / dev
        for p in ports:
            d = real / "ports" / str(p)
            (d / "counters").mkdir(parents=True)
            (d / "hw_counters").mkdir()
            (d / "hw_counters" / "lifespan").write_text("10\n")
            (d / "state").write_text(f"{state}\n")
            (d / "phys_state").write_text("5: LinkUp\n")
            (d / "rate").write_text("200 Gb/sec (4X HDR)\n")
            (d / "link_layer").write_text(f"{link_layer}\n")
            self.set(dev, p, {n: 0 for n in PMA}, {n: 0 for n in HW})
        (real / "device").symlink_to(Path("..") / ".." / ".." / real.parent.parent.name)
        (real.parent.parent / "numa_node").write_text(f"{numa}\n")
        cls = self.root / "class" / "infiniband"
        cls.mkdir(parents=True, exist_ok=True)
        (cls / dev).symlink_to(Path("..") / ".." / real.relative_to(self.root))

    def gpu(self, pci: str, bus: str, numa: int, uuid: str, proc: Path):
        """An NVIDIA GPU at `pci` (bridges first, as for device), in /sys/bus/pci/devices, and
        the driver's /proc/driver/nvidia/gpus/<address>/information."""
        real = self.root / "devices" / bus / pci
        real.mkdir(parents=True)
        for name, text in (("vendor", "0x10de"), ("class", "0x030200"), ("numa_node", str(numa))):
            (real / name).write_text(f"{text}\n")
        addr = real.name
        link = self.root / "bus" / "pci" / "devices" / addr
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path("..") / ".." / ".." / real.relative_to(self.root))
        info = proc / "driver" / "nvidia" / "gpus" / addr
        info.mkdir(parents=True)
        (info / "information").write_text(f"Model: \t\t NVIDIA H100\nGPU UUID: \t {uuid}\nBus Location: \t {addr}\n")

    def numa_nodes(self, cpulists: list[str]):
        for i, cpus in enumerate(cpulists):
            d = self.root / "devices" / "system" / "node" / f"node{i}"
            d.mkdir(parents=True)
            (d / "cpulist").write_text(f"{cpus}\n")

    def set(self, dev: str, port: int, counters=None, hw=None):
        d = self.root / "class" / "infiniband" / dev / "ports" / str(port)
        if not d.exists():
            d = next((self.root / "devices").rglob(f"infiniband/{dev}")) / "ports" / str(port)
        for kind, vals in (("counters", counters or {}), ("hw_counters", hw or {})):
            for name, v in vals.items():
                (d / kind / name).write_text(f"{v}\n")

    def remove(self, dev: str):
        link = self.root / "class" / "infiniband" / dev
        shutil.rmtree(link.resolve())
        link.unlink()


@pytest.fixture
def sysfs(tmp_path):
    return Sysfs(tmp_path / "sys")


def rows_of(got):
    return {(d, p, n): (v, iv) for d, p, n, v, iv in got}


def test_every_counter_is_read_and_its_rise_per_interval_recorded(sysfs):
    sysfs.device("mlx5_0", ports=(1, 2))
    s = RdmaSampler(sysfs.root)
    assert s.sample(10 * MS) == []                     # the first read is the baseline
    sysfs.set("mlx5_0", 1, {n: i + 1 for i, n in enumerate(PMA)}, {n: 100 + i for i, n in enumerate(HW)})
    got = rows_of(s.sample(11 * MS))
    for i, n in enumerate(PMA):
        words = n in ("port_xmit_data", "port_rcv_data")
        assert got[("mlx5_0", 1, n)] == ((i + 1) * (4 if words else 1), MS), n
    for i, n in enumerate(HW):
        assert got[("mlx5_0", 1, n)] == (100 + i, MS), n
    assert not [k for k in got if k[1] == 2]           # nothing rose on port 2: no row
    assert "lifespan" not in {k[2] for k in got}
    ports = s.port_rows()
    assert [(p["device"], p["port"], p["state"], p["rate"], p["link_layer"]) for p in ports] == [
        ("mlx5_0", 1, "4: ACTIVE", "200 Gb/sec (4X HDR)", "InfiniBand"),
        ("mlx5_0", 2, "4: ACTIVE", "200 Gb/sec (4X HDR)", "InfiniBand")]


def test_a_cleared_counter_counts_from_zero_and_a_q_counter_wraps_at_32_bits(sysfs):
    sysfs.device("mlx5_0")
    sysfs.set("mlx5_0", 1, {"port_rcv_errors": 500}, {"out_of_sequence": (1 << 32) - 10, "np_cnp_sent": 900})
    s = RdmaSampler(sysfs.root)
    s.sample(0)
    sysfs.set("mlx5_0", 1, {"port_rcv_errors": 7}, {"out_of_sequence": 5, "np_cnp_sent": 3})
    got = rows_of(s.sample(MS))
    assert got[("mlx5_0", 1, "port_rcv_errors")][0] == 7      # perfquery -R: counts since the clear
    assert got[("mlx5_0", 1, "out_of_sequence")][0] == 15     # 32-bit Q counter wrapped
    assert got[("mlx5_0", 1, "np_cnp_sent")][0] == 3          # a 64-bit counter went down: cleared


def test_a_port_counter_at_its_maximum_is_reported_saturated(sysfs):
    sysfs.device("mlx5_0")
    sysfs.set("mlx5_0", 1, {"symbol_error": 65530, "link_downed": 255})
    s = RdmaSampler(sysfs.root)
    s.sample(0)
    assert s.port_rows()[0]["saturated"] == "link_downed"
    sysfs.set("mlx5_0", 1, {"symbol_error": 65535})
    assert rows_of(s.sample(MS))[("mlx5_0", 1, "symbol_error")][0] == 5
    assert s.port_rows()[0]["saturated"] == "link_downed,symbol_error"
    sysfs.set("mlx5_0", 1, {"symbol_error": 65535, "link_downed": 0})
    assert s.sample(2 * MS) == []
    assert s.port_rows()[0]["saturated"] == "symbol_error"


def test_a_device_that_disappears_starts_over_from_a_new_baseline(sysfs):
    sysfs.device("mlx5_0")
    sysfs.device("mlx5_1")
    s = RdmaSampler(sysfs.root)
    s.sample(0)
    sysfs.remove("mlx5_1")
    sysfs.set("mlx5_0", 1, hw={"out_of_sequence": 4})
    assert set(rows_of(s.sample(MS))) == {("mlx5_0", 1, "out_of_sequence")}
    sysfs.device("mlx5_1")                      # back (a driver reload), counters from zero
    sysfs.set("mlx5_1", 1, hw={"out_of_sequence": 9})
    assert s.sample(2 * MS) == []               # a baseline again, not 9 - (old value)
    sysfs.set("mlx5_1", 1, hw={"out_of_sequence": 12})
    assert rows_of(s.sample(3 * MS)) == {("mlx5_1", 1, "out_of_sequence"): (3, MS)}


def test_unreadable_counters_and_a_missing_class_folder_give_no_rows_and_no_error(sysfs, tmp_path):
    assert RdmaSampler(tmp_path / "nothing").sample() == []
    sysfs.device("mlx5_0")
    sysfs.set("mlx5_0", 1, {"symbol_error": "N/A (no PMA)"})
    s = RdmaSampler(sysfs.root)
    s.sample(0)
    sysfs.set("mlx5_0", 1, {"symbol_error": "N/A (no PMA)", "link_downed": 1})
    assert rows_of(s.sample(MS)) == {("mlx5_0", 1, "link_downed"): (1, MS)}


def test_counter_delta_and_saturation_rules():
    assert counter_delta("port_xmit_wait", "counters", 10, 25) == 15
    assert counter_delta("port_xmit_wait", "counters", (1 << 32) - 5, 3) == 3      # PortCounters never wrap
    assert counter_delta("vport_packet_seq_err", "hw_counters", (1 << 32) - 1, 0) == 1
    assert counter_delta("packet_seq_err", "hw_counters", 1000, 10) == 10          # cleared, not wrapped
    assert saturated("excessive_buffer_overrun_errors", "counters", 15)
    assert saturated("port_xmit_data", "counters", (1 << 32) - 1)
    assert not saturated("port_xmit_data", "counters", 1 << 32)                   # extended (64-bit)
    assert not saturated("out_of_sequence", "hw_counters", (1 << 32) - 1)


# NCCL_IB_HCA: the examples of NCCL's env.rst, and parseStringList/matchIfList's edges
DEVS = [(d, p) for d in ("mlx5_0", "mlx5_1", "mlx5_4", "mlx5_10", "mlx4_0") for p in (1, 2)]


def used(text):
    f = parse_ib_hca(text)
    return sorted(k for k in DEVS if f.matches(*k))


def test_ib_hca_prefix_exact_port_and_exclusion():
    assert used("mlx5") == sorted(k for k in DEVS if k[0].startswith("mlx5"))
    assert used("=mlx5_0:1,mlx5_1:1") == [("mlx5_0", 1), ("mlx5_1", 1)]
    assert used("^=mlx5_1,mlx5_4") == sorted(k for k in DEVS if k[0] not in ("mlx5_1", "mlx5_4"))
    assert used("mlx5_1") == [("mlx5_1", 1), ("mlx5_1", 2), ("mlx5_10", 1), ("mlx5_10", 2)]
    assert used("=mlx5_1") == [("mlx5_1", 1), ("mlx5_1", 2)]
    assert used("=mlx5_0::0:0,mlx5_1::0:1") == [("mlx5_0", 1), ("mlx5_0", 2), ("mlx5_1", 1), ("mlx5_1", 2)]
    assert used("=mlx5_0:2:0:0") == [("mlx5_0", 2)]
    assert used("^mlx5_0:1") == sorted(k for k in DEVS if k != ("mlx5_0", 1))


def test_ib_hca_edges_as_nccl_parses_them():
    assert used("") == sorted(DEVS)                       # set but empty: no filter
    assert used(",,=mlx5_0,,") == []                      # '=' only counts first: a name "=mlx5_0"
    assert used(",,mlx5_4,,") == [("mlx5_4", 1), ("mlx5_4", 2)]   # empty entries skipped
    assert used(":1,mlx4") == [("mlx4_0", 1), ("mlx4_0", 2)]     # an entry with no name is skipped
    assert used("=mlx5_0:x") == []                        # atoi("x") is port 0: no port has it
    assert used("=mlx5_0: 2") == [("mlx5_0", 2)]          # atoi skips leading blanks
    assert used("=^mlx5_0") == []                         # '^' only counts first
    assert used("^") == []                                # an empty list matches all, then excluded
    f = parse_ib_hca(",".join(f"mlx5_{i}" for i in range(40)))
    assert len(f.entries) == 32                           # NCCL reads MAX_IB_DEVS entries


def _ports(sysfs: Sysfs, s: RdmaSampler):
    s.sample(0)
    return list(s.ports.values())


def test_ports_from_nccl_ib_hca_then_from_open_uverbs_devices(sysfs, tmp_path):
    sysfs.device("mlx5_0")
    sysfs.device("mlx5_1", ports=(1, 2))
    sysfs.device("mlx5_2", link_layer="Ethernet")
    sysfs.device("mlx5_3", state="1: DOWN")
    sysfs.device("mlx5_4", state="5: ACTIVE_DEFER")
    ports = _ports(sysfs, RdmaSampler(sysfs.root))
    verbs = sysfs.root / "class" / "infiniband_verbs"
    for i, (dev, devno) in enumerate((("mlx5_0", "231:192"), ("mlx5_1", "231:193"), ("mlx5_2", "1:3"))):
        (verbs / f"uverbs{i}").mkdir(parents=True)
        (verbs / f"uverbs{i}" / "ibdev").write_text(f"{dev}\n")
        (verbs / f"uverbs{i}" / "dev").write_text(f"{devno}\n")
    proc = tmp_path / "proc"
    (proc / "42" / "fd").mkdir(parents=True)
    os.symlink("/dev/null", proc / "42" / "fd" / "0")
    # a container's /dev/infiniband/uverbs7 that is the host's uverbs2 (device 1:3, here /dev/null)
    cdev = tmp_path / "ctr" / "dev" / "infiniband"
    cdev.mkdir(parents=True)
    os.symlink("/dev/null", cdev / "uverbs7")
    os.symlink(cdev / "uverbs7", proc / "42" / "fd" / "5")
    # one whose device number is unknown here: matched by name
    os.symlink("/dev/infiniband/uverbs1", proc / "42" / "fd" / "6")
    assert uverbs_devices(42, proc, sysfs.root) == ["mlx5_1", "mlx5_2"]
    got, how = rank_ports(42, {}, ports, proc, sysfs.root)
    assert how == "uverbs" and [(p.device, p.port) for p in got] == [("mlx5_1", 1), ("mlx5_1", 2), ("mlx5_2", 1)]
    got, how = rank_ports(42, {"NCCL_IB_HCA": "=mlx5_0,mlx5_1:2,mlx5_3,mlx5_4"}, ports, proc, sysfs.root)
    assert how == "NCCL_IB_HCA" and [(p.device, p.port) for p in got] == [("mlx5_0", 1), ("mlx5_1", 2)]
    assert rank_ports(43, {}, ports, proc, sysfs.root) == ([], None)


def test_rank_rows_say_how_each_was_mapped_and_retry_the_unknown(sysfs, tmp_path):
    sysfs.device("mlx5_0")
    sysfs.device("mlx5_1")
    s = RdmaSampler(sysfs.root)
    s.sample(0)
    proc = tmp_path / "proc"
    (proc / "8" / "fd").mkdir(parents=True)
    procs = [(7, 0, {"NCCL_IB_HCA": "=mlx5_1"}), (8, 1, {})]
    assert s.rank_rows(procs, proc) == [{"pid": 7, "rank": 0, "device": "mlx5_1", "port": 1, "source": "NCCL_IB_HCA"}]
    verbs = sysfs.root / "class" / "infiniband_verbs" / "uverbs0"
    verbs.mkdir(parents=True)
    (verbs / "ibdev").write_text("mlx5_0\n")
    os.symlink("/dev/infiniband/uverbs0", proc / "8" / "fd" / "9")    # opened at its NCCL init
    assert s.rank_rows(procs, proc)[1] == {"pid": 8, "rank": 1, "device": "mlx5_0", "port": 1, "source": "uverbs"}


def _two_sockets(sysfs: Sysfs, proc: Path) -> list:
    """Two NUMA nodes: on node 0 two PCIe switches, each with a GPU and a NIC; on node 1 a
    switch with a GPU and a NIC, and a GPU on a root port of its own."""
    sysfs.numa_nodes(["0-15", "16-31"])
    for dev, pci, bus, numa in (("mlx5_0", "0000:00:01.0/0000:01:00.0/0000:03:00.0", "pci0000:00", 0),
                                ("mlx5_1", "0000:00:02.0/0000:04:00.0/0000:06:00.0", "pci0000:00", 0),
                                ("mlx5_2", "0000:80:01.0/0000:81:00.0/0000:83:00.0", "pci0000:80", 1)):
        sysfs.device(dev, pci=pci, bus=bus, numa=numa)
    for i, (pci, bus, numa) in enumerate((("0000:00:01.0/0000:01:00.0/0000:02:00.0", "pci0000:00", 0),
                                          ("0000:00:02.0/0000:04:00.0/0000:05:00.0", "pci0000:00", 0),
                                          ("0000:80:01.0/0000:81:00.0/0000:82:00.0", "pci0000:80", 1),
                                          ("0000:80:03.0/0000:84:00.0", "pci0000:80", 1))):
        sysfs.gpu(pci, bus, numa, f"GPU-{i}aaa-bbbb", proc)
    return [p for p in _ports(sysfs, RdmaSampler(sysfs.root)) if p.active]


@pytest.mark.parametrize("env,want", [
    ({"LOCAL_RANK": "0"}, ["mlx5_0"]),                       # the NIC behind the GPU's own switch
    ({"LOCAL_RANK": "1"}, ["mlx5_1"]),
    ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "2,3"}, ["mlx5_2"]),   # GPU 3: only its root complex
    ({"LOCAL_RANK": "0", "NVIDIA_VISIBLE_DEVICES": "GPU-1aaa"}, ["mlx5_1"]),   # a container's one GPU, by UUID
    ({"LOCAL_RANK": "3", "NVIDIA_VISIBLE_DEVICES": "1,2", "CUDA_VISIBLE_DEVICES": "1"}, ["mlx5_2"]),
], ids=["gpu0", "gpu1", "cuda-visible", "container-uuid", "visible-twice"])
def test_a_rank_without_ib_hca_or_open_devices_gets_the_nic_nearest_its_gpu(sysfs, tmp_path, env, want):
    proc = tmp_path / "proc"
    active = _two_sockets(sysfs, proc)
    (proc / "9" / "fd").mkdir(parents=True)
    got, how = rank_ports(9, env, active, proc, sysfs.root)
    assert (how, [p.device for p in got]) == ("gpu-pci", want)


def test_without_a_known_gpu_the_nics_on_the_numa_nodes_of_its_cpus_else_none(sysfs, tmp_path):
    proc = tmp_path / "proc"
    active = _two_sockets(sysfs, proc)
    (proc / "9").mkdir(parents=True)
    (proc / "9" / "status").write_text("Name:\tpython\nCpus_allowed_list:\t16-19,24\n")
    # four GPUs and no LOCAL_RANK: which one is the rank's is not known
    assert nearest_ports(9, {}, active, proc, sysfs.root) == ([active[2]], "cpu-numa")
    (proc / "9" / "status").write_text("Name:\tpython\nCpus_allowed_list:\t0-31\n")
    assert nearest_ports(9, {}, active, proc, sysfs.root) == ([], None)
    assert nearest_ports(9, {"CUDA_VISIBLE_DEVICES": "GPU-nope"}, active, proc, sysfs.root) == ([], None)
    s = RdmaSampler(sysfs.root)
    s.sample(0)
    (proc / "9" / "status").write_text("Cpus_allowed_list:\t0-3\n")
    assert s.rank_rows([(9, 4, {"LOCAL_RANK": "2"}), (10, 5, {})], proc) == [
        {"pid": 9, "rank": 4, "device": "mlx5_2", "port": 1, "source": "gpu-pci"}]
