"""The agent's Prometheus metrics (prometheus_client), served on --metrics-port.

Read at scrape time from the sessions on disk (Parquet footers, cached per file), so
they cost nothing between scrapes: sessions by state, events recorded and lost per
session and ring (a full ring drops events; `lost` names the probe family's ring),
segment bytes, the data folder's size against its cap, tracer starts, and the API's
open connections and requests. Names follow Prometheus' naming guide (`_total` on
counters, base units, no `_created` series). Series per session carry `session`
(namespace.name.uid, the operator's session id): bounded by the sessions kept on the
node's disk (`--data-max-bytes`); a deleted session's series go with it.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

import ingero
from ingero import serving
from ingero_agent.api import SessionManager

prometheus_client.disable_created_metrics()

STATES = ("starting", "running", "stopped", "finished", "failed", "interrupted")


class SessionCollector:
    def __init__(self, manager: SessionManager, slots=None):
        self.manager = manager
        self.slots = slots                  # the API server's connection slots, when known

    def collect(self):
        node = self.manager.node
        by_state = GaugeMetricFamily("ingero_agent_sessions", "Sessions on this node, by state",
                                     labels=["node", "state"])
        events = CounterMetricFamily("ingero_agent_events", "Events recorded, by session and table",
                                     labels=["node", "session", "table"])
        lost = CounterMetricFamily("ingero_agent_lost_events",
                                   "Events the probes could not hand over (ring full), by session and ring",
                                   labels=["node", "session", "ring"])
        size = GaugeMetricFamily("ingero_agent_segment_bytes", "Bytes of a session's segments on disk",
                                 labels=["node", "session"])
        starts = CounterMetricFamily("ingero_agent_tracer_starts", "Times a session's tracer was started",
                                     labels=["node", "session"])
        total = GaugeMetricFamily("ingero_agent_data_bytes", "Bytes of every session's segments", labels=["node"])
        cap = GaugeMetricFamily("ingero_agent_data_max_bytes", "--data-max-bytes (0: no cap)", labels=["node"])
        count = {s: 0 for s in STATES}
        all_bytes = 0
        for s in self.manager.all_sessions():
            state = s.state()
            count[state] = count.get(state, 0) + 1
            ev, lo, b = self.manager.counts(s)
            all_bytes += b
            for table, n in sorted(ev.items()):
                events.add_metric([node, s.id, table], n)
            for ring, n in sorted(lo.items()):
                lost.add_metric([node, s.id, ring], n)
            size.add_metric([node, s.id], b)
            starts.add_metric([node, s.id], s.starts)
        for state, n in sorted(count.items()):
            by_state.add_metric([node, state], n)
        total.add_metric([node], all_bytes)
        cap.add_metric([node], self.manager.max_bytes or 0)
        yield from (by_state, events, lost, size, starts, total, cap)
        if self.slots is not None:
            conns = GaugeMetricFamily("ingero_agent_connections", "API connections open now", labels=["node"])
            conns.add_metric([node], self.slots.open)
            limit = GaugeMetricFamily("ingero_agent_connections_limit", "API connections the agent serves at once",
                                      labels=["node"])
            limit.add_metric([node], self.slots.limit)
            yield from (conns, limit)


def registry(manager: SessionManager, slots=None) -> tuple[CollectorRegistry, Counter]:
    """A registry with the session collector, the build info and a request counter
    (route, status)."""
    reg = CollectorRegistry()
    reg.register(SessionCollector(manager, slots))
    Info("ingero_build", "The agent's version", registry=reg).info({"component": "agent",
                                                                   "version": ingero.__version__})
    requests = Counter("ingero_agent_requests", "API requests answered, by route and status",
                       ["node", "route", "status"], registry=reg)
    return reg, requests


def serve(reg: CollectorRegistry, port: int, addr: str) -> serving.ServerThread:
    """The registry on its own bounded port (``ingero.serving``): no thread per scrape."""
    return serving.serve_metrics(reg, port, addr)
