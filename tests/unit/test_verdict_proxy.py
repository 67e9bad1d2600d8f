"""NCCL's proxy send waits as the only network evidence (no TCP probe, no NIC counter), on
simulated jobs judged along the operator's path.

The jobs are test_verdict_rdma's (``bench.synthetic.pipeline_session``: 2 nodes, tp2 pp2 dp2). Its network
fault slows every transfer that crosses the lossy node's link and writes TCP retransmits
inside those transfers; here the retransmits are taken away and the plugin's proxy
summaries carry the loss instead, as the tracer writes nccl_proxy rows: every rank's sends
wait 50 us on the network in an operation every 4 ms, and a send of the rank that owned each
retransmit waits `loss_ms` around it in that slot's operation (a stalled IB work request, or
a resent segment)."""

from __future__ import annotations

import re

import duckdb
import numpy as np
import pytest

from ingero import schema
from ingero.store import SegmentWriter
from tests.unit.test_verdict_rdma import _job, _judge   # the same job (loss_ms 3), judged as the operator does

LOSS_MS = 3.0
COMM = 0x1A2B3C4D5E6F7081


def _column(seg, table: str, cols: str) -> dict:
    files = sorted(str(f) for f in (seg / table).glob("*.parquet"))
    return duckdb.sql(f"SELECT {cols} FROM read_parquet({files}) ORDER BY 1").fetchnumpy()


def _proxy(tmp_path, gt, stalls: dict) -> None:
    """Every node's TCP retransmits gone, its ranks' send ProxyOps written: the 50 us baseline,
    and a LOSS_MS wait at each (time, rank) of `stalls` ({node: (times, ranks)})."""
    for i, node in enumerate(gt["nodes"]):
        seg = tmp_path / "work" / "nodes" / node
        span = _column(seg, "nccl_events", "timestamp_ns")["timestamp_ns"]
        for f in (seg / "tcp_events").glob("*.parquet"):
            f.unlink()
        ranks = [r for r in range(8) if r // 4 == i]
        t = np.arange(span[0], span[-1], 4_000_000)
        ts, rk = [np.tile(t, len(ranks))], [np.repeat(ranks, len(t))]
        seq = [np.tile(np.arange(len(t)), len(ranks))]       # the operation: every rank's send of a slot
        wait, dur = [np.full(len(t) * len(ranks), 50_000)], [np.full(len(t) * len(ranks), 200_000)]
        if node in stalls:
            at, who = stalls[node]
            ts.append(at - 1_000_000)
            rk.append(who)
            seq.append(np.searchsorted(t, at - 1_000_000, side="right") - 1)
            wait.append(np.full(len(at), int(LOSS_MS * 1e6)))
            dur.append(np.full(len(at), int(LOSS_MS * 1e6) + 1_000_000))
        n = sum(len(x) for x in ts)
        w = SegmentWriter(seg, node=node, session_id="pipeline")
        w.append("nccl_proxy", {"event_id": schema.node_prefix(node) + np.arange(n, dtype=np.uint64),
                                "timestamp_ns": np.concatenate(ts), "duration_ns": np.concatenate(dur),
                                "rank": np.concatenate(rk), "is_send": [True] * n, "net": ["ib"] * n,
                                "comm_hash": [COMM] * n, "op": ["ALL_REDUCE"] * n, "seq": np.concatenate(seq),
                                "steps": [4] * n,
                                "send_net_wait_ns": np.concatenate(wait)})
        w.close()


def test_sends_waiting_on_the_network_name_the_lossy_node_with_its_transport(tmp_path):
    gt = _job(tmp_path, "network")
    node = gt["lossy_node"]
    retx = _column(tmp_path / "work" / "nodes" / node, "tcp_events", "timestamp_ns, rank")
    assert len(retx["timestamp_ns"]) > 20
    _proxy(tmp_path, gt, {node: (retx["timestamp_ns"], retx["rank"])})
    rep = _judge(tmp_path, gt)
    assert rep.retransmits == 0
    s = rep.straggler
    assert s is not None and (s.cause, s.node) == ("network", node), (s, rep.best_candidate)
    assert re.search(r"NCCL's proxy: ranks? [\d, ]+'s sends waited \d+ ms on the network \(ProxyStep SendWait\)",
                     s.evidence), s.evidence
    assert f"NCCL's transport per communicator of these ranks (proxy): {COMM:016x} NET/IB" in s.evidence, s.evidence
    assert s.saving_ms_per_step == pytest.approx(gt["planted_saving_ms"], rel=0.3), (s, gt["planted_saving_ms"])


def test_the_same_waits_beside_transfers_that_do_not_wait_name_nobody(tmp_path):
    """A clean job whose rank 5 logs stalls as long, as often: its transfers are not slower,
    so fixing them saves nothing (the replay), and nobody is named."""
    gt = _job(tmp_path, "clean")
    node = gt["nodes"][1]
    span = _column(tmp_path / "work" / "nodes" / node, "nccl_events", "timestamp_ns")["timestamp_ns"]
    at = np.sort(np.random.default_rng(3).uniform(span[0], span[-1], 60)).astype(np.int64)
    _proxy(tmp_path, gt, {node: (at, np.full(len(at), 5))})
    rep = _judge(tmp_path, gt)
    assert rep.straggler is None, rep.straggler



def test_only_sends_between_nodes_or_to_unknown_peers_are_compared():
    from ingero.analysis.model import RankRow
    from ingero.analysis.proxy import ProxySends, _across_nodes

    rows = {r: RankRow(rank=r, node="a" if r < 2 else "b", pod=None, pid=r) for r in range(4)}
    peer = np.array([1, 2, 3, 0, -1, 9])            # same node, across, same node, across, unknown, untraced
    z = np.zeros(6, np.int64)
    got = _across_nodes(ProxySends(np.array([0, 1, 2, 3, 0, 2]), z, z, np.arange(6), peer, z, comms={}), rows)
    assert got.wait.tolist() == [1, 3, 4, 5] and got.peer.tolist() == [2, 0, -1, 9]
