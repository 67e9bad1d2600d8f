"""A hung job: ranks wait in an NCCL call that another rank of the communicator never
entered (or entered and then stopped).

A wait is a call that was in flight for long: a row of ``nccl_inflight`` (the tracer saw
the thread inside the call; the call never returned before the trace ended or the process
died) or a call that returned an error after that long (NCCL gave up on a peer: a timeout).
A call that returned success is no hang, however long it took: the job moved on (a rank
stopped for a while and then continued is a straggler, judged elsewhere).

The waits are grouped by the collective instance they wait in (communicator, op, seq); the
instance with the most waiting ranks is the hang. Every other member of the communicator
is then named by what it did: it never entered the instance (its last call ended when,
and what its threads were doing: stopped, on a CPU, in I/O, asleep), or it is inside it
with its threads stopped (both are in ``Hang.missing``: the ranks the others wait for).
"""

from __future__ import annotations

import duckdb

from ingero.analysis.model import Hang
from ingero.schema import COLLECTIVE_OPS, NCCL_OK_RETS

# A call this long in flight may be a hang: a healthy collective takes milliseconds to
# seconds, while NCCL's and PyTorch's watchdogs give up only after minutes.
HANG_MIN_S = 10.0
# ... and only when it is this many times the rank's own longest usual call of that op on
# that communicator (its p99): a job whose collectives take seconds is not hung at 10 s.
USUAL_FACTOR = 20.0
STOPPED_STATES = ("T", "t")     # /proc state letters: stopped by a signal, stopped by a tracer

_OK = ", ".join(map(str, NCCL_OK_RETS))
_COLL = ", ".join(repr(o) for o in COLLECTIVE_OPS)
_RANK_OF = """LEFT JOIN (SELECT node, pid, any_value(rank) AS rank FROM ranks GROUP BY node, pid) r
              ON r.node IS NOT DISTINCT FROM {a}.node AND r.pid = {a}.pid"""

# calls in flight the trace never saw return
_OPEN = f"""
    SELECT COALESCE(r.rank, i.rank) AS grank, i.node, i.pid, i.op, i.comm_id_hash AS comm, i.seq,
           i.since_ns AS since, i.seen_ns - i.since_ns AS waited, i.state, NULL::INTEGER AS ret
    FROM nccl_inflight i {_RANK_OF.format(a="i")}
    WHERE i.op IN ({_COLL}) AND i.comm_id_hash IS NOT NULL AND i.seq IS NOT NULL
      AND i.seen_ns - i.since_ns >= $min_ns
      AND NOT EXISTS (SELECT 1 FROM nccl_events e
                      WHERE e.node IS NOT DISTINCT FROM i.node AND e.pid = i.pid AND e.tid = i.tid
                        AND e.op = i.op AND e.comm_id_hash = i.comm_id_hash AND e.seq = i.seq)"""
# calls that failed after a long wait
_FAILED = f"""
    SELECT COALESCE(r.rank, e.global_rank) AS grank, e.node, e.pid, e.op, e.comm_id_hash AS comm, e.seq,
           e.timestamp_ns AS since, e.duration_ns AS waited, NULL AS state, e.ret
    FROM nccl_events e {_RANK_OF.format(a="e")}
    WHERE e.op IN ({_COLL}) AND e.ret NOT IN ({_OK}) AND e.duration_ns >= $min_ns
      AND e.comm_id_hash <> 0 AND e.seq IS NOT NULL"""


def find_hang(con) -> Hang | None:
    """The hang in the trace on `con` (a DuckDB connection), or None."""
    params = {"min_ns": int(HANG_MIN_S * 1e9)}
    waits = [w for w in _rows(con, _FAILED, params) + _rows(con, _OPEN, params, inflight=True)
             if w["grank"] is not None]
    if not waits:
        return None
    usual = _usual_ns(con, {(w["grank"], w["op"], w["comm"]) for w in waits})
    waits = [w for w in waits if w["waited"] >= USUAL_FACTOR * usual.get((w["grank"], w["op"], w["comm"]), 0)]
    if not waits:
        return None
    # the instance most ranks wait in (then the longest wait)
    by_inst: dict[tuple, dict[int, dict]] = {}
    for w in waits:
        inst = by_inst.setdefault((w["comm"], w["op"], w["seq"]), {})
        if w["grank"] not in inst or w["waited"] > inst[w["grank"]]["waited"]:
            inst[w["grank"]] = w
    (comm, op, seq), held = max(by_inst.items(), key=lambda kv: (len(kv[1]), max(w["waited"] for w in kv[1].values())))
    end_ns = max(w["since"] + w["waited"] for w in held.values())
    members = _members(con, comm)
    entered = _entered(con, comm, op, seq)
    states = _thread_states(con)
    stopped_inside = sorted(r for r, w in held.items() if w["state"] in STOPPED_STATES)
    waiting = sorted(r for r in held if r not in stopped_inside)
    if not waiting:
        return None     # only stopped ranks inside: nobody waits on them (yet)
    never = sorted(m for m in members if m not in held and m not in entered)
    passed = sorted(m for m in members if m not in held and m in entered)
    last_end = _last_call_end(con, never)
    waited_s = max(held[r]["waited"] for r in waiting) / 1e9
    failed = sorted(r for r in waiting if held[r]["ret"] is not None)

    # times "ago" are counted back from the end of the longest wait (as last seen)
    where = f"{op} #{seq} of communicator {comm:016x}"
    gave_up = ("" if not failed else " and gave up with an NCCL error" if len(failed) == len(waiting)
               else f" ({_ranks(failed)} gave up with an NCCL error)")
    parts = [f"{_ranks(waiting)} wait{'s' if len(waiting) == 1 else ''} in {where} for {waited_s:.0f} s{gave_up}"]
    for r in never:
        ago = (f"its last call ended {(end_ns - last_end[r]) / 1e9:.0f} s ago" if r in last_end
               else "it made no traced call")
        parts.append(f"rank {r} never entered it ({ago}; its threads {_doing(states.get(r))})")
    for r in stopped_inside:
        parts.append(f"rank {r} entered it {(end_ns - held[r]['since']) / 1e9:.0f} s ago and its threads "
                     f"{_doing(states.get(r))}")
    for r in passed:
        parts.append(f"rank {r} finished it and went on")
    if not never and not stopped_inside:
        parts.append("every traced member entered it and none is stopped: the data does not move "
                     "(a peer outside the trace, or the network)")
    unknown = _size(con, comm) - len(members | set(held))
    if unknown > 0:
        parts.append(f"{unknown} member{'s' if unknown > 1 else ''} of the communicator "
                     f"{'were' if unknown > 1 else 'was'} not traced")
    return Hang(
        waiting=[{"rank": r, "op": op, "comm": f"{comm:016x}", "seq": seq, "since_ns": held[r]["since"],
                  "waited_s": round(held[r]["waited"] / 1e9, 3), "state": held[r]["state"],
                  "ret": held[r]["ret"]} for r in waiting],
        missing=never + stopped_inside, op=op, comm=f"{comm:016x}", seq=seq, waited_s=round(waited_s, 3),
        evidence="; ".join(parts))


def _rows(con, sql: str, params: dict, inflight: bool = False) -> list[dict]:
    try:
        cur = con.execute(sql, params)
    except duckdb.CatalogException:
        if not inflight:
            raise
        return []   # a trace written before the tracer recorded calls in flight
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]


def _usual_ns(con, keys: set) -> dict:
    """(rank, op, comm) -> p99 of the rank's successful calls of that op on that comm, ns."""
    out = {}
    for grank, op, comm in keys:
        v = con.execute(f"""SELECT quantile_cont(e.duration_ns, 0.99) FROM nccl_events e {_RANK_OF.format(a="e")}
                            WHERE COALESCE(r.rank, e.global_rank) = ? AND e.op = ? AND e.comm_id_hash = ?
                              AND e.ret IN ({_OK})""", [grank, op, comm]).fetchone()[0]
        out[(grank, op, comm)] = v or 0
    return out


def _members(con, comm: int) -> set:
    """Global ranks seen calling on (or creating) the communicator."""
    rows = con.execute(f"""SELECT DISTINCT COALESCE(r.rank, e.global_rank) FROM nccl_events e {_RANK_OF.format(a="e")}
                           WHERE e.comm_id_hash = ?""", [comm]).fetchall()
    return {g for (g,) in rows if g is not None}


def _size(con, comm: int) -> int:
    return con.execute("SELECT COALESCE(max(nranks), 0) FROM nccl_events WHERE comm_id_hash = ?", [comm]).fetchone()[0]


def _entered(con, comm: int, op: str, seq: int) -> set:
    """Ranks that called the instance and saw it return (with any result)."""
    rows = con.execute(f"""SELECT DISTINCT COALESCE(r.rank, e.global_rank) FROM nccl_events e {_RANK_OF.format(a="e")}
                           WHERE e.comm_id_hash = ? AND e.op = ? AND e.seq = ?""", [comm, op, seq]).fetchall()
    return {g for (g,) in rows if g is not None}


def _last_call_end(con, ranks: list) -> dict:
    if not ranks:
        return {}
    rows = con.execute(f"""SELECT COALESCE(r.rank, e.global_rank) AS g, max(e.timestamp_ns + e.duration_ns)
                           FROM nccl_events e {_RANK_OF.format(a="e")}
                           WHERE COALESCE(r.rank, e.global_rank) IN ({', '.join('?' * len(ranks))})
                           GROUP BY g""", list(ranks)).fetchall()
    return {g: t for g, t in rows if t is not None}


def _thread_states(con) -> dict:
    """rank -> the state letters of its threads as last seen (nccl_inflight)."""
    try:
        rows = con.execute(f"""SELECT COALESCE(r.rank, i.rank) AS g, list(i.state ORDER BY i.tid)
                               FROM nccl_inflight i {_RANK_OF.format(a="i")} GROUP BY g""").fetchall()
    except duckdb.CatalogException:
        return {}
    return {g: s for g, s in rows if g is not None}


def _doing(states: list | None) -> str:
    """What a rank's threads were doing, in words, from their /proc state letters."""
    if not states:
        return "were not seen"
    if all(s in STOPPED_STATES for s in states):
        return "are stopped"
    if any(s in STOPPED_STATES for s in states):
        return "are partly stopped"
    if any(s == "R" for s in states):
        return "run (on a CPU or waiting for one) outside NCCL"
    if any(s == "D" for s in states):
        return "wait in I/O"
    if any(s == "Z" or s == "X" for s in states):
        return "are exiting"
    return "sleep outside NCCL"


def _ranks(ranks: list) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
