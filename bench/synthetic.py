"""NCCL-shaped synthetic events, shaped like what the agent records on a node.

Used by the storage and ingest benchmarks (and later the analysis benchmark):
ranks of one node calling a fixed sequence of collectives per step on two
communicators, with monotonic timestamps, jittered durations and the columns
the agent fills (pid, tid, cgroup, pod).
"""

from __future__ import annotations

import numpy as np

from ingero.store import dict_column

OPS = np.array(["ALL_REDUCE", "ALL_GATHER", "REDUCE_SCATTER", "SEND", "RECV"])


def nccl_columns(n_events: int, ranks: int = 8, rank0: int = 0, seed: int = 1,
                 t0_ns: int = 1_750_000_000_000_000_000, step_ns: int = 50_000_000) -> dict:
    """`n_events` rows for `ranks` ranks of one node, in timestamp order."""
    rng = np.random.default_rng(seed)
    per_rank = -(-n_events // ranks)
    call = np.arange(per_rank)
    op_idx = call % len(OPS)
    cols = {k: [] for k in ("timestamp_ns", "duration_ns", "op", "rank", "nranks", "comm_id_hash",
                            "seq", "count", "bytes", "datatype", "reduce_op", "peer", "ret", "pid",
                            "tid", "cgroup_id", "pod", "namespace", "ts_mono_ns", "comm", "stream")}
    hashes = np.array([0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9], dtype=np.uint64)
    for r in range(ranks):
        start = t0_ns + call * (step_ns // len(OPS)) + rng.integers(0, 200_000, per_rank)
        dur = rng.lognormal(np.log(2_000_000), 0.5, per_rank).astype(np.int64)
        comm = (call % 2).astype(np.int64)
        count = np.where(op_idx < 3, 262_144, 65_536).astype(np.int64)
        cols["timestamp_ns"].append(start)
        cols["duration_ns"].append(dur)
        cols["op"].append(OPS[op_idx])
        cols["rank"].append(np.full(per_rank, rank0 + r, np.int32))
        cols["nranks"].append(np.full(per_rank, 1024, np.int32))
        cols["comm_id_hash"].append(hashes[comm])
        cols["seq"].append(call // 2)
        cols["count"].append(count)
        cols["bytes"].append(count * 4)
        cols["datatype"].append(np.full(per_rank, "float32"))
        cols["reduce_op"].append(np.where(op_idx < 3, "sum", None))
        cols["peer"].append(np.where(op_idx >= 3, (rank0 + r + 1) % 1024, -1).astype(np.int32))
        cols["ret"].append(np.zeros(per_rank, np.int32))
        cols["pid"].append(np.full(per_rank, 4000 + r, np.int32))
        cols["tid"].append(np.full(per_rank, 4000 + r, np.int32))
        cols["cgroup_id"].append(np.full(per_rank, 9000 + r, np.uint64))
        cols["pod"].append(np.full(per_rank, f"train-worker-{rank0 + r}"))
        cols["namespace"].append(np.full(per_rank, "default"))
        cols["ts_mono_ns"].append(start - t0_ns + 12_345_678_900)
        cols["comm"].append((0x55550000 + comm * 0x1000).astype(np.uint64))
        cols["stream"].append(np.full(per_rank, 0x7F0000001000, np.uint64))
    out = {k: np.concatenate(v)[:n_events] for k, v in cols.items()}
    order = np.argsort(out["timestamp_ns"], kind="stable")
    return {k: v[order] for k, v in out.items()}


def as_agent_columns(cols: dict) -> dict:
    """The same rows as the agent hands them to the writer: strings as dictionary codes."""
    out = dict(cols)
    for k in ("op", "datatype", "reduce_op", "pod", "namespace"):
        v = cols[k]
        names = sorted({x for x in v.tolist() if x is not None})
        index = {n: i for i, n in enumerate(names)}
        codes = np.array([index.get(x, -1) if x is not None else -1 for x in v.tolist()], np.int32)
        out[k] = dict_column(codes, names)
    return out


def session(seg_dir, nodes: int = 2, ranks_per_node: int = 2, steps: int = 200,
            fault: str = "clean", victim: int | None = None, step_ms: float = 50.0,
            seed: int = 7) -> dict:
    """Write a whole synthetic session (every node's segments) below `seg_dir`.

    Each step: compute, then an ALL_REDUCE on communicator A and an ALL_GATHER
    on B. Faults: `slow-rank` (victim arrives late), `io-stall` / `cpu-hog`
    (late, with io / runqueue off-CPU time), `lossy-link` (the victim's node
    retransmits on its own sockets and every collective it joins is slower).
    Returns the layout: victim rank and node names.
    """
    from pathlib import Path

    from ingero.store import SegmentWriter

    rng = np.random.default_rng(seed)
    world = nodes * ranks_per_node
    victim = world - 1 if victim is None else victim
    vnode = victim // ranks_per_node
    t0 = 1_750_000_000_000_000_000
    step_ns = int(step_ms * 1e6)
    node_names = [f"node-{chr(97 + i)}" for i in range(nodes)]
    hashes = [0x1111_2222_3333_4444, 0x1111_2222_3333_4445]
    for ni, node in enumerate(node_names):
        w = SegmentWriter(Path(seg_dir) / node, node=node, session_id="synthetic")
        ranks_rows, totals = [], []
        tcp_ts = []
        for lr in range(ranks_per_node):
            r = ni * ranks_per_node + lr
            pid = 1000 + r
            late = (8e6 if r == victim and fault in ("slow-rank", "io-stall", "cpu-hog") else 0)
            cols = {k: [] for k in ("timestamp_ns", "duration_ns", "op", "rank", "nranks",
                                    "comm_id_hash", "seq", "count", "bytes", "pid", "tid",
                                    "global_rank", "ret")}
            for s in range(steps):
                base = t0 + s * step_ns
                for ci, op in enumerate(("ALL_REDUCE", "ALL_GATHER")):
                    arrive = base + 30e6 + ci * 4e6 + rng.normal(0, 2e5) + late
                    # everyone leaves together when the last rank has arrived
                    last = base + 30e6 + ci * 4e6 + 8e6 * (fault in ("slow-rank", "io-stall", "cpu-hog"))
                    wire = 2e6 * (1 + (fault == "lossy-link" and rng.random() < 0.3) * 5)
                    cols["timestamp_ns"].append(int(arrive))
                    cols["duration_ns"].append(int(max(last - arrive, 0) + wire))
                    cols["op"].append(op)
                    cols["comm_id_hash"].append(hashes[ci])
                    cols["seq"].append(s)
                    if fault == "lossy-link" and ni == vnode and rng.random() < 0.3:
                        tcp_ts.append((int(arrive + 1e6), pid, r))
            n = len(cols["timestamp_ns"])
            cols.update(rank=[r] * n, nranks=[world] * n, count=[262144] * n, bytes=[1 << 20] * n,
                        pid=[pid] * n, tid=[pid] * n, global_rank=[r] * n, ret=[0] * n)
            w.append("nccl_events", {k: np.asarray(v) if k != "op" else v for k, v in cols.items()})
            ranks_rows.append({"pid": pid, "rank": r, "local_rank": lr, "world_size": world,
                               "pod": f"train-{r}", "namespace": "default"})
            traced = steps * step_ns
            runq = 0.2 if (r == victim and fault == "cpu-hog") else 0.01
            io = 0.15 if (r == victim and fault == "io-stall") else 0.0
            totals += [{"pid": pid, "rank": r, "reason": "runqueue", "total_ns": int(runq * traced),
                        "intervals": steps},
                       {"pid": pid, "rank": r, "reason": "io", "total_ns": int(io * traced),
                        "intervals": steps},
                       {"pid": pid, "rank": r, "reason": "sleep", "total_ns": int(0.6 * traced),
                        "intervals": steps}]
        if tcp_ts:
            w.append("tcp_events", {"timestamp_ns": np.array([t for t, _, _ in tcp_ts]),
                                    "event": ["tcp_retransmit_skb"] * len(tcp_ts),
                                    "pid": np.array([p for _, p, _ in tcp_ts], np.int32),
                                    "rank": np.array([r for _, _, r in tcp_ts], np.int32)})
        w.put_rows("ranks", ranks_rows)
        w.put_rows("sched_totals", totals)
        w.close()
    return {"victim": victim, "victim_node": node_names[vnode], "nodes": node_names}
