"""TraceSession status: bounded rendering of a Report, node rows and conditions.

Status must stay small (etcd objects are limited to ~1.5 MB and every
`kubectl get -w` re-sends it): strings are cut, the ranks table keeps the
worst ranks only; the full report is beside the artifact.
"""

from __future__ import annotations

import datetime as dt

from ingero.analysis import Report
from ingero_operator.settings import GatherSettings


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def parse_iso(text: str | None) -> dt.datetime | None:
    if not text:
        return None
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def cut(text: str | None, limit: int) -> str | None:
    if text is None or len(text) <= limit:
        return text
    return text[:max(0, limit - 1)] + "…"


def _r(x, nd=2):
    return round(float(x), nd) if x is not None else None


def rank_row(r) -> dict:
    return {"rank": r.rank, "node": r.node, "pod": r.pod, "collectives": r.collectives,
            "p50Ms": _r(r.p50_ms, 3), "p99Ms": _r(r.p99_ms, 3), "lateMs": _r(r.late_ms, 3),
            "lateZ": _r(r.late_z), "lastPct": _r(100 * r.last_share, 1), "retransmits": r.retransmits,
            "retransmitsInWindow": r.retransmits_in_window,
            **({"slowCollectives": r.slow_collectives} if r.slow_collectives is not None else {}),
            **({"stage": r.stage} if r.stage is not None else {}),
            "ownMs": _r(r.own_ms, 3), "waitMs": _r(r.wait_ms, 3),
            "offcpuMs": {k: _r(v, 1) for k, v in sorted(r.offcpu_ms.items())}}


def ranks_table(rep: Report, rows: int) -> list[dict]:
    """The `rows` worst ranks (by lateness z, then retransmits in collectives), in rank order."""
    ranked = sorted(rep.ranks, key=lambda r: (-(r.late_z or 0), -r.retransmits_in_window, r.rank))
    keep = sorted(ranked[:rows], key=lambda r: r.rank)
    return [rank_row(r) for r in keep]


def who(s) -> str:
    """What the STRAGGLER column shows: the rank's pod, or the group ("stage 1 (ranks 4-7)")."""
    if s.kind != "rank" and s.group:
        return s.group
    return s.pod or f"rank {s.rank}"


def report_status(rep: Report, world: int | None, g: GatherSettings) -> dict:
    """The analysis part of status. Keys that must disappear are set to None (merge patch)."""
    s = rep.straggler
    out = {"ranks": len(rep.ranks), "worldSize": world or len(rep.ranks) or None,
           "stepMs": _r(rep.step_ms, 3), "meanStepMs": _r(rep.mean_step_ms, 3),
           "predictedStepMs": _r(rep.predicted_step_ms, 3) if rep.predicted_step_ms is not None else None,
           "bestSavingPct": _r(rep.best_saving_pct, 1), "retransmits": int(rep.retransmits),
           "ranksTable": ranks_table(rep, g.ranks_table_rows), "straggler": None, "slowdown": None}
    if s is not None:
        out["straggler"] = {
            "rank": s.rank, "pod": s.pod, "node": s.node, "score": _r(s.score), "cause": s.cause,
            "evidence": cut(s.evidence, g.evidence_chars), "savingPct": _r(s.saving_pct, 1),
            "savingMsPerStep": _r(s.saving_ms_per_step, 2), "group": s.group,
            "kind": s.kind, "who": who(s), "ranks": list(s.ranks)[:4096],
            "propagated": [cut(p, g.evidence_chars) for p in s.propagated[:16]]}
        out["slowdown"] = f"{s.saving_pct:.1f}%"
    return out


def bounded_warnings(warnings: list[str], g: GatherSettings) -> list[str]:
    seen, out = set(), []
    for w in warnings:
        if w and w not in seen:
            seen.add(w)
            out.append(cut(w, g.evidence_chars))
    if len(out) > g.max_warnings:
        out = out[:g.max_warnings - 1] + [f"... and {len(out) - g.max_warnings + 1} more warnings "
                                          "(see report.json)"]
    return out


def condition(ctype: str, ok: bool | None, reason: str, message: str, generation: int | None,
              old: list[dict] | None = None) -> list[dict]:
    """Conditions with `ctype` set (ok None: "Unknown"); lastTransitionTime kept when the
    status did not change."""
    status = "Unknown" if ok is None else "True" if ok else "False"
    conds = [c for c in (old or []) if c.get("type") != ctype]
    prev = next((c for c in (old or []) if c.get("type") == ctype), None)
    since = prev.get("lastTransitionTime") if prev and prev.get("status") == status else now_iso()
    conds.append({"type": ctype, "status": status, "reason": reason, "message": cut(message, 300),
                  "lastTransitionTime": since, **({"observedGeneration": generation} if generation is not None else {})})
    return sorted(conds, key=lambda c: c["type"])


def node_row(name: str, reached: bool, state: str | None, pods: int, info: dict | None,
             clock: tuple[int, int] | None) -> dict:
    row = {"name": name, "agentReached": reached, "state": state or ("unreachable" if not reached else None),
           "pods": pods}
    if info:
        row["events"] = int(info.get("events") or 0)
        row["lostEvents"] = int(info.get("lost") or 0)
    if clock:
        row["clockOffsetNs"], row["clockRttNs"] = int(clock[0]), int(clock[1])
    return row


CONDITION_TYPES = ("Completed", "Failed", "Ready", "StragglerDetected", "Tracing")


def lifecycle(phase: str, reason: str, message: str, generation: int | None, old: list[dict] | None,
              straggler: dict | None = None, verdict: bool = False) -> list[dict]:
    """Every condition for a session in `phase` (metav1.Condition-shaped, one per type):

    - Tracing: True while Running (the probes record);
    - Completed / Failed: True once the session ended that way;
    - Ready: True only once the final verdict is in (Completed), so that
      `kubectl wait --for=condition=Ready` returns after the verdict, not before;
    - StragglerDetected: True when a straggler is named (live or final), False once a
      verdict names nobody (`verdict`), Unknown before.
    `reason` is CamelCase (Pending, NoPods, InvalidSpec, Tracing, Gathering, Completed, ...)."""
    conds = old
    running = phase == "Running"
    conds = condition("Tracing", running, "Tracing" if running else reason, message, generation, conds)
    conds = condition("Completed", phase == "Completed", reason, message, generation, conds)
    conds = condition("Failed", phase == "Failed", reason if phase == "Failed" else "NotFailed",
                      message if phase == "Failed" else "", generation, conds)
    conds = condition("Ready", phase == "Completed", reason, message, generation, conds)
    if straggler:
        who = straggler.get("who") or f"rank {straggler.get('rank')}"
        conds = condition("StragglerDetected", True, "Straggler",
                          f"{who}: cause {straggler.get('cause')}, saves {straggler.get('savingPct')}% of the step",
                          generation, conds)
    elif verdict:
        conds = condition("StragglerDetected", False, "NoStraggler", "no rank or group slows the job",
                          generation, conds)
    elif phase == "Failed":
        conds = condition("StragglerDetected", None, reason, "no verdict: the session failed", generation, conds)
    else:
        conds = condition("StragglerDetected", None, "NoVerdictYet", "not enough steps traced yet",
                          generation, conds)
    return conds
