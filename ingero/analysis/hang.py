"""A hung job: ranks wait in an NCCL call that another rank never entered (or entered and
then stopped).

A wait is a call that was in flight for long: a row of ``nccl_inflight`` (the tracer saw
the thread inside the call; the call never returned before the trace ended or the process
died) or a call that returned an error after that long (NCCL gave up on a peer: a timeout).
A call that returned success is no hang, however long it took: the job moved on (a rank
stopped for a while and then continued is a straggler, judged elsewhere).

The collective waits are grouped by the instance they wait in (communicator, op, seq); the
instance with the most waiting ranks is the hang (with no collective waits: the longest
point-to-point or group wait, among every traced rank). Every other member is then named
by what it did: it never entered the instance (its last call ended when, and what its
threads were doing: stopped, on a CPU, in I/O, asleep), it waits in another call (a send,
a receive or a group with someone else: not the cause), it finished the instance, or it is
inside a call with its threads stopped. ``Hang.missing`` holds the ranks the others wait
for: those that never entered it and wait in nothing, and those stopped inside a call.

A call found on a thread's stack (``nccl_inflight`` with an op and no comm_rank: the thread was
inside it when the probes attached, ingero_agent.stackscan) has no communicator or seq: the
waits in one collective op found that way are taken for one instance, among every traced
rank, and each lasted at least from when it was first seen (since_ns) to when it was last
seen. A job that hung before the trace began is named that way.

On a GPU the host only queues a collective and waits in the stream's synchronisation, outside
NCCL: the wait is on the device. Ingero's profiler plugin holds every operation NCCL started
and has not finished, and the tracer reads them live (``nccl_device_inflight``): one the GPU
started (a kernel channel began) and did not finish is a wait too, at least from its device
start to when it was last seen, with NCCL's own communicator hash and seq (the same on every
rank, as in ``nccl_profiler_events``), so the ranks waiting in one instance are grouped as
host waits are. For a rank whose process has the plugin, its operations are the evidence and
its stack is not read for calls: its host threads wait outside NCCL, where a stack holds only
return addresses left over from earlier calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb

from ingero.analysis.model import Hang
from ingero.schema import COLLECTIVE_OPS, NCCL_OK_RETS, P2P_OPS

# A call this long in flight may be a hang: a healthy collective takes milliseconds to
# seconds, while NCCL's and PyTorch's watchdogs give up only after minutes.
HANG_MIN_S = 10.0
# ... and only when it is this many times the rank's own longest usual call of that op on
# that communicator (its p99): a job whose collectives take seconds is not hung at 10 s.
USUAL_FACTOR = 20.0
STOPPED_STATES = ("T", "t")     # /proc state letters: stopped by a signal, stopped by a tracer
# an open call matches its returned event by thread, op and entry time: the two wall-clock
# times come from one monotonic reading, converted with offsets taken apart (microseconds)
SAME_ENTRY_NS = 1_000_000

_OK = ", ".join(map(str, NCCL_OK_RETS))
_CALLS = ", ".join(repr(o) for o in COLLECTIVE_OPS + P2P_OPS + ("GROUP_END", "GROUP_SIMULATE_END"))
_RANK_OF = """LEFT JOIN (SELECT node, pid, any_value(rank) AS rank FROM ranks GROUP BY node, pid) r
              ON r.node IS NOT DISTINCT FROM {a}.node AND r.pid = {a}.pid"""

# calls in flight the trace never saw return
_OPEN = f"""
    SELECT COALESCE(r.rank, i.rank) AS grank, i.op, COALESCE(i.comm_id_hash, 0) AS comm, i.seq,
           i.since_ns AS since, i.seen_ns - i.since_ns AS waited, i.state, NULL::INTEGER AS ret,
           i.comm_rank IS NULL AS on_stack,    -- the probes give every call one (-1: not known)
           false AS on_device
    FROM nccl_inflight i {_RANK_OF.format(a="i")}
    WHERE i.op IN ({_CALLS}) AND i.seen_ns - i.since_ns >= $min_ns
      AND NOT EXISTS (SELECT 1 FROM nccl_events e
                      WHERE e.node IS NOT DISTINCT FROM i.node AND e.pid = i.pid AND e.tid = i.tid
                        AND e.op = i.op AND abs(e.timestamp_ns - i.since_ns) < {SAME_ENTRY_NS})"""
# is there one? (else the anti-join above would still hash every call of the session)
_ANY_OPEN = f"SELECT 1 FROM nccl_inflight i WHERE i.op IN ({_CALLS}) AND i.seen_ns - i.since_ns >= $min_ns LIMIT 1"
# calls that failed after a long wait
_FAILED = f"""
    SELECT COALESCE(r.rank, e.global_rank) AS grank, e.op, COALESCE(e.comm_id_hash, 0) AS comm, e.seq,
           e.timestamp_ns AS since, e.duration_ns AS waited, NULL AS state, e.ret, false AS on_stack,
           false AS on_device
    FROM nccl_events e {_RANK_OF.format(a="e")}
    WHERE e.op IN ({_CALLS}) AND e.ret NOT IN ({_OK}) AND e.duration_ns >= $min_ns"""
# operations the GPU started and never finished (the profiler plugin's, read live)
_DEVICE = f"""
    SELECT COALESCE(r.rank, d.rank) AS grank, d.op, d.comm_hash AS comm, d.seq, d.device_start_ns AS since,
           d.seen_ns - d.device_start_ns AS waited, NULL AS state, NULL::INTEGER AS ret, false AS on_stack,
           true AS on_device
    FROM nccl_device_inflight d {_RANK_OF.format(a="d")}
    WHERE d.op IN ({_CALLS}) AND d.device_start_ns IS NOT NULL AND d.seen_ns - d.device_start_ns >= $min_ns"""


def find_hang(con, min_s: float = HANG_MIN_S) -> Hang | None:
    """The hang in the trace on `con` (a DuckDB connection), or None. `min_s`: how long a
    call must be in flight (or a job stand still) to count (a live status may want less)."""
    waits = _waits(con, min_s)
    if not waits:
        return _standstill(con, min_s)
    longest: dict[int, dict] = {}               # each rank's longest wait
    for w in sorted(waits, key=lambda w: w["waited"]):
        longest[w["grank"]] = w
    at = _choose(con, waits, longest)
    roles = _roles(at, longest)
    if roles is None or _unseen_since(con, roles.never, min(w["since"] for w in at.held.values())):
        return None
    return _hang(con, at, roles, longest)


def _unseen_since(con, ranks: list, t_ns: int) -> bool:
    """Was one of `ranks` last looked at (its threads' snapshot) before `t_ns`? Then whether it
    entered the call is not known yet: its node's snapshot has not arrived (a live status reads
    each node's as it comes)."""
    if not ranks:
        return False
    seen = {x["g"]: x["seen"] for x in _rows(con, f"""SELECT COALESCE(r.rank, i.rank) AS g, max(i.seen_ns) AS seen
        FROM nccl_inflight i {_RANK_OF.format(a="i")} GROUP BY g""", {}, inflight=True)}
    return any(seen[r] < t_ns for r in ranks if seen.get(r) is not None)


def _waits(con, min_s: float) -> list[dict]:
    """Calls in flight or failed after at least `min_s`, and at least USUAL_FACTOR times the
    rank's own p99 of that op on that communicator."""
    params = {"min_ns": int(min_s * 1e9)}
    plugin = {x["g"] for x in _rows(con, f"""SELECT DISTINCT COALESCE(r.rank, d.rank) AS g
        FROM nccl_device_inflight d {_RANK_OF.format(a="d")}""", {}, inflight=True)}
    in_flight = _rows(con, _OPEN, params, inflight=True) if _rows(con, _ANY_OPEN, params, inflight=True) else []
    waits = [w for w in _rows(con, _FAILED, params) + in_flight
             + _rows(con, _DEVICE, params, inflight=True)
             if w["grank"] is not None and not (w["on_stack"] and w["grank"] in plugin)]
    states = _thread_states(con) if any(w["on_device"] for w in waits) else {}
    for w in waits:
        if w["on_device"] and states.get(w["grank"]) and all(s in STOPPED_STATES for s in states[w["grank"]]):
            w["state"] = "T"    # the rank's threads, the device's included, are stopped
    key = lambda w: (w["grank"], w["op"], w["comm"], w["on_device"])  # noqa: E731
    usual = _usual_ns(con, {key(w) for w in waits})
    return [w for w in waits if w["waited"] >= USUAL_FACTOR * usual[key(w)]]


@dataclass
class _At:
    """The call the hang is judged at, and who is in it."""

    comm: int
    op: str
    seq: int | None
    held: dict                  # rank -> its wait in this call
    members: set                # the communicator's ranks (every traced rank: not a collective)
    entered: set                # ranks that called it and saw it return
    collective: bool
    on_stack: bool = False      # found on the waiters' stacks: communicator and seq unknown
    on_device: bool = False     # operations the GPU started and never finished (profiler plugin)


def _choose(con, waits: list[dict], longest: dict) -> _At:
    """The collective instance a cause can be seen in (a member that never entered it and
    waits in nothing, or is stopped; others only wait on a wait), then the one most ranks
    wait in, then the longest wait. With no collective waiting: the longest send, receive
    or group wait, among every traced rank."""
    by_inst: dict[tuple, dict[int, dict]] = {}
    for w in sorted(waits, key=lambda w: w["waited"]):
        if w["op"] in COLLECTIVE_OPS and ((w["comm"] and w["seq"] is not None) or w["on_stack"]):
            by_inst.setdefault((w["comm"], w["op"], w["seq"]), {})[w["grank"]] = w
    if not by_inst:
        w = max(waits, key=lambda w: w["waited"])
        held = {r: x for r, x in longest.items() if x["state"] not in STOPPED_STATES}
        return _At(w["comm"], w["op"], w["seq"], held, _members(con, None), set(), False)
    cands = [_At(c, o, q, held, _members(con, c), _entered(con, c, o, q), True,
                 on_device=any(w["on_device"] for w in held.values()))
             if q is not None else _At(c, o, q, held, _members(con, None), set(), True, on_stack=True)
             for (c, o, q), held in by_inst.items()]

    def rank(at: _At):
        # a call only stopped ranks are in holds nobody yet (a rank stopped inside an operation
        # its peers finished: they wait in its next one)
        waited = any(w["state"] not in STOPPED_STATES for w in at.held.values())
        cause = any(m not in at.held and m not in at.entered
                    and (m not in longest or longest[m]["state"] in STOPPED_STATES) for m in at.members)
        cause |= any(w["state"] in STOPPED_STATES for w in at.held.values())
        # a host call and its operation on the device are one wait: the host's names the call
        return waited, cause, len(at.held), not at.on_device, max(w["waited"] for w in at.held.values())
    return max(cands, key=rank)


@dataclass
class _Roles:
    waiting: list               # wait in the call, threads not stopped
    never: list                 # never entered it and wait in nothing
    stopped_inside: list        # inside it, or inside another call, with their threads stopped
    elsewhere: list             # never entered it: wait in another call
    passed: list                # finished it
    also: list                  # not members, waiting in other calls


def _roles(at: _At, longest: dict) -> _Roles | None:
    """Every member's part; None when nobody waits but stopped ranks (nobody waits on them yet)."""
    stopped_inside = sorted(r for r, w in at.held.items() if w["state"] in STOPPED_STATES)
    waiting = sorted(r for r in at.held if r not in stopped_inside)
    if not waiting:
        return None
    others = sorted(m for m in at.members if m not in at.held)
    elsewhere = [m for m in others if m in longest and m not in at.entered]
    stopped_inside += [m for m in elsewhere if longest[m]["state"] in STOPPED_STATES]
    return _Roles(waiting=waiting, never=[m for m in others if m not in at.entered and m not in longest],
                  stopped_inside=sorted(stopped_inside),
                  elsewhere=[m for m in elsewhere if m not in stopped_inside],
                  passed=[m for m in others if m in at.entered],
                  also=sorted(r for r in longest if r not in at.held and r not in at.members))


def _hang(con, at: _At, ro: _Roles, longest: dict) -> Hang:
    """The Hang and its sentence. Times "ago" count back from the end of the longest wait
    (as last seen)."""
    held = at.held
    end_ns = max(w["since"] + w["waited"] for w in list(held.values()) + [longest[m] for m in at.members
                                                                          if m in longest and m not in held])
    last_end = _last_call_end(con, ro.never)
    states = _thread_states(con)
    waited_s = max(held[r]["waited"] for r in ro.waiting) / 1e9
    failed = sorted(r for r in ro.waiting if held[r]["ret"] is not None)
    gave_up = ("" if not failed else " and gave up with an NCCL error" if len(failed) == len(ro.waiting)
               else f" ({_ranks(failed)} gave up with an NCCL error)")
    where = " on the device" if at.on_device else ""
    parts = [f"{_ranks(ro.waiting)} wait{'s' if len(ro.waiting) == 1 else ''} in {_call(at.op, at.comm, at.seq)}"
             f"{where} for {'at least ' if at.on_stack or at.on_device else ''}{waited_s:.0f} s{gave_up}"]
    if at.on_device:
        parts[0] += " (the GPU started it and never finished it; the host waits outside NCCL)"
    if at.on_stack:
        parts[0] += (" (found inside it on their threads' stacks: they were in it when the probes attached, "
                     "its communicator is not known)")
    for r in ro.never:
        ago = (f"its last call ended {(end_ns - last_end[r]) / 1e9:.0f} s ago" if r in last_end
               else "it made no traced call")
        never = "is inside no NCCL call" if at.on_stack else "never entered it" if at.collective else "waits in no call"
        parts.append(f"rank {r} {never} ({ago}; its threads {_doing(states.get(r))})")
    for r in ro.stopped_inside:
        w = held.get(r) or longest[r]
        inside = "it" if r in held else _call(w["op"], w["comm"], w["seq"])
        entered = (f"was inside {inside} when the probes attached" if w.get("on_stack")
                   else f"entered {inside} {(end_ns - w['since']) / 1e9:.0f} s ago")
        parts.append(f"rank {r} {entered} and its threads {_doing(states.get(r))}")
    for r in ro.elsewhere:
        w = longest[r]
        parts.append(f"rank {r} waits in {_call(w['op'], w['comm'], w['seq'])} for "
                     f"{'at least ' if w['on_stack'] else ''}{w['waited'] / 1e9:.0f} s")
    parts += [f"rank {r} finished it and went on" for r in ro.passed]
    if ro.also:
        ops = sorted({longest[r]["op"] for r in ro.also})
        parts.append(f"{_ranks(ro.also)} also wait{'s' if len(ro.also) == 1 else ''}, in {', '.join(ops)}")
    if not ro.never and not ro.stopped_inside:
        parts.append("every traced member entered it or waits elsewhere, and none is stopped: the data does "
                     "not move (a peer outside the trace, or the network)")
    unknown = _size(con, at.comm) - len(at.members | set(held)) if at.comm else 0
    if unknown > 0:
        parts.append(f"{unknown} member{'s' if unknown > 1 else ''} of the communicator "
                     f"{'were' if unknown > 1 else 'was'} not traced")
    return Hang(
        waiting=[{"rank": r, "op": held[r]["op"], "comm": _hex(held[r]["comm"]), "seq": held[r]["seq"],
                  "since_ns": held[r]["since"], "waited_s": round(held[r]["waited"] / 1e9, 3),
                  "state": held[r]["state"], "ret": held[r]["ret"]} for r in ro.waiting],
        missing=sorted(ro.never + ro.stopped_inside), op=at.op, comm=_hex(at.comm), seq=at.seq,
        waited_s=round(waited_s, 3), evidence="; ".join(parts))


# per rank: its threads' last sight, whether all are stopped, whether one is inside a call
_SEEN = f"""seen AS (SELECT COALESCE(r.rank, i.rank) AS g, max(i.seen_ns) AS seen,
                         bool_and(i.state IN ('T', 't')) AS stopped, bool_or(i.op IS NOT NULL) AS in_call
                  FROM nccl_inflight i {_RANK_OF.format(a="i")} GROUP BY g)"""
# ... and its last call's end, the p99 gap between its calls
_QUIET = f"""
    WITH c AS (SELECT COALESCE(r.rank, e.global_rank) AS g, e.timestamp_ns + e.duration_ns AS t
               FROM nccl_events e {_RANK_OF.format(a="e")} WHERE e.op IN ({_CALLS}) AND e.duration_ns IS NOT NULL),
         gaps AS (SELECT g, t, t - lag(t) OVER (PARTITION BY g ORDER BY t) AS gap FROM c),
         calls AS (SELECT g, max(t) AS last_end, quantile_cont(gap, 0.99) AS p99_gap FROM gaps GROUP BY g),
         {_SEEN}
    SELECT calls.g, last_end, p99_gap, seen, stopped, in_call
    FROM calls JOIN seen ON seen.g = calls.g ORDER BY calls.g"""
# ... or, in a trace without a call, when the tracer first saw the rank's process (probes in place)
_QUIET_UNCALLED = f"""
    WITH first AS (SELECT rank AS g, min(first_seen_ns) AS t FROM ranks WHERE rank IS NOT NULL GROUP BY rank),
         {_SEEN}
    SELECT first.g, t, NULL, seen, stopped, in_call
    FROM first JOIN seen ON seen.g = first.g
    WHERE NOT EXISTS (SELECT 1 FROM nccl_events WHERE op IN ({_CALLS})) ORDER BY first.g"""


def _standstill(con, min_s: float) -> Hang | None:
    """No call waits, yet no rank has made an NCCL call for long while every one was still
    seen, and some rank's threads are stopped: the job stands still around it. (On a GPU the
    host only queues a collective and then waits in the stream's synchronisation, outside
    NCCL, so a hung collective leaves no call in flight.) Without a stopped rank such a quiet
    spell may be work without collectives (a checkpoint, an evaluation): no verdict.

    A trace without a single call (it began after the job stood still) counts the quiet from
    when each rank was first seen: how long the job stood still before is not known."""
    try:
        if not con.execute("SELECT count(*) FROM nccl_inflight").fetchone()[0]:
            return None     # no thread was seen: nothing to say who stands still
        rows = con.execute(_QUIET).fetchall()
        uncalled = not rows
        if uncalled:
            rows = con.execute(_QUIET_UNCALLED).fetchall()
    except duckdb.CatalogException:
        return None
    if len(rows) < 2 or any(in_call for *_, in_call in rows):
        return None     # a call in flight, not yet long enough to be a wait (find_hang)
    quiet = {g: (seen - end, p99 or 0) for g, end, p99, seen, _, _ in rows}
    if any(q < min_s * 1e9 or q < USUAL_FACTOR * p99 for q, p99 in quiet.values()):
        return None
    stopped = [g for g, _, _, _, st, _ in rows if st]
    if not stopped:
        return None
    states = _thread_states(con)
    others = [g for g, *_ in rows if g not in stopped]
    usual_s = max(p99 for _, p99 in quiet.values()) / 1e9
    quiet_s = min(q for q, _ in quiet.values()) / 1e9
    if uncalled:
        stand = (f"no rank made an NCCL call in the {quiet_s:.0f} s the job was traced (how long it stood "
                 "still before the trace began is not known)")
    else:
        stand = (f"no rank made an NCCL call for {quiet_s:.0f} s before its threads were last seen (before, "
                 f"at most {usual_s:.2g} s passed between its calls): the job stands still")
    parts = [stand, f"{_ranks(stopped)}: {'its' if len(stopped) == 1 else 'their'} threads are stopped"]
    parts += [f"rank {g}: its threads {_doing(states.get(g))}" for g in others]
    return Hang(waiting=[{"rank": g, "op": None, "comm": None, "seq": None, "since_ns": None,
                          "waited_s": round(quiet[g][0] / 1e9, 3), "state": None, "ret": None} for g in others],
                missing=stopped, op=None, comm=None, seq=None, waited_s=round(quiet_s, 3),
                evidence="; ".join(parts))


def _hex(comm: int) -> str | None:
    return f"{comm:016x}" if comm else None


def _call(op: str, comm: int, seq) -> str:
    """ALL_REDUCE #812 of communicator ab12... / GROUP_END"""
    if op in COLLECTIVE_OPS and comm and seq is not None:
        return f"{op} #{seq} of communicator {comm:016x}"
    return f"{op} on communicator {comm:016x}" if comm else op


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
    """(rank, op, comm, on_device) -> p99 of the rank's successful calls of that op on that comm
    (on the device: of its operations' device times), ns."""
    host = f"""SELECT quantile_cont(e.duration_ns, 0.99) AS v FROM nccl_events e {_RANK_OF.format(a="e")}
               WHERE COALESCE(r.rank, e.global_rank) = $g AND e.op = $op AND COALESCE(e.comm_id_hash, 0) = $comm
                 AND e.ret IN ({_OK})"""
    device = f"""SELECT quantile_cont(e.device_duration_ns, 0.99) AS v FROM nccl_profiler_events e
                 {_RANK_OF.format(a="e")}
                 WHERE COALESCE(r.rank, e.global_rank) = $g AND e.op = $op AND e.comm_hash = $comm
                   AND NOT COALESCE(e.unfinished, false)"""
    out = {}
    for grank, op, comm, on_device in keys:
        got = _rows(con, device if on_device else host, {"g": grank, "op": op, "comm": comm}, inflight=True)
        out[(grank, op, comm, on_device)] = (got[0]["v"] if got else None) or 0
    return out


def _members(con, comm: int | None) -> set:
    """Global ranks seen calling on (or creating) the communicator; None: every traced rank
    (seen calling, or its threads seen)."""
    rows = con.execute(f"""SELECT DISTINCT COALESCE(r.rank, e.global_rank) FROM nccl_events e {_RANK_OF.format(a="e")}
                           WHERE $comm IS NULL OR e.comm_id_hash = $comm""", {"comm": comm}).fetchall()
    ranks = {g for (g,) in rows}
    if comm is None:
        ranks |= {x["g"] for x in _rows(con, f"""SELECT DISTINCT COALESCE(r.rank, i.rank) AS g
                                                 FROM nccl_inflight i {_RANK_OF.format(a="i")}""", {}, inflight=True)}
    else:   # NCCL's own hash of it: the profiler plugin's operations, finished or open
        for t, a, g in (("nccl_profiler_events", "e", "e.global_rank"), ("nccl_device_inflight", "d", "d.rank")):
            ranks |= {x["g"] for x in _rows(con, f"""SELECT DISTINCT COALESCE(r.rank, {g}) AS g FROM {t} {a}
                                                     {_RANK_OF.format(a=a)} WHERE {a}.comm_hash = $comm""",
                                            {"comm": comm}, inflight=True)}
    return ranks - {None}


def _size(con, comm: int) -> int:
    sizes = [x["n"] for t, c in (("nccl_events", "comm_id_hash"), ("nccl_profiler_events", "comm_hash"),
                                 ("nccl_device_inflight", "comm_hash"))
             for x in _rows(con, f"SELECT max(nranks) AS n FROM {t} WHERE {c} = $comm", {"comm": comm}, inflight=True)]
    return max([n for n in sizes if n is not None], default=0)


def _entered(con, comm: int, op: str, seq: int) -> set:
    """Ranks that called the instance and saw it return (with any result), or whose device
    finished it (the profiler plugin's record, NCCL's hash and seq)."""
    rows = con.execute(f"""SELECT DISTINCT COALESCE(r.rank, e.global_rank) FROM nccl_events e {_RANK_OF.format(a="e")}
                           WHERE e.comm_id_hash = ? AND e.op = ? AND e.seq = ?""", [comm, op, seq]).fetchall()
    dev = _rows(con, f"""SELECT DISTINCT COALESCE(r.rank, e.global_rank) AS g FROM nccl_profiler_events e
                         {_RANK_OF.format(a="e")} WHERE e.comm_hash = $comm AND e.op = $op AND e.seq = $seq
                           AND NOT COALESCE(e.unfinished, false)""", {"comm": comm, "op": op, "seq": seq},
                inflight=True)
    return {g for (g,) in rows if g is not None} | {x["g"] for x in dev if x["g"] is not None}


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
