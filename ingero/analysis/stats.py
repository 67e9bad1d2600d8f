"""Per-rank statistics and small vectorised helpers (grouped quantiles, robust z)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

import numpy as np

from ingero.analysis.calls import OPS, Calls, _RECV, _SEND
from ingero.analysis.model import RankRow, Rows

K = TypeVar("K")           # whatever robust_z's values are keyed by


def _packed(keys: np.ndarray, values: np.ndarray):
    """keys and values packed into one sortable int64 (key in the high bits), when they fit:
    (packed, value bits, value offset, value scale), else None. Sorting one int64 array is
    ~6x faster than np.lexsort of two."""
    if not len(keys) or keys.min() < 0:
        return None
    scale = 1
    if values.dtype.kind == "f":
        twice = values * 2
        if not np.isfinite(twice).all() or not (twice == np.round(twice)).all():
            return None
        values, scale = twice.astype(np.int64), 2          # medians of ints are x or x.5
    elif values.dtype.kind not in "iu":
        return None
    lo = int(values.min())
    span = int(values.max()) - lo
    kbits = max(int(keys.max()).bit_length(), 1)
    vbits = max(span.bit_length(), 1)
    if kbits + vbits > 62:
        return None
    packed = (keys.astype(np.int64) << vbits) | (values.astype(np.int64) - lo)
    return packed, vbits, lo, scale


def group_sort(keys: np.ndarray, values: np.ndarray):
    """(unique keys, start of each group, its size, values sorted within groups)."""
    p = _packed(keys, values)
    if p is not None:
        packed, vbits, lo, scale = p
        packed.sort()
        k = packed >> vbits
        v = (packed & ((1 << vbits) - 1)) + lo
        v = v / scale if scale != 1 else v
    else:
        o = np.lexsort((values, keys))
        k, v = keys[o], values[o]
    new = np.r_[True, k[1:] != k[:-1]] if len(k) else np.zeros(0, bool)
    starts = np.flatnonzero(new)
    sizes = np.diff(np.r_[starts, len(k)])
    return k[starts], starts, sizes, v


def group_quantile(keys: np.ndarray, values: np.ndarray, q: float):
    """(unique keys, quantile_cont(q) of each group's values), linear interpolation."""
    uk, _, (qv,) = group_quantiles(keys, values, (q,))
    return uk, qv


def group_quantiles(keys: np.ndarray, values: np.ndarray, qs) -> tuple[np.ndarray, np.ndarray, list]:
    """(unique keys, group sizes, [quantile_cont(q) of each group's values for q in qs]), one sort."""
    uk, starts, sizes, v = group_sort(keys, values)
    out = []
    for q in qs:
        rn = (sizes - 1) * q
        lo = np.floor(rn).astype(np.int64)
        hi = np.ceil(rn).astype(np.int64)
        f = rn - lo
        vl, vh = v[starts + lo].astype(np.float64), v[starts + hi].astype(np.float64)
        out.append(vl + (vh - vl) * f)
    return uk, sizes, out


def quantile_at(keys: np.ndarray, values: np.ndarray, q: float, at: np.ndarray) -> np.ndarray:
    """quantile_cont(q) of the group (by key) of `values`, looked up for each key in `at`
    (NaN where `at` holds a key with no values)."""
    out = np.full(len(at), np.nan)
    if len(keys) == 0 or len(at) == 0:
        return out
    uk, qv = group_quantile(keys, values, q)
    pos = np.minimum(np.searchsorted(uk, at), len(uk) - 1)
    hit = uk[pos] == at
    out[hit] = qv[pos[hit]]
    return out


def median_of_others(keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """For each element, the median of the other elements with the same key (NaN alone)."""
    n = len(values)
    out = np.full(n, np.nan)
    if n == 0:
        return out
    p = _packed(keys - keys.min(), values)
    if p is None:                     # keys too wide to pack: number them densely first
        p = _packed(np.unique(keys, return_inverse=True)[1].ravel(), values)
    o = np.argsort(p[0]) if p is not None else np.lexsort((values, keys))
    del p
    k = keys[o]
    new = np.empty(n, bool)
    new[0] = True
    np.not_equal(k[1:], k[:-1], out=new[1:])
    del k
    starts = np.flatnonzero(new)
    del new
    sizes = np.diff(np.r_[starts, n])
    gs = np.repeat(starts, sizes)                    # each element's group start (sorted order)
    m = np.repeat(sizes - 1, sizes)                  # others in the group
    i = np.arange(n) - gs                            # own index within the sorted group
    v = values[o].astype(np.float64)

    def pick(j):
        j += j >= i                                  # the j-th of the others, skipping itself
        j += gs
        return v[np.minimum(j, n - 1, out=j)]

    med = pick((m - 1) // 2)
    med += pick(m // 2)
    med /= 2
    med[m == 0] = np.nan
    out[o] = med
    return out


def robust_z(values: Mapping[K, float], floor: float) -> dict[K, float]:
    """For each key, (x - median of the others) / max(1.4826 * MAD of the others, floor).

    Each value is judged against its peers without itself: with a handful of ranks, an
    outlier inside its own median and MAD widens the scale it is measured by."""
    keys = list(values)
    if len(keys) < 2:
        return {k: 0.0 for k in keys}
    x = np.asarray([float(values[k]) for k in keys])
    n = len(x)
    z = np.empty(n)
    for lo in range(0, n, 256):                     # rows of "the others", a block at a time
        i = np.arange(lo, min(lo + 256, n))
        keep = np.ones((len(i), n), bool)
        keep[np.arange(len(i)), i] = False
        others = np.broadcast_to(x, keep.shape)[keep].reshape(len(i), n - 1)
        med = np.median(others, axis=1)
        scale = np.maximum(1.4826 * np.median(np.abs(others - med[:, None]), axis=1), floor)
        z[i] = (x[i] - med) / scale
    return dict(zip(keys, z.tolist()))


def rank_rows(c: Calls, slow_collective_ms: float | None) -> tuple[Rows, list[str]]:
    """Per rank: collective counts, duration quantiles (all and per op), arrival lateness,
    share of instances where it came last."""
    rows: Rows = {}
    warnings: list[str] = []
    coll = c.inst >= 0
    ranks = np.unique(c.rank[(c.op > 0)]) if c.n else np.zeros(0, np.int64)
    for r in ranks.tolist():
        node, pod, pid = c.node_of.get(r, (None, None, 0))
        rows[r] = RankRow(rank=r, node=node, pod=pod, pid=pid)
    if not coll.any():
        return rows, warnings
    cr, cd, ct, ci, co = c.rank[coll], c.d[coll], c.t[coll], c.inst[coll], c.op[coll].astype(np.int64)
    W = int(cr.max()) + 1
    key = cr * 64 + co
    kk, cnt, (q50, q99) = group_quantiles(key, cd, (0.5, 0.99))
    uk = np.unique(kk // 64)
    if len(uk) == len(kk):           # one op per rank: its calls are its op's calls
        n, p50, p99 = cnt, q50, q99
    else:
        uk, n, (p50, p99) = group_quantiles(cr, cd, (0.5, 0.99))
    for r, k in zip(uk.tolist(), n.tolist()):
        rows[r].collectives = k
    for r, a, b in zip(uk.tolist(), p50.tolist(), p99.tolist()):
        rows[r].p50_ms, rows[r].p99_ms = a / 1e6, b / 1e6
    for k, m, a, b in zip(kk.tolist(), cnt.tolist(), q50.tolist(), q99.tolist()):
        rows[k // 64].per_op[OPS[k % 64 - 1]] = {"calls": m, "p50_ms": a / 1e6, "p99_ms": b / 1e6}
    if slow_collective_ms is not None:
        slow = np.bincount(cr[cd > slow_collective_ms * 1e6], minlength=W)
        for r in rows:
            rows[r].slow_collectives = int(slow[r]) if r < len(slow) else 0
    # lateness: arrival - the instance's median arrival, instances with more than one call
    ui, starts, sizes, ts = group_sort(ci, ct)
    med = (ts[starts + (sizes - 1) // 2].astype(np.float64) + ts[starts + sizes // 2]) / 2
    last_t = ts[starts + sizes - 1]
    pos = np.searchsorted(ui, ci)
    multi = sizes[pos] > 1
    late = ct - med[pos]
    is_last = ct == last_t[pos]
    arrived = np.bincount(cr[multi], minlength=W)
    lasts = np.bincount(cr[multi & is_last], minlength=W)
    if multi.any():
        lk, lm = group_quantile(key[multi], late[multi], 0.5)
        best: dict = {}
        for k, m in zip(lk.tolist(), lm.tolist()):
            best[k // 64] = max(best.get(k // 64, m), m)
        for r, m in best.items():
            rows[r].late_ms = m / 1e6
    for r in rows:
        a = int(arrived[r]) if r < len(arrived) else 0
        rows[r].last_share = (int(lasts[r]) / a) if a else 0.0
        if a == 0 and rows[r].collectives:
            warnings.append(f"rank {r}: no collective matched on another rank (other ranks not traced?)")
    return rows, warnings


def p2p_calls(c: Calls) -> int:
    return int(np.count_nonzero((c.op == _SEND) | (c.op == _RECV)))


# Retransmits with the rank that owns the connection (by socket owner pid, else the event's
# rank), and whether the connection stays inside its node: to the node's own address (or a
# loopback one, or another pod's address on that node), i.e. no wire between the two ends.
RETX_BY_RANK = """
    WITH node_addr AS (
        SELECT DISTINCT node, trim(unnest(string_split(addresses, ','))) AS addr
        FROM ranks WHERE addresses IS NOT NULL AND addresses <> '')
    SELECT t.timestamp_ns AS ts, COALESCE(r.rank, t.rank) AS grank, t.node AS node,
           coalesce(t.daddr = t.saddr OR t.daddr LIKE '127.%' OR t.daddr = '::1'
                    OR t.daddr IN (SELECT a.addr FROM node_addr a WHERE a.node IS NOT DISTINCT FROM t.node),
                    false) AS local
    FROM tcp_events t
    LEFT JOIN (SELECT node, pid, any_value(rank) AS rank FROM ranks GROUP BY ALL) r
      ON r.node IS NOT DISTINCT FROM t.node AND r.pid = t.pid AND t.pid > 0
    WHERE t.event = 'tcp_retransmit_skb' AND t.timestamp_ns IS NOT NULL"""


class Retransmits(NamedTuple):
    """Every retransmit, by time: who owns its connection and whether that stays in one node."""

    ts: np.ndarray            # timestamps, sorted
    rank: np.ndarray          # the rank owning the connection, -1 where none does
    node: list                # the node it was seen on
    local: np.ndarray         # the connection stays inside its node (no wire between its ends)

    def only(self, keep: np.ndarray) -> Retransmits:
        """The retransmits where `keep` holds."""
        return Retransmits(self.ts[keep], self.rank[keep], [n for n, k in zip(self.node, keep) if k],
                           self.local[keep])


@dataclass
class NetworkHit:
    """A node (or one rank on it) whose link lost or delayed data while transfers were in
    flight: TCP retransmits and RDMA counters (verdict), NCCL's proxy waits (proxy)."""

    node: str
    hit: np.ndarray           # per sync event: the loss fell inside its transfer
    why: str
    share: float              # its score: the share of the loss on it (the proxy's: of the operations)
    rank: int | None          # the rank named for it
    single: bool              # that rank alone
    lead: str = ""            # the evidence's first clause, what the loss is (quoted beside a starved rank)
    rdma: bool = False        # RDMA counters: no TCP timers that a starved rank could fire


def retransmits(con) -> Retransmits:
    """Every retransmit of the trace, by time."""
    rows = con.execute(RETX_BY_RANK + " ORDER BY ts").fetchall()
    ts = np.array([r[0] for r in rows], np.int64)
    rk = np.array([-1 if r[1] is None else r[1] for r in rows], np.int64)
    return Retransmits(ts, rk, [r[2] for r in rows], np.array([bool(r[3]) for r in rows], bool))


def add_network(c: Calls, rows: Rows, ts: np.ndarray, rk: np.ndarray, windows: bool = True) -> None:
    """Retransmits per rank on its own connections, and (`windows`: the calls' times are
    when the data moved) those inside its calls' windows."""
    for r in rows.values():
        mine = ts[rk == r.rank]
        r.retransmits = len(mine)
        if not len(mine) or not windows:
            continue
        lo, hi = np.searchsorted(c.rank, [r.rank, r.rank + 1])          # calls come rank by rank
        sel = np.flatnonzero(c.op[lo:hi] > 0) + lo
        t, e = c.t[sel], c.t[sel] + c.d[sel]
        o = np.argsort(t, kind="stable")
        t, e = t[o], np.maximum.accumulate(e[o])
        i = np.searchsorted(t, mine, side="right") - 1
        r.retransmits_in_window = int(np.count_nonzero((i >= 0) & (e[np.maximum(i, 0)] >= mine)))


def add_offcpu(con, rows: Rows) -> None:
    """Off-CPU time by reason: kernel totals when present, else the events over threshold.

    An I/O wait is the whole interval, blocked and then runnable until it runs: the wait for
    a CPU after the wake-up comes of the I/O (without the block there is no wake-up to wait
    after). The events' durations hold it; the kernel's totals count that runnable tail under
    runqueue, so the tails of the recorded I/O intervals move from runqueue to io."""
    has_totals = con.execute("SELECT count(*) FROM sched_totals").fetchone()[0] > 0
    src, col = ("sched_totals", "total_ns") if has_totals else ("sched_events", "duration_ns")
    # the number of waits only from the kernel's totals: the events are only those over a threshold
    waits = "sum(s.intervals)" if has_totals else "NULL"
    q = f"SELECT COALESCE(r.rank, s.rank), s.reason, sum(s.{col}), {waits} FROM {_ranked(src)} GROUP BY ALL"
    for grank, reason, ns, n in con.execute(q).fetchall():
        if grank in rows and reason and ns is not None:
            rows[grank].offcpu_ms[reason] = ns / 1e6
            if n:
                rows[grank].offcpu_waits[reason] = int(n)
    if not has_totals:
        return
    q = f"SELECT COALESCE(r.rank, s.rank), sum(s.runq_ns) FROM {_ranked('sched_events')} WHERE s.reason = 'io' GROUP BY ALL"
    for grank, ns in con.execute(q).fetchall():
        if grank in rows and ns:
            ms = rows[grank].offcpu_ms
            ms["io"] = ms.get("io", 0.0) + ns / 1e6
            ms["runqueue"] = max(ms.get("runqueue", 0.0) - ns / 1e6, 0.0)


def _ranked(src: str) -> str:
    """The sched table `src` (alias s) beside the rank of its process (alias r)."""
    return f"""{src} s LEFT JOIN (SELECT node, pid, any_value(rank) AS rank FROM ranks GROUP BY ALL) r
               ON r.node IS NOT DISTINCT FROM s.node AND r.pid = s.pid"""


class RunqTails(NamedTuple):
    """The runnable tail of each recorded off-CPU interval: the wait for a CPU that ends it."""

    rank: np.ndarray          # -1 where the process has none
    start: np.ndarray
    end: np.ndarray


def runqueue_tails(con) -> RunqTails:
    """The runnable tail of every recorded off-CPU interval (the whole interval for a
    preempted thread) but the I/O ones, whose wait for a CPU is the I/O's (`add_offcpu`).
    Only the intervals over the tracer's threshold are events."""
    q = f"""SELECT COALESCE(r.rank, s.rank, -1) AS g, s.timestamp_ns + s.duration_ns AS e, s.runq_ns AS rq
            FROM {_ranked('sched_events')} WHERE s.runq_ns > 0 AND s.reason IS DISTINCT FROM 'io'
              AND s.timestamp_ns IS NOT NULL AND s.duration_ns IS NOT NULL"""
    cols = con.execute(q).fetchnumpy()
    g, e, rq = (np.asarray(cols[k], np.int64) for k in ("g", "e", "rq"))
    return RunqTails(g, e - rq, e)


# RDMA counters that count loss or congestion on a port, as the evidence names them (the
# kernel's sysfs-class-infiniband; mlx5's Q and congestion counters, "vport_" + name in
# switchdev mode). port_xmit_wait is not among them: a busy port waits for credits too.
RDMA_EVIDENCE = {
    "symbol_error": "symbol errors", "link_error_recovery": "link error recoveries",
    "link_downed": "link downs", "port_rcv_errors": "receive errors",
    "port_rcv_remote_physical_errors": "remote physical errors", "port_xmit_discards": "discarded sends",
    "local_link_integrity_errors": "link integrity errors",
    "excessive_buffer_overrun_errors": "buffer overruns", "out_of_sequence": "out-of-sequence",
    "packet_seq_err": "packet sequence errors", "implied_nak_seq_err": "implied NAK sequence errors",
    "local_ack_timeout_err": "local ACK timeouts", "rnr_nak_retry_err": "RNR NAK retries",
    "req_transport_retries_exceeded": "transport retries exceeded",
    "req_rnr_retries_exceeded": "RNR retries exceeded", "duplicate_request": "duplicate requests",
    "np_cnp_sent": "CNPs sent", "rp_cnp_handled": "CNPs handled",
    "np_ecn_marked_roce_packets": "ECN-marked packets",
}


@dataclass
class RdmaPort:
    """One RDMA port's loss and congestion counters over the trace, and the ranks behind it."""

    node: str | None
    device: str
    port: int
    ranks: list                # global ranks that use it
    how: str | None            # nccl_proxy | NCCL_IB_HCA | uverbs | gpu-pci | cpu-numa (None: no traced rank uses it)
    start: np.ndarray          # sampling intervals with a rise, sorted: [start, end] wall ns
    end: np.ndarray
    by_counter: dict           # counter -> its rise in each interval
    count: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))   # all of them, per interval

    def totals(self, sel: np.ndarray | None = None) -> list[tuple[str, int]]:
        """(what, how many) per counter, the most first, over the intervals `sel` (all)."""
        got = [(RDMA_EVIDENCE[k], int(v.sum() if sel is None else v[sel].sum())) for k, v in self.by_counter.items()]
        return sorted(((w, n) for w, n in got if n), key=lambda x: -x[1])

    def label(self) -> str:
        return f"{self.device} port {self.port}"


def _has_table(con, name: str, cols: tuple[str, ...]) -> bool:
    have = {c for (c,) in con.execute("SELECT column_name FROM duckdb_columns() WHERE table_name = ? "
                                      "AND NOT internal", [name]).fetchall()}
    return set(cols) <= have


def rdma_ports(con) -> list[RdmaPort]:
    """Every port whose loss or congestion counters rose, with the ranks that use it: from the
    profiler plugin's proxy table (the NIC each channel used) where it names a rank, else from
    the agent's rdma_ranks (NCCL_IB_HCA, the devices the rank holds open, the NICs nearest its
    GPU or CPUs)."""
    if not _has_table(con, "rdma_counters", ("node", "device", "port", "counter", "delta", "interval_ns")):
        return []
    names = [*RDMA_EVIDENCE, *(f"vport_{k}" for k in RDMA_EVIDENCE)]
    rows = con.execute(
        "SELECT node, device, port, regexp_replace(counter, '^vport_', '') AS c, timestamp_ns - interval_ns, "
        "timestamp_ns, sum(delta) FROM rdma_counters WHERE counter IN (SELECT unnest(?::VARCHAR[])) "
        "AND delta > 0 AND timestamp_ns IS NOT NULL GROUP BY ALL ORDER BY 1, 2, 3, 6", [names]).fetchall()
    if not rows:
        return []
    uses: dict = {}
    proxy: set = set()
    if _has_table(con, "nccl_proxy", ("rank", "nic_device", "nic_port")):
        node = "p.node" if _has_table(con, "nccl_proxy", ("node",)) else "NULL"
        for nd, dev, port, rank in con.execute(
                f"SELECT DISTINCT coalesce({node}, r.node), p.nic_device, p.nic_port, p.rank FROM nccl_proxy p "
                "LEFT JOIN (SELECT rank, any_value(node) AS node FROM ranks GROUP BY ALL) r ON r.rank = p.rank "
                "WHERE p.rank IS NOT NULL AND p.nic_device IS NOT NULL").fetchall():
            uses.setdefault((nd, dev, port), {})[rank] = "nccl_proxy"
            proxy.add(rank)
    if _has_table(con, "rdma_ranks", ("node", "rank", "device", "port", "source")):
        for nd, dev, port, rank, how in con.execute(
                "SELECT DISTINCT node, device, port, rank, source FROM rdma_ranks WHERE rank IS NOT NULL").fetchall():
            if rank not in proxy:
                uses.setdefault((nd, dev, port), {})[rank] = how
    out: list[RdmaPort] = []
    for key in dict.fromkeys((nd, dev, port) for nd, dev, port, *_ in rows):
        mine = [r for r in rows if (r[0], r[1], r[2]) == key]
        spans = sorted({(s, e) for *_, s, e, _ in mine})
        at = {s: i for i, s in enumerate(spans)}
        by: dict = {}
        for *_, c, s, e, d in mine:
            by.setdefault(c, np.zeros(len(spans), np.int64))[at[(s, e)]] += int(d)
        who = uses.get(key, {})
        out.append(RdmaPort(node=key[0], device=key[1], port=key[2], ranks=sorted(who),
                            how=",".join(sorted(set(who.values()))) or None,
                            start=np.array([s for s, _ in spans], np.int64), end=np.array([e for _, e in spans], np.int64),
                            by_counter=by, count=np.sum(list(by.values()), axis=0)))
    return out

