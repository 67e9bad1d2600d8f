"""NCCL's proxy summaries (``nccl_proxy``, Ingero's profiler plugin): per rank, how long its
transfers waited on the network, and the network candidate those waits make alone.

A send step waits for the network (NCCL's ProxyStepSendWait) while the transport has not
completed it: on a lossy or congested link its segments are resent (IB: its work request is
retried) and the step waits longer. A receive waits for the network's data too
(ProxyStepRecvWait), but also while its peer is late for any reason, so the send side is the
one read as network evidence. NCCL records step states only in its network transport
(transport/net.cc), so a ProxyOp with steps is a NET transfer; the NetPlugin events under its
steps name the plugin (socket or IB).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import duckdb
import numpy as np

from ingero.analysis.model import Rows
from ingero.analysis.stats import NetworkHit, median_of_others
from ingero.analysis.steps import Timeline

NET_WAIT_ALPHA = 0.001        # a rank's sends wait longer than its peers' in the same operations more
                              # consistently than a fair coin would once in 1000 (one-sided sign test,
                              # over the ranks tested)
NET_WAIT_FLOOR_MS = 10.0      # ... by at least this much over the trace (the scale's floor)
SLOW_OP_FLOOR_NS = 1_000_000  # one ProxyOp's send wait under 1 ms is no stall
SLOW_OP_QUANTILE = 0.95       # ... and a stall waits longer than 95% of the other ranks' ProxyOps
MIN_EVENT_SHARE = 0.05        # the stalls overlap >= 5% of the sync events (as the TCP rule asks)
TRANSPORT = {"socket": "NET/Socket", "ib": "NET/IB"}   # nccl_proxy.net -> NCCL's name for it


@dataclass
class ProxySends:
    """The send ProxyOps of the traced ranks: wall-clock start and end, send network wait."""

    rank: np.ndarray
    start: np.ndarray
    end: np.ndarray
    wait: np.ndarray
    peer: np.ndarray            # the peer's global rank, -1 where it is not known
    op: np.ndarray              # the operation (communicator, op, seq): one number on every rank, -1 not known
    comms: dict                 # comm_transports: {comm_hash: {NCCL transport name: [global ranks]}}
    nics: dict = field(default_factory=dict)   # rank_nics: {global rank: its NICs, in words}


def add_proxy_waits(con, rows: Rows) -> None:
    """Set each rank's `net_wait_ms` (model.RankRow): its sends' time waiting on the network
    over the trace, from the plugin's proxy summaries; left None without them."""
    try:
        got = con.execute("""SELECT rank, sum(send_net_wait_ns) / 1e6 FROM nccl_proxy
                             WHERE rank IS NOT NULL GROUP BY rank""").fetchall()
    except duckdb.CatalogException:
        return      # a trace written before the plugin summarised proxy operations
    for rank, ms in got:
        if rank in rows and ms is not None:
            rows[rank].net_wait_ms = round(float(ms), 3)


def comm_transports(con) -> dict:
    """{comm_hash: {NCCL transport name: [global ranks]}} from the proxy summaries: NET/IB or
    NET/Socket where NetPlugin events named the plugin, NET where the steps show the network
    transport but no plugin event came (a plugin built without NCCL_ENABLE_NET_PROFILING),
    "proxy, no network steps" for a ProxyOp without steps (P2P or SHM through the proxy).
    A communicator absent here made no transfer through NCCL's proxy (P2P/NVLink or SHM
    inside a node, or the plugin did not summarise proxy operations)."""
    try:
        got = con.execute("""SELECT comm_hash, CASE WHEN net IS NOT NULL THEN net
                                    WHEN coalesce(steps, 0) > 0 THEN 'net' END AS t,
                                    list(DISTINCT rank ORDER BY rank)
                             FROM nccl_proxy WHERE comm_hash IS NOT NULL AND rank IS NOT NULL
                             GROUP BY ALL""").fetchall()
    except duckdb.CatalogException:
        return {}
    out: dict = {}
    for comm, t, ranks in got:
        name = TRANSPORT.get(t, "NET") if t is not None else "proxy, no network steps"
        out.setdefault(comm, {})[name] = list(ranks)
    return out


def proxy_sends(con) -> ProxySends | None:
    """The send ProxyOps with their network wait, and each rank's transports; None without
    the plugin's proxy summaries."""
    try:
        got = con.execute("""SELECT rank, timestamp_ns, timestamp_ns + greatest(duration_ns, 0),
                                    coalesce(send_net_wait_ns, 0), coalesce(peer_rank, -1),
                                    CASE WHEN comm_hash IS NULL OR seq IS NULL THEN -1
                                         ELSE dense_rank() OVER (ORDER BY comm_hash, op, seq) END
                             FROM nccl_proxy WHERE is_send AND rank IS NOT NULL AND timestamp_ns IS NOT NULL
                             ORDER BY 2""").fetchnumpy()
    except duckdb.CatalogException:
        return None
    if not len(got["rank"]):
        return None
    rank, start, end, wait, peer, op = (np.asarray(c, np.int64) for c in got.values())
    return ProxySends(rank, start, end, wait, peer, op, comms=comm_transports(con), nics=rank_nics(con))


def rank_nics(con) -> dict:
    """{global rank: "eth0 (its sockets' interface)" | "mlx5_0 port 1 (uverbs)", ...}: the NICs
    each rank's proxy transfers used. NET/Socket: the interface of the sockets the NetPlugin
    events named. NET/IB: its IB event gives only the device's index inside the connection's
    virtual NIC (NCCL's qpIndex % ndevs, 0 where no ports are fused), never which NIC, so the
    ports the agent mapped the rank to (rdma_ranks, with how) name it."""
    out: dict = {}
    try:
        for rank, nic in con.execute("""SELECT DISTINCT rank, nic_device FROM nccl_proxy
                                        WHERE net = 'socket' AND rank IS NOT NULL AND nic_device IS NOT NULL
                                        ORDER BY ALL""").fetchall():
            out.setdefault(rank, []).append(f"{nic} (its sockets' interface)")
        ib = [r for (r,) in con.execute("SELECT DISTINCT rank FROM nccl_proxy WHERE net = 'ib' AND rank IS NOT NULL")
              .fetchall()]
        if ib:
            for rank, dev, port, how in con.execute(
                    """SELECT DISTINCT rank, device, port, source FROM rdma_ranks
                       WHERE rank IN (SELECT unnest(?::INTEGER[])) ORDER BY ALL""", [ib]).fetchall():
                out.setdefault(rank, []).append(f"{dev} port {port} ({how})")
    except (duckdb.CatalogException, duckdb.BinderException):
        pass        # a trace without the plugin's NIC columns or the agent's RDMA mapping
    return {r: ", ".join(v) for r, v in out.items()}


@dataclass
class PairedWait:
    """A rank's send network wait against its peers' in the same operations (`paired_waits`)."""

    mine_ms: float      # its wait, summed over the operations it shares with a peer
    peers_ms: float     # the median of the peers' wait in each of those operations, summed
    longer: int         # operations where it waited longer than that median ...
    decided: int        # ... of those where the two differ and one is a stall (over SLOW_OP_FLOOR_NS)
    p: float            # the chance of `longer` or more of `decided` for a rank as fast as its peers

    @property
    def excess_ms(self) -> float:
        return self.mine_ms - self.peers_ms


def sign_test(k: int, n: int) -> float:
    """P(X >= k) for X ~ Binomial(n, 1/2): the one-sided sign test, summed term by term from
    the k-th (its logarithm from lgamma) until the terms no longer count."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    term = math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) - n * math.log(2))
    total = 0.0
    for i in range(k, n + 1):
        total += term
        if term < 1e-17 * total and i > n / 2:
            break
        term *= (n - i) / (i + 1)
    return min(total, 1.0)


def paired_waits(sends: ProxySends) -> dict[int, PairedWait]:
    """Per rank, its sends' network wait in each operation (communicator, op, seq) against the
    median of the other ranks' in the same operation: a link slowed both ways (a congested
    port delays the data one way and the acknowledgements the other) makes its peers' waits
    grow with its own, and a busy machine grows them all, so only the comparison inside one
    operation, counted over many, says which side waits. Sends of unknown operation are left
    out."""
    ok = sends.op >= 0
    if not ok.any():
        return {}
    width = int(sends.rank[ok].max()) + 1
    key, inv = np.unique(sends.op[ok] * width + sends.rank[ok], return_inverse=True)
    wait = np.bincount(inv.ravel(), sends.wait[ok], len(key))
    op, rank = key // width, key % width
    peers = median_of_others(op, wait)
    has = ~np.isnan(peers)
    theirs = np.where(has, peers, 0.0)
    decided = has & (np.maximum(wait, theirs) >= SLOW_OP_FLOOR_NS) & (wait != theirs)
    ranks, i = np.unique(rank, return_inverse=True)
    sums = [np.bincount(i, w, len(ranks)) for w in (has * wait, theirs, decided & (wait > theirs), decided, has)]
    return {int(r): PairedWait(mine / 1e6, peer / 1e6, int(k), int(n), sign_test(int(k), int(n)))
            for r, mine, peer, k, n, shared in zip(ranks.tolist(), *sums) if shared}


def net_wait_outliers(sends: ProxySends) -> dict[int, PairedWait]:
    """The ranks whose sends wait on the network longer than their peers' in the same
    operations, consistently (the sign test at NET_WAIT_ALPHA over the ranks tested) and by
    NET_WAIT_FLOOR_MS or more over the trace."""
    paired = paired_waits(sends)
    return {r: w for r, w in paired.items()
            if w.p <= NET_WAIT_ALPHA / len(paired) and w.excess_ms >= NET_WAIT_FLOOR_MS}


def proxy_network(tl: Timeline, rows: Rows, sends: ProxySends | None) -> NetworkHit | None:
    """The rank (or node) whose sends wait on the network beyond the other ranks', from
    NCCL's own proxy steps alone (no TCP probe: NET/IB has none), as verdict's network rules
    return it.

    Only sends to a rank on another node count (`_across_nodes`): a transfer inside a node
    has no wire, and an inter-node transfer takes longer than an intra-node one without any
    fault. The outliers (`net_wait_outliers`) are compared operation by operation with the
    other ranks sending between nodes; those of the node holding most of their excess are
    named, one rank alone when it is the only one there. The events hit are the sync events
    whose transfer window overlaps one of their stalls (a ProxyOp waiting over
    SLOW_OP_FLOOR_NS and the other ranks' SLOW_OP_QUANTILE); the replay sets them to the
    clean median."""
    if sends is None or tl is None:
        return None
    ev, m = tl.ev, tl.m
    sends = _across_nodes(sends, rows)
    if not len(ev.a):
        return None
    out = {r: w for r, w in net_wait_outliers(sends).items() if r in rows}
    if not out:
        return None
    by_node: dict = {}
    for r in out:
        by_node.setdefault(rows[r].node, []).append(r)
    node = max(by_node, key=lambda n: sum(out[r].excess_ms for r in by_node[n]))
    named = sorted(by_node[node], key=lambda r: -out[r].excess_ms)
    mine = np.isin(sends.rank, named)
    others = sends.wait[~mine]
    thr = max(SLOW_OP_FLOOR_NS, float(np.quantile(others, SLOW_OP_QUANTILE)) if len(others) else 0.0)
    slow = mine & (sends.wait > thr)
    if not slow.any():
        return None
    lo, hi = sends.start[slow], np.maximum.accumulate(sends.end[slow])   # starts sorted (proxy_sends)
    i = np.searchsorted(lo, ev.e, side="right") - 1
    hit = tl.inwin & (i >= 0) & (hi[np.maximum(i, 0)] >= m.ready)
    clean = m.x[~hit & tl.inwin]
    if hit.sum() < MIN_EVENT_SHARE * tl.inwin.sum() or not len(clean):
        return None
    r = named[0]
    node_ranks = [k for k, v in rows.items() if v.node == node]
    single = len(named) == 1 or len(node_ranks) == 1
    who = f"rank {r}" if len(named) == 1 else "ranks " + ", ".join(map(str, sorted(named)))
    their = "its" if len(named) == 1 else "their"
    w = out[r]
    lead = (f"NCCL's proxy: {who}'s sends waited {sum(out[k].mine_ms for k in named):.0f} ms on the network "
            f"(ProxyStep SendWait) vs {sum(out[k].peers_ms for k in named):.0f} ms for the other ranks' in the same "
            f"operations (median per operation); {'rank ' + str(r) if len(named) > 1 else 'it'} waited longer in "
            f"{w.longer} of the {w.decided} operations where one of them waited over {SLOW_OP_FLOOR_NS / 1e6:.0f} ms")
    why = (f"{lead}; {int(slow.sum())} of {int(mine.sum())} of {their} send operations waited over {thr / 1e6:.1f} ms; "
           f"transfers with one in flight take {np.median(m.x[hit]) / 1e6:.1f} ms at median vs "
           f"{np.median(clean) / 1e6:.1f} ms without, in {int(hit.sum())} of {int(tl.inwin.sum())} sync events")
    nics = [f"rank {k}: {sends.nics[k]}" if len(named) > 1 else sends.nics[k] for k in sorted(named) if k in sends.nics]
    if nics:
        why += f"; {their} NIC{'s' if len(nics) > 1 or ',' in nics[0] else ''}: {'; '.join(nics)}"
    return NetworkHit(node, hit, why, round(w.longer / w.decided, 2), r, single, lead)


def _across_nodes(sends: ProxySends, rows: dict) -> ProxySends:
    """The sends whose peer is known to be on another node than the sender, or not known at
    all. NCCL records step states only in its network transport, which it uses inside a node
    only with P2P and SHM turned off; the lab's NCCL sends between ranks of one node over the
    same socket transport."""
    node = {r: v.node for r, v in rows.items()}
    mine = [node.get(r) for r in sends.rank.tolist()]
    theirs = [node.get(p) for p in sends.peer.tolist()]
    keep = np.array([a is None or b is None or a != b for a, b in zip(mine, theirs)], bool)
    return ProxySends(sends.rank[keep], sends.start[keep], sends.end[keep], sends.wait[keep], sends.peer[keep],
                      sends.op[keep], comms=sends.comms, nics=sends.nics)


def transport_note(sends: ProxySends | None, ranks: list, most: int = 4) -> str:
    """"; NCCL's transport per communicator of these ranks (proxy): <hash> NET/Socket, …": the
    transports of the communicators `ranks` made proxy transfers in, or "" without them."""
    if sends is None:
        return ""
    want = set(ranks)
    got = [(comm, names) for comm, names in sorted(sends.comms.items())
           if any(want & set(rs) for rs in names.values())]
    if not got:
        return ""
    parts = [f"{comm:016x} {' + '.join(sorted(names))}" for comm, names in got[:most]]
    more = f" and {len(got) - most} more" if len(got) > most else ""
    return f"; NCCL's transport per communicator of these ranks (proxy): {', '.join(parts)}{more}"
