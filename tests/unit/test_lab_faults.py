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
