"""Whole lab runs as root: network namespaces, pod cgroups, faults and clean-up.

Skipped when not root. About 25 s in all.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ingero.errors import IngeroError
from ingero.lab import cgroups
from ingero.lab.netns import offloads
from ingero.lab.runner import LabConfig, LabRun

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, cgroups)")

REPO = Path(__file__).resolve().parents[2]


def running(pid: int) -> bool:
    """pid exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def leftovers(run_id: str) -> list[str]:
    ns = [n for n in os.listdir("/run/netns") if run_id in n] if os.path.isdir("/run/netns") else []
    cg = [str(cgroups.run_cgroup(run_id))] if cgroups.run_cgroup(run_id).exists() else []
    return ns + cg


def test_clean_run_puts_ranks_in_pod_cgroups_finishes_in_lockstep_and_leaves_nothing(tmp_path):
    cfg = LabConfig(scenario="clean", seconds=5, out_dir=tmp_path, compute_ms=20)
    with LabRun(cfg, log=lambda m: None) as lab:
        node_b = lab.nodes[1]
        proc, pod = lab.run_in_node("lab-node-b", ["ip", "-4", "addr", "show", "eth0"],
                                    stdout=subprocess.PIPE, name="probe")
        assert node_b.ipv4 in proc.communicate(timeout=10)[0].decode()
        pods_b = json.loads(lab.pods_file(node_b).read_text())
        assert pods_b["cgroup_root"] == str(cgroups.node_cgroup_root(lab.run_id, "lab-node-b"))
        assert [p["rank"] for p in pods_b["pods"] if "rank" in p] == [2, 3]
        assert "probe" in [p["name"] for p in pods_b["pods"]]
        lab.start_ranks()
        for rp in lab.ranks:
            rel = "/" + str(rp.pod.cgroup.relative_to(cgroups.CGROUP_ROOT))
            assert f"0::{rel}\n" in Path(f"/proc/{rp.proc.pid}/cgroup").read_text()
            assert f"kubepods-besteffort-pod{rp.pod.uid.replace('-', '_')}.slice" in rel
        codes = lab.wait()
        run_id = lab.run_id
    assert codes == {0: 0, 1: 0, 2: 0, 3: 0}
    steps = {rp.stats["steps"] for rp in lab.ranks}
    assert len(steps) == 1 and steps.pop() > 20
    report = json.loads((tmp_path / "lab.json").read_text())
    assert report["ended_ns"] > report["started_ns"] and [r["exit_code"] for r in report["ranks"]] == [0] * 4
    assert leftovers(run_id) == []


def test_lossy_link_makes_retransmits_on_the_victim_node_only(tmp_path):
    cfg = LabConfig(scenario="lossy-link", seconds=5, loss_percent=5, out_dir=tmp_path, compute_ms=20)
    with LabRun(cfg, log=lambda m: None) as lab:
        ends = [(n.netns, "eth0") for n in lab.nodes] + [(lab.net.switch, lab.net.port(n)) for n in lab.nodes]
        states = {end: offloads(*end) for end in ends}
        lab.start_ranks()
        codes = lab.wait()
        run_id = lab.run_id
    assert set(codes.values()) == {0}
    # segmentation/receive offloads off on both ends of every veth ...
    assert all(st == {"gso": False, "tso": False, "gro": False} for st in states.values()), states
    tcp = lab.notes["node_tcp"]
    victim, other = tcp["lab-node-b"]["retrans_segs"], tcp["lab-node-a"]["retrans_segs"]
    dropped = tcp["switch"]["nft_dropped"]
    assert dropped > 0
    assert victim > 50 and victim > 10 * max(other, 1), tcp
    # ... so each drop is one segment: with GSO a drop took a ~64 KB super-packet, and the
    # victim retransmitted dozens of segments per dropped packet
    assert victim <= 3 * dropped, tcp
    assert lab.times["fault_injected_ns"] >= lab.times["started_ns"]
    assert leftovers(run_id) == []


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_sigint_to_lab_run_removes_namespaces_and_cgroups(tmp_path):
    # started as a terminal starts its foreground job, SIGINT at its default: a process that
    # inherits SIGINT ignored keeps it ignored (Python too), and this worker's may be (some
    # in-process code of an earlier test left it so)
    proc = subprocess.Popen([sys.executable, "-m", "ingero", "lab", "run", "--scenario", "cpu-hog",
                             "--seconds", "60", "--out", str(tmp_path)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_sigint_default)
    run_id = None
    for line in proc.stdout:        # the lab's build and network come first: minutes on a busy machine
        run_id = run_id or line.split()[1].rstrip(":")
        if "rank 3 started" in line:
            break
    else:
        raise AssertionError(f"lab run {run_id} ended before its ranks started (exit {proc.wait()})")
    time.sleep(1.5)
    assert leftovers(run_id), "the run should be up before the interrupt"
    # this run's own processes (ranks and busy loops), not every busy loop on the machine
    run_cg = cgroups.run_cgroup(run_id)
    pids = {int(p) for f in run_cg.rglob("cgroup.procs") for p in f.read_text().split()}
    assert len(pids) >= 4 + 8, pids    # four ranks and the default eight hogs
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGINT, (signal.getsignal(signal.SIGINT), rest)
    assert leftovers(run_id) == []
    assert [p for p in pids if running(p)] == []


def test_background_load_runs_beside_the_job_unpinned_and_is_removed_with_the_run(tmp_path):
    cfg = LabConfig(scenario="clean", seconds=2, out_dir=tmp_path, compute_ms=20, background_load=3)
    with LabRun(cfg, log=lambda m: None) as lab:
        cg = cgroups.run_cgroup(lab.run_id) / "background-load"
        pids = [int(p) for p in (cg / "cgroup.procs").read_text().split()]
        allowed = [len(os.sched_getaffinity(p)) for p in pids]
        lab.start_ranks()
        codes = lab.wait()
        run_id = lab.run_id
    assert set(codes.values()) == {0}
    assert len(pids) >= 3 and all(n == os.cpu_count() for n in allowed), (pids, allowed)
    assert [p for p in pids if running(p)] == [] and leftovers(run_id) == []


def test_background_load_out_of_range_is_refused_with_the_range(tmp_path):
    with pytest.raises(IngeroError, match="--background-load 65 is out of range"):
        LabRun(LabConfig(out_dir=tmp_path, background_load=65))


def test_the_cpu_hog_weighs_against_its_victim_only_and_its_cpu_group_is_removed():
    """The hogs and the victim share one cgroup v1 cpu group (cpu.shares 16:1 inside it), so
    the lab as a whole weighs one session on the machine and a run beside it keeps its CPU."""
    if not (cgroups.CPU_V1_ROOT / "cpu.shares").exists():
        pytest.skip(f"no cgroup v1 cpu controller at {cgroups.CPU_V1_ROOT}: the hogs' weight is their session's")
    from ingero.lab import faults

    run_id = "t" + os.urandom(3).hex()
    group = cgroups.cpu_share_group(run_id, {"victim": 1024, "hogs": 16 * 1024})
    hogs_cg = cgroups.make_plain(run_id, "hogs")
    victim = subprocess.Popen(["sh", "-c", 'echo $$ > "$0" && exec sleep 30', str(group["victim"] / "cgroup.procs")])
    procs, done = faults.start_hogs(2, str(sorted(os.sched_getaffinity(0))[-1]), hogs_cg, 16.0, share=group["hogs"])
    try:
        deadline = time.monotonic() + 5
        while len(cgroups.procs(group["hogs"])) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(cgroups.procs(group["hogs"])) == 3          # the leader and its 2 loops
        assert victim.pid in cgroups.procs(group["victim"])
        assert done["cpu_shares"] == 16 * 1024 and "autogroup_nice" not in done, done
        assert int((group["hogs"] / "cpu.shares").read_text()) == 16 * int((group["victim"] / "cpu.shares").read_text())
    finally:
        faults.stop_hogs(procs)
        victim.kill()
        victim.wait()
        for p in procs:
            p.wait()
        errors = cgroups.remove_cpu_group(run_id) + cgroups.remove_tree(cgroups.run_cgroup(run_id))
    assert errors == [] and not (cgroups.CPU_V1_ROOT / f"{cgroups.RUN_PREFIX}{run_id}").exists()
