"""The agent's query endpoint behind HTTP: read-only, bounded SQL over its sessions' segments.

``ingero fleet query`` sends the same statement to every node's agent
(``POST /v1/query``). The guard is ``ingero.readonly_sql``: each query gets a
fresh DuckDB connection that sees only the ``segments/`` folders of the
sessions asked for (views), with file access beyond them switched off and
the configuration locked, so ``COPY ... TO``, ``ATTACH``, ``read_csv`` of
other files, ``INSTALL`` and ``LOAD`` fail in the engine; one SELECT (or
EXPLAIN) statement only; a timer interrupts it; rows and bytes returned are
capped; and at most ``slots`` queries run at once, so queries cannot starve
the tracer of this node for long.
"""

from __future__ import annotations

import threading

from ingero import readonly_sql
from ingero_agent.api import ApiError, SessionManager

MAX_SQL_CHARS = 100_000


class QueryService:
    def __init__(self, manager: SessionManager, limits: readonly_sql.Limits | None = None, slots: int = 2):
        self.manager = manager
        self.limits = limits or readonly_sql.Limits()
        self._slots = threading.BoundedSemaphore(max(1, slots))

    def sources(self, session_id: str | None):
        """Segment folders of one session, or of every session this agent knows."""
        m = self.manager
        if session_id is not None:
            sessions = [m.get(session_id)]
        else:
            with m.lock:
                sessions = list(m.sessions.values())
        return [m._inside(s.segments) for s in sessions if s.segments.is_dir()]

    def query(self, body) -> dict:
        """Run ``{"sql", "session_id"?, "timeout_s"?, "max_rows"?}``.

        ApiError 400 for a refused or failing statement, 408 when it ran out of
        time, 429 when every query slot is busy.
        """
        if not isinstance(body, dict) or not isinstance(body.get("sql"), str):
            raise ApiError(400, 'body must be {"sql": "SELECT ...", "session_id": optional}')
        sql = body["sql"]
        if len(sql) > MAX_SQL_CHARS:
            raise ApiError(400, f"sql longer than {MAX_SQL_CHARS} characters")
        sid = body.get("session_id")
        sources = self.sources(sid if sid else None)
        try:
            limits = self.limits.narrowed(body.get("timeout_s"), body.get("max_rows"))
        except (TypeError, ValueError):
            raise ApiError(400, "timeout_s and max_rows must be numbers") from None
        if not self._slots.acquire(timeout=1.0):
            raise ApiError(429, "every query slot of this agent is busy; retry shortly")
        try:
            res = readonly_sql.query(sources, sql, limits)
        except readonly_sql.QueryRefused as e:
            raise ApiError(408 if e.timeout else 400, str(e)) from None
        finally:
            self._slots.release()
        return {"node": self.manager.node, "sessions": sorted(p.parent.name for p in sources),
                **res.to_dict()}
