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

from dataclasses import dataclass

import duckdb
import numpy as np

from ingero.analysis.stats import NetworkHit, robust_z

NET_WAIT_Z = 3.5              # a rank's send wait on the network, an outlier among the ranks' ...
NET_WAIT_RATIO = 3.0          # ... and >= 3x the others' median (lab slow-link sender: 2.1-7.1x the
                              # other node's, 6 runs; clean: no outlier)
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
    comms: dict                 # comm_transports: {comm_hash: {NCCL transport name: [global ranks]}}


def add_proxy_waits(con, rows: dict) -> None:
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
                                    coalesce(send_net_wait_ns, 0), coalesce(peer_rank, -1)
                             FROM nccl_proxy WHERE is_send AND rank IS NOT NULL AND timestamp_ns IS NOT NULL
                             ORDER BY 2""").fetchnumpy()
    except duckdb.CatalogException:
        return None
    if not len(got["rank"]):
        return None
    cols = list(got.values())
    return ProxySends(*(np.asarray(c, np.int64) for c in cols), comms=comm_transports(con))


def proxy_network(tl, rows: dict, sends: ProxySends | None) -> NetworkHit | None:
    """The rank (or node) whose sends wait on the network far beyond the other ranks', from
    NCCL's own proxy steps alone (no TCP probe: NET/IB has none), as verdict's network rules
    return it.

    Only sends to a rank on another node count (`_across_nodes`): a transfer inside a node
    has no wire, and an inter-node transfer takes longer than an intra-node one without any
    fault. The outliers are ranks whose send wait over the trace is a robust outlier
    (NET_WAIT_Z on a NET_WAIT_FLOOR_MS floor) and NET_WAIT_RATIO times the others' median
    (with one other rank: its wait, the scale the floor); those of the node
    holding most of it are named, one rank alone when it is the only one there. The events hit
    are the sync events whose transfer window overlaps one of their stalls (a ProxyOp waiting
    over SLOW_OP_FLOOR_NS and the other ranks' SLOW_OP_QUANTILE); the replay sets them to
    the clean median."""
    if sends is None or tl is None:
        return None
    ev, m = tl.ev, tl.m
    sends = _across_nodes(sends, rows)
    total = {int(r): float(sends.wait[sends.rank == r].sum()) / 1e6 for r in np.unique(sends.rank).tolist()
             if int(r) in rows}
    if len(total) < 2 or not len(ev.a):
        return None
    z = robust_z(total, NET_WAIT_FLOOR_MS)
    peers = {r: float(np.median([v for k, v in total.items() if k != r])) for r in total}
    out = [r for r in total if z[r] >= NET_WAIT_Z and total[r] >= NET_WAIT_RATIO * peers[r]]
    if not out:
        return None
    by_node: dict = {}
    for r in out:
        by_node.setdefault(rows[r].node, []).append(r)
    node = max(by_node, key=lambda n: sum(total[r] for r in by_node[n]))
    named = sorted(by_node[node], key=lambda r: -total[r])
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
    lead = (f"NCCL's proxy: {who}'s sends waited {sum(total[k] for k in named):.0f} ms on the network "
            f"(ProxyStep SendWait) vs {peers[r]:.0f} ms per rank at median for the others (z {z[r]:.1f})")
    why = (f"{lead}; {int(slow.sum())} of {int(mine.sum())} of {their} send operations waited over {thr / 1e6:.1f} ms; "
           f"transfers with one in flight take {np.median(m.x[hit]) / 1e6:.1f} ms at median vs "
           f"{np.median(clean) / 1e6:.1f} ms without, in {int(hit.sum())} of {int(tl.inwin.sum())} sync events")
    return NetworkHit(node, hit, why, round(z[r], 2), r, single, lead)


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
                      comms=sends.comms)


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
