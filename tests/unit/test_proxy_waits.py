"""ingero.analysis.proxy and the network verdict's proxy evidence, on built traces."""

from __future__ import annotations

import math

import duckdb

from ingero import schema
from ingero.analysis.model import RankRow
from ingero.analysis.proxy import add_proxy_waits
from ingero.analysis.verdict import _proxy_evidence


def _rows() -> dict:
    return {r: RankRow(rank=r, node="a" if r < 2 else "b", pod=None, pid=100 + r) for r in range(4)}


def test_each_ranks_send_network_wait_is_summed_from_the_proxy_summaries():
    con = duckdb.connect()
    schema.create_all(con)
    for rank, send, recv in ((0, 5, 900), (1, 120, 800), (1, 80, 0), (2, 6, 700), (3, 9, 750)):
        con.execute("INSERT INTO nccl_proxy (rank, send_net_wait_ns, recv_net_wait_ns) VALUES (?, ?, ?)",
                    [rank, send * 1_000_000, recv * 1_000_000])
    rows = _rows()
    add_proxy_waits(con, rows)
    assert {r: v.net_wait_ms for r, v in rows.items()} == {0: 5.0, 1: 200.0, 2: 6.0, 3: 9.0}
    assert _proxy_evidence(rows, "a") == ("; NCCL's proxy: a's ranks' sends waited up to 200 ms on the network, "
                                          "the other ranks' 8 ms at median")


def test_without_proxy_summaries_nothing_is_added():
    rows = _rows()
    add_proxy_waits(duckdb.connect(), rows)         # a trace without the table
    assert all(v.net_wait_ms is None for v in rows.values())
    assert _proxy_evidence(rows, "a") == ""


def test_a_peer_on_another_node_gets_its_global_rank_once_the_traces_are_merged():
    from ingero.comms import resolve_split_ranks

    con = duckdb.connect()
    schema.create_all(con)
    for node, pid, rank, comm_rank in (("a", 100, 0, 0), ("b", 200, 5, 1)):
        con.execute("INSERT INTO nccl_device_inflight (node, pid, rank, comm_hash, comm_rank) VALUES (?, ?, ?, 7, ?)",
                    [node, pid, rank, comm_rank])
    con.execute("INSERT INTO nccl_proxy (node, rank, comm_hash, peer, peer_rank) VALUES "
                "('a', 0, 7, 1, NULL), ('b', 5, 7, 0, 0), ('a', 0, 7, 3, NULL), ('a', 0, 8, 1, NULL)")
    resolve_split_ranks(con)
    got = con.execute("SELECT rank, comm_hash, peer, peer_rank FROM nccl_proxy ORDER BY ALL").fetchall()
    # peer 3 of communicator 7 and communicator 8 were not traced: still unknown
    assert got == [(0, 7, 1, 5), (0, 7, 3, None), (0, 8, 1, None), (5, 7, 0, 0)]


def test_the_sign_test_is_the_binomial_tail():
    from ingero.analysis.proxy import sign_test

    assert sign_test(0, 0) == 1.0 and sign_test(3, 2) == 0.0
    for k, n in ((5, 10), (72, 72), (1, 72), (1066, 2000), (1500, 2000), (40, 100)):
        exact = sum(math.comb(n, i) for i in range(k, n + 1)) / 2 ** n
        assert abs(sign_test(k, n) - exact) <= 1e-12 * exact, (k, n)


def test_each_ranks_nic_named_by_its_sockets_or_by_the_ports_the_agent_mapped_it_to():
    from ingero.analysis.proxy import rank_nics

    con = duckdb.connect()
    schema.create_all(con)
    con.execute("INSERT INTO nccl_proxy (rank, net, nic_device, nic_index) VALUES "
                "(0, 'socket', 'eth0', NULL), (0, 'socket', 'eth1', NULL), (1, 'socket', NULL, NULL), "
                "(4, 'ib', NULL, 0), (5, 'ib', NULL, 0), (6, 'ib', NULL, 1)")
    con.execute("INSERT INTO rdma_ranks (node, pid, rank, device, port, source) VALUES "
                "('b', 40, 4, 'mlx5_1', 1, 'NCCL_IB_HCA'), ('b', 50, 5, 'mlx5_0', 1, 'uverbs'), "
                "('b', 50, 5, 'mlx5_3', 1, 'uverbs'), ('b', 70, 7, 'mlx5_2', 1, 'gpu-pci')")
    assert rank_nics(con) == {0: "eth0 (its sockets' interface), eth1 (its sockets' interface)",
                              4: "mlx5_1 port 1 (NCCL_IB_HCA)",
                              5: "mlx5_0 port 1 (uverbs), mlx5_3 port 1 (uverbs)"}
    assert rank_nics(duckdb.connect()) == {}         # no proxy table: nothing said


def _lab_sends(case: str):
    """The sends between nodes of a GPU-like lab run traced with NCCL probes only (2 nodes x 2
    ranks; ranks 0, 1 on lab-node-a), beside 2-3 busy processes on a machine at load 30-47:
    "slow-link", lab-node-a's data out at 100 Mbit/s (victim rank 1), and "clean"."""
    from pathlib import Path

    from ingero.analysis.proxy import proxy_sends

    con = duckdb.connect()
    schema.create_all(con)
    con.execute("""INSERT INTO nccl_proxy BY NAME SELECT * EXCLUDE (case_, node), true AS is_send
                   FROM read_csv(?) WHERE case_ = ?""",
                [str(Path(__file__).parent / "fixtures" / "lab-proxy-sends.csv"), case])
    return proxy_sends(con)


def test_a_slowed_link_is_named_though_the_acknowledgements_slow_the_other_way_too():
    """Rank 1's data crosses the slowed link; rank 3's sends into its node wait too (2.5x less
    over the run: a ratio of totals against the peers' would miss it), but in every one of
    the operations where either waited, rank 1 waited longer."""
    from ingero.analysis.proxy import net_wait_outliers, paired_waits

    sends = _lab_sends("slow-link")
    total = {r: sends.wait[sends.rank == r].sum() / 1e6 for r in (1, 3)}
    assert 2 < total[1] / total[3] < 3, total
    got = net_wait_outliers(sends)
    assert list(got) == [1], paired_waits(sends)
    assert (got[1].longer, got[1].decided) == (78, 78) and got[1].excess_ms > 4000, got[1]


def test_a_clean_job_on_a_busy_machine_waits_as_long_both_ways():
    """The same job without the fault, its cross-node sends waiting 1.8-2.0 s each under the
    load: the longer waiter changes from operation to operation."""
    from ingero.analysis.proxy import net_wait_outliers, paired_waits

    sends = _lab_sends("clean")
    paired = paired_waits(sends)
    assert set(paired) == {1, 3} and all(w.mine_ms > 1500 for w in paired.values()), paired
    assert net_wait_outliers(sends) == {}, paired
