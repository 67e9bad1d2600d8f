"""RDMA port counters as network evidence, on simulated jobs judged along the operator's path.

The jobs are ``bench.synthetic.pipeline_session``'s (2 nodes, tp2 pp2 dp2). Its network
fault slows every transfer that crosses the lossy node's link and writes TCP retransmits
inside those transfers; here the retransmits are taken away (NCCL over InfiniBand: no TCP)
and the lossy node's NIC counts them instead, as an agent writes rdma_counters rows: per
10 ms sampling interval, 100 out-of-sequence packets and one local ACK timeout per
retransmit that fell in it."""

from __future__ import annotations

import re

import duckdb
import numpy as np
import pytest

from bench.synthetic import pipeline_session
from ingero.store import SegmentWriter

INTERVAL = 10_000_000


def _job(tmp_path, fault: str) -> dict:
    return pipeline_session(tmp_path / "work" / "nodes", 2, 2, 2, nodes=2, steps=12, fault=fault,
                            lossy_node=1, loss_ms=3.0, seed=11, skew_ns=[1_500_000, -2_000_000])


def _column(seg, table: str, col: str) -> np.ndarray:
    files = sorted(str(f) for f in (seg / table).glob("*.parquet"))
    if not files:
        return np.zeros(0, np.int64)
    return duckdb.sql(f"SELECT {col} FROM read_parquet({files}) ORDER BY 1").fetchnumpy()[col]


def _nic(seg, node: str, times: np.ndarray, span: tuple[int, int], ranks: list, device="mlx5_1") -> None:
    """Replace the node's TCP retransmits by its NIC's counters rising at `times`, read every
    INTERVAL over `span`; `ranks` use the port (NCCL_IB_HCA), none: an idle NIC."""
    for f in (seg / "tcp_events").glob("*.parquet"):
        f.unlink()
    edges = np.arange(span[0] - INTERVAL, span[1] + 2 * INTERVAL, INTERVAL)
    k = np.histogram(times, edges)[0]
    at = np.flatnonzero(k)
    w = SegmentWriter(seg, node=node, session_id="pipeline")
    for counter, per in (("out_of_sequence", 100), ("local_ack_timeout_err", 1)):
        w.append("rdma_counters", {"timestamp_ns": edges[at + 1], "device": [device] * len(at), "port": [1] * len(at),
                                   "counter": [counter] * len(at), "delta": k[at] * per,
                                   "interval_ns": [INTERVAL] * len(at)})
    w.put_rows("rdma_ranks", [{"pid": 1000 + r, "rank": r, "device": device, "port": 1, "source": "NCCL_IB_HCA"}
                              for r in ranks])
    w.close()


def _judge(tmp_path, gt):
    from ingero_operator import gather

    return gather.build_artifact(gather.LocalSession(tmp_path), gt["offsets"])[0]


def test_a_nic_counting_loss_while_its_ranks_transfers_wait_is_named_network_with_the_port(tmp_path):
    gt = _job(tmp_path, "network")
    node = gt["lossy_node"]
    seg = tmp_path / "work" / "nodes" / node
    retx = _column(seg, "tcp_events", "timestamp_ns")
    calls = _column(seg, "nccl_events", "timestamp_ns")
    assert len(retx) > 20
    for other in gt["nodes"]:
        for f in (tmp_path / "work" / "nodes" / other / "tcp_events").glob("*.parquet"):
            f.unlink()
    _nic(seg, node, retx, (int(calls[0]), int(calls[-1])), gt["node_ranks"])
    rep = _judge(tmp_path, gt)
    assert rep.retransmits == 0
    s = rep.straggler
    assert s is not None and (s.cause, s.node) == ("network", node), (s, rep.best_candidate)
    # the rises in intervals that overlap its transfers in the step window; the notes count all
    got = re.search(r"network: mlx5_1 port 1: ([\d,]+) out-of-sequence, (\d+) local ACK timeouts", s.evidence)
    assert got and int(got[1].replace(",", "")) == 100 * int(got[2]) and 0.8 * len(retx) <= int(got[2]) <= len(retx), \
        s.evidence
    assert "ranks 4-7 use it, mapped by NCCL_IB_HCA" in s.evidence, s.evidence
    assert s.saving_ms_per_step == pytest.approx(gt["planted_saving_ms"], rel=0.25), (s, gt["planted_saving_ms"])
    assert f"RDMA: node {node}, mlx5_1 port 1 (ranks 4-7, mapped by NCCL_IB_HCA): {100 * len(retx):,} " \
           f"out-of-sequence, {len(retx)} local ACK timeouts during the trace" in rep.warnings, rep.warnings


def _steady(calls: np.ndarray) -> np.ndarray:
    """A rise every 2 ms over the whole trace: a link that errs all the time, in every interval."""
    return np.arange(calls[0] - INTERVAL, calls[-1] + INTERVAL, 2_000_000)


def test_a_nic_that_errs_in_every_interval_is_named_against_the_transfers_that_do_not_cross_it(tmp_path):
    gt = _job(tmp_path, "network")
    node = gt["lossy_node"]
    seg = tmp_path / "work" / "nodes" / node
    calls = _column(seg, "nccl_events", "timestamp_ns")
    for other in gt["nodes"]:
        for f in (tmp_path / "work" / "nodes" / other / "tcp_events").glob("*.parquet"):
            f.unlink()
    _nic(seg, node, _steady(calls), (int(calls[0]), int(calls[-1])), gt["node_ranks"])
    s = _judge(tmp_path, gt).straggler
    assert s is not None and (s.cause, s.node) == ("network", node), s
    assert s.saving_ms_per_step == pytest.approx(gt["planted_saving_ms"], rel=0.25), (s, gt["planted_saving_ms"])


@pytest.mark.parametrize("ranks,steady", [([], False), ([4, 5, 6, 7], False), ([4, 5, 6, 7], True)],
                         ids=["idle-nic", "nic-of-a-clean-job", "nic-of-a-clean-job-erring-always"])
def test_the_same_counters_on_an_idle_nic_or_beside_transfers_that_do_not_wait_name_nobody(tmp_path, ranks, steady):
    gt = _job(tmp_path, "clean")
    node = gt["nodes"][1]
    seg = tmp_path / "work" / "nodes" / node
    calls = _column(seg, "nccl_events", "timestamp_ns")
    times = np.sort(np.random.default_rng(3).uniform(calls[0], calls[-1], 60)).astype(np.int64)
    times = _steady(calls) if steady else times
    for other in gt["nodes"]:
        for f in (tmp_path / "work" / "nodes" / other / "tcp_events").glob("*.parquet"):
            f.unlink()
    _nic(seg, node, times, (int(calls[0]), int(calls[-1])), ranks)
    rep = _judge(tmp_path, gt)
    assert rep.straggler is None, rep.straggler
    note = [w for w in rep.warnings if w.startswith(f"RDMA: node {node}, mlx5_1 port 1")]
    assert note and f"{100 * len(times):,} out-of-sequence, {len(times)} local ACK timeouts" in note[0], rep.warnings
    assert ("no traced rank uses it" in note[0]) == (not ranks)
