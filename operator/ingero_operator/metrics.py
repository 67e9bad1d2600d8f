"""The operator's Prometheus metrics (prometheus_client), served on --metrics-port.

Names follow Prometheus' naming guide: base units (seconds, ratios), `_total` on
counters, no `_created` series. Series per TraceSession carry `namespace` and `name`;
per-rank series are only the ranks of status.ranksTable (at most
`gather.ranks_table_rows`), per-node series the session's nodes, so the cardinality is
bounded by sessions × (ranks table rows + nodes) whatever the job size. The named
straggler is a series only while its session runs (live verdict): it goes when the
session completes or fails, or when nobody is named any more, so an alert on it
resolves. A session's other series go when it is forgotten (deleted); its phase count
stays in `ingero_sessions`.
"""

from __future__ import annotations

import threading

import prometheus_client
from prometheus_client import CollectorRegistry, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

import ingero
from ingero import serving
from ingero.analysis.coverage import span

prometheus_client.disable_created_metrics()

PHASES = ("Pending", "Running", "Gathering", "Completed", "Failed")
ENDED = ("Completed", "Failed")


class SessionState:
    """What one session's last status patches said, in the units the metrics export."""

    def __init__(self, namespace: str, name: str):
        self.key = (namespace, name)
        self.phase = ""
        self.straggler: dict | None = None      # labels of the named straggler, and "saving"
        self.verdict = ""
        self.step_s: float | None = None
        self.ranks: list[dict] = []
        self.nodes: dict[str, dict] = {}

    def update(self, status: dict) -> None:
        if status.get("phase"):
            self.phase = status["phase"]
        if "straggler" in status:
            s = status["straggler"]
            self.straggler = straggler_labels(s) if s else None
        if "verdict" in status:
            self.verdict = str((status["verdict"] or {}).get("kind") or "")
        if status.get("meanStepMs") is not None:
            self.step_s = float(status["meanStepMs"]) / 1e3
        if "ranksTable" in status:
            self.ranks = list(status["ranksTable"] or [])
        for node in status.get("nodes") or []:
            self.nodes[str(node.get("name"))] = node


def straggler_labels(s: dict) -> dict:
    """Who and why, truthfully: a rank verdict names the rank and its pod; a group verdict
    (stage, node, ...) names the group and its member ranks, never one member's pod."""
    kind = str(s.get("kind") or "rank")
    ranks = [r for r in (s.get("ranks") or [s.get("rank")]) if r is not None]
    return {"kind": kind, "who": str(s.get("who") or ""), "ranks": span(ranks),
            "pod": str(s.get("pod") or "") if kind == "rank" else "",
            "cause": str(s.get("cause") or ""), "saving": float(s.get("savingPct") or 0.0) / 100}


class SessionCollector:
    """Builds every per-session family at scrape time from the states `observe` keeps."""

    def __init__(self):
        self.lock = threading.Lock()
        self.sessions: dict[str, SessionState] = {}       # uid -> state

    def collect(self):
        ns = ["namespace", "name"]
        phases = GaugeMetricFamily("ingero_sessions", "TraceSessions this operator serves, by phase", labels=["phase"])
        phase = GaugeMetricFamily("ingero_session_phase", "1 for the phase a TraceSession is in now, 0 for the "
                                  "others", labels=ns + ["phase"])
        straggler = GaugeMetricFamily(
            "ingero_straggler_saving_ratio",
            "Share of the step the named straggler's fix would save (replayed), while its session runs; "
            "kind rank: who and pod are the rank's pod; a group kind: who is the group, ranks its members",
            labels=ns + ["kind", "who", "ranks", "pod", "cause"])
        verdict = GaugeMetricFamily("ingero_verdict", "1 for the kind of a session's verdict now (live or final): "
                                    "straggler, none (judged, nobody named), cannot-judge (the trace cannot support "
                                    "a verdict), hang", labels=ns + ["verdict"])
        step = GaugeMetricFamily("ingero_step_seconds", "Mean step of the session's traced job (replayed)",
                                 labels=ns)
        late = GaugeMetricFamily("ingero_rank_lateness_seconds",
                                 "Median arrival lateness of a rank at its collectives", labels=ns + ["rank"])
        retx = CounterMetricFamily("ingero_rank_retransmits", "TCP retransmits on a rank's own connections",
                                   labels=ns + ["rank"])
        offcpu = CounterMetricFamily("ingero_rank_offcpu_seconds", "Off-CPU time of a rank, by reason",
                                     labels=ns + ["rank", "reason"])
        reachable = GaugeMetricFamily("ingero_agent_reachable", "1 when the node's agent answered the last call",
                                      labels=ns + ["node"])
        lost = CounterMetricFamily("ingero_node_lost_events",
                                   "Events a node's probes could not hand over (ring full)", labels=ns + ["node"])
        count = dict.fromkeys(PHASES, 0)
        with self.lock:
            for st in self.sessions.values():
                key = list(st.key)
                if st.phase:
                    count[st.phase] = count.get(st.phase, 0) + 1
                    for p in PHASES:
                        phase.add_metric(key + [p], 1 if st.phase == p else 0)
                s = st.straggler
                if s is not None and st.phase not in ENDED:
                    straggler.add_metric(key + [s["kind"], s["who"], s["ranks"], s["pod"], s["cause"]], s["saving"])
                if st.verdict:
                    verdict.add_metric(key + [st.verdict], 1)
                if st.step_s is not None:
                    step.add_metric(key, st.step_s)
                for row in st.ranks:
                    r = str(row.get("rank"))
                    late.add_metric(key + [r], float(row.get("lateMs") or 0.0) / 1e3)
                    retx.add_metric(key + [r], float(row.get("retransmits") or 0))
                    for reason, ms in sorted((row.get("offcpuMs") or {}).items()):
                        offcpu.add_metric(key + [r, reason], float(ms or 0.0) / 1e3)
                for node, n in sorted(st.nodes.items()):
                    reachable.add_metric(key + [node], 1.0 if n.get("agentReached") else 0.0)
                    if n.get("lostEvents") is not None:
                        lost.add_metric(key + [node], float(n["lostEvents"]))
        for p, n in count.items():
            phases.add_metric([p], n)
        yield from (phases, phase, straggler, verdict, step, late, retx, offcpu, reachable, lost)


REGISTRY = CollectorRegistry()
SESSIONS = SessionCollector()
REGISTRY.register(SESSIONS)
Info("ingero_build", "The operator's version", registry=REGISTRY).info(
    {"component": "operator", "version": ingero.__version__})
DURATION = Histogram("ingero_operator_step_seconds", "Gather, live analysis and final merge + analysis",
                     ["step"], registry=REGISTRY,
                     buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))


def serve(port: int, addr: str = "0.0.0.0") -> serving.ServerThread:
    """REGISTRY on its own bounded port (``ingero.serving``): no thread per scrape."""
    return serving.serve_metrics(REGISTRY, port, addr)


def observe(uid: str, namespace: str, name: str, status: dict) -> None:
    """Update the series from a status patch the operator wrote."""
    with SESSIONS.lock:
        SESSIONS.sessions.setdefault(uid, SessionState(namespace, name)).update(status)


def forget(uid: str) -> None:
    with SESSIONS.lock:
        SESSIONS.sessions.pop(uid, None)
