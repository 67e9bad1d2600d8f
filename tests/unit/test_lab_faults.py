"""Lab fault plans, nft rules and naming: pure logic, no root."""

from __future__ import annotations

from pathlib import Path

import pytest

from ingero.errors import IngeroError
from ingero.lab import faults
from ingero.lab.netns import LabNetwork, node_name, subnet_index


def test_loss_rules_drop_only_tcp_data_segments_on_the_victim_port():
    rules = faults.nft_loss_ruleset("p1", 5)
    assert 'ingress device "p1"' in rules
    drops = [line for line in rules.splitlines() if "drop" in line]
    assert len(drops) == 2  # IPv4 and IPv6
    for line in drops:
        assert "tcp flags & (syn | fin | rst) == 0" in line and "numgen random mod 100 < 5" in line
    assert "ip length > 80" in drops[0] and "ip6 length > 60" in drops[1]


@pytest.mark.parametrize("bad", [0, -1, 101])
def test_loss_percent_out_of_range_is_a_user_error(bad):
    with pytest.raises(IngeroError, match="--loss-percent"):
        faults.nft_loss_ruleset("p1", bad)


def test_slow_link_shapes_only_tcp_data_segments_leaving_the_victim_node():
    tc, nft = faults.slow_link_setup("eth0", 100)
    assert tc[0][-6:] == ["root", "handle", "1:", "htb", "default", "10"], tc
    assert tc[2][tc[2].index("classid") + 1] == faults.SLOW_CLASS and tc[2][-4:] == ["rate", "100mbit",
                                                                                      "ceil", "100mbit"]
    marks = [line for line in nft.splitlines() if "priority set" in line]
    assert len(marks) == 2 and all(f"meta priority set {faults.SLOW_CLASS}" in m and 'oifname "eth0"' in m
                                   and "tcp flags & (syn | fin | rst) == 0" in m for m in marks)
    assert "ip length > 80" in marks[0] and "ip6 length > 60" in marks[1]     # no pure ACK is shaped
    with pytest.raises(IngeroError, match="--rate-mbit"):
        faults.slow_link_setup("eth0", 0)


def test_slow_rank_and_io_stall_change_only_the_victim(tmp_path: Path):
    slow = faults.plan_ranks("slow-rank", 4, 3, compute_ms=40, slow_factor=2, io_mb=8, io_dir=tmp_path)
    assert float(slow[3].env["INGERO_LAB_COMPUTE_MS"]) == 80.0 and len(slow[3].env) == 1
    assert all(not slow[r].env for r in range(3))
    io = faults.plan_ranks("io-stall", 4, 1, compute_ms=40, slow_factor=2, io_mb=8, io_dir=tmp_path)
    assert io[1].env == {"INGERO_LAB_IO_MB": "8", "INGERO_LAB_IO_DIR": str(tmp_path)}
    assert all(not io[r].env for r in (0, 2, 3))


def test_cpu_hog_pins_the_victim_apart_from_the_other_ranks(tmp_path: Path):
    import os
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    plan = faults.plan_ranks("cpu-hog", 4, 2, compute_ms=40, slow_factor=2, io_mb=8, io_dir=tmp_path)
    victim_cpu = plan[2].cpus
    others = {plan[r].cpus for r in (0, 1, 3)}
    assert len(others) == 1 and victim_cpu not in others.pop().split(",")


def test_unknown_scenario_is_a_user_error(tmp_path: Path):
    with pytest.raises(IngeroError, match="unknown scenario"):
        faults.plan_ranks("meteor", 2, 1, compute_ms=40, slow_factor=2, io_mb=8, io_dir=tmp_path)


def test_nodes_get_letters_and_per_run_addresses():
    assert [node_name(i) for i in (0, 1, 25, 26)] == ["lab-node-a", "lab-node-b", "lab-node-z", "lab-node-26"]
    net = LabNetwork("0000ff", 3)
    k = subnet_index("0000ff")
    assert 1 <= k <= 250
    assert [n.ipv4 for n in net.nodes] == [f"10.213.{k}.{i}" for i in (1, 2, 3)]
    assert net.nodes[1].ipv6 == f"fd00:1a6e:{k:x}::2"
    assert net.nodes[0].netns == "ingero-0000ff-lab-node-a" and net.switch == "ingero-0000ff-sw"


def test_layout_parses_in_any_order_and_must_match_the_lab():
    from ingero.lab.faults import parse_layout, stage_of

    assert parse_layout("tp=2,pp=2,dp=2", 8) == (2, 2, 2)
    assert parse_layout("dp=2, pp=4", 8) == (1, 4, 2)
    assert parse_layout(None, 4) is None
    for bad, why in (("tp=2,pp=2", "has 4 ranks but the lab has 8"), ("tp=0,pp=8", "positive integers"),
                     ("xp=2", "positive integers"), ("tp2", "positive integers")):
        with pytest.raises(IngeroError, match=why):
            parse_layout(bad, 8)
    # Megatron's order: tensor fastest, then pipeline, then data
    assert [stage_of(r, (2, 2, 2)) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [stage_of(r, (1, 4, 2)) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_slow_stage_slows_every_rank_of_that_stage_and_imbalance_every_rank(tmp_path):
    from ingero.lab.faults import plan_ranks

    kw = dict(compute_ms=40.0, slow_factor=1.5, io_mb=8, io_dir=tmp_path)
    plans = plan_ranks("slow-stage", 8, 7, layout=(2, 2, 2), stage=1, **kw)
    slow = sorted(r for r, p in plans.items() if p.env.get("INGERO_LAB_COMPUTE_MS") == "60.0")
    assert slow == [2, 3, 6, 7] and all(not plans[r].env for r in (0, 1, 4, 5))
    plans = plan_ranks("imbalance", 8, 7, layout=(2, 2, 2), imbalance=0.5, **kw)
    assert all(p.env == {"INGERO_LAB_IMBALANCE": "0.5"} for p in plans.values())
    with pytest.raises(IngeroError, match="needs a pipeline"):
        plan_ranks("slow-stage", 8, 7, layout=(8, 1, 1), **kw)
    with pytest.raises(IngeroError, match="--stage 2 is out of range"):
        plan_ranks("slow-stage", 8, 7, layout=(2, 2, 2), stage=2, **kw)


def test_a_hang_without_fault_after_stops_its_rank_once_the_job_runs():
    from ingero.lab.runner import LabConfig, LabRun

    assert LabRun(LabConfig(scenario="hang")).cfg.fault_after_s == faults.HANG_AFTER_S
    assert LabRun(LabConfig(scenario="hang", fault_after_s=2.0)).cfg.fault_after_s == 2.0


def test_hang_stops_a_middle_rank_by_default_and_others_the_last():
    assert faults.default_victim("hang", 4) == 2 and faults.default_victim("hang", 8) == 4
    assert faults.default_victim("slow-rank", 4) == 3


@pytest.mark.parametrize("kw, msg", [
    ({"scenario": "clean", "hang_s": 5.0}, "--hang-for needs --scenario hang"),
    ({"scenario": "hang", "fault_after_s": 2.0, "hang_s": 0.0}, "--hang-for"),
    ({"scenario": "hang", "fault_after_s": 2.0, "timeout_s": 0}, "--timeout 0"),
    ({"scenario": "hang", "fault_after_s": 2.0, "hang_mode": "sleep", "hang_s": 5.0}, "--hang-mode stop"),
    ({"scenario": "hang", "fault_after_s": 2.0, "hang_mode": "nap"}, "--hang-mode 'nap'"),
])
def test_hang_settings_are_checked(kw, msg):
    from ingero.lab.runner import LabConfig, LabRun

    with pytest.raises(IngeroError, match=msg):
        LabRun(LabConfig(**kw))


def test_a_sleeping_hang_makes_only_the_victim_compute_for_a_day_from_the_fault(tmp_path):
    plans = faults.plan_ranks("hang", 4, 2, compute_ms=40, slow_factor=2, io_mb=8, io_dir=tmp_path,
                              delayed=True, hang_mode="sleep")
    assert plans[2].env == {"INGERO_LAB_FAULT_COMPUTE_MS": str(faults.HANG_SLEEP_MS)}
    assert all(not plans[r].env for r in (0, 1, 3))
    assert not faults.plan_ranks("hang", 4, 2, compute_ms=40, slow_factor=2, io_mb=8, io_dir=tmp_path,
                                 delayed=True)[2].env


def test_signal_pod_signals_every_process_of_the_cgroup(tmp_path, monkeypatch):
    import signal
    import subprocess

    p = subprocess.Popen(["sleep", "30"])
    try:
        monkeypatch.setattr(faults.cgroups, "procs", lambda cg: [p.pid] if cg == tmp_path else [])
        assert faults.signal_pod(tmp_path, signal.SIGSTOP) == [p.pid]
        import time

        deadline = time.monotonic() + 5   # the signal is delivered when the process next runs
        while Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            assert time.monotonic() < deadline, "the process did not stop"
            time.sleep(0.01)
        faults.signal_pod(tmp_path, signal.SIGCONT)
    finally:
        p.kill()
        p.wait()
