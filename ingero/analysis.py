"""Per-rank analysis and the straggler verdict, in SQL over the trace tables.

Signals (DESIGN.md, "Analysis"):

* arrival lateness: for each collective instance (comm_id_hash, seq), when
  each rank called it, against the median arrival of its peers. On a GPU the
  host call only enqueues work, so arrival is the robust signal; durations
  are reported too (a compute straggler has the *shortest* durations).
* retransmits on the rank's own connections (attributed by socket owner or
  address, never by the on-CPU task), inside its collectives' windows.
* off-CPU time by reason (runqueue, io, sleep), summed in the kernel.

The straggler is a robust peer outlier: median and MAD, never mean and
standard deviation, with a floor on the spread so that a perfectly regular
run does not turn microseconds into a verdict. Network blame needs the
retransmits to be concentrated on one node (or rank), because a lossy link
slows every rank of the job while only its own sockets retransmit.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

import numpy as np

from ingero.schema import COLLECTIVE_OPS, NCCL_OK_RETS

# Thresholds; units in the names. Chosen for lab runs of 2-16 ranks.
LATE_Z = 3.5                  # robust z-score that makes an arrival outlier
LATE_FLOOR_NS = 500_000       # spread floor: host jitter below ~0.5 ms is noise
LATE_FLOOR_STEP_SHARE = 0.01  # ... or 1% of a step, whichever is larger
LATE_MIN_STEP_SHARE = 0.05    # a late rank must also cost >= 5% of a step to matter
RETX_MIN = 3                  # fewer retransmits than this in windows is not a cause
RETX_SHARE = 0.67             # share of all in-window retransmits that makes them "concentrated"
# Network blame also needs a retransmit in flight in >= 5% of collective instances: low-RTT
# links retransmit now and then without loss (tail-loss probes racing delayed ACKs). Lab
# runs, real eBPF data: clean 1.2% (16 of 1374), lossy-link at 5% loss 28.6% (247 of 864).
RETX_MIN_COLL_SHARE = 0.05
OFFCPU_RATIO = 2.0            # cause needs >= 2x the peers' median off-CPU time of that reason
OFFCPU_MIN_SHARE = 0.03       # ... and >= 3% of the traced time
OFFCPU_FLOOR_MS = 50.0        # spread floor when judging off-CPU totals as an outlier


@dataclass
class RankRow:
    rank: int
    node: str | None
    pod: str | None
    pid: int
    collectives: int = 0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    late_ms: float = 0.0          # median arrival lateness vs the group median
    last_share: float = 0.0       # share of collectives where it arrived last
    late_z: float = 0.0
    retransmits: int = 0          # on its own connections, whole trace
    retransmits_in_window: int = 0
    slow_collectives: int | None = None   # collectives over the session's threshold, when one is set
    offcpu_ms: dict = field(default_factory=dict)  # reason -> ms
    per_op: dict = field(default_factory=dict)     # op -> {"calls", "p50_ms", "p99_ms"}


@dataclass
class Straggler:
    rank: int | None
    node: str | None
    pod: str | None
    cause: str                    # network | cpu-contention | io | compute/unknown
    score: float
    evidence: str
    saving_ms_per_step: float
    saving_pct: float
    group: str | None = None      # "node lab-node-b" when a whole group is slow together


@dataclass
class Report:
    ranks: list[RankRow]
    straggler: Straggler | None
    step_ms: float
    collectives: int
    retransmits: int
    warnings: list[str]

    def to_dict(self) -> dict:
        return asdict(self)


log = logging.getLogger("ingero.analysis")

_COLL = ", ".join(f"'{o}'" for o in COLLECTIVE_OPS)
_OK = ", ".join(str(r) for r in NCCL_OK_RETS)   # ncclSuccess, and ncclInProgress (non-blocking)


def _prepare(con) -> None:
    """Temp views: one row per collective call of a process with its global rank."""
    con.execute(f"""
        CREATE OR REPLACE TEMP VIEW _coll AS
        SELECT e.node, e.pid, e.op, e.comm_id_hash, e.seq, e.timestamp_ns AS t, e.duration_ns AS d,
               COALESCE(r.rank, e.global_rank, e.rank) AS grank,
               COALESCE(r.pod, e.pod) AS pod
        FROM nccl_events e
        LEFT JOIN (SELECT node, pid, any_value(rank) AS rank, any_value(pod) AS pod
                   FROM ranks GROUP BY node, pid) r
          ON r.node IS NOT DISTINCT FROM e.node AND r.pid = e.pid
        WHERE e.op IN ({_COLL}) AND e.comm_id_hash <> 0 AND e.ret IN ({_OK})""")
    con.execute("""
        CREATE OR REPLACE TEMP VIEW _arr AS
        SELECT *, t - median(t) OVER g AS late, t = max(t) OVER g AS is_last,
               count(*) OVER g AS arrived
        FROM _coll WINDOW g AS (PARTITION BY comm_id_hash, seq, op)""")


class _Sql:
    """The statistics the verdict needs, in SQL over whatever tables `con` holds."""

    def __init__(self, con):
        self.con = con
        _prepare(con)

    def step_ns(self) -> float:
        """Median gap between consecutive instances of the busiest communicator's collectives."""
        row = self.con.execute("""
            WITH top AS (SELECT comm_id_hash, op FROM _coll GROUP BY ALL
                         -- ties (every op once per step) broken so the same data gives the same step
                         ORDER BY count(*) DESC, comm_id_hash, op LIMIT 1),
            inst AS (SELECT seq, min(t) AS t FROM _coll JOIN top USING (comm_id_hash, op) GROUP BY seq)
            SELECT median(gap) FROM (SELECT t - lag(t) OVER (ORDER BY seq) AS gap FROM inst)
            WHERE gap IS NOT NULL""").fetchone()
        return float(row[0] or 0.0)

    def rank_rows(self, slow_collective_ms: float | None) -> tuple[dict, list[str]]:
        con, rows, warnings = self.con, {}, []
        for (grank, node, pod, pid, n, p50, p99, late, last, in_groups) in con.execute("""
                SELECT grank, arg_max(node, t), arg_max(pod, t), arg_max(pid, t), count(*),
                       quantile_cont(d, 0.5), quantile_cont(d, 0.99),
                       median(late) FILTER (WHERE arrived > 1), avg(is_last::INT) FILTER (WHERE arrived > 1),
                       count(*) FILTER (WHERE arrived > 1)
                FROM _arr GROUP BY grank ORDER BY grank""").fetchall():
            rows[grank] = RankRow(rank=grank, node=node, pod=pod, pid=pid, collectives=n,
                                  p50_ms=p50 / 1e6, p99_ms=p99 / 1e6, late_ms=(late or 0) / 1e6,
                                  last_share=last or 0.0)
            if in_groups == 0:
                warnings.append(f"rank {grank}: no collective matched on another rank "
                                "(other ranks not traced?)")
        for grank, op, n, p50, p99 in con.execute("""
                SELECT grank, op, count(*), quantile_cont(d, 0.5), quantile_cont(d, 0.99)
                FROM _coll GROUP BY ALL ORDER BY ALL""").fetchall():
            rows[grank].per_op[op] = {"calls": n, "p50_ms": p50 / 1e6, "p99_ms": p99 / 1e6}
        # A rank that is late once per step (at the first collective after its own compute)
        # is on time at the others, so the median over all of its collectives hides it. Use
        # the largest of its per-op medians. (Lab slow-rank, real eBPF data: the slow rank is
        # 38.5 ms late at ALL_REDUCE and within +-0.4 ms at the other three ops, so its median
        # over all collectives was 0.08 ms and no straggler was named.)
        for grank, late in con.execute("""
                SELECT grank, max(m) FROM (SELECT grank, op, median(late) AS m FROM _arr
                                           WHERE arrived > 1 GROUP BY grank, op) GROUP BY grank""").fetchall():
            if grank in rows and late is not None:
                rows[grank].late_ms = late / 1e6
        if slow_collective_ms is not None:
            for grank, n in con.execute("SELECT grank, count(*) FILTER (WHERE d > ?) FROM _coll GROUP BY grank",
                                        [int(slow_collective_ms * 1e6)]).fetchall():
                rows[grank].slow_collectives = n
        return rows, warnings

    def traced_ns(self) -> int:
        return self.con.execute("SELECT max(t + d) - min(t) FROM _coll").fetchone()[0] or 0

    def span_ns(self) -> int:
        return self.con.execute("SELECT max(t) - min(t) FROM _coll").fetchone()[0] or 0

    def retransmits_by_rank(self) -> list[tuple[int, int, int]]:
        """(rank, retransmits on its own connections, of those inside its collectives' windows)."""
        return self.con.execute(f"""
            WITH rt AS ({_RETX_BY_RANK})
            SELECT rt.grank, count(DISTINCT rt.ts),
                   count(DISTINCT rt.ts) FILTER (WHERE c.t IS NOT NULL)
            FROM rt LEFT JOIN _coll c ON c.grank = rt.grank AND rt.ts BETWEEN c.t AND c.t + c.d
            WHERE rt.grank IS NOT NULL GROUP BY rt.grank""").fetchall()

    def lateness_total_ns(self, late: list) -> float | None:
        """Sum over collective instances of how much later the `late` ranks came than the others."""
        marks = ", ".join(str(int(k)) for k in late)
        return self.con.execute(f"""
            WITH g AS (SELECT comm_id_hash, seq, op,
                              max(t) FILTER (WHERE grank IN ({marks})) AS late_t,
                              max(t) FILTER (WHERE grank NOT IN ({marks})) AS others_t
                       FROM _coll GROUP BY ALL)
            SELECT sum(greatest(late_t - others_t, 0)) FROM g
            WHERE late_t IS NOT NULL AND others_t IS NOT NULL""").fetchone()[0]

    def retransmit_windows(self) -> tuple:
        """Median duration of collectives without / with a retransmit in flight, the number of
        instances with one, and the number of instances."""
        con = self.con
        clean = con.execute("""
            SELECT median(c.d) FROM _coll c WHERE NOT EXISTS (
              SELECT 1 FROM tcp_events t WHERE t.event = 'tcp_retransmit_skb'
                AND t.timestamp_ns BETWEEN c.t AND c.t + c.d)""").fetchone()[0]
        slow = con.execute("""
            SELECT median(c.d), count(DISTINCT (c.comm_id_hash, c.seq, c.op)) FROM _coll c WHERE EXISTS (
              SELECT 1 FROM tcp_events t WHERE t.event = 'tcp_retransmit_skb'
                AND t.timestamp_ns BETWEEN c.t AND c.t + c.d)""").fetchone()
        instances = con.execute("SELECT count(DISTINCT (comm_id_hash, seq, op)) FROM _coll").fetchone()[0]
        return clean, slow[0], slow[1], instances


# Retransmits with the rank that owns the connection (by socket owner pid, else the event's rank).
_RETX_BY_RANK = """
    SELECT t.timestamp_ns AS ts, COALESCE(r.rank, t.rank) AS grank
    FROM tcp_events t
    LEFT JOIN (SELECT node, pid, any_value(rank) AS rank FROM ranks GROUP BY ALL) r
      ON r.node IS NOT DISTINCT FROM t.node AND r.pid = t.pid AND t.pid > 0
    WHERE t.event = 'tcp_retransmit_skb'"""


def analyse(con, slow_collective_ms: float | None = None, segments=None) -> Report:
    """Analyse every table in `con` (a DuckDB connection) into a Report.

    `slow_collective_ms` (a TraceSession's thresholds.slowCollectiveMs): also
    count, per rank, the collectives that took longer than this.

    `segments` (an ``analysis_dense.Segments``): where `con`'s nccl_events rows
    come from, as Parquet files per node with the clock offset to apply. The
    per-row work is then done column-wise in memory straight from those files
    (``analysis_dense``), with the same results as the SQL below; data it does
    not handle (e.g. one rank calling the same collective twice) falls back to SQL.
    """
    be = None
    if segments is not None:
        from ingero.analysis_dense import Dense, Unsupported
        try:
            be = Dense.from_segments(con, segments)
        except Unsupported as e:
            log.info("column-wise analysis not used (%s); analysing in SQL", e)
    if be is None:
        be = _Sql(con)
    step_ns = be.step_ns()
    rows, warnings = be.rank_rows(slow_collective_ms)
    _add_network(be, rows)
    _add_offcpu(con, rows)
    traced_ns = be.traced_ns()
    straggler = _verdict(be, rows, step_ns, traced_ns)
    total_retx = con.execute(
        "SELECT count(*) FROM tcp_events WHERE event = 'tcp_retransmit_skb'").fetchone()[0]
    return Report(ranks=sorted(rows.values(), key=lambda r: r.rank), straggler=straggler,
                  step_ms=step_ns / 1e6, collectives=sum(r.collectives for r in rows.values()),
                  retransmits=total_retx, warnings=warnings)


def _add_network(be, rows: dict) -> None:
    """Retransmits per rank on its own connections, and inside its collectives."""
    for grank, total, inwin in be.retransmits_by_rank():
        if grank in rows:
            rows[grank].retransmits = total
            rows[grank].retransmits_in_window = inwin


def _add_offcpu(con, rows: dict) -> None:
    """Off-CPU time by reason: kernel totals when present, else the events over threshold."""
    has_totals = con.execute("SELECT count(*) FROM sched_totals").fetchone()[0] > 0
    if has_totals:
        q = """SELECT COALESCE(r.rank, s.rank), s.reason, sum(s.total_ns)
               FROM sched_totals s LEFT JOIN (SELECT node, pid, any_value(rank) AS rank
                                              FROM ranks GROUP BY ALL) r
                 ON r.node IS NOT DISTINCT FROM s.node AND r.pid = s.pid GROUP BY ALL"""
    else:
        q = """SELECT COALESCE(r.rank, s.rank), s.reason, sum(s.duration_ns)
               FROM sched_events s LEFT JOIN (SELECT node, pid, any_value(rank) AS rank
                                              FROM ranks GROUP BY ALL) r
                 ON r.node IS NOT DISTINCT FROM s.node AND r.pid = s.pid GROUP BY ALL"""
    for grank, reason, ns in con.execute(q).fetchall():
        if grank in rows and reason:
            rows[grank].offcpu_ms[reason] = ns / 1e6


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    if n == 0:
        return 0.0
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def robust_z(values: dict, floor: float) -> dict:
    """For each key, (x - median of the others) / max(1.4826 * MAD of the others, floor).

    Each value is judged against its peers without itself: with a handful of ranks, an
    outlier inside its own median and MAD widens the scale it is measured by (a CI run of
    the 4-rank lab cpu-hog scored its victim z 2.85 with the victim inside, under 3.5)."""
    keys = list(values)
    if len(keys) < 2:
        return {k: 0.0 for k in keys}
    x = np.asarray([float(values[k]) for k in keys])
    out = {}
    for i, k in enumerate(keys):
        others = np.delete(x, i)
        med = float(np.median(others))
        scale = max(1.4826 * float(np.median(np.abs(others - med))), floor)
        out[k] = (x[i] - med) / scale
    return out


def _verdict(be, rows: dict, step_ns: float, traced_ns: int) -> Straggler | None:
    if len(rows) < 2:
        return None
    # Lateness first: a rank that arrives late costs every step. Retransmits alone do not
    # make a verdict when a rank is late, because waiting peers retransmit too (lab
    # slow-rank and io-stall, real data: 127 and 30 tail-loss-probe retransmits on the
    # late rank's ring neighbour, with no loss injected). A lossy link leaves arrivals
    # on time (lab lossy-link: every rank within 0.5 ms) and is judged below.
    late = _late_verdict(be, rows, step_ns, traced_ns)
    return late or _starved_verdict(be, rows, step_ns, traced_ns) or _network_verdict(be, rows, step_ns)


def _starved_verdict(be, rows: dict, step_ns: float, traced_ns: int) -> Straggler | None:
    """The latest rank, when its own off-CPU time (runqueue or I/O) is an outlier among the
    ranks and the lateness it causes costs the step: the off-CPU excess is the evidence, the
    lateness need not be an outlier on its own. A rank starved of CPU acknowledges late, so
    its peers retransmit without any loss, and on a busy machine every rank is somewhat late
    (CI, lab cpu-hog beside other work: the victim 6.6 ms late, lateness z 2.0, its ring
    neighbour's 106 spurious retransmits named "network"). A lossy link leaves arrivals on
    time and no rank with an off-CPU outlier, so it is judged after this."""
    worst = max(rows, key=lambda k: rows[k].late_ms)
    r = rows[worst]
    if r.late_ms * 1e6 < max(LATE_FLOOR_NS, LATE_FLOOR_STEP_SHARE * step_ns):
        return None
    cause, why = _cpu_cause(rows, worst, traced_ns)
    if cause == "compute/unknown":
        return None
    reason = {"io": "io", "cpu-contention": "runqueue"}[cause]
    z = robust_z({k: x.offcpu_ms.get(reason, 0.0) for k, x in rows.items()}, OFFCPU_FLOOR_MS)[worst]
    saving = _lateness_saving_ns(be, [worst], step_ns)
    if z < LATE_Z or saving < LATE_MIN_STEP_SHARE * step_ns:
        return None
    retx = sum(x.retransmits_in_window for k, x in rows.items() if k != worst)
    evidence = (f"rank {worst} arrives {r.late_ms:.1f} ms after its peers' median at its collectives, "
                f"the latest of all ranks (lateness z {r.late_z:.1f}), and {why} (z {z:.1f}); weighed "
                f"against {retx} retransmits on other ranks' connections, which a rank answering late "
                "causes without any loss")
    return Straggler(rank=worst, node=r.node, pod=r.pod, cause=cause, score=round(z, 2),
                     evidence=evidence, saving_ms_per_step=saving / 1e6,
                     saving_pct=100.0 * saving / step_ns if step_ns else 0.0)


def _late_verdict(be, rows: dict, step_ns: float, traced_ns: int) -> Straggler | None:
    floor = max(LATE_FLOOR_NS, LATE_FLOOR_STEP_SHARE * step_ns)
    z = robust_z({k: r.late_ms * 1e6 for k, r in rows.items()}, floor)
    for k, v in z.items():
        rows[k].late_z = round(v, 2)
    # Judge lateness against step time: a consistent lateness that costs
    # (almost) nothing per step is not a straggler.
    late = [k for k, v in z.items()
            if v >= LATE_Z and rows[k].late_ms * 1e6 >= LATE_MIN_STEP_SHARE * step_ns]
    if not late:
        return None
    nodes = {rows[k].node for k in late}
    worst = max(late, key=lambda k: z[k])
    r = rows[worst]
    cause, why = _cpu_cause(rows, worst, traced_ns)
    mine = r.retransmits_in_window
    total_retx = sum(x.retransmits_in_window for x in rows.values())
    if mine >= RETX_MIN and mine >= RETX_SHARE * total_retx:
        cause, why = "network", (f"{mine} of {total_retx} retransmits inside collectives are on its own "
                                 "connections")
    peers_p50 = _median([x.p50_ms for k, x in rows.items() if k != worst])
    saving = _lateness_saving_ns(be, late, step_ns)
    group = None
    if len(late) > 1 and len(nodes) == 1:
        node_ranks = [k for k, x in rows.items() if x.node == r.node]
        if set(node_ranks) <= set(late):
            group = f"node {r.node}"
    evidence = (f"rank {worst} arrives {r.late_ms:.1f} ms after its peers' median at its collectives "
                f"(robust z {z[worst]:.1f}; last in {r.last_share:.0%} of them) while its own "
                f"collectives take {r.p50_ms:.1f} ms at p50 vs {peers_p50:.1f} ms for the others"
                f"{'; ' + why if why else ''}")
    return Straggler(rank=worst, node=r.node, pod=r.pod, cause=cause, score=round(z[worst], 2),
                     evidence=evidence, saving_ms_per_step=saving / 1e6,
                     saving_pct=100.0 * saving / step_ns if step_ns else 0.0, group=group)


def _cpu_cause(rows: dict, k, traced_ns: int) -> tuple[str, str]:
    """cpu-contention or io when the late rank's off-CPU time of that reason stands out."""
    for reason, cause in (("io", "io"), ("runqueue", "cpu-contention")):
        mine = rows[k].offcpu_ms.get(reason, 0.0)
        peers = _median([r.offcpu_ms.get(reason, 0.0) for j, r in rows.items() if j != k])
        if mine >= OFFCPU_RATIO * peers and mine * 1e6 >= OFFCPU_MIN_SHARE * traced_ns:
            return cause, (f"it spent {mine:.0f} ms off-CPU in {reason} wait vs a peer median of "
                           f"{peers:.0f} ms")
    return "compute/unknown", "no network, CPU or I/O excess explains it"


def _lateness_saving_ns(be, late: list, step_ns: float) -> float:
    """Per step: how much earlier each collective would start without the late ranks."""
    total = be.lateness_total_ns(late)
    if not total or not step_ns:
        return 0.0
    span = be.span_ns()
    steps = max(span / step_ns, 1.0)
    return float(total) / steps


def _network_verdict(be, rows: dict, step_ns: float) -> Straggler | None:
    total = sum(r.retransmits_in_window for r in rows.values())
    if total < RETX_MIN:
        return None
    by_node: dict = {}
    for r in rows.values():
        by_node[r.node] = by_node.get(r.node, 0) + r.retransmits_in_window
    node, n = max(by_node.items(), key=lambda kv: kv[1])
    if n < RETX_SHARE * total:
        return None
    node_ranks = sorted((r for r in rows.values() if r.node == node),
                        key=lambda r: -r.retransmits_in_window)
    top = node_ranks[0]
    single = len(node_ranks) == 1 or top.retransmits_in_window >= RETX_SHARE * n
    others = [r.p50_ms for r in rows.values()]
    clean, slow_med, slow_n, instances = be.retransmit_windows()
    slow = (slow_med, slow_n)
    if (slow[1] or 0) < RETX_MIN_COLL_SHARE * instances:
        return None
    span = be.span_ns()
    steps = max(span / step_ns, 1.0) if step_ns else 1.0
    extra = max((slow[0] or 0) - (clean or 0), 0) * (slow[1] or 0) / steps
    where = f"rank {top.rank} on {node}" if single else f"node {node}"
    evidence = (f"{n} of {total} retransmits inside collectives are on {where}'s own connections; "
                f"collectives with a retransmit in flight take {(slow[0] or 0) / 1e6:.1f} ms at "
                f"median vs {(clean or 0) / 1e6:.1f} ms without (all ranks p50 "
                f"{_median(others):.1f} ms)")
    return Straggler(rank=top.rank, node=node, pod=top.pod, cause="network",
                     score=round(n / total, 2), evidence=evidence,
                     saving_ms_per_step=extra / 1e6,
                     saving_pct=100.0 * extra / step_ns if step_ns else 0.0,
                     group=None if single else f"node {node}")
