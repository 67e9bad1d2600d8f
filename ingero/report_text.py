"""A report as text: the per-rank table, the verdict and its evidence (`ingero report`,
`kubectl ingero report`)."""

from __future__ import annotations

import sys

from ingero.analysis import Report
from ingero.analysis.coverage import ranks_text, span
from ingero.console import print_table, printable


def render(rep: Report, out=None) -> None:
    out = out or sys.stdout
    names = ["rank", "node", "pod", "stage", "own ms", "wait ms", "colls", "p50 ms", "p99 ms", "late ms",
             "last %", "z", "retx", "retx in coll", "runq ms", "io ms", "sleep ms"]
    rows = [(r.rank, r.node or "", r.pod or "", "" if r.stage is None else r.stage, r.own_ms, r.wait_ms,
             r.collectives, r.p50_ms, r.p99_ms, r.late_ms,
             round(100 * r.last_share), r.late_z, r.retransmits, r.retransmits_in_window,
             r.offcpu_ms.get("runqueue", 0.0), r.offcpu_ms.get("io", 0.0),
             r.offcpu_ms.get("sleep", 0.0)) for r in rep.ranks]
    print_table(names, rows, out=out)

    def say(text: str) -> None:      # names and evidence come from the trace
        print(printable(text), file=out)

    timing = {"device": "device times (the NCCL profiler plugin)", "host": "host times",
              "host-enqueue": "host enqueue times only"}.get(rep.timing, rep.timing)
    print(file=out)
    say(f"step ~{rep.step_ms:.1f} ms (mean {rep.mean_step_ms:.1f} ms), {rep.collectives} collectives, "
        f"{rep.retransmits} retransmits; timing: {timing}")
    say(f"verdict: {verdict_line(rep)}")
    if rep.hang is not None:
        say(f"hang: {rep.hang.evidence}")
    s = rep.straggler
    if rep.verdict == "none":
        best = (f"; the best single fix ({rep.best_candidate}) would save {rep.best_saving_pct:.1f}% "
                "of the step, under the floor" if rep.best_candidate else "")
        say(f"straggler: none{best}")
    elif rep.verdict == "straggler" and s is not None:
        who = s.group if s.kind != "rank" and s.group else f"rank {s.rank} ({s.pod or s.node})"
        say(f"straggler: {who}, cause {s.cause}, score {s.score}; would save "
            f"~{s.saving_ms_per_step:.1f} ms/step ({s.saving_pct:.1f}%): predicted step "
            f"{rep.predicted_step_ms:.1f} ms instead of {rep.mean_step_ms:.1f} ms")
        say(f"evidence: {s.evidence}")
        for p in s.propagated:
            say(f"propagated: {p}")
    for w in rep.warnings:
        say(f"warning: {w}")


def verdict_line(rep: Report) -> str:
    """The verdict kind in words: "straggler", "none", "cannot judge: <why>", "hang: <who>";
    with the ranks it covers when that is not every rank of the job."""
    if rep.verdict == "cannot-judge":
        return f"cannot judge: {rep.cannot_judge}"
    if rep.verdict == "hang" and rep.hang is not None:
        h = rep.hang
        if not h.missing:
            return "hang"
        # missing: ranks that never entered the call, or are stopped inside it (the evidence says which)
        return (f"hang: {ranks_text(h.missing)} holds up the {h.op} the others wait in" if h.op
                else f"hang: {ranks_text(h.missing)} stopped, and no rank calls NCCL")
    covers = f" (covers ranks {span(rep.covered_ranks)} only)" if rep.covered_ranks else ""
    return rep.verdict + covers
