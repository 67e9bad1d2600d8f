"""What part of the job a trace lets the verdict judge, and why not, when it cannot.

The analysis places a call when it knows its communicator (``comm_id_hash`` not 0)
and its global rank (the ranks table, the torchrun RANK, or a communicator rank).
A verdict needs at least two placed ranks, a step, and no rank or node the trace
names (the ranks and nodes tables) that placed nothing: such a rank may be the one
the others wait for, so "nobody" would be a silent all-clear. Ranks the job has
(WORLD_SIZE) but the trace never saw leave the verdict partial: it says which ranks
it covers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ingero.analysis.calls import OPS
from ingero.schema import NCCL_OK_RETS

# Every collective and p2p call that returned, per (node, global rank as calls.load takes
# it), with the calls it cannot place: an unknown communicator or no seq; and those on a
# communicator created before the probes attached whose handle is known, which calls.load
# may place yet (ingero/analysis/recover.py matches them across ranks). calls.load counts
# the same from the rows it reads (``Calls.counted``).
_COUNTS = f"""
    SELECT e.node, COALESCE(r.rank, e.global_rank, e.rank) AS grank, count(*) AS calls,
           count(*) FILTER (WHERE COALESCE(e.comm_id_hash, 0) = 0 AND COALESCE(e.comm, 0) = 0) AS no_comm,
           count(*) FILTER (WHERE COALESCE(e.comm_id_hash, 0) <> 0 AND e.seq IS NULL) AS no_seq,
           count(*) FILTER (WHERE COALESCE(e.comm_id_hash, 0) = 0 AND COALESCE(e.comm, 0) <> 0) AS handles
    FROM nccl_events e
    LEFT JOIN (SELECT node, pid, any_value(rank) AS rank FROM ranks GROUP BY node, pid) r
      ON r.node IS NOT DISTINCT FROM e.node AND r.pid = e.pid
    WHERE e.op IN ({', '.join(repr(o) for o in OPS)}) AND e.ret IN ({', '.join(map(str, NCCL_OK_RETS))})
      AND e.timestamp_ns IS NOT NULL AND e.duration_ns IS NOT NULL
    GROUP BY ALL"""


@dataclass
class Coverage:
    calls: int = 0                 # collective and p2p calls that returned
    no_comm: int = 0               # ... with an unknown communicator (comm_id_hash 0)
    no_rank: int = 0               # ... of a process of unknown rank (and a known communicator)
    no_seq: int = 0                # ... with a known communicator but no seq
    handles: int = 0               # ... on a communicator created before tracing, its handle known
    dropped_by_rank: dict = field(default_factory=dict)   # rank -> calls it made that cannot be placed
    listed: list = field(default_factory=list)            # ranks the ranks table names
    world: int = 0                 # the largest WORLD_SIZE a traced process gave
    nodes: list = field(default_factory=list)             # nodes the trace names (nodes, sessions, ranks)
    nodes_calling: list = field(default_factory=list)     # ... that made a collective or p2p call
    other_events: dict = field(default_factory=dict)      # table -> rows, when no call was traced

    @property
    def dropped(self) -> int:
        return self.no_comm + self.no_rank + self.no_seq

    def why_dropped(self) -> str:
        parts = [f"{self.no_comm:,} with an unknown communicator (comm_id_hash 0: created before the "
                 "probes attached)" if self.no_comm else "",
                 f"{self.no_rank:,} from processes of unknown rank (no torchrun RANK, no ranks row, "
                 "no communicator rank)" if self.no_rank else "",
                 f"{self.no_seq:,} without a seq" if self.no_seq else ""]
        return "; ".join(p for p in parts if p)


def coverage(con, counted: list | None = None) -> Coverage:
    """The counts `judge` weighs, from the trace's tables. `counted`: the calls' counts
    (``Calls.counted``) when calls.load read them; None: one pass over nccl_events."""
    cov = Coverage()
    placed_nodes = set()
    for node, grank, calls, no_comm, no_seq, handles in counted if counted is not None \
            else con.execute(_COUNTS).fetchall():
        cov.calls += calls
        cov.handles += handles
        if grank is None or grank < 0:
            cov.no_rank += calls - no_comm
            cov.no_comm += no_comm
            continue
        cov.no_comm += no_comm
        cov.no_seq += no_seq
        if no_comm + no_seq:
            cov.dropped_by_rank[grank] = cov.dropped_by_rank.get(grank, 0) + no_comm + no_seq
        if calls > no_comm + no_seq:
            placed_nodes.add(node)
    cov.listed = [r for (r,) in con.execute(
        "SELECT DISTINCT rank FROM ranks WHERE rank >= 0 ORDER BY rank").fetchall()]
    cov.world = int(con.execute("SELECT max(world_size) FROM ranks").fetchone()[0] or 0)
    named = set()
    for table in ("nodes", "sessions", "ranks"):
        named |= {n for (n,) in con.execute(f"SELECT DISTINCT node FROM {table} WHERE node IS NOT NULL").fetchall()}
    cov.nodes = sorted(named)
    cov.nodes_calling = sorted(n for n in placed_nodes if n is not None)
    if not cov.calls:
        for table in ("nccl_events", "tcp_events", "sched_events"):
            cov.other_events[table] = int(con.execute(f"SELECT count(*) FROM {table}").fetchone()[0])
    return cov


class Scope(NamedTuple):
    cannot_judge: str | None     # why the trace cannot support a verdict (None: it can)
    covered: list | None         # the ranks a verdict covers, when not every rank of the job
    note: str | None             # a warning saying which ranks a partial verdict leaves out, and why


def judge(cov: Coverage, placed: list, stepped: list | None) -> Scope:
    """What a verdict on this trace can cover. `placed`: the ranks the analysis placed calls
    of; `stepped`: the ranks the step window covers (None: no step was found)."""
    placed = sorted(placed)
    known = sorted(set(cov.listed) | set(range(cov.world)) | set(placed))

    def no(why: str) -> Scope:
        return Scope(why, None, None)

    if not cov.calls:
        ev = cov.other_events
        return no(f"no NCCL collective or point-to-point call was traced ({ev.get('nccl_events', 0):,} other NCCL "
                  f"rows, {ev.get('tcp_events', 0):,} TCP and {ev.get('sched_events', 0):,} scheduler events"
                  f"{'; the trace names ranks ' + span(cov.listed) if cov.listed else ''})")
    if not placed:
        unmatched = (f"{cov.handles:,} on communicators created before the probes attached that no other "
                     "rank's calls matched" if cov.handles else "")
        why = "; ".join(p for p in (cov.why_dropped(), unmatched) if p)
        return no(f"none of the {cov.calls:,} NCCL calls can be placed: {why}")
    if len(placed) < 2:
        more = f"; {cov.dropped:,} more cannot be placed: {cov.why_dropped()}" if cov.dropped else ""
        return no(f"only rank {placed[0]} made NCCL calls the analysis can place, of {len(known)} ranks "
                  f"known; a verdict compares at least 2 ranks{more}")
    silent = sorted(set(cov.listed) - set(placed))
    if silent:
        how = [f"rank {r}: {cov.dropped_by_rank[r]:,} calls that cannot be placed" for r in silent
               if r in cov.dropped_by_rank]
        how_text = f"; {', '.join(how[:8])}; {cov.why_dropped()}" if how else ""
        return no(f"{len(silent)} of {len(known)} ranks are traced but made no NCCL call the analysis can place "
                  f"(ranks {span(silent)}{how_text}): any of them may be the rank the others wait for")
    quiet = sorted(set(cov.nodes) - set(cov.nodes_calling))
    if quiet:
        return no(f"{len(quiet)} of {len(cov.nodes)} traced nodes sent no NCCL call ({', '.join(quiet[:8])}"
                  f"{', ...' if len(quiet) > 8 else ''}): their ranks may be the ones the others wait for")
    if stepped is None:
        return no(f"no collective recurs often enough on the {len(placed)} ranks to mark whole steps: no step "
                  f"to judge ({cov.calls - cov.dropped:,} calls placed)")
    stepped = sorted(stepped)
    if len(stepped) < 2:
        return no(f"only {ranks_text(stepped)} of the {len(placed)} ranks with calls has whole steps; a verdict "
                  "compares at least 2 ranks")
    if len(stepped) == len(known):
        return Scope(None, None, None)
    gaps = [f"{ranks_text(sorted(set(placed) - set(stepped)))} made calls but have no whole step"
            if len(stepped) < len(placed) else "",
            f"{ranks_text(sorted(set(known) - set(placed)))} were not traced" if len(placed) < len(known) else ""]
    return Scope(None, stepped, f"the verdict covers {ranks_text(stepped)} of the job's {len(known)}: "
                                + "; ".join(g for g in gaps if g))


def span(ranks: list) -> str:
    """'0-3, 6, 8-9' for [0, 1, 2, 3, 6, 8, 9]."""
    out, ranks = [], sorted(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(out)


def ranks_text(ranks: list) -> str:
    """'rank 2' or 'ranks 0-1, 3'."""
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {span(ranks)}"
