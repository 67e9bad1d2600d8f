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
            seed: int = 7, fault_from_step: int = 0, late_ms: float = 8.0,
            jitter_ms: float = 0.2, spurious_retx_rank: int | None = None,
            rank_bias_ms: tuple = ()) -> dict:
    """Write a whole synthetic session (every node's segments) below `seg_dir`.

    Each step: compute, then an ALL_REDUCE on communicator A and an ALL_GATHER
    on B, causal (a rank arrives when its own work since its last return is done).
    Faults: `slow-rank` (victim works late_ms longer before each collective), `io-stall` / `cpu-hog`
    (late, with io / runqueue off-CPU time), `lossy-link` (the victim's node
    retransmits on its own sockets and every collective it joins is slower),
    from step `fault_from_step` on (a fault injected mid-session). `late_ms`: how late
    the victim of a late fault arrives; `jitter_ms`: the arrival noise of every rank (sd);
    `spurious_retx_rank`: this rank's connections retransmit in 30% of collectives without
    any loss or slowdown (what the peers of a starved rank see: it acknowledges late).
    `rank_bias_ms`: a fixed extra lateness per rank (rank i gets item i), as ranks sharing
    busy CPUs show.
    Returns the layout: victim rank and node names.
    """
    from pathlib import Path

    from ingero.store import SegmentWriter

    rng = np.random.default_rng(seed)
    world = nodes * ranks_per_node
    victim = world - 1 if victim is None else victim
    vnode = victim // ranks_per_node
    t0 = 1_750_000_000_000_000_000
    node_names = [f"node-{chr(97 + i)}" for i in range(nodes)]
    hashes = [0x1111_2222_3333_4444, 0x1111_2222_3333_4445]
    lateish = fault in ("slow-rank", "io-stall", "cpu-hog")
    # Causal timeline: a rank arrives at a collective when its own work since its last
    # return is done; every member returns when the last has arrived plus the transfer.
    # Own work per step: 30 ms before the ALL_REDUCE, 4 ms before the ALL_GATHER, the
    # rest of the step after it; the victim of a late fault works late_ms longer before each.
    work = (30e6, 4e6)
    rest = step_ms * 1e6 - sum(work) - 2 * 2e6
    arrive = np.zeros((steps, 2, world))
    leave = np.zeros((steps, 2, world))
    wire = np.zeros((steps, 2))
    prev = np.full(world, float(t0))
    retx_at = []
    for s in range(steps):
        faulty = s >= fault_from_step
        for ci in range(2):
            own = np.full(world, work[ci]) + (rest if ci == 0 and s > 0 else 0)
            own += rng.normal(0, jitter_ms * 1e6, world)
            own += np.array([rank_bias_ms[r] * 1e6 if r < len(rank_bias_ms) else 0.0 for r in range(world)])
            if lateish and faulty:
                own[victim] += late_ms * 1e6
            a = prev + np.maximum(own, 0)
            lossy = fault == "lossy-link" and faulty and rng.random() < 0.3
            x = 2e6 * (1 + lossy * 5)
            end = a.max() + x
            arrive[s, ci], leave[s, ci], wire[s, ci] = a, end, x
            if lossy:
                retx_at.append((s, ci, a.max() + 1e6))
            prev = np.full(world, end)
    for ni, node in enumerate(node_names):
        w = SegmentWriter(Path(seg_dir) / node, node=node, session_id="synthetic")
        ranks_rows, totals = [], []
        tcp_ts = []
        for lr in range(ranks_per_node):
            r = ni * ranks_per_node + lr
            pid = 1000 + r
            cols = {k: [] for k in ("timestamp_ns", "duration_ns", "op", "rank", "nranks",
                                    "comm_id_hash", "seq", "count", "bytes", "pid", "tid",
                                    "global_rank", "ret")}
            for s in range(steps):
                for ci, op in enumerate(("ALL_REDUCE", "ALL_GATHER")):
                    a = arrive[s, ci, r]
                    cols["timestamp_ns"].append(int(a))
                    cols["duration_ns"].append(int(leave[s, ci, r] - a))
                    cols["op"].append(op)
                    cols["comm_id_hash"].append(hashes[ci])
                    cols["seq"].append(s)
                    if r == spurious_retx_rank and rng.random() < 0.3:
                        tcp_ts.append((int(leave[s, ci, r] - 1e6), pid, r))
            if ni == vnode and lr == victim % ranks_per_node:
                tcp_ts += [(int(t), pid, r) for _, _, t in retx_at]
            n = len(cols["timestamp_ns"])
            cols.update(rank=[r] * n, nranks=[world] * n, count=[262144] * n, bytes=[1 << 20] * n,
                        pid=[pid] * n, tid=[pid] * n, global_rank=[r] * n, ret=[0] * n)
            w.append("nccl_events", {k: np.asarray(v) if k != "op" else v for k, v in cols.items()})
            ranks_rows.append({"pid": pid, "rank": r, "local_rank": lr, "world_size": world,
                               "pod": f"train-{r}", "namespace": "default"})
            traced = steps * step_ms * 1e6
            runq = 0.2 if (r == victim and fault == "cpu-hog") else 0.01
            io = 0.15 if (r == victim and fault == "io-stall") else 0.0
            totals += [{"pid": pid, "rank": r, "reason": "runqueue", "total_ns": int(runq * traced),
                        "intervals": steps},
                       {"pid": pid, "rank": r, "reason": "io", "total_ns": int(io * traced),
                        "intervals": steps},
                       {"pid": pid, "rank": r, "reason": "sleep", "total_ns": int(0.6 * traced),
                        "intervals": steps}]
        if tcp_ts:
            tcp_ts.sort()
            w.append("tcp_events", {"timestamp_ns": np.array([t for t, _, _ in tcp_ts]),
                                    "event": ["tcp_retransmit_skb"] * len(tcp_ts),
                                    "pid": np.array([p for _, p, _ in tcp_ts], np.int32),
                                    "rank": np.array([r for _, _, r in tcp_ts], np.int32)})
        w.put_rows("ranks", ranks_rows)
        w.put_rows("sched_totals", totals)
        w.close()
    return {"victim": victim, "victim_node": node_names[vnode], "nodes": node_names}


# ---- at scale: 1,024 ranks x 100,000 collectives (bench/analysis_scale.py) ---------------

SCALE_T0 = 1_750_000_000_000_000_000
# One step of the scale session: (op, communicator index, start within the step as a share).
SCALE_STEP = (("ALL_GATHER", 0, 0.05), ("REDUCE_SCATTER", 0, 0.45), ("BROADCAST", 1, 0.55),
              ("ALL_REDUCE", 1, 0.80))
JITTER_CAP = 600_000   # ns: a rank's arrival within 3 sd of the instance's start
SCALE_HASHES = np.array([0x5CA1_AB1E_0000_0001, 0x5CA1_AB1E_0000_0002], dtype=np.uint64)


def scale_layout(ranks: int, collectives: int, nodes: int, fault: str, seed: int = 11) -> dict:
    """Who is planted where in a scale session (deterministic from the arguments)."""
    rng = np.random.default_rng([seed, ranks, collectives, nodes])
    rpn = ranks // nodes
    victim = int(rng.integers(0, ranks))
    vnode = victim // rpn
    # a node with retransmits that is not the victim's: "realistic retransmits on one node"
    noisy = (vnode + nodes // 2) % nodes
    offsets = rng.integers(-5_000_000, 5_000_000, nodes)   # each node's clock error, ns
    return {"victim": victim, "victim_node": _scale_node(vnode), "vnode": vnode,
            "noisy_node": _scale_node(noisy), "noisy": noisy, "fault": fault,
            "offsets": {_scale_node(i): int(o) for i, o in enumerate(offsets)},
            "ranks_per_node": rpn}


def _scale_node(i: int) -> str:
    return f"node-{i:04d}"


def scale_session(seg_root, ranks: int = 1024, collectives: int = 100_000, nodes: int = 128,
                  fault: str = "slow-rank", step_ms: float = 40.0, segments_per_node: int = 8,
                  late_ms: float = 10.0, seed: int = 11, progress=None,
                  slow_span: tuple[float, float] = (0.0, 1.0)) -> dict:
    """Write a large synthetic session below `seg_root/<node>/` through the real SegmentWriter.

    Every rank calls every collective: `collectives` instances in steps of
    four (ALL_GATHER, REDUCE_SCATTER on communicator A, BROADCAST, ALL_REDUCE
    on B), `ranks // nodes` ranks per node, each node's rows in
    `segments_per_node` time-ordered segments, in drain order (instance-major).
    Each node's clock is off by a few ms (``layout["offsets"]``; the reader
    must subtract it), so a verdict is right only when offsets are applied.

    A rank issues its calls in program order, each after its previous one
    returned: an instance starts at its place in the step, or later when the
    previous one ended too late for that.

    Faults: ``slow-rank``: the victim arrives `late_ms` late at every
    ALL_REDUCE (everyone waits for it, and the next ALL_GATHER starts late), while another node (``noisy``)
    retransmits in 2% of instances (waiting peers' tail-loss probes): the
    verdict must be the victim, compute/unknown; `slow_span`: the shares of the session
    (of its collectives) between which it is late, e.g. (1/3, 2/3). ``lossy-link``: the victim's
    node retransmits on its own sockets in 30% of instances and every rank's
    collective then takes 4x longer on the wire, plus 0.3% background
    retransmits elsewhere: the verdict must be network on the victim's node.
    ``clean``: background retransmits only, no straggler. Every rank has
    sched_totals (runqueue, io, sleep) and a few sched_events.
    """
    from pathlib import Path

    from ingero.store import SegmentWriter

    if ranks % nodes:
        raise ValueError("ranks must be a multiple of nodes")
    lay = scale_layout(ranks, collectives, nodes, fault, seed)
    rpn, victim = lay["ranks_per_node"], lay["victim"]
    step_ns = int(step_ms * 1e6)
    per_step = len(SCALE_STEP)
    # ---- what every node agrees on: instance schedule, wire time, who retransmits when
    g = np.random.default_rng([seed, 1])
    inst = np.arange(collectives)
    slot = inst % per_step
    step = inst // per_step
    ops = np.array([s[0] for s in SCALE_STEP])
    comm_of = np.array([s[1] for s in SCALE_STEP])
    share = np.array([s[2] for s in SCALE_STEP])
    base = SCALE_T0 + step * step_ns + (share[slot] * step_ns).astype(np.int64)
    comm = comm_of[slot]
    # seq: per-communicator call number
    per_comm_calls = np.array([sum(1 for s in SCALE_STEP if s[1] == c) for c in range(2)])
    before = np.array([sum(1 for s in SCALE_STEP[:k] if s[1] == SCALE_STEP[k][1]) for k in range(per_step)])
    seq = step * per_comm_calls[comm] + before[slot]
    is_ar = ops[slot] == "ALL_REDUCE"
    late_ns = int(late_ms * 1e6)
    in_span = (inst >= slow_span[0] * collectives) & (inst < slow_span[1] * collectives)
    victim_late = np.where(is_ar & (fault == "slow-rank") & in_span, late_ns, 0)
    wire = g.lognormal(np.log(1_500_000), 0.25, collectives).astype(np.int64)
    if fault == "lossy-link":
        hit = g.random(collectives) < 0.30       # instances with a retransmit on the victim node
        wire = np.where(hit, wire * 4, wire)
        retx_node = np.where(hit, lay["vnode"], -1)
    else:
        hit = g.random(collectives) < (0.02 if fault == "slow-rank" else 0.0)
        retx_node = np.where(hit, lay["noisy"], -1)
    bg = (g.random(collectives) < 0.003) & ~hit  # background: a retransmit now and then anywhere
    retx_node = np.where(bg, g.integers(0, nodes, collectives), retx_node)
    retx_lrank = g.integers(0, rpn, collectives)
    # Program order: each rank issues a call only after its previous one returned (its
    # arrival jitter is within +-JITTER_CAP of the instance's start), so an instance starts
    # at its place in the step or, when the previous one ended too late for that (a late
    # victim keeps everyone waiting), that long after the previous instance's last return.
    last_after = 800_000 + victim_late           # the last arrival after the start (>= any jitter)
    busy = last_after + wire + 50_000 + JITTER_CAP + 100_000
    before_i = np.concatenate(([0], np.cumsum(busy[:-1])))
    base = before_i + np.maximum.accumulate(base - before_i)
    last = base + last_after
    retx_at = last + (g.uniform(0.1, 0.9, collectives) * wire).astype(np.int64)
    count = np.where(is_ar, 1 << 22, 1 << 24).astype(np.int64)
    bounds = np.linspace(0, collectives, segments_per_node + 1).astype(np.int64)
    op_names = [s[0] for s in SCALE_STEP]
    op_code = slot.astype(np.int32)
    traced = int(collectives / per_step * step_ns)
    for ni in range(nodes):
        node = _scale_node(ni)
        off = lay["offsets"][node]
        rng = np.random.default_rng([seed, 2, ni])
        w = SegmentWriter(Path(seg_root) / node, node=node, session_id="scale", roll_seconds=1e9)
        lranks = np.arange(rpn)
        granks = ni * rpn + lranks
        pids = (1000 + lranks).astype(np.int32)
        pods = [f"train-{r}" for r in granks]
        for a, b in zip(bounds[:-1], bounds[1:]):
            n = int(b - a)
            # rows in drain order: instance-major, the node's ranks within an instance
            jit = np.clip(rng.normal(0, 200_000, (n, rpn)), -JITTER_CAP, JITTER_CAP).astype(np.int64)
            arrive = base[a:b, None] + jit
            arrive[:, granks == victim] += victim_late[a:b, None]
            extra = rng.integers(0, 50_000, (n, rpn))
            dur = np.maximum(last[a:b, None] - arrive, 0) + wire[a:b, None] + extra
            ts = arrive + off                      # this node's clock
            rows = n * rpn
            cols = {
                "timestamp_ns": ts.ravel(),
                "ts_mono_ns": (ts - SCALE_T0 + 5_000_000_000_000).ravel(),
                "duration_ns": dur.ravel(),
                "op": dict_column(np.repeat(op_code[a:b], rpn), op_names),
                "nranks": np.full(rows, ranks, np.int32),
                "rank": np.tile(granks, n).astype(np.int32),
                "global_rank": np.tile(granks, n).astype(np.int32),
                "comm_id_hash": np.repeat(SCALE_HASHES[comm[a:b]], rpn),
                "seq": np.repeat(seq[a:b], rpn),
                "count": np.repeat(count[a:b], rpn),
                "bytes": np.repeat(count[a:b] * 2, rpn),
                "datatype": dict_column(np.zeros(rows, np.int32), ["bfloat16"]),
                "reduce_op": dict_column(np.repeat(np.where(op_code[a:b] % 2 == 1, 0, -1), rpn), ["sum"]),
                "peer": np.full(rows, -1, np.int32),
                "ret": np.zeros(rows, np.int32),
                "in_group": np.zeros(rows, bool),
                "comm": np.repeat((0x7F00_0000_0000 + comm[a:b] * 0x1000).astype(np.uint64), rpn),
                "stream": np.full(rows, 0x7F00_1000_0000, np.uint64),
                "pid": np.tile(pids, n),
                "tid": np.tile(pids, n),
                "cgroup_id": np.tile((100_000 + granks).astype(np.uint64), n),
                "pod": dict_column(np.tile(lranks, n), pods),
                "namespace": dict_column(np.zeros(rows, np.int32), ["default"]),
            }
            w.append("nccl_events", cols)
            # retransmits on this node's sockets, attributed to the owning rank
            mine = np.nonzero(retx_node[a:b] == ni)[0]
            if len(mine):
                lr = retx_lrank[a:b][mine]
                tts = retx_at[a:b][mine] + off
                k = len(mine)
                w.append("tcp_events", {
                    "timestamp_ns": tts, "ts_mono_ns": tts - SCALE_T0 + 5_000_000_000_000,
                    "event": dict_column(np.zeros(k, np.int32), ["tcp_retransmit_skb"]),
                    "saddr": dict_column(lr, [f"10.0.{ni}.{10 + i}" for i in range(rpn)]),
                    "daddr": dict_column(np.zeros(k, np.int32), [f"10.0.{(ni + 1) % nodes}.10"]),
                    "sport": (40000 + lr).astype(np.int32), "dport": np.full(k, 29500, np.int32),
                    "family": dict_column(np.zeros(k, np.int32), ["AF_INET"]),
                    "state": dict_column(np.zeros(k, np.int32), ["ESTABLISHED"]),
                    "owner_source": dict_column(np.zeros(k, np.int32), ["socket"]),
                    "pid": pids[lr], "rank": granks[lr].astype(np.int32),
                    "pod": dict_column(lr, pods)})
            # a few off-CPU intervals over the threshold per rank
            k = max(1, n // 400)
            ls = rng.integers(0, rpn, k)
            sts = base[a:b][rng.integers(0, n, k)] + off
            w.append("sched_events", {
                "timestamp_ns": sts, "ts_mono_ns": sts - SCALE_T0 + 5_000_000_000_000,
                "duration_ns": rng.integers(1_000_000, 5_000_000, k), "runq_ns": rng.integers(0, 1_000_000, k),
                "reason": dict_column(rng.integers(0, 3, k), ["runqueue", "io", "sleep"]),
                "pid": pids[ls], "tid": pids[ls], "rank": granks[ls].astype(np.int32),
                "pod": dict_column(ls, pods)})
            w.flush(wait=False)
        w.put_rows("ranks", [{"pid": int(pids[i]), "rank": int(granks[i]), "local_rank": i,
                              "world_size": ranks, "local_world_size": rpn, "group_rank": ni,
                              "pod": pods[i], "namespace": "default",
                              "cgroup_id": 100_000 + int(granks[i]), "process": "python3"}
                             for i in range(rpn)])
        w.put_rows("sched_totals", [{"pid": int(pids[i]), "rank": int(granks[i]), "reason": reason,
                                     "total_ns": int(frac * traced), "intervals": collectives // 10}
                                    for i in range(rpn)
                                    for reason, frac in (("runqueue", 0.01), ("io", 0.002), ("sleep", 0.5))])
        w.put_rows("comms", [{"pid": int(pids[i]), "comm": 0x7F00_0000_0000 + c * 0x1000,
                              "comm_id_hash": int(SCALE_HASHES[c]), "rank": int(granks[i]),
                              "nranks": ranks, "op": "COMM_INIT_RANK_CONFIG", "timestamp_ns": SCALE_T0 + off}
                             for i in range(rpn) for c in range(2)])
        w.put_rows("nodes", [{"hostname": node, "kernel": "6.1.0", "agent_version": "bench",
                              "events_nccl": collectives * rpn, "lost_nccl": 0, "started_ns": SCALE_T0 + off}])
        w.put_rows("sessions", [{"started_ns": SCALE_T0 + off, "probes": "nccl,tcp,sched",
                                 "status": "stopped"}])
        w.close()
        if progress:
            progress(ni + 1, nodes)
    return lay


# ---- a tensor x pipeline x data parallel job, simulated (tests/unit/test_verdict_pipeline.py) ----

def pipeline_layout(tp: int, pp: int, dp: int, replicas: int = 1) -> dict:
    """Megatron's rank order (tp fastest, then pp, then dp) and the communicators of each rank
    (the embedding group: the first and last stage of each pipeline). `replicas` > 1 (HSDP):
    the data-parallel ranks of a (stage, tp) position also split into shard groups of
    dp / replicas consecutive ones ("shard") and the replicate groups across them ("rep"),
    as a (replicate, shard) device mesh does."""
    world = tp * pp * dp
    rank = lambda d, p, t: d * pp * tp + p * tp + t
    groups = {"world": [list(range(world))]}
    groups["tp"] = [[rank(d, p, t) for t in range(tp)] for d in range(dp) for p in range(pp)]
    groups["dp"] = [[rank(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)]
    groups["pp"] = [[rank(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)]
    groups["emb"] = [[rank(d, 0, t), rank(d, pp - 1, t)] for d in range(dp) for t in range(tp)] if pp > 1 else []
    if replicas > 1:
        if dp % replicas:
            raise ValueError(f"dp {dp} is no multiple of replicas {replicas}")
        sh = dp // replicas
        pos = [(p, t) for p in range(pp) for t in range(tp)]
        groups["shard"] = [[rank(r * sh + i, p, t) for i in range(sh)] for p, t in pos for r in range(replicas)]
        groups["rep"] = [[rank(r * sh + i, p, t) for r in range(replicas)] for p, t in pos for i in range(sh)]
    stage = {rank(d, p, t): p for d in range(dp) for p in range(pp) for t in range(tp)}
    return {"world": world, "groups": groups, "stage": stage, "rank": rank}


def _pipeline_program(r: int, stage: int, pp: int, pipe: list, tp: int, micro: int, schedule: str,
                      fwd, bwd) -> list:
    """One step of rank `r` (pipeline stage `stage`): its compute ("work", ms) and calls.
    gpipe: every microbatch's forward, then every backward, send/recv ungrouped. 1f1b: warm-up
    forwards, one forward and one backward per microbatch, cool-down backwards; each exchange
    with a neighbour is one group of sends and receives (``batch_isend_irecv``), as Megatron's
    ``send_forward_recv_backward`` and ``send_backward_recv_forward``."""
    prev = pipe[stage - 1] if stage > 0 else None
    nxt = pipe[stage + 1] if stage < pp - 1 else None
    tpar = [("ALL_REDUCE", "tp", None)] if tp > 1 else []
    if schedule == "gpipe":
        prog = []
        for _ in range(micro):
            prog += ([("RECV", "pp", prev)] if prev is not None else []) + [("work", fwd())] + tpar
            prog += [("SEND", "pp", nxt)] if nxt is not None else []
        for _ in range(micro):
            prog += ([("RECV", "pp", nxt)] if nxt is not None else []) + [("work", bwd())] + tpar
            prog += [("SEND", "pp", prev)] if prev is not None else []
        return prog

    def group(*ops):
        ops = [o for o in ops if o[2] is not None]
        return [("GROUP", ops)] if ops else []

    warm = min(pp - stage - 1, micro)
    prog = []
    for _ in range(warm):
        prog += group(("RECV", "pp", prev)) + [("work", fwd())] + tpar + group(("SEND", "pp", nxt))
    steady = micro - warm
    if steady:
        prog += group(("RECV", "pp", prev))
    for i in range(steady):
        prog += [("work", fwd())] + tpar + group(("SEND", "pp", nxt), ("RECV", "pp", nxt))
        prog += [("work", bwd())] + tpar
        prog += group(("SEND", "pp", prev)) if i == steady - 1 else group(("SEND", "pp", prev), ("RECV", "pp", prev))
    for _ in range(warm):
        prog += group(("RECV", "pp", nxt)) + [("work", bwd())] + tpar + group(("SEND", "pp", prev))
    return prog


def _fsdp_program(layers: int, tp: int, micro: int, shard: str, replicate: bool, fwd, bwd,
                  streams: bool = False) -> list:
    """One step of an FSDP rank (no pipeline): per layer, forward: its parameters
    all-gathered over the shard group (two tensors, coalesced: one ncclGroupStart/End), its
    compute, the tensor all-reduce; backward, layers in reverse: the parameters gathered
    again (resharded after the forward), the compute, the tensor all-reduce, the gradients
    reduce-scattered (two, coalesced) and with `replicate` (HSDP) all-reduced over the
    replicate group. A layer's compute is 1/`layers` of `micro` microbatches'. `streams`: the
    replicate all-reduce is issued asynchronously on its own stream (beside the next layer's
    gather and backward), waited for at the step's end."""
    tpar = [("ALL_REDUCE", "tp", None)] if tp > 1 else []
    gather = [("COALESCED", shard, ("ALL_GATHER", "ALL_GATHER"))]
    reduce = [("COALESCED", shard, ("REDUCE_SCATTER", "REDUCE_SCATTER"))]
    reduce += [("ALL_REDUCE", "rep", "ASYNC" if streams else None)] if replicate else []
    prog = []
    for _ in range(layers):
        prog += gather + [("work", fwd() * micro / layers)] + tpar
    for _ in range(layers):
        prog += gather + [("work", bwd() * micro / layers)] + tpar + reduce
    return prog + ([("WAIT",)] if streams else [])


def simulate_pipeline(tp: int, pp: int, dp: int, steps: int, micro: int = 4, fwd_ms: float = 4.0,
                      bwd_ms: float = 8.0, x_ms: float = 0.3, jitter: float = 0.03, seed: int = 5,
                      factor=None, extra=None, schedule: str = "gpipe", world: bool = True,
                      dist_opt: bool = False, embedding: bool = False, fsdp: int = 0,
                      replicas: int = 1, log_every: int = 0, streams: bool = False,
                      x_kind: dict | None = None) -> dict:
    """Run a pipeline schedule per step (``_pipeline_program``: gpipe or 1f1b) as a
    discrete-event simulation: compute is own work (fwd_ms / bwd_ms per microbatch, times
    ``factor(rank, step)`` and a jitter), sends are eager, a recv (or a group holding recvs)
    returns when its sends were posted, a collective when its last member arrived, each plus a
    transfer of x_ms. Then the data-parallel gradient all-reduce (``dist_opt``: the
    distributed optimizer's reduce-scatter, and its parameter all-gather after the optimizer
    step), the embedding all-reduce of the first and last stage (``embedding``), and a world
    all-reduce ending the step (``world``; Megatron and FSDP jobs have none).
    ``fsdp`` > 0 (needs pp = 1): instead of the schedule and the data-parallel collectives,
    an FSDP step of that many layers (``_fsdp_program``), sharded over dp / ``replicas``
    ranks; a coalesced group ends when its last member arrived, plus one transfer.
    ``log_every`` > 0: a world all-reduce after every log_every-th step only (the loss
    reduced for logging, as torchtitan does every log_freq steps).
    ``streams``: each communicator runs on a device stream of its own, as each PyTorch
    process group does, and the data-parallel reduce-scatter (or all-reduce) and the
    embedding all-reduce are issued asynchronously (``async_op=True``): each starts when
    the rank issues it and its stream is free, the two run side by side, and the rank
    waits for both before the optimizer's work (FSDP: each layer's gradient reduce runs
    beside the next layer's backward, and the rank waits for all of them at the step's end).
    ``x_kind``: the transfer of a communicator kind's collectives, ms, where it is not x_ms
    (a data-parallel gradient reduce moves far more than a tensor all-reduce).
    ``extra(members)`` adds nanoseconds to the transfer of an instance among `members`
    (global ranks; a send/recv pair is [src, dst]): a lossy link.
    Returns {"calls": per rank list of (op, group kind, group index, peer global rank or -1,
    t, d)} (group starts and ends have kind None), "step_ns": mean step (the latest rank's
    step end to step end), "slowed": [(transfer start, end, members)] of every instance
    `extra` slowed}."""
    if fsdp and pp != 1:
        raise ValueError("an FSDP job here has no pipeline: pp must be 1")
    lay = pipeline_layout(tp, pp, dp, replicas)
    world_n, stage = lay["world"], lay["stage"]
    gi = {k: {r: i for i, g in enumerate(gs) for r in g} for k, gs in lay["groups"].items()}
    members = {k: {i: g for i, g in enumerate(gs)} for k, gs in lay["groups"].items()}
    rng = np.random.default_rng(seed)
    factor = factor or (lambda r, s: 1.0)
    prog = {r: [] for r in range(world_n)}
    for r in range(world_n):
        s_, pipe = stage[r], members["pp"][gi["pp"][r]]
        for st in range(steps):
            f = factor(r, st)
            fwd = lambda: fwd_ms * f * (1 + rng.normal(0, jitter))
            bwd = lambda: bwd_ms * f * (1 + rng.normal(0, jitter))
            if fsdp:
                prog[r] += _fsdp_program(fsdp, tp, micro, "shard" if replicas > 1 else "dp", replicas > 1, fwd, bwd,
                                         streams)
                prog[r].append(("work", 0.5))
            else:
                prog[r] += _pipeline_program(r, s_, pp, pipe, tp, micro, schedule, fwd, bwd)
            asy = "ASYNC" if streams else None
            if dp > 1 and not fsdp:
                prog[r].append(("REDUCE_SCATTER" if dist_opt else "ALL_REDUCE", "dp", asy))
            if embedding and pp > 1 and s_ in (0, pp - 1):
                prog[r].append(("ALL_REDUCE", "emb", asy))
            if streams:
                prog[r].append(("WAIT",))
            if not fsdp:
                prog[r].append(("work", 0.5))
            if dp > 1 and dist_opt and not fsdp:
                prog[r].append(("ALL_GATHER", "dp", None))
            if world or (log_every and st % log_every == log_every - 1):
                prog[r].append(("ALL_REDUCE", "world", None))
            prog[r].append(("step", st))
    x = x_ms * 1e6
    extra = extra or (lambda members: 0.0)
    slowed = []
    t = {r: 0.0 for r in range(world_n)}
    ptr = {r: 0 for r in range(world_n)}
    calls = {r: [] for r in range(world_n)}
    sent: dict = {}                       # (src, dst) -> [send arrival times]
    got: dict = {}                        # (src, dst) -> recvs done
    coll_n = {}                           # (rank, kind) -> collectives called
    arrivals: dict = {}                   # (kind, group, seq) -> {rank: t}
    ends: dict = {}                       # (kind, group, seq) -> end of the transfer
    posted: dict = {}                     # rank -> arrival of the group whose sends it posted
    step_end = {r: [] for r in range(world_n)}
    free: dict = {}                       # (rank, kind) -> when its stream's last async op ends
    pending = {r: [] for r in range(world_n)}   # rank -> (call index, instance) of its async ops

    def recv_end(r, src, a):
        """End of rank r's next recv from `src` arriving at `a`, or None while unsent."""
        k = got.get((src, r), 0)
        if len(sent.get((src, r), [])) <= k:
            return None
        more = extra([src, r])
        end = max(a, sent[(src, r)][k]) + x + more
        if more:
            slowed.append((max(a, sent[(src, r)][k]), end, [src, r]))
        return end

    done = 0
    total = sum(len(p) for p in prog.values())
    while done < total:
        progressed = False
        for r in range(world_n):
            while ptr[r] < len(prog[r]):
                op = prog[r][ptr[r]]
                if op[0] == "work":
                    t[r] += max(op[1], 0) * 1e6
                elif op[0] == "step":
                    step_end[r].append(t[r])
                elif op[0] == "WAIT":             # the handles of the rank's async ops
                    if any(key not in ends for _, key in pending[r]):
                        break
                    for i, key in pending[r]:
                        c = calls[r][i]
                        calls[r][i] = c[:5] + (ends[key] - c[4],)
                        free[(r, key[0])] = ends[key]
                        t[r] = max(t[r], ends[key])
                    pending[r] = []
                elif op[0] == "SEND":
                    sent.setdefault((r, op[2]), []).append(t[r])
                    calls[r].append(("SEND", "pp", gi["pp"][r], op[2], t[r], 20_000))
                    t[r] += 20_000
                elif op[0] == "RECV":
                    end = recv_end(r, op[2], t[r])
                    if end is None:
                        break
                    got[(op[2], r)] = got.get((op[2], r), 0) + 1
                    calls[r].append(("RECV", "pp", gi["pp"][r], op[2], t[r], end - t[r]))
                    t[r] = end
                elif op[0] == "GROUP":
                    # sends are posted at the group's start, once; the group ends with its recvs
                    a = posted.get(r)
                    if a is None:
                        a = posted[r] = t[r]
                        for o, _, peer in op[1]:
                            if o == "SEND":
                                sent.setdefault((r, peer), []).append(a)
                    rv = [peer for o, _, peer in op[1] if o == "RECV"]
                    if any(len(sent.get((src, r), [])) <= got.get((src, r), 0) for src in rv):
                        break
                    end = max([recv_end(r, src, a) for src in rv] + [a + 20_000])
                    for src in rv:
                        got[(src, r)] = got.get((src, r), 0) + 1
                    del posted[r]
                    n = len(op[1])
                    calls[r].append(("GROUP_START", None, -1, -1, a, 1_000))
                    for i, (o, _, peer) in enumerate(op[1]):
                        calls[r].append((o, "pp", gi["pp"][r], peer, a + 1_000 * (i + 1), 1_000))
                    calls[r].append(("GROUP_END", None, -1, -1, a + 1_000 * (n + 1), end - a - 1_000 * (n + 1)))
                    t[r] = end
                else:
                    kind = op[1]
                    g = gi[kind][r]
                    seq = coll_n.get((r, kind), 0)
                    inst = arrivals.setdefault((kind, g, seq), {})
                    if r not in inst:
                        inst[r] = max(t[r], free.get((r, kind), 0.0))
                    mem = members[kind][g]
                    if len(inst) == len(mem) and (kind, g, seq) not in ends:
                        more = extra(mem)         # once per instance (extra may draw)
                        ends[(kind, g, seq)] = max(inst.values()) + (x_kind or {}).get(kind, x_ms) * 1e6 + more
                        if more:
                            slowed.append((max(inst.values()), ends[(kind, g, seq)], list(mem)))
                    if op[2] == "ASYNC":          # issued: the rank goes on, its stream runs it
                        pending[r].append((len(calls[r]), (kind, g, seq)))
                        calls[r].append((op[0], kind, g, -1, inst[r], 0))
                        coll_n[(r, kind)] = seq + 1
                        ptr[r] += 1
                        done += 1
                        progressed = True
                        continue
                    if len(inst) < len(mem):
                        break
                    end = ends[(kind, g, seq)]
                    if op[0] == "COALESCED":     # the group's calls only queue; its end waits
                        a, n = inst[r], len(op[2])
                        calls[r].append(("GROUP_START", None, -1, -1, a, 1_000))
                        calls[r] += [(o, kind, g, -1, a + 1_000 * (i + 1), 1_000) for i, o in enumerate(op[2])]
                        calls[r].append(("GROUP_END", None, -1, -1, a + 1_000 * (n + 1), end - a - 1_000 * (n + 1)))
                    else:
                        calls[r].append((op[0], kind, g, -1, inst[r], end - inst[r]))
                    coll_n[(r, kind)] = seq + 1
                    t[r] = end
                ptr[r] += 1
                done += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the simulated schedule deadlocked")
    last = [max(step_end[r][k] for r in range(world_n)) for k in range(steps)]
    step_ns = (last[-1] - last[0]) / (steps - 1)
    return {"calls": calls, "step_ns": step_ns, "layout": lay, "slowed": slowed}


def _device_launches(calls: list, kinds: list) -> tuple:
    """Per simulated call of one rank: (device start, device end, kernel launch number, stream)
    as NCCL's profiler plugin reports them: the calls of a group share its launch and its
    interval (the group's start to its end); any other call is a launch of its own. Streams:
    one per communicator kind; group starts and ends get -1."""
    n = len(calls)
    start, end = np.zeros(n, np.int64), np.zeros(n, np.int64)
    launch, stream = np.full(n, -1, np.int64), np.zeros(n, np.uint64)
    i, k = 0, 0
    while i < n:
        op, kind, _, _, a, d = calls[i]
        if op == "GROUP_START":
            j = next(j for j in range(i + 1, n) if calls[j][0] == "GROUP_END")
            ge = calls[j][4] + calls[j][5]
            for m in range(i + 1, j):
                start[m], end[m], launch[m] = a, ge, k
                stream[m] = 0x7F00_0000_0000 + kinds.index(calls[m][1])
            i, k = j + 1, k + 1
            continue
        start[i], end[i], launch[i] = a, a + d, k
        stream[i] = 0x7F00_0000_0000 + kinds.index(kind)
        i, k = i + 1, k + 1
    return start, end, launch, stream


def pipeline_instances_per_step(tp: int, pp: int, dp: int, micro: int = 4, world: bool = True,
                                dist_opt: bool = False, embedding: bool = False, fsdp: int = 0,
                                replicas: int = 1, **_) -> int:
    """Collective instances per simulated step: a tp all-reduce per microbatch forward and
    backward in every tp group, a dp all-reduce (or reduce-scatter and all-gather) per dp
    group, an embedding all-reduce per pipeline, one world all-reduce. FSDP: per layer and tp
    group a tp all-reduce forward and backward; per layer and shard group two coalesced
    all-gathers and one coalesced reduce-scatter (two calls each); HSDP: per layer and
    replicate group an all-reduce."""
    if fsdp:
        rep = fsdp * tp * (dp // replicas) if replicas > 1 else 0
        return fsdp * 2 * dp * (tp > 1) + fsdp * tp * replicas * 6 + rep + (1 if world else 0)
    return ((2 * micro * pp * dp if tp > 1 else 0) + (tp * pp * (2 if dist_opt else 1) if dp > 1 else 0)
            + (dp * tp if embedding and pp > 1 else 0) + (1 if world else 0))


OFFCPU_REASON = {"cpu-contention": "runqueue", "io": "io"}


def pipeline_session(seg_dir, tp: int, pp: int, dp: int, nodes: int, steps: int = 12,
                     fault: str = "clean", victim: int | None = None, stage_slow: int = 1,
                     slow: float = 1.5, imbalance: float = 1.0, seed: int = 5, lossy_node: int = 0,
                     loss_ms: float = 2.0, skew_ns=None, gpu: str | None = None, busy: float = 0.0,
                     untraced=(), hidden=(), **kw) -> dict:
    """Write a simulated tp x pp x dp session below `seg_dir` (one folder per node, ranks
    in order over nodes) and return the ground truth: the planted saving per step (the
    same run without the fault, same noise), the victim, stage or lossy node.

    Faults: clean, slow-rank (`victim`'s own work x `slow`), cpu-contention and io (the same,
    and the victim's off-CPU time of that reason accounts for its extra work, as the sched
    probe records it), slow-stage, imbalance (every rank's work x U(1, 1 + imbalance) per
    step), slow-node (every rank of node `lossy_node` x `slow`), network (every transfer
    between `lossy_node` and another node takes ~`loss_ms` longer, with retransmits on the
    lossy node's connections inside those transfers).
    `skew_ns[i]`: node i's clock is off by that much (the timestamps it writes).
    `gpu`: the job runs on GPUs, where an NCCL call returns once its work is queued: the
    host calls (nccl_events) are enqueue times, up to a few ms ahead of the device, 20 us
    long; with "plugin" the profiler plugin's rows (nccl_profiler_events) carry the
    simulated times as device start/end, NCCL's comm hash and per-function seq, the kernel
    launch (``group_id``: the calls of one group share it and the group's interval, from its
    start to its end, as NCCL stamps one kernel) and the stream (one per communicator).
    `busy`: a busy machine under the fault: every rank's work x U(1, 1 + busy) per step
    (other draws than `imbalance`'s); the planted saving's run keeps it.
    `untraced`: global ranks that run but whose rows are not written (no probe on them).
    `hidden`: kinds of group (e.g. "world") whose collectives run but are not written, as a
    sync over another backend (gloo, the store) would be.
    `fsdp` (layers), `replicas` and `streams` in `kw`: an FSDP (HSDP) job, asynchronous
    collectives on streams of their own (``simulate_pipeline``)."""
    from pathlib import Path

    from ingero.store import SegmentWriter

    if kw.get("streams") and not gpu:
        raise ValueError("streams run asynchronous collectives, which only a GPU job has: pass gpu='plugin' or 'host'")
    lay = pipeline_layout(tp, pp, dp, kw.get("replicas", 1))
    world = lay["world"]
    rpn = world // nodes
    frng = np.random.default_rng([seed, 99])
    draws = frng.uniform(1.0, 1.0 + imbalance, (world, steps))
    if fault in ("slow-rank", "cpu-contention", "io"):
        fac = lambda r, s: slow if r == victim else 1.0
    elif fault == "slow-stage":
        fac = lambda r, s: slow if lay["stage"][r] == stage_slow else 1.0
    elif fault == "slow-node":
        fac = lambda r, s: slow if r // rpn == lossy_node else 1.0
    elif fault == "imbalance":
        fac = lambda r, s: float(draws[r, s])
    else:
        fac = None
    if busy:
        noise = np.random.default_rng([seed, 98]).uniform(1.0, 1.0 + busy, (world, steps))
        inner = fac
        fac = lambda r, s: (inner(r, s) if inner else 1.0) * float(noise[r, s])
    extra = None
    if fault == "network":
        lrng = np.random.default_rng([seed, 7])

        def extra(members):   # only transfers that cross the lossy node's link
            on = {m // rpn == lossy_node for m in members}
            return float(lrng.uniform(0.5, 1.5) * loss_ms * 1e6) if on == {True, False} else 0.0
    run = simulate_pipeline(tp, pp, dp, steps, seed=seed, factor=fac, extra=extra, **kw)
    fixed = simulate_pipeline(tp, pp, dp, steps, seed=seed,
                              factor=(lambda r, s: float(noise[r, s])) if busy else None, **kw)
    if fault == "imbalance":
        # every rank at the median draw, without the jitter: the engine's "fix everyone" caps
        # each rank's work at its position's median, which removes the jitter above it too
        med = float(np.median(draws))
        fixed = simulate_pipeline(tp, pp, dp, steps, seed=seed, factor=lambda r, s: med,
                                  **{**kw, "jitter": 0.0})
    hashes = {k: [0x7000_0000_0000_0000 + (ki << 16) + i for i in range(len(gs))]
              for ki, (k, gs) in enumerate(lay["groups"].items())}
    names = [f"node-{chr(97 + i)}" for i in range(nodes)] if nodes <= 26 else [_scale_node(i) for i in range(nodes)]
    skew = [int(x) for x in (skew_ns or [0] * nodes)]
    # off-CPU time per rank and reason, as sched_totals has it: a little for everyone, and for a
    # starved victim what its extra work took
    off = {r: {"runqueue": 1.0 + 0.1 * (r % 3)} for r in range(world)}
    if fault in OFFCPU_REASON and victim is not None:   # 90% of the victim's extra work was off-CPU
        extra_ms = steps * (slow - 1.0) * kw.get("micro", 4) * (kw.get("fwd_ms", 4.0) + kw.get("bwd_ms", 8.0))
        reason = OFFCPU_REASON[fault]
        off[victim][reason] = off[victim].get(reason, 0.0) + 0.9 * extra_ms
    retx = []       # (timestamp on the true clock, owner global rank)
    if fault == "network":
        for a, e, members in run["slowed"]:
            owner = min(m for m in members if m // rpn == lossy_node)
            retx.append((a + 0.3 * (e - a), owner))
    t0 = 1_750_000_000_000_000_000
    for ni, node in enumerate(names):
        w = SegmentWriter(Path(seg_dir) / node, node=node, session_id="pipeline")
        ranks_rows, totals = [], []
        for r in (r for r in range(ni * rpn, (ni + 1) * rpn) if r not in untraced):
            cols = {k: [] for k in ("timestamp_ns", "duration_ns", "op", "rank", "nranks", "comm_id_hash",
                                    "seq", "peer", "pid", "tid", "global_rank", "ret", "count", "bytes")}
            seqs: dict = {}
            calls = [call for call in run["calls"][r] if call[1] not in hidden]
            dev = _device_launches(calls, list(hashes))
            for op, kind, g, peer, a, d in calls:
                cols["timestamp_ns"].append(t0 + int(a) + skew[ni])
                cols["duration_ns"].append(int(d))
                cols["op"].append(op)
                if kind is None:                   # ncclGroupStart / ncclGroupEnd: no communicator
                    for k, v in (("rank", -1), ("nranks", -1), ("comm_id_hash", 0), ("seq", 0), ("peer", -1)):
                        cols[k].append(v)
                    continue
                mem = lay["groups"][kind][g]
                h = hashes[kind][g]
                seqs[h] = seqs.get(h, 0) + 1
                cols["rank"].append(mem.index(r))
                cols["nranks"].append(len(mem))
                cols["comm_id_hash"].append(h)
                cols["seq"].append(seqs[h] - 1)
                cols["peer"].append(mem.index(peer) if peer >= 0 else -1)
            n = len(cols["op"])
            cols.update(pid=[1000 + r] * n, tid=[1000 + r] * n, global_rank=[r] * n, ret=[0] * n,
                        count=[1024] * n, bytes=[4096] * n)
            if gpu:
                dev_t = np.asarray(cols["timestamp_ns"], np.int64) - np.asarray([a for _, _, _, _, a, _ in calls], np.int64)
                dev_t, dev_d = dev_t + dev[0], dev[1] - dev[0]
                lead = np.random.default_rng([seed, r, 3]).uniform(0.2e6, 3e6, n).astype(np.int64)
                cols["timestamp_ns"] = list(dev_t - lead)          # queued before the device ran it
                cols["duration_ns"] = [20_000] * n                 # the call returns at once
                if gpu == "plugin":
                    fseq: dict = {}
                    pseq = []
                    for h, o, pe in zip(cols["comm_id_hash"], cols["op"], cols["peer"]):
                        k = (h, o, pe if o in ("SEND", "RECV") else None)   # per function; p2p per peer
                        pseq.append(fseq.get(k, 0))
                        fseq[k] = pseq[-1] + 1
                    prof = {
                        "timestamp_ns": cols["timestamp_ns"], "op": cols["op"], "rank": cols["rank"],
                        "nranks": cols["nranks"], "comm_hash": np.asarray(cols["comm_id_hash"], np.uint64),
                        "seq": pseq, "peer": cols["peer"], "count": cols["count"], "bytes": cols["bytes"],
                        "host_duration_ns": [20_000] * n, "device_start_ns": list(dev_t),
                        "device_end_ns": list(dev_t + dev_d), "device_duration_ns": list(dev_d),
                        "unfinished": [False] * n, "global_rank": [r] * n, "pid": [1000 + r] * n,
                        "tid": [1000 + r] * n, "profiler_api": [5] * n, "group_id": dev[2],
                        "stream": dev[3]}
                    ops_only = [i for i, o in enumerate(cols["op"]) if not o.startswith("GROUP")]
                    w.append("nccl_profiler_events", {k: np.asarray(v)[ops_only] if k != "op" else
                                                      [v[i] for i in ops_only] for k, v in prof.items()})
            w.append("nccl_events", {k: np.asarray(v, dtype=np.uint64) if k == "comm_id_hash" else
                                     (np.asarray(v) if k != "op" else v) for k, v in cols.items()})
            ranks_rows.append({"pid": 1000 + r, "rank": r, "local_rank": r % rpn, "world_size": world,
                               "pod": f"train-{r}", "namespace": "default"})
            totals += [{"pid": 1000 + r, "rank": r, "reason": reason, "total_ns": int(ms * 1e6),
                        "intervals": steps} for reason, ms in sorted(off[r].items())]
        mine = [(ts, o) for ts, o in retx if o // rpn == ni]
        if mine:
            w.append("tcp_events", {
                "timestamp_ns": [t0 + int(ts) + skew[ni] for ts, _ in mine],
                "event": ["tcp_retransmit_skb"] * len(mine), "pid": [1000 + o for _, o in mine],
                "rank": [o for _, o in mine], "saddr": [f"10.0.0.{ni + 1}"] * len(mine),
                "daddr": ["10.0.0.250"] * len(mine), "sport": [40000] * len(mine), "dport": [29500] * len(mine),
                "owner_source": ["socket"] * len(mine)})
        w.put_rows("ranks", ranks_rows)
        w.put_rows("sched_totals", totals)
        w.close()
    step = run["step_ns"]
    return {"step_ms": step / 1e6, "planted_saving_ms": (step - fixed["step_ns"]) / 1e6,
            "victim": victim, "stage": stage_slow, "nodes": names, "layout": lay,
            "lossy_node": names[lossy_node] if fault in ("network", "slow-node") else None,
            "node_ranks": list(range(lossy_node * rpn, (lossy_node + 1) * rpn)),
            "offsets": {names[i]: skew[i] for i in range(nodes)},
            "stage_ranks": sorted(r for r, s in lay["stage"].items() if s == stage_slow)}
