"""TraceSession status: bounded rendering of a Report, node rows and conditions.

Status must stay small (etcd objects are limited to ~1.5 MB and every
`kubectl get -w` re-sends it): strings are cut, the ranks table keeps the
worst ranks only; the full report is beside the artifact.
"""

from __future__ import annotations

import datetime as dt

from ingero.analysis import Report
from ingero.analysis.coverage import ranks_text, span
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


def verdict_status(rep: Report, g: GatherSettings) -> dict:
    """status.verdict: the kind (hang | cannot-judge | straggler | none), what the STRAGGLER
    column shows ("cannot judge", "hang: rank 2", the straggler, "none"), why (the reason a
    verdict is impossible, or the hang's evidence) and the ranks a partial verdict covers."""
    kind, why = rep.verdict, None
    if kind == "hang":
        col = f"hang: {ranks_text(rep.hang.missing)}" if rep.hang.missing else "hang"
        why = rep.hang.evidence
    elif kind == "cannot-judge":
        col, why = "cannot judge", rep.cannot_judge
    else:
        col = who(rep.straggler) if kind == "straggler" else "none"
    return {"kind": kind, "who": cut(col, 200), "reason": cut(why, g.evidence_chars),
            "coveredRanks": list(rep.covered_ranks)[:4096] if rep.covered_ranks else None}


def hang_status(h, g: GatherSettings) -> dict:
    """status.hang: who waits in which call since when, and who holds it up (bounded)."""
    return {"missing": list(h.missing)[:4096], "op": h.op, "comm": h.comm, "seq": h.seq,
            "waitedS": _r(h.waited_s, 1), "evidence": cut(h.evidence, g.evidence_chars),
            "waiting": [{k: w[k] for k in ("rank", "op", "comm", "seq", "since_ns") if w.get(k) is not None}
                        for w in h.waiting[:16]]}    # (no nulls: a list is replaced whole, nulls and all)


def report_status(rep: Report, world: int | None, g: GatherSettings) -> dict:
    """The analysis part of status. Keys that must disappear are set to None (merge patch)."""
    s = rep.straggler if rep.verdict == "straggler" else None
    out = {"ranks": len(rep.ranks), "worldSize": world or len(rep.ranks) or None,
           "stepMs": _r(rep.step_ms, 3), "meanStepMs": _r(rep.mean_step_ms, 3), "timing": rep.timing,
           "predictedStepMs": _r(rep.predicted_step_ms, 3) if rep.predicted_step_ms is not None else None,
           "bestSavingPct": _r(rep.best_saving_pct, 1), "retransmits": int(rep.retransmits),
           "ranksTable": ranks_table(rep, g.ranks_table_rows), "straggler": None, "slowdown": None,
           "verdict": verdict_status(rep, g), "hang": hang_status(rep.hang, g) if rep.hang is not None else None}
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
    conds.append({"type": ctype, "status": status, "reason": reason, "message": cut(message or "", 300),
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


# The lifecycle, as conditions (metav1.Condition-shaped, one per type):
#   phase      Tracing                 Completed        Failed           Ready
#   Pending    False WaitingForPods/   False Pending    False Pending    False Pending
#              AgentUnreachable
#   Running    True  Tracing           False Tracing    False Tracing    False Tracing
#   Gathering  False Gathering         False Gathering  False Gathering  False Gathering
#   Completed  False Finished          True  Completed  False Completed  True  VerdictReady
#   Failed     False Failed            False Failed     True  <reason>   False <reason>
# Ready is True only once the final verdict is in, so `kubectl wait --for=condition=Ready`
# (or Completed) returns after the verdict, not while tracing.
# StragglerDetected: True (reason from the cause: Network, CpuContention, ...) when the live
# or final verdict names a rank or group; False (NoStraggler) once the final verdict names
# none; Unknown before that (NoVerdictYet), when the trace cannot support a verdict
# (CannotJudge), when the job is hung (Hung) or when the session failed (NoVerdict).
# Judged: True once a verdict is reached (reason PartialRanks when it covers only some of
# the job's ranks), False (CannotJudge, the reason in the message) when the trace cannot
# support one: no call, no step, ranks or communicators unknown, a rank or node silent.
# Hung: True (Hang, the evidence in the message) while the verdict is a hang, False
# (NotHung) once a verdict is in that is not one; Unknown (CannotJudge) with no verdict.
CONDITION_TYPES = ("Completed", "Failed", "Hung", "Judged", "Ready", "StragglerDetected", "Tracing")


def cause_reason(cause: str | None) -> str:
    """A CamelCase condition reason for a verdict cause ("cpu-contention" -> "CpuContention")."""
    words = "".join(ch if ch.isalnum() else " " for ch in str(cause or "")).split()
    return "".join(w[:1].upper() + w[1:] for w in words) or "Unknown"


def straggler_message(s: dict) -> str:
    """One line naming the straggler: the rank (pod, node) or the group, the cause, the saving."""
    if s.get("kind") not in (None, "rank") and s.get("who"):
        name = str(s["who"])
    else:
        where = ", ".join(x for x in (f"pod {s['pod']}" if s.get("pod") else "",
                                      f"node {s['node']}" if s.get("node") else "") if x)
        name = f"rank {s.get('rank')}" + (f" ({where})" if where else "")
    saving = ""
    if s.get("savingPct") is not None:
        saving = f"; saving {s['savingPct']:.1f}% of step time"
        if s.get("savingMsPerStep") is not None:
            saving += f" ({s['savingMsPerStep']:.2f} ms/step)"
    return f"{name} is the straggler: cause {s.get('cause')}{saving}"


def verdict_message(verdict: dict, straggler: dict | None) -> str:
    """The final verdict in one line, for the Completed Event."""
    kind = verdict.get("kind")
    if kind == "straggler" and straggler:
        return straggler_message(straggler)
    if kind == "cannot-judge":
        return f"cannot judge: {verdict.get('reason')}"
    if kind == "hang":
        return verdict.get("reason") or str(verdict.get("who"))
    covered = verdict.get("coveredRanks")
    return "no straggler: no rank or group slows the job" + (
        f" (the verdict covers ranks {span(covered)} only)" if covered else "")


def lifecycle(phase: str, reason: str | None, message: str, generation: int | None, old: list[dict] | None,
              straggler: dict | None = None, verdict: dict | None = None) -> list[dict]:
    """Every lifecycle condition for `phase` (see the table above). `reason` is the CamelCase
    reason of what just happened (Failed: why; Pending: WaitingForPods or AgentUnreachable);
    `straggler` the status' straggler (None: none named; in phase Completed, the final verdict's);
    `verdict` the status' verdict (`verdict_status`; None: no analysis yet)."""
    conds = list(old or [])

    def put(ctype, ok, why, msg=message):
        nonlocal conds
        conds = condition(ctype, ok, why, msg, generation, conds)

    if phase in ("Pending", "Running", "Gathering"):
        put("Tracing", phase == "Running", "Tracing" if phase == "Running" else (
            reason or "WaitingForPods") if phase == "Pending" else "Gathering")
        for t in ("Completed", "Failed", "Ready"):
            put(t, False, "Tracing" if phase == "Running" else phase)
    elif phase == "Completed":
        put("Tracing", False, "Finished")
        put("Completed", True, "Completed")
        put("Failed", False, "Completed")
        put("Ready", True, "VerdictReady")
    elif phase == "Failed":
        put("Tracing", False, "Failed")
        put("Completed", False, "Failed")
        put("Failed", True, reason or "Failed")
        put("Ready", False, reason or "Failed")
    else:
        raise ValueError(f"unknown phase {phase!r}")
    kind = (verdict or {}).get("kind") if phase != "Failed" else None
    why = (verdict or {}).get("reason") or ""
    if kind is None:
        put("Judged", None, "NoVerdict" if phase == "Failed" else "NoVerdictYet", "no verdict (yet)")
        put("Hung", None, "NoVerdict" if phase == "Failed" else "NoVerdictYet", "no verdict (yet)")
    else:
        covered = verdict.get("coveredRanks")
        if kind == "cannot-judge":
            put("Judged", False, "CannotJudge", why)
        elif covered:
            put("Judged", True, "PartialRanks", f"the verdict covers ranks {span(covered)} only")
        else:
            put("Judged", True, "Judged", "the verdict covers every traced rank")
        if kind == "hang":
            put("Hung", True, "Hang", why)
        elif kind == "cannot-judge":
            put("Hung", None, "CannotJudge", why)
        else:
            put("Hung", False, "NotHung", "no rank waits in a call that another never entered")
    if straggler:
        put("StragglerDetected", True, cause_reason(straggler.get("cause")), straggler_message(straggler))
    elif kind == "cannot-judge":
        put("StragglerDetected", None, "CannotJudge", why)
    elif kind == "hang":
        put("StragglerDetected", None, "Hung", "the job is hung (see the Hung condition)")
    elif phase == "Completed":
        put("StragglerDetected", False, "NoStraggler", "the final verdict names no straggler rank or group")
    elif phase == "Failed":
        put("StragglerDetected", None, "NoVerdict", "the session failed before its final verdict")
    else:
        put("StragglerDetected", None, "NoVerdictYet", "no rank or group stands out (yet)")
    return conds
