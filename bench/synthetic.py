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
