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

import numpy as np

from ingero.analysis.calls import events, load
from ingero.analysis.model import RankRow, Report, Straggler
from ingero.analysis.replay import measure
from ingero.analysis.stats import add_network, add_offcpu, rank_rows, retransmits, robust_z
from ingero.analysis.verdict import decide, own_per_rank, timeline, wait_per_rank

__all__ = ["RankRow", "Report", "Straggler", "analyse", "robust_z"]

log = logging.getLogger("ingero.analysis")

LATE_FLOOR_NS = 500_000       # lateness z: host jitter below ~0.5 ms is noise


def analyse(con, slow_collective_ms: float | None = None) -> Report:
    """Analyse every table in `con` (a DuckDB connection) into a Report.

    `slow_collective_ms` (a TraceSession's thresholds.slowCollectiveMs): also count, per
    rank, the collectives that took longer than this."""
    return analyse_with_replays(con, slow_collective_ms)[0]


def analyse_with_replays(con, slow_collective_ms: float | None = None) -> tuple[Report, dict]:
    """analyse, and what the verdict worked on: {"timeline", "base" (the measured step
    replayed), "named" (the named or best candidate, its replay in extra["replay"])};
    empty when there was no step to judge."""
    c, warnings = load(con)
    rows, w2 = rank_rows(c, slow_collective_ms)
    warnings += w2
    retx = retransmits(con)
    add_network(c, rows, retx[0], retx[1])
    add_offcpu(con, rows)
    total_retx = len(retx[0])
    collectives = sum(r.collectives for r in rows.values())
    ev = events(c)
    if ev.unpaired:
        warnings.append(f"{ev.unpaired} send/recv calls have no matching call on their peer "
                        "(peer not traced, or the trace starts or ends between them)")
    m = measure(ev)
    tl = timeline(c, ev, m)
    traced_ns = int((c.t + c.d).max() - c.t.min()) if c.n else 0
    step_ms = _median_gap_ms(tl)
    report = Report(ranks=sorted(rows.values(), key=lambda r: r.rank), straggler=None, step_ms=step_ms,
                    collectives=collectives, retransmits=total_retx, warnings=warnings)
    floor = max(LATE_FLOOR_NS, 0.01 * step_ms * 1e6)
    for k, z in robust_z({k: r.late_ms * 1e6 for k, r in rows.items()}, floor).items():
        rows[k].late_z = round(z, 2)
    if tl is None or len(rows) < 2:
        if len(rows) >= 2:
            warnings.append("no collective recurs on all ranks: no step to judge, no verdict")
        return report, {}
    for r, v in own_per_rank(tl, m.w).items():
        if r in rows:
            rows[r].own_ms = v / 1e6
    for r, v in wait_per_rank(tl).items():
        if r in rows:
            rows[r].wait_ms = v / 1e6
    for r, s in tl.stage_of.items():
        if r in rows:
            rows[r].stage = s
    straggler, info = decide(c, tl, rows, retx, traced_ns)
    if info.get("stuck_rounds"):
        warnings.append(f"the replay met {info['stuck_rounds']} cycles in the calls' dependencies "
                        "(mismatched send/recv?) and released them")
    base = info["base_step_ns"]
    report.straggler = straggler
    report.mean_step_ms = base / 1e6
    best = info.get("best")
    report.best_saving_pct = round(info.get("best_saving_pct", 0.0), 2)
    report.best_candidate = best.label if best else None
    if straggler is not None:
        report.predicted_step_ms = (base / 1e6) - straggler.saving_ms_per_step
    elif best is not None:
        report.predicted_step_ms = (base - best.saving_ns) / 1e6
    log.debug("candidates: %s", info.get("candidates"))
    return report, {"timeline": tl, "base": info.get("base_replay"), "named": info.get("named") or best}


def _median_gap_ms(tl) -> float:
    """Median gap between consecutive marker instances (their first arrival), ms."""
    if tl is None:
        return 0.0
    ev = tl.ev
    first = np.full(int(ev.inst.max()) + 1, np.iinfo(np.int64).max, np.int64)
    has = ev.inst >= 0
    np.minimum.at(first, ev.inst[has], ev.a[has])
    gaps = np.diff(first[tl.marker_inst])
    return float(np.median(gaps)) / 1e6 if len(gaps) else 0.0
