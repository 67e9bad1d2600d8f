"""The operator's Prometheus metrics (prometheus_client), served on --metrics-port.

Series per TraceSession carry `namespace` and `name`; per-rank series are only the
ranks of status.ranksTable (at most `gather.ranks_table_rows`), so the cardinality
stays bounded whatever the job size. A session's series go when it is forgotten
(deleted), its phase count stays in `ingero_sessions`.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Gauge, Histogram

from ingero import serving

REGISTRY = CollectorRegistry()
SESSIONS = Gauge("ingero_sessions", "TraceSessions this operator serves, by phase", ["phase"],
                 registry=REGISTRY)
STRAGGLER = Gauge("ingero_straggler", "1 for the straggler a session names now (live or final)",
                  ["namespace", "name", "kind", "who", "rank", "pod", "cause"], registry=REGISTRY)
VERDICT = Gauge("ingero_verdict", "1 for the kind of a session's verdict now (live or final): straggler, none "
                "(judged, nobody named), cannot-judge (the trace cannot support a verdict), hang",
                ["namespace", "name", "verdict"], registry=REGISTRY)
SAVING = Gauge("ingero_straggler_saving_percent",
               "Share of the step the named fix would save (replayed), 0 when nobody is named",
               ["namespace", "name"], registry=REGISTRY)
STEP = Gauge("ingero_step_milliseconds", "Mean step of the session's traced job (replayed)",
             ["namespace", "name"], registry=REGISTRY)
LATE = Gauge("ingero_rank_lateness_milliseconds", "Median arrival lateness of a rank at its collectives",
             ["namespace", "name", "rank"], registry=REGISTRY)
RETX = Gauge("ingero_rank_retransmits", "TCP retransmits on a rank's own connections",
             ["namespace", "name", "rank"], registry=REGISTRY)
OFFCPU = Gauge("ingero_rank_offcpu_milliseconds", "Off-CPU time of a rank, by reason",
               ["namespace", "name", "rank", "reason"], registry=REGISTRY)
REACHABLE = Gauge("ingero_agent_reachable", "1 when the node's agent answered the last call",
                  ["namespace", "name", "node"], registry=REGISTRY)
LOST = Gauge("ingero_node_lost_events", "Events a node's probes could not hand over (ring full)",
             ["namespace", "name", "node"], registry=REGISTRY)
DURATION = Histogram("ingero_operator_step_seconds", "Gather, live analysis and final merge + analysis",
                     ["step"], registry=REGISTRY,
                     buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))

_lock = threading.Lock()
_phase: dict[str, str] = {}                   # uid -> phase
_series: dict[str, list] = {}                 # uid -> [(gauge, labels)] set for that session


def serve(port: int, addr: str = "0.0.0.0") -> serving.ServerThread:
    """REGISTRY on its own bounded port (``ingero.serving``): no thread per scrape."""
    return serving.serve_metrics(REGISTRY, port, addr)


def observe(uid: str, namespace: str, name: str, status: dict) -> None:
    """Update the series from a status patch the operator wrote."""
    with _lock:
        if "phase" in status and status["phase"]:
            _phase[uid] = status["phase"]
            _count_phases()
        own = _series.setdefault(uid, [])

        def put(gauge, labels: tuple, value: float) -> None:
            gauge.labels(*labels).set(value)
            if (gauge, labels) not in own:
                own.append((gauge, labels))

        def drop(gauge) -> None:
            for g, labels in [x for x in own if x[0] is gauge]:
                g.remove(*labels)
                own.remove((g, labels))

        if "straggler" in status:
            drop(STRAGGLER)
            s = status["straggler"]
            if s:
                put(STRAGGLER, (namespace, name, str(s.get("kind") or "rank"), str(s.get("who") or ""),
                                str(s.get("rank")), str(s.get("pod") or ""), str(s.get("cause") or "")), 1)
            put(SAVING, (namespace, name), float((s or {}).get("savingPct") or 0.0))
        if "verdict" in status:
            drop(VERDICT)
            if status["verdict"]:
                put(VERDICT, (namespace, name, str(status["verdict"].get("kind"))), 1)
        if status.get("meanStepMs") is not None:
            put(STEP, (namespace, name), float(status["meanStepMs"]))
        if "ranksTable" in status:
            for g in (LATE, RETX, OFFCPU):
                drop(g)
            for row in status["ranksTable"] or []:
                r = str(row.get("rank"))
                put(LATE, (namespace, name, r), float(row.get("lateMs") or 0.0))
                put(RETX, (namespace, name, r), float(row.get("retransmits") or 0))
                for reason, ms in (row.get("offcpuMs") or {}).items():
                    put(OFFCPU, (namespace, name, r, reason), float(ms or 0.0))
        for node in status.get("nodes") or []:
            n = str(node.get("name"))
            put(REACHABLE, (namespace, name, n), 1.0 if node.get("agentReached") else 0.0)
            if node.get("lostEvents") is not None:
                put(LOST, (namespace, name, n), float(node["lostEvents"]))


def forget(uid: str) -> None:
    with _lock:
        _phase.pop(uid, None)
        for g, labels in _series.pop(uid, []):
            try:
                g.remove(*labels)
            except KeyError:
                pass
        _count_phases()


def _count_phases() -> None:
    counts: dict[str, int] = {}
    for p in _phase.values():
        counts[p] = counts.get(p, 0) + 1
    for p in ("Pending", "Running", "Gathering", "Completed", "Failed"):
        SESSIONS.labels(p).set(counts.get(p, 0))
