"""A session judged in windows of whole steps: memory bounded by a window, not by the session.

The engine (``analyse_part``) holds every call of what it judges in memory. A
session holding more calls than a window is read window after window, each a time range
of the event tables (views that DuckDB answers from the Parquet row groups in range), and
the windows' figures are combined:

* The windows follow one another at step boundaries: the next window starts at the first
  arrival of the last boundary the previous window judged (a little before, by a quarter of
  its step), so each step is judged in exactly one window and none is lost to a cut.
* Sends and receives pair in order per (communicator, sender, receiver), counted from the
  session's start: each window starts from the counts of the calls before it.
* Rows the next window reads again (the part of a step after that boundary) count in the
  window that read them first: the per-rank counts (calls, retransmits) add up over the
  windows. The off-CPU totals the kernel keeps carry no time: a window takes its share by
  its length, and the session's table shows the whole totals.
* The verdict: each window's candidates' savings, weighted by the window's steps, are the
  session's savings (a candidate a window did not name or replay saves 0 there). The
  candidate some window named that saves most over the session is named when it clears
  the floor, with the cause that holds most of its saving and the evidence of the window
  where it saved most. Own work and waits per step are the windows' weighted by steps,
  duration quantiles and lateness weighted by calls.

A long session repeats the same step thousands of times, and the replay costs a few CPU-us
per call. A session holding more calls than REPLAY_BUDGET is judged on a sample of windows
of whole steps, about REPLAY_BUDGET calls in all (``sampled``), and one DuckDB aggregate over
all its calls (``sampling.prepass``) gives the rest:

* Which windows: SAMPLED_SPREAD spread evenly over the session, and SAMPLED_UNEVEN where the
  ranks are most uneven (the rank with the least time inside collectives against the median
  rank: the late arriver waits least), so that a rank slow for part of the session only is
  judged where it is slow. Each window starts at a bucket of the pre-pass and spans
  MIN_STEPS whole steps at least, a step being about the session's length over the calls
  per rank of its least made collective (``sampling._least_recurring``; when the first
  window judged holds fewer all are widened), up to `window_calls` calls. Where steps are
  so long that those windows would hold more than the budget, fewer are judged: as many
  as it holds, and two at least (one spread, one uneven).
* A saving near its floor: when the saving over the judged steps of a candidate a window
  named (none named: of the best) is within SETTLE_PCT of its floor, the sample does not
  settle the verdict: it is judged again, once, on windows SETTLE_WIDER times as long.
* What each stands for: each bucket of the session goes to the judged window whose
  unevenness is nearest its own (``Prepass.stand_for``); a window stands for as many steps as
  its step takes in those buckets' time, and the verdict weighs the windows by those steps
  as above. The report says so in its first warning.
* Sends and receives before a window, to pair its own with: the pre-pass's counts per
  (communicator, sender, receiver) before its bucket; the skipped calls are never read.
  Where the pre-pass cannot name a send's or receive's pair (a communicator the trace began
  after, which the engine recovers from the call sequences), every step is judged, window
  after window, and the report says why.
* Calls NCCL never ran: the engine leaves out the calls of a group closed by
  ncclGroupSimulateEnd, which the pre-pass cannot tell from the others; a session with such
  a group has every step judged, window after window, and the report says why.
* The counts of the table (calls per rank and op, over the threshold, retransmits) are the
  whole session's, not extrapolated; retransmits inside a rank's calls are its retransmits
  times the share inside its calls in the judged windows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

import numpy as np

from ingero import schema
from ingero.analysis import analyse, analyse_part
from ingero.analysis.calls import P2pCounts
from ingero.analysis.hang import find_hang
from ingero.analysis.model import RankRow, Report, Straggler
from ingero.analysis.proxy import add_proxy_waits
from ingero.analysis.sampling import Prepass, prepass
from ingero.analysis.stats import add_offcpu, retransmits, robust_z
from ingero.analysis.verdict import SAVING_FLOOR_PCT, SPREAD_FLOOR_PCT

WINDOW_CALLS = 1_250_000     # NCCL calls per window (the last up to 1.5x): 2.5 M-call windows peaked at 1.96 GiB
                             # with DuckDB (docs/benchmarks.md), and the chart's operator limit is 2 GiB
REPLAY_BUDGET = 400_000     # NCCL calls judged at most (replayed): a session holding more is judged on a sample
SAMPLED_SPREAD, SAMPLED_UNEVEN = 2, 2   # sampled windows spread evenly / where the ranks are most uneven
MIN_STEPS = 10               # whole steps a sampled window holds at least, for the per-step medians its verdict
                             # rests on (a pipeline's saving replays alike on 3 or 10: a window's edges lose none)
SETTLE_PCT = 1.5             # a candidate's saving this near its floor (% of the step) is not settled by the sample:
SETTLE_WIDER = 4             # ... it is judged again on windows this many times as long (up to `window_calls`)
BOUNDARY_LEAD = 0.25         # a window starts this share of a step before the boundary it opens with
SPREAD = "spread: no single rank"


@contextlib.contextmanager
def events_where(con, where: str, rows: dict | None = None):
    """For the while, temporary views shadow every event table with its rows matching
    `where` (SQL, e.g. on timestamp_ns). Yields (the database's name, for a view over
    another of its tables; the list of views dropped at the end, to add such a view to).
    A temporary view already shadowing a table (``readonly_sql.confine_views``) is the one
    narrowed, and is back at the end. `rows`: table -> a query of exactly those rows to show
    instead (None: none), for tables the caller reads another way."""
    db = con.execute("SELECT current_database()").fetchone()[0].replace('"', '""')
    shadowed = list(schema.EVENT_TABLES)
    moved = [t for (t,) in con.execute("SELECT view_name FROM duckdb_views() WHERE temporary AND view_name IN "
                                       "(SELECT unnest(?))", [shadowed]).fetchall()]
    try:
        for table in moved:
            con.execute(f"ALTER VIEW temp.{table} RENAME TO _whole_{table}")
        for table in schema.EVENT_TABLES:
            src = f"temp._whole_{table}" if table in moved else f'"{db}".main.{table}'
            body = (rows or {}).get(table, f"SELECT * FROM {src} WHERE {where}")
            con.execute(f"CREATE OR REPLACE TEMP VIEW {table} AS {body or f'SELECT * FROM {src} WHERE false'}")
        yield db, shadowed
    finally:
        for table in shadowed:
            con.execute(f"DROP VIEW IF EXISTS temp.{table}")
        for table in moved:
            con.execute(f"ALTER VIEW temp._whole_{table} RENAME TO {table}")


def events_between(con, lo: int, hi: int | None):
    """``events_where`` the rows from `lo` to `hi` (ns; None: to the end)."""
    return events_where(con, f"timestamp_ns >= {int(lo)}" + ("" if hi is None else f" AND timestamp_ns < {int(hi)}"))


@dataclasses.dataclass
class _Window:
    report: Report
    steps: int                 # whole steps it judged
    candidates: dict           # label -> saving, ns per step
    named: str | None          # the label of the candidate it named
    work_step: float           # the step spread's floors are shares of (``Decision.work_step_ns``)
    lo: int                    # its time range (ns)
    hi: int
    stands: float | None = None   # a sampled window: the session's steps it stands for, per step it judged

    @property
    def weight(self):
        """The steps it stands for: its own, or a sampled window's share of the session's."""
        return self.steps if self.stands is None else self.steps * self.stands

    @property
    def straggler(self) -> Straggler:
        """The straggler it named (a window with `named` set names one)."""
        assert self.report.straggler is not None
        return self.report.straggler


def analyse_windows(con, slow_collective_ms: float | None = None, window_calls: int = WINDOW_CALLS,
                    between=events_between, extent: tuple | None = None, budget: int | None = None) -> Report:
    """The session on `con` judged in windows of whole steps holding about `window_calls`
    NCCL calls each (see the module's docstring); `analyse` itself when it holds no more.
    `between(con, lo, hi)`: a context that shows the event tables' rows from `lo` to `hi`
    (None: to the end) and yields ``events_where``'s pair (the operator's reads only the
    segments in range). `extent`: nccl_events' (rows, first and last timestamp_ns) when the
    caller knows them (the operator, from the segments' footers); None: counted. A session
    holding more than `budget` calls (None: REPLAY_BUDGET): judged on a sample of its windows
    (``sampled``)."""
    calls, first, last = extent or con.execute(
        "SELECT count(*), min(timestamp_ns), max(timestamp_ns) FROM nccl_events").fetchall()[0]
    budget = REPLAY_BUDGET if budget is None else budget
    if calls > budget and first is not None and last > first:
        pre = prepass(con, int(first), int(last), slow_collective_ms)
        if pre.unkeyed:
            why = (f"{pre.unkeyed:,} sends and receives are on communicators the trace began after, which only the "
                   "calls around them pair")
        elif pre.simulate_ends:
            why = (f"groups closed by ncclGroupSimulateEnd ({pre.simulate_ends:,} returned ncclSuccess) hold calls "
                   "NCCL never ran, which the counts leave out and only the calls around them tell apart")
        else:
            return sampled(con, slow_collective_ms, window_calls, between, (calls, int(first), int(last)), budget, pre)
        out = _every_window(con, slow_collective_ms, window_calls, between, (calls, int(first), int(last)))
        out.warnings.insert(0, f"every step judged, not a sample: {why}")
        return out
    if first is None or last <= first:
        return analyse(con, slow_collective_ms)
    return _every_window(con, slow_collective_ms, window_calls, between, (calls, int(first), int(last)))


def _every_window(con, slow_collective_ms: float | None, window_calls: int, between, extent: tuple) -> Report:
    """The session judged in windows of whole steps, one after the other (see the module's
    docstring); `analyse` itself when it holds no more than `window_calls` calls."""
    calls, first, last = extent
    if calls <= window_calls:
        return analyse(con, slow_collective_ms)
    width = max(int((last - first) * window_calls / calls), 1)
    wins: list[_Window] = []
    lo, counted = int(first), None
    pairs = P2pCounts()
    while True:
        hi = lo + width
        final = hi + width // 2 >= last          # what is left is less than half a window: all of it
        part, win = _judge(con, slow_collective_ms, between, lo, None if final else hi, first, last,
                           count_from=counted, pairs=pairs)
        wins.append(win)
        if final:
            break
        rep, d = part.report, part.decision
        tl = d.timeline if d is not None else None
        nxt = hi
        if tl is not None and tl.steps:
            nxt = int(tl.first_arrivals()[:, -1].min() - BOUNDARY_LEAD * rep.step_ms * 1e6)
        nxt = nxt if lo < nxt < hi else hi
        if part.calls is not None:
            pairs.add(part.calls, nxt)
        lo, counted = nxt, hi
    out = combine(wins, con)
    out.hang = find_hang(con)
    return out


def sampled(con, slow_collective_ms: float | None, window_calls: int, between, extent: tuple,
            budget: int, pre: Prepass) -> Report:
    """The session judged on SAMPLED_SPREAD + SAMPLED_UNEVEN windows of about `budget` calls
    in all (``sampling.Prepass.choose``; fewer, two at least, where windows of MIN_STEPS
    whole steps hold more), each a `window_calls` at most; the table's counts are the whole
    session's (``sampling.prepass``)."""
    calls, first, last = extent
    cap = max(int((last - first) * window_calls / calls), 1)
    lead = MIN_STEPS + 1 + 2 * BOUNDARY_LEAD     # steps a window spans to hold MIN_STEPS whole ones
    width = min(max(int((last - first) * budget / (SAMPLED_SPREAD + SAMPLED_UNEVEN) / calls),
                    int(lead * pre.step_ns), 1), cap)

    def choose(width: int) -> list[tuple[int, str]]:
        """The windows `width` ns long to judge: as many as the budget holds, two at least."""
        k = SAMPLED_SPREAD + SAMPLED_UNEVEN
        n = min(k, max(2, int(budget * (last - first) / (width * calls))))
        spread = max(1, n * SAMPLED_SPREAD // k) if SAMPLED_SPREAD else 0
        return pre.choose(-(-width // pre.width), spread, n - spread)

    plan = choose(width)
    wins: list[_Window] = []
    rounds = 0
    while True:
        while len(wins) < len(plan):
            s, _ = plan[len(wins)]
            lo = pre.first + s * pre.width
            _, win = _judge(con, slow_collective_ms, between, lo, min(lo + width, last + 1), first, last,
                            count_from=None, pairs=pre.p2p_before(s))
            if not wins and win.steps < MIN_STEPS and width < cap:    # steps longer than the window: widen it
                step = win.report.step_ms * 1e6
                width = min(cap, max(2 * width, int(lead * step)))
                plan = choose(width)
                continue
            wins.append(win)
        if rounds or width >= cap or not _unsettled(wins):
            break
        width, rounds, wins = min(cap, SETTLE_WIDER * width), 1, []
        plan = choose(width)
    span = -(-width // pre.width)
    stood = pre.stand_for([(w.lo - pre.first) // pre.width for w in wins], span, [w.steps > 0 for w in wins])
    for w, n in zip(wins, stood):     # the steps it stands for: as many as its step takes in that time
        step = w.steps * w.report.step_ms * 1e6
        w.stands = n * pre.width / step if step > 0 else 0.0
    out = combine(wins, con, whole=pre, settled=bool(rounds))
    out.hang = find_hang(con)
    return out


def _unsettled(wins: list[_Window]) -> bool:
    """Is the saving over the judged steps (each alike) of a candidate some window named (none
    named: of the one that saves most) within SETTLE_PCT of its floor? Then the sample does
    not settle whether the session names it."""
    judged = [w for w in wins if w.steps]
    steps = sum(w.steps for w in judged)
    base = sum((w.report.mean_step_ms or 0.0) * 1e6 * w.steps for w in judged) / steps if steps else 0.0
    if base <= 0:
        return False
    saving: dict = {}
    for w in judged:
        for label, ns in w.candidates.items():
            saving[label] = saving.get(label, 0.0) + ns * w.steps / steps
    named = {w.named for w in judged if w.named is not None} or set(sorted(saving, key=saving.__getitem__)[-1:])
    return any(abs(100.0 * saving.get(label, 0.0) / base - (SPREAD_FLOOR_PCT if label == SPREAD else SAVING_FLOOR_PCT))
               < SETTLE_PCT for label in named)


def _judge(con, slow_collective_ms, between, lo: int, hi: int | None, first: int, last: int,
           count_from: int | None, pairs: P2pCounts) -> tuple:
    """(analyse_part's Part, the _Window) of the rows from `lo` to `hi` (None: to the end)."""
    with between(con, lo, hi) as (db, shadowed):
        share = ((last if hi is None else hi) - lo) / (last - first)
        con.execute(f"""CREATE OR REPLACE TEMP VIEW sched_totals AS
            SELECT * REPLACE (CAST(total_ns * {share!r} AS BIGINT) AS total_ns,
                              CAST(intervals * {share!r} AS BIGINT) AS intervals)
            FROM "{db}".main.sched_totals""")
        shadowed.append("sched_totals")
        part = analyse_part(con, slow_collective_ms, count_from=count_from, hang=False, p2p_before=pairs)
    rep, d = part.report, part.decision
    tl = d.timeline if d is not None else None
    named = (d.named or d.best) if d is not None else None
    return part, _Window(rep, tl.steps if tl is not None and not rep.cannot_judge else 0,
                         {k.label: k.saving_ns for k in d.candidates} if d is not None else {},
                         named.label if named is not None and rep.straggler is not None else None,
                         d.work_step_ns if d is not None else 0.0, lo, last if hi is None else hi)


def combine(wins: list[_Window], con=None, whole: Prepass | None = None, settled: bool = False) -> Report:
    """The session's report from its windows' (see the module's docstring). With `con`, the
    off-CPU times and NCCL's proxy waits of the table are the whole session's; with `whole`
    (the windows are a sample of it, on `con`), its counts too; `settled`: the sample was
    judged again on windows SETTLE_WIDER times as long, a saving being near its floor."""
    judged = [w for w in wins if w.steps]
    first = wins[0].report
    out = Report(ranks=_ranks(wins), straggler=None, step_ms=0.0,
                 collectives=sum(w.report.collectives for w in wins),
                 retransmits=sum(w.report.retransmits for w in wins),
                 warnings=_warnings(wins), timing=first.timing)
    if whole is not None:
        _whole_counts(out, whole, con)
    if con is not None:
        rows = {r.rank: r for r in out.ranks}
        for r in out.ranks:
            r.offcpu_ms, r.offcpu_waits = {}, {}
        add_offcpu(con, rows)
        add_proxy_waits(con, rows)
    if not judged:
        out.cannot_judge = next((w.report.cannot_judge for w in wins if w.report.cannot_judge),
                                "no window held two whole steps")
        return out
    steps = sum(w.weight for w in judged)
    weigh = lambda f: sum(f(w) * w.weight for w in judged) / steps
    out.step_ms = weigh(lambda w: w.report.step_ms)
    out.mean_step_ms = weigh(lambda w: w.report.mean_step_ms)
    if any(w.report.covered_ranks is not None for w in judged):
        covered = set().union(*(w.report.covered_ranks or {r.rank for r in w.report.ranks} for w in judged))
        out.covered_ranks = None if covered >= {r.rank for r in out.ranks} else sorted(covered)
    floor = max(0.5e6, 0.01 * out.step_ms * 1e6)
    for k, z in robust_z({r.rank: r.late_ms * 1e6 for r in out.ranks}, floor).items():
        next(r for r in out.ranks if r.rank == k).late_z = round(z, 2)
    skipped = [w for w in wins if not w.steps]
    if skipped:
        out.warnings.insert(0, f"{len(skipped)} of {len(wins)} windows could not be judged and the verdict does "
                               f"not weigh them ({skipped[0].report.cannot_judge or 'no whole step'})")
    if whole is None:
        out.warnings.insert(0, f"judged in {len(wins)} windows of whole steps ({steps:,} steps in all)")
    else:
        out.warnings.insert(0, f"judged {len(wins)} sampled window{'s' if len(wins) != 1 else ''} of whole steps "
                               f"({sum(w.steps for w in judged):,} of ~{round(steps):,} steps) spread over the "
                               "session and where the ranks were most uneven"
                               + (f", on windows {SETTLE_WIDER}x as long as at first (a saving was within "
                                  f"{SETTLE_PCT:g} points of its floor)" if settled else "")
                               + "; counts are the whole session's")
    # each candidate's saving over the session, ns per step
    saving: dict = {}
    for w in judged:
        named_saving = {}
        if w.named is not None:
            named_saving[w.named] = w.straggler.saving_ms_per_step * 1e6
        for label, s in {**w.candidates, **named_saving}.items():
            saving[label] = saving.get(label, 0.0) + s * w.weight / steps
    base = out.mean_step_ms * 1e6
    if saving and base > 0:
        best = max(saving, key=saving.__getitem__)
        out.best_candidate, out.best_saving_pct = best, round(100.0 * saving[best] / base, 2)
    names = {w.named for w in judged if w.named is not None}
    if names and base > 0:
        label = max(names, key=lambda k: saving[k])
        # spread's floor is a share of the step without the ranks' waits for a CPU, as in a window
        of = weigh(lambda w: w.work_step or w.report.mean_step_ms * 1e6) if label == SPREAD else base
        if 100.0 * saving[label] / of >= (SPREAD_FLOOR_PCT if label == SPREAD else SAVING_FLOOR_PCT):
            out.straggler = _named(judged, label, saving[label], base, steps)
            out.predicted_step_ms = (base - saving[label]) / 1e6
    if out.straggler is None and out.best_candidate is not None:
        out.predicted_step_ms = (base - saving[out.best_candidate]) / 1e6
    return out


def _named(judged: list[_Window], label: str, saving_ns: float, base: float, steps) -> Straggler:
    """The straggler a label names over the session: the cause that holds most of its saving,
    the evidence of the window where it saved most."""
    mine = [w for w in judged if w.named == label]
    by_cause: dict[str, float] = {}
    for w in mine:
        s = w.straggler
        by_cause[s.cause] = by_cause.get(s.cause, 0.0) + s.saving_ms_per_step * w.weight
    cause = max(by_cause, key=by_cause.__getitem__)
    top = max((w for w in mine if w.straggler.cause == cause), key=lambda w: w.straggler.saving_ms_per_step)
    s = top.straggler
    held = sum(w.weight for w in mine)
    return dataclasses.replace(
        s, cause=cause, saving_ms_per_step=saving_ns / 1e6, saving_pct=100.0 * saving_ns / base,
        evidence=(f"named in {len(mine)} of {len(judged)} windows ({round(held):,} of {round(steps):,} steps), saving "
                  f"{saving_ns / 1e6:.1f} ms/step over the session; in the window where it saved most: {s.evidence}"))


def _ranks(wins: list[_Window]) -> list[RankRow]:
    """The per-rank table over the windows: counts added, own work and waits weighted by the
    windows' steps, quantiles and lateness by the rank's calls in each."""
    acc: dict = {}
    for w in wins:
        for r in w.report.ranks:
            acc.setdefault(r.rank, []).append((r, w.weight))
    out = []
    for rank, got in sorted(acc.items()):
        last = got[-1][0]
        row = RankRow(rank=rank, node=last.node, pod=last.pod, pid=last.pid)
        n = sum(r.collectives for r, _ in got)
        by_calls = lambda f: sum(f(r) * r.collectives for r, _ in got) / n if n else 0.0
        st = sum(s for _, s in got)
        by_steps = lambda f: sum(f(r) * s for r, s in got) / st if st else 0.0
        row.collectives = n
        row.p50_ms, row.p99_ms = by_calls(lambda r: r.p50_ms), by_calls(lambda r: r.p99_ms)
        row.late_ms, row.last_share = by_calls(lambda r: r.late_ms), by_calls(lambda r: r.last_share)
        row.retransmits = sum(r.retransmits for r, _ in got)
        row.retransmits_in_window = sum(r.retransmits_in_window for r, _ in got)
        if any(r.slow_collectives is not None for r, _ in got):
            row.slow_collectives = sum(r.slow_collectives or 0 for r, _ in got)
        row.own_ms, row.wait_ms = by_steps(lambda r: r.own_ms), by_steps(lambda r: r.wait_ms)
        row.stage = next((r.stage for r, _ in reversed(got) if r.stage is not None), None)
        row.offcpu_ms, row.offcpu_waits, row.net_wait_ms = last.offcpu_ms, last.offcpu_waits, last.net_wait_ms
        for op in dict.fromkeys(k for r, _ in got for k in r.per_op):
            parts = [r.per_op[op] for r, _ in got if op in r.per_op]
            k = sum(p["calls"] for p in parts)
            row.per_op[op] = {"calls": k, **{q: sum(p[q] * p["calls"] for p in parts) / k if k else 0.0
                                             for q in ("p50_ms", "p99_ms")}}
        out.append(row)
    return out


def _whole_counts(out: Report, pre: Prepass, con) -> None:
    """The table's counts of a sampled session: the whole session's collectives per rank and
    op (and over the threshold) and retransmits. Retransmits inside a rank's calls: its
    retransmits times the share of them inside its calls in the judged windows. An op no
    judged window held has no p50/p99 (None: not measured)."""
    rows = {r.rank: r for r in out.ranks}
    for rank in pre.ranks.tolist():
        if rank not in rows:
            rows[rank] = RankRow(rank=rank, node=None, pod=None, pid=0)
    retx = retransmits(con)
    per_rank = dict(zip(*(a.tolist() for a in np.unique(retx.rank, return_counts=True))))
    for r in rows.values():
        ops = pre.per_op.get(r.rank, {})
        for op in dict.fromkeys([*r.per_op, *ops]):
            q = r.per_op.get(op, {})
            r.per_op[op] = {"calls": ops.get(op, 0), "p50_ms": q.get("p50_ms"), "p99_ms": q.get("p99_ms")}
        r.collectives = sum(ops.values())
        if pre.slow is not None:
            r.slow_collectives = pre.slow.get(r.rank, 0)
        seen, inside = r.retransmits, r.retransmits_in_window
        r.retransmits = per_rank.get(r.rank, 0)
        r.retransmits_in_window = round(r.retransmits * inside / seen) if seen else 0
    out.ranks = sorted(rows.values(), key=lambda r: r.rank)
    out.collectives = sum(r.collectives for r in out.ranks)
    out.retransmits = len(retx.ts)


def _warnings(wins: list[_Window]) -> list[str]:
    """Each window's warnings once: those that differ only in their figures are one, with
    the number of windows that gave it."""
    seen: dict = {}
    for w in wins:
        for text in w.report.warnings:
            shape = re.sub(r"\d[\d,.]*", "#", text)
            if shape in seen:
                seen[shape][1] += 1
            else:
                seen[shape] = [text, 1]
    return [t if k == 1 else f"{t} (in {k} of {len(wins)} windows; figures of the first)" for t, k in seen.values()]
