"""The agent's query endpoint behind HTTP: read-only, bounded SQL over its sessions' segments.

``ingero fleet query`` sends the same statement to every node's agent
(``POST /v1/query``). The guard is ``ingero.readonly_sql``: each query gets a
fresh DuckDB connection that sees only the ``segments/`` folders of the
sessions asked for (views), with file access beyond them switched off and
the configuration locked, so ``COPY ... TO``, ``ATTACH``, ``read_csv`` of
other files, ``INSTALL`` and ``LOAD`` fail in the engine; one SELECT (or
EXPLAIN) statement only; a timer interrupts it; rows and bytes returned are
capped; and at most ``slots`` queries run at once (the server holds a query
until a slot is free, or answers 429), so queries cannot starve the tracer of
this node for long.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ingero import readonly_sql
from ingero_agent.api import ApiError, SessionManager

MAX_SQL_CHARS = 100_000


@dataclass
class Job:
    """One checked query: what it reads, its statement, its bounds."""

    sources: list[Path]
    sql: str
    limits: readonly_sql.Limits


class QueryService:
    def __init__(self, manager: SessionManager, limits: readonly_sql.Limits | None = None, slots: int = 2):
        self.manager = manager
        self.limits = limits or readonly_sql.Limits()
        self.slots = max(1, slots)

    def sources(self, session_id: str | None):
        """Segment folders of one session, or of every session this agent knows."""
        m = self.manager
        if session_id is not None:
            sessions = [m.get(session_id)]
        else:
            with m.lock:
                sessions = list(m.sessions.values())
        return [m._inside(s.segments) for s in sessions if s.segments.is_dir()]

    def prepare(self, body) -> Job:
        """Check ``{"sql", "session_id"?, "timeout_s"?, "max_rows"?}``: ApiError 400 for a bad
        body, 404 for an unknown session."""
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
        return Job(sources, sql, limits)

    def run(self, job: Job) -> dict:
        """Run a checked query (blocking; the caller keeps to `slots` at once): ApiError 400
        for a refused or failing statement, 408 when it ran out of time."""
        try:
            res = readonly_sql.query(job.sources, job.sql, job.limits)
        except readonly_sql.QueryRefused as e:
            raise ApiError(408 if e.timeout else 400, str(e)) from None
        return {"node": self.manager.node, "sessions": sorted(p.parent.name for p in job.sources),
                **res.to_dict()}
