"""A trace as Chrome Trace Event JSON, the format ui.perfetto.dev (and chrome://tracing) opens.

Layout: one process per node (``pid`` in node-name order, ``process_sort_index``
the same), one thread track per rank (``thread_sort_index`` by rank, so the
order is the same on every export). On a rank's track:

* NCCL calls as complete slices (``"ph": "X"``; cat ``collective``, ``p2p``
  or ``comm``) named by op, with op, bytes, count, comm (id hash in hex), seq,
  nranks and the rank's arrival lateness against the median of the
  collective's ranks in ``args``;
* calls NCCL only simulated (in a group closed by ``ncclGroupSimulateEnd``; the
  analysis leaves them out, ingero/analysis/calls.py) drawn where the host made
  them, as cat ``simulated``, named ``<op> (simulated)``, with ``simulated`` in
  ``args``, no lateness and no arrows: they ran on no wire, yet the host spent
  that time in the call;
* off-CPU intervals (cat ``offcpu``) as slices: they nest inside the NCCL call
  the thread was blocked in;
* TCP retransmits and resets on the rank's own connections as instant events
  (``"ph": "i"``, thread scope); ones owned by no known rank are process-scoped
  instants on their node.

Slices on one track must nest perfectly (the format and Perfetto require it).
Those that would overlap partially (other threads of the same rank) move to
an extra track of that rank ("rank 3 · overlap 1"), never clipped or dropped.

Flow arrows (``"s"`` -> ``"f"`` with ``"bp": "e"``, bound to the enclosing
slice) link each rank's slice of a collective (same comm_id_hash, seq, op; seq
counted over launched calls, as the analysis counts it) to the slice of the
rank that arrived last, so a late arrival is where all the arrows of a
collective point.

Timestamps are microseconds since the first event of the trace (``t0_ns`` in
``otherData``), written with nanosecond precision.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ingero.analysis.calls import simulated_calls
from ingero.console import parse_seconds
from ingero.errors import IngeroError
from ingero.schema import COLLECTIVE_OPS, LIFECYCLE_OPS, P2P_OPS
from ingero.readonly_sql import open_source

_COLL = ", ".join(f"'{o}'" for o in COLLECTIVE_OPS)
_P2P = ", ".join(f"'{o}'" for o in P2P_OPS)
_LIFE = ", ".join(f"'{o}'" for o in LIFECYCLE_OPS)
TCP_INSTANTS = ("tcp_retransmit_skb", "tcp_send_reset", "tcp_receive_reset")


@dataclass
class Summary:
    """What an export holds; counts per kind."""

    slices: dict[str, int] = field(default_factory=dict)   # cat -> X events
    instants: int = 0
    flows: int = 0
    tracks: int = 0
    nodes: int = 0
    overlap_tracks: int = 0
    sampled_stride: int = 1
    t0_ns: int | None = None


def _prepare(con) -> None:
    con.execute("""CREATE OR REPLACE TEMP VIEW _pf_rk AS
        SELECT node, pid, any_value(rank) AS rank, any_value(pod) AS pod FROM ranks GROUP BY ALL""")
    # the analysis' own marks: calls NCCL only simulated, and seq over launched calls
    sim = simulated_calls(con)
    if sim is None:
        con.execute("CREATE OR REPLACE TEMP TABLE _pf_sim (node VARCHAR, event_id UBIGINT, simulated BOOLEAN, "
                    "seq BIGINT)")
    else:
        con.register("_pf_sim_arrow", sim)
        con.execute("CREATE OR REPLACE TEMP TABLE _pf_sim AS SELECT * FROM _pf_sim_arrow")
        con.unregister("_pf_sim_arrow")
    con.execute(f"""CREATE OR REPLACE TEMP VIEW _pf_slices AS
        SELECT 'nccl' AS kind, e.event_id, e.node, COALESCE(r.rank, e.global_rank, e.rank) AS grank, e.pid, e.tid,
               COALESCE(r.pod, e.pod) AS pod, e.timestamp_ns AS ts, greatest(e.duration_ns, 0) AS dur,
               CASE WHEN m.simulated THEN e.op || ' (simulated)' ELSE e.op END AS name,
               CASE WHEN m.simulated THEN 'simulated' WHEN e.op IN ({_COLL}) THEN 'collective'
                    WHEN e.op IN ({_P2P}) THEN 'p2p' ELSE 'comm' END AS cat,
               e.bytes, e.count, e.datatype, e.comm_id_hash, e.seq, e.nranks, e.rank AS comm_rank, e.peer, e.ret,
               e.in_group, NULL::VARCHAR AS reason, NULL::BIGINT AS runq_ns,
               CASE WHEN e.op IN ({_COLL}) AND e.comm_id_hash <> 0 AND NOT COALESCE(m.simulated, false)
                    THEN e.timestamp_ns - median(e.timestamp_ns) OVER (
                        PARTITION BY e.comm_id_hash, COALESCE(m.seq, e.seq), e.op, COALESCE(m.simulated, false))
               END AS late_ns,
               COALESCE(m.seq, e.seq) AS inst_seq, COALESCE(m.simulated, false) AS simulated
        FROM nccl_events e LEFT JOIN _pf_rk r ON r.node IS NOT DISTINCT FROM e.node AND r.pid = e.pid
        LEFT JOIN _pf_sim m ON m.node IS NOT DISTINCT FROM e.node AND m.event_id = e.event_id
        WHERE e.op IN ({_COLL}, {_P2P}, {_LIFE})
        UNION ALL
        SELECT 'offcpu', s.event_id, s.node, COALESCE(r.rank, s.rank), s.pid, s.tid, COALESCE(r.pod, s.pod),
               s.timestamp_ns, greatest(s.duration_ns, 0), 'off-CPU: ' || COALESCE(s.reason, '?'), 'offcpu',
               NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, s.reason, s.runq_ns, NULL, NULL, false
        FROM sched_events s LEFT JOIN _pf_rk r ON r.node IS NOT DISTINCT FROM s.node AND r.pid = s.pid""")
    ins = ", ".join(f"'{e}'" for e in TCP_INSTANTS)
    con.execute(f"""CREATE OR REPLACE TEMP VIEW _pf_instants AS
        SELECT t.node, CASE WHEN t.pid > 0 THEN COALESCE(r.rank, t.rank) ELSE t.rank END AS grank, t.pid,
               COALESCE(r.pod, t.pod) AS pod, t.timestamp_ns AS ts, t.event AS name, t.saddr, t.daddr,
               t.sport, t.dport, t.owner_source
        FROM tcp_events t LEFT JOIN _pf_rk r ON r.node IS NOT DISTINCT FROM t.node AND r.pid = t.pid AND t.pid > 0
        WHERE t.event IN ({ins})""")


def _window(con, start_s: float | None, end_s: float | None) -> tuple[int | None, int, int]:
    t0 = con.execute("SELECT least((SELECT min(ts) FROM _pf_slices), (SELECT min(ts) FROM _pf_instants))"
                     ).fetchone()[0]
    if t0 is None:
        return None, 0, 0
    lo = t0 + int((start_s or 0) * 1e9)
    hi = t0 + int(end_s * 1e9) if end_s is not None else (1 << 63) - 1
    return int(t0), lo, hi


def _stride(con, lo: int, hi: int, max_events: int | None) -> int:
    if not max_events:
        return 1
    n_sl, n_coll = con.execute("SELECT count(*), count(*) FILTER (WHERE cat = 'collective') FROM _pf_slices "
                               "WHERE ts >= ? AND ts < ?", [lo, hi]).fetchone()
    n_in = con.execute("SELECT count(*) FROM _pf_instants WHERE ts >= ? AND ts < ?", [lo, hi]).fetchone()[0]
    total = n_sl + n_in + 2 * n_coll       # a flow costs two events (s and f) per non-last rank
    return max(1, math.ceil(total / max_events))


def _rows(con, lo: int, hi: int, stride: int):
    """Slices kept (whole collective instances when sampling), in track and time order."""
    return con.execute("""
        WITH w AS (SELECT * FROM _pf_slices WHERE ts >= ? AND ts < ?),
        inst AS (SELECT comm_id_hash, inst_seq, name,
                        dense_rank() OVER (ORDER BY first, comm_id_hash, inst_seq, name) AS k
                 FROM (SELECT comm_id_hash, inst_seq, name, min(ts) AS first FROM w
                       WHERE cat = 'collective' AND comm_id_hash <> 0 GROUP BY ALL)),
        kept AS (SELECT w.*, inst.k FROM w LEFT JOIN inst USING (comm_id_hash, inst_seq, name)
                 QUALIFY CASE WHEN inst.k IS NOT NULL THEN inst.k % ? = 0
                              WHEN w.cat = 'comm' THEN TRUE
                              ELSE row_number() OVER (PARTITION BY w.node, w.grank, w.pid, w.cat
                                                      ORDER BY w.ts, w.event_id) % ? = 0 END)
        SELECT kind, event_id, node, grank, pid, tid, pod, ts, dur, name, cat, bytes, count, datatype,
               comm_id_hash, seq, nranks, comm_rank, peer, ret, in_group, reason, runq_ns, late_ns, k,
               inst_seq, simulated
        FROM kept ORDER BY node, CASE WHEN grank >= 0 THEN grank END NULLS LAST,
                           CASE WHEN grank >= 0 THEN 0 ELSE pid END, ts, dur DESC, kind, event_id""",
                       [lo, hi, stride, stride]).fetchall()


def _us(ns: int, t0: int) -> float:
    return round((ns - t0) / 1000.0, 3)


class _Tracks:
    """Processes per node, thread tracks per (rank or pid, overlap lane); tids in stable order."""

    def __init__(self, nodes: list[str]):
        self.pid = {n: i + 1 for i, n in enumerate(nodes)}
        self.lanes: dict[tuple, list[list[int]]] = {}   # track key -> per lane: stack of slice ends
        self.names: dict[tuple, str] = {}

    @staticmethod
    def key(grank, pid) -> tuple:
        return (0, int(grank), 0) if grank is not None and grank >= 0 else (1, 0, int(pid or 0))

    def place(self, node: str, key: tuple, pod: str | None, ts: int, end: int) -> int:
        """The lane (0 = the rank's own track) where [ts, end] nests; opens a new lane if none."""
        lanes = self.lanes.setdefault((node, key), [])
        self.names.setdefault((node, key), pod or "")
        for i, stack in enumerate(lanes):
            while stack and stack[-1] <= ts:
                stack.pop()
            if not stack or end <= stack[-1]:
                stack.append(end)
                return i
        lanes.append([end])
        return len(lanes) - 1

    def ensure(self, node: str, key: tuple, pod: str | None) -> None:
        if (node, key) not in self.lanes:
            self.lanes[(node, key)] = [[]]
            self.names[(node, key)] = pod or ""

    def tids(self) -> dict[tuple, int]:
        """(node, key, lane) -> tid: 1.. in (rank, lane) order within each node."""
        out, per_node = {}, {}
        for (node, key), lanes in sorted(self.lanes.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            for lane in range(max(1, len(lanes))):
                per_node[node] = per_node.get(node, 0) + 1
                out[(node, key, lane)] = per_node[node]
        return out

    def label(self, node: str, key: tuple, lane: int) -> str:
        who = f"rank {key[1]}" if key[0] == 0 else f"pid {key[2]} (rank unknown)"
        pod = self.names.get((node, key)) or ""
        base = f"{who} · {pod}" if pod else who
        return base if lane == 0 else f"{who} · overlap {lane}"


def build(con, start_s: float | None = None, end_s: float | None = None,
          max_events: int | None = None, source: str = "") -> tuple[dict, Summary]:
    """The Chrome Trace Event document of the trace open in `con`, and a summary."""
    _prepare(con)
    summ = Summary()
    t0, lo, hi = _window(con, start_s, end_s)
    doc = {"traceEvents": [], "displayTimeUnit": "ms",
           "otherData": {"generator": "ingero export perfetto", "source": source}}
    if t0 is None:
        return doc, summ
    summ.t0_ns = t0
    stride = _stride(con, lo, hi, max_events)
    summ.sampled_stride = stride
    rows = _rows(con, lo, hi, stride)
    instants = con.execute("""SELECT node, grank, pid, pod, ts, name, saddr, daddr, sport, dport, owner_source
                              FROM _pf_instants WHERE ts >= ? AND ts < ?
                              QUALIFY row_number() OVER (PARTITION BY node ORDER BY ts) % ? = 0
                              ORDER BY node, ts""", [lo, hi, stride]).fetchall()
    nodes = sorted({r[2] or "?" for r in rows} | {r[0] or "?" for r in instants})
    tracks = _Tracks(nodes)
    placed = []
    for r in rows:
        node, key = r[2] or "?", _Tracks.key(r[3], r[4])
        placed.append((node, key, tracks.place(node, key, r[6], r[7], r[7] + r[8]), r))
    for node, grank, pid, pod, *_ in instants:
        if grank is not None and grank >= 0:
            tracks.ensure(node or "?", _Tracks.key(grank, pid), pod)
    tids = tracks.tids()
    ev = doc["traceEvents"]
    for node in nodes:
        pid = tracks.pid[node]
        ev.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": node}})
        ev.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
    for (node, key, lane), tid in sorted(tids.items(), key=lambda kv: (tracks.pid[kv[0][0]], kv[1])):
        pid = tracks.pid[node]
        ev.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                   "args": {"name": tracks.label(node, key, lane)}})
        ev.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        summ.overlap_tracks += lane > 0
    summ.tracks, summ.nodes = len(tids), len(nodes)
    members: dict[tuple, list] = {}
    for node, key, lane, r in placed:
        (kind, _eid, _n, grank, pid_, tid_, pod, ts, dur, name, cat, nbytes, count, dtype, comm, seq, nranks,
         comm_rank, peer, ret, in_group, reason, runq, late, inst, inst_seq, simulated) = r
        pid, tid = tracks.pid[node], tids[(node, key, lane)]
        if kind == "nccl":
            args = {"op": name, "bytes": nbytes, "count": count, "datatype": dtype,
                    "comm": f"{comm:016x}" if comm is not None else None, "seq": seq, "nranks": nranks,
                    "comm_rank": comm_rank, "rank": grank, "ret": ret, "duration_ms": dur / 1e6}
            if peer is not None and peer >= 0 and cat == "p2p":
                args["peer"] = peer
            if in_group:
                args["in_group"] = True
            if simulated:
                args["simulated"] = True     # ncclGroupSimulateEnd: NCCL launched nothing
            if late is not None:
                args["late_ms"] = round(late / 1e6, 6)
        else:
            args = {"reason": reason, "duration_ms": dur / 1e6, "runq_ms": (runq or 0) / 1e6, "rank": grank,
                    "tid": tid_}
        ev.append({"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": _us(ts, t0),
                   "dur": round(dur / 1000.0, 3), "args": args})
        summ.slices[cat] = summ.slices.get(cat, 0) + 1
        if cat == "collective" and inst is not None:
            members.setdefault((comm, inst_seq, name), []).append((ts, grank, pid, tid, dur))
    for node, grank, pid_, pod, ts, name, saddr, daddr, sport, dport, owner in instants:
        node = node or "?"
        args = {"saddr": saddr, "daddr": daddr, "sport": sport, "dport": dport, "owner": owner, "rank": grank}
        e = {"ph": "i", "name": name, "cat": "tcp", "pid": tracks.pid[node], "ts": _us(ts, t0), "args": args}
        if grank is not None and grank >= 0:
            e.update(tid=tids[(node, _Tracks.key(grank, pid_), 0)], s="t")
        else:
            e["s"] = "p"
        ev.append(e)
        summ.instants += 1
    summ.flows = _flows(ev, members, t0)
    doc["otherData"].update(t0_ns=str(t0), sampled_stride=str(stride),
                            window=f"{start_s or 0:g}s..{'' if end_s is None else f'{end_s:g}s'}")
    return doc, summ


def _flows(ev: list, members: dict, t0: int) -> int:
    """Arrows from every rank's slice of a collective to the slice of the rank that arrived last."""
    fid = 0
    for (comm, seq, op), ms in sorted(members.items(), key=lambda kv: min(m[0] for m in kv[1])):
        if len(ms) < 2:
            continue
        ms.sort(key=lambda m: (m[0], m[1] if m[1] is not None else -1))
        last = ms[-1]
        for ts, grank, pid, tid, dur in ms[:-1]:
            fid += 1
            args = {"comm": f"{comm:016x}", "seq": seq, "op": op}
            # inside each slice (1 ns after it starts), so the flow binds to it, not to a neighbour
            ev.append({"ph": "s", "id": fid, "name": "arrival", "cat": "flow", "pid": pid, "tid": tid,
                       "ts": _us(ts + min(1, dur), t0), "args": args})
            ev.append({"ph": "f", "bp": "e", "id": fid, "name": "arrival", "cat": "flow", "pid": last[2],
                       "tid": last[3], "ts": _us(last[0] + min(1, last[4]), t0), "args": args})
    return fid


def write(doc: dict, out: Path) -> int:
    """Write the document (one event per line, so large traces stay greppable); returns bytes."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    with open(tmp, "w") as f:
        f.write('{"traceEvents": [\n')
        evs = doc["traceEvents"]
        for i, e in enumerate(evs):
            f.write(json.dumps(e, separators=(",", ":")))
            f.write(",\n" if i + 1 < len(evs) else "\n")
        rest = {k: v for k, v in doc.items() if k != "traceEvents"}
        f.write("],\n" + json.dumps(rest)[1:])
    tmp.replace(out)
    return out.stat().st_size


def export(source: Path, out: Path, start: str | None = None, end: str | None = None,
             max_events: int | None = None, session: str | None = None, label: str | None = None) -> None:
    """Write the Perfetto timeline of the trace at `source` to `out` and say what it holds
    (on stderr). `label` names the trace in that line and in the file (default: `source`)."""
    t0 = parse_seconds(start, "--start", allow_zero=True) if start else None
    t1 = parse_seconds(end, "--end") if end else None
    if t0 is not None and t1 is not None and t1 <= t0:
        raise IngeroError(f"--end {end} is not after --start {start}")
    if max_events is not None and max_events < 100:
        raise IngeroError("--max-events must be at least 100")
    if not out.parent.is_dir():
        raise IngeroError(f"-o {out}: folder {out.parent} does not exist")
    label = label or str(source)
    con = open_source(source, session=session)
    try:
        doc, summ = build(con, t0, t1, max_events, source=label)
    finally:
        con.close()
    if summ.t0_ns is None:
        raise IngeroError(f"{label} holds no NCCL, off-CPU or TCP events to put on a timeline")
    size = write(doc, out)
    kinds = ", ".join(f"{n} {c}" for c, n in sorted(summ.slices.items()))
    print(f"wrote {out} ({size / 1e6:.1f} MB): {summ.nodes} nodes, {summ.tracks} tracks, slices: {kinds}; "
          f"{summ.instants} tcp instants, {summ.flows} arrival arrows"
          + (f"; sampled every {summ.sampled_stride}th collective" if summ.sampled_stride > 1 else "")
          + "; open it at https://ui.perfetto.dev", file=sys.stderr)
