"""Per-rank analysis and the straggler verdict: one engine, on numpy columns.

1. ``calls``: every collective, send/recv and group call, with its global rank,
   as columns; sync events (where a rank blocks on others) and their
   dependencies (collective instances, send->recv pairs).
2. ``replay``: own work (between a rank's blocking calls) and transfer time per
   sync event; a replay of the step with some of them changed.
3. ``verdict``: candidates (a rank, a pipeline stage, a node, a node's network,
   everyone) each replayed with its excess removed; the saving is measured step
   minus replayed step. Blame goes to the excess own work, not to whoever
   arrives last: a rank late only because it waits upstream is listed as
   propagated blame.
4. ``stats``: per-rank figures for the table (durations, arrival lateness,
   retransmits, off-CPU time).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np

from ingero.analysis import untraced
from ingero.analysis.calls import Calls, P2pCounts, device_timing, events, load
from ingero.analysis.coverage import coverage, judge
from ingero.analysis.hang import find_hang
from ingero.analysis.model import Hang, RankRow, Report, Straggler
from ingero.analysis.proxy import add_proxy_waits, proxy_sends
from ingero.analysis.replay import measure
from ingero.analysis.stats import (add_network, add_offcpu, rank_rows, rdma_ports, retransmits, robust_z,
                                   runqueue_tails)
from ingero.analysis.steps import own_per_rank, timeline, wait_per_rank
from ingero.analysis.verdict import Decision, decide, rdma_notes

__all__ = ["Hang", "RankRow", "Report", "Straggler", "analyse", "robust_z"]

log = logging.getLogger("ingero.analysis")

LATE_FLOOR_NS = 500_000       # lateness z: host jitter below ~0.5 ms is noise


def analyse(con, slow_collective_ms: float | None = None) -> Report:
    """Analyse every table in `con` (a DuckDB connection) into a Report.

    `slow_collective_ms` (a TraceSession's thresholds.slowCollectiveMs): also count, per
    rank, the collectives that took longer than this."""
    return analyse_with_replays(con, slow_collective_ms)[0]


def analyse_with_replays(con, slow_collective_ms: float | None = None) -> tuple[Report, Decision | None]:
    """analyse, and what the verdict worked on (None when there was no step to judge)."""
    part = analyse_part(con, slow_collective_ms)
    return part.report, part.decision


class Part(NamedTuple):
    """One part of a session judged (``analyse_part``)."""

    report: Report
    decision: Decision | None     # None: no step to judge
    calls: Calls | None           # its calls, when asked for (`p2p_before`)


def analyse_part(con, slow_collective_ms: float | None = None, count_from: int | None = None,
                 hang: bool = True, p2p_before: P2pCounts | None = None) -> Part:
    """analyse_with_replays on what `con` shows, a window of a session (``windows``) or all of it.

    `count_from` (a window after the first): the per-rank counts and figures take only the
    calls and retransmits from this time on (the earlier ones were counted by the window
    before). `hang`: look for a hang (a window leaves it to the session). `p2p_before`: the
    sends and receives before the window, to pair its own with; the Part then holds its calls."""
    device, why = device_timing(con)
    c, warnings = load(con, device=device)
    cov = coverage(con, c.counted)
    if not device and cov.calls == cov.dropped:     # no call to place: nothing to key a rank's row by
        # (a job that hung before the trace began made no call since: its threads show the hang)
        return Part(Report(ranks=[], straggler=None, step_ms=0.0, collectives=0,
                           retransmits=len(retransmits(con).ts), warnings=[why] if why else [],
                           cannot_judge=judge(cov, [], None).cannot_judge,
                           hang=find_hang(con) if hang else None), None, None)
    warnings += [why] if why else []
    rows, w2 = rank_rows(c if count_from is None else c.since(count_from), slow_collective_ms)
    warnings += w2
    retx = retransmits(con)
    counted = slice(None) if count_from is None else retx.ts >= count_from
    ev = events(c, p2p_before)
    timing = "device" if device else ("host" if host_synchronous(ev) else "host-enqueue")
    if timing == "host-enqueue":
        # on a GPU a call returns once its work is queued: [t, t + duration] is not when the
        # data moved, so it is no window for retransmits, and no network verdict comes of it
        warnings.append("NCCL calls return before their collectives complete (a GPU: host time is enqueue "
                        "time); timing is host-side only and the network is not judged from host windows. "
                        "Load Ingero's NCCL profiler plugin for device times (docs/tracing.md)")
    add_network(c, rows, retx.ts[counted], retx.rank[counted], windows=timing != "host-enqueue")
    add_proxy_waits(con, rows)
    add_offcpu(con, rows)
    rdma = rdma_ports(con)
    warnings += rdma_notes(rdma)
    if ev.unpaired:
        warnings.append(f"{ev.unpaired} send/recv calls have no matching call on their peer "
                        "(peer not traced, or the trace starts or ends between them)")
    ev, m, tl = _timeline(c, ev, timing, p2p_before, warnings)
    step_ms = _median_gap_ms(tl)
    report = Report(ranks=sorted(rows.values(), key=lambda r: r.rank), straggler=None, step_ms=step_ms,
                    collectives=sum(r.collectives for r in rows.values()), retransmits=len(retx.ts[counted]),
                    warnings=warnings, timing=timing)
    report.hang = find_hang(con) if hang else None
    floor = max(LATE_FLOOR_NS, 0.01 * step_ms * 1e6)
    for k, z in robust_z({k: r.late_ms * 1e6 for k, r in rows.items()}, floor).items():
        rows[k].late_z = round(z, 2)
    placed = [r for r in rows if r >= 0]
    scope = judge(cov, placed, None if tl is None else placed if tl.covered is None else tl.covered)
    report.cannot_judge, report.covered_ranks = scope.cannot_judge, scope.covered
    kept = c if p2p_before is not None else None
    if report.cannot_judge:
        return Part(report, None, kept)
    if cov.dropped:
        warnings.append(f"{cov.dropped:,} of {cov.calls:,} NCCL calls cannot be placed, and the verdict does "
                        f"not weigh them: {cov.why_dropped()}")
    if scope.note:
        warnings.append(scope.note)
    return Part(report, _verdict(con, report, rows, c, retx, m, tl, rdma), kept)


def _verdict(con, report: Report, rows: dict, c: Calls, retx, m, tl, rdma) -> Decision:
    """The straggler verdict of a judged part, into `report` and its rows."""
    warnings, timing = report.warnings, report.timing
    for r, v in own_per_rank(tl, m.w).items():
        if r in rows:
            rows[r].own_ms = v / 1e6
    for r, v in wait_per_rank(tl).items():
        if r in rows:
            rows[r].wait_ms = v / 1e6
    for r, s in tl.stage_of.items():
        if r in rows:
            rows[r].stage = s
    # judged for a lossy link: retransmits on connections that leave their node (inside a node
    # there is no wire to lose a segment on: a receiver that does not drain its socket, e.g.
    # starved of CPU, makes its local peer retransmit), and none from host windows
    wire = ~retx.local if timing != "host-enqueue" else np.zeros(len(retx.ts), bool)
    traced_ns = int((c.t + c.d).max() - c.t.min()) if c.n else 0
    d = decide(tl, rows, retx.only(wire), traced_ns, runqueue_tails(con),
               rdma=rdma if timing != "host-enqueue" else None, local_retx=int(retx.local.sum()),
               proxy=proxy_sends(con) if timing != "host-enqueue" else None)
    if d.base.stuck_rounds:
        warnings.append(f"the replay met {d.base.stuck_rounds} cycles in the calls' dependencies "
                        "(mismatched send/recv?) and released them")
    base = d.base_step_ns
    report.straggler = d.straggler
    report.mean_step_ms = base / 1e6
    report.best_saving_pct = round(d.best_saving_pct, 2)
    report.best_candidate = d.best.label if d.best else None
    if d.straggler is not None:
        report.predicted_step_ms = (base / 1e6) - d.straggler.saving_ms_per_step
    elif d.best is not None:
        report.predicted_step_ms = (base - d.best.saving_ns) / 1e6
    log.debug("candidates: %s", [(k.label, k.saving_ns) for k in d.candidates])
    return d


def _timeline(c: Calls, ev, timing: str, p2p_before: P2pCounts | None, warnings: list[str]):
    """(events, their measurement, the step timeline); a sync between steps that the trace does
    not show (``untraced``) is judged as a collective over the ranks it holds."""
    m = measure(ev)
    tl = timeline(c, ev, m)
    u = untraced.between_steps(c, ev, tl) if tl is not None and timing == "host" else None
    if u is None:
        return ev, m, tl
    warnings.append(u.note())
    c = untraced.with_sync(c, u)
    ev = events(c, p2p_before)
    m = measure(ev)
    return ev, m, timeline(c, ev, m)


def host_synchronous(ev, min_spread_ns: int = 100_000, min_instances: int = 10) -> bool:
    """Do the traced calls return when their collective completes (a CPU NCCL, or a host
    that waits), or as soon as they are queued (a GPU)? A blocking call cannot return
    before the last member of its collective has arrived, so the earliest arriver of an
    instance ends after the latest arrival; a queued call returns in microseconds, long
    before. Judged on instances whose arrivals spread over `min_spread_ns` (loss or a slow
    peer only make a blocking call end later, never earlier); too few of them to tell:
    synchronous (nothing to correct)."""
    idx, at, _ = ev.by_inst()
    if not len(idx):
        return True
    a = ev.a[idx]
    a_first, a_last = np.minimum.reduceat(a, at), np.maximum.reduceat(a, at)
    eq = a == np.repeat(a_first, np.diff(np.r_[at, len(idx)]))   # the earliest arriver (of equal ones the first)
    e_first = ev.e[np.minimum.reduceat(np.where(eq, idx, len(ev.a)), at)]
    sel = (a_last - a_first) >= min_spread_ns
    if sel.sum() < min_instances:
        return True
    waited = e_first[sel] >= a_last[sel] - min_spread_ns // 10   # a little slack for clock noise
    return float(np.mean(waited)) >= 0.5


def _median_gap_ms(tl) -> float:
    """Median gap between consecutive step boundaries (each marker's first arrivals), ms."""
    if tl is None:
        return 0.0
    gaps = np.diff(tl.first_arrivals(), axis=1)
    return float(np.median(gaps)) / 1e6 if gaps.size else 0.0
