"""The MCP server: Ingero traces for an AI assistant (official MCP Python SDK).

Tools (each description says what it is for, what it takes, what it returns):

* ``list_sessions`` - traces under the root folder: ``.duckdb`` files (``ingero
  trace``/``lab``/``merge`` outputs, operator artifacts) and segment folders;
* ``straggler_report`` - the verdict of one trace: which rank is slow, why,
  the evidence, the saving, and the per-rank table (``ingero.analysis``);
* ``rank_detail`` - one rank: per-op latency, lateness, retransmits, off-CPU
  time, and its latest arrivals;
* ``describe_tables`` - tables, columns and units, with example queries;
* ``query`` - one read-only SQL statement, bounded (``ingero.readonly_sql``).

Sessions are named by their path relative to the root; nothing outside the
root is opened.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import numpy as np
from mcp.server.mcpserver.exceptions import ToolError

from ingero import readonly_sql, schema
from ingero.errors import IngeroError, trace_error

MAX_SESSIONS = 500
MAX_DEPTH = 8
QUERY_LIMITS = readonly_sql.Limits(timeout_s=15.0, max_rows=1000, max_bytes=1 << 20, memory_mb=256,
                                   memory_flags="--query-memory-mb 256 (one query) and --max-memory-mb 2048")
TOOL_THREADS = 4            # tool calls run at once (each a thread; more wait their turn)


def _latest(con, rank: int, n: int) -> list[tuple]:
    """A rank's collectives where it arrived latest after its peers' median, as the analysis
    measures lateness (its calls: instances over launched calls, without the calls NCCL only
    simulated): [(op, comm hash hex, seq, late ms, ms)], latest first."""
    from ingero.analysis.calls import OPS, load
    from ingero.analysis.stats import quantile_at

    c, _ = load(con)
    coll = np.flatnonzero(c.inst >= 0)
    if not len(coll):
        return []
    mine = coll[(c.rank[coll] == rank) & (c.inst_size[c.inst[coll]] > 1)]
    late = c.t[mine] - quantile_at(c.inst[coll], c.t[coll].astype(np.float64), 0.5, c.inst[mine])
    order = np.lexsort((c.seq[mine], -late))[:n]
    return [(OPS[int(c.op[k]) - 1], f"{int(c.comm_hash[c.comm[k]]):016x}", int(c.seq[k]), float(late[o]) / 1e6,
             int(c.d[k]) / 1e6) for o, k in zip(order.tolist(), mine[order].tolist())]


@contextmanager
def tool_errors():
    """What a trace causes (bad input, a damaged or crafted trace) as a one-line tool error."""
    try:
        yield
    except Exception as e:
        line = trace_error(e)
        if line is None:
            raise
        raise ToolError(line) from None


EXAMPLES = [
    "SELECT op, rank, nranks, duration_ns/1e6 AS ms FROM nccl_events ORDER BY duration_ns DESC LIMIT 20",
    "SELECT COUNT(*) FROM tcp_events WHERE event = 'tcp_retransmit_skb'",
    "SELECT node, rank, reason, sum(duration_ns)/1e6 AS ms FROM sched_events GROUP BY ALL ORDER BY ms DESC",
]


class Traces:
    """Finds and opens traces below one root folder; what the tools share."""

    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise IngeroError(f"--root {root} is not a folder; pass the folder holding traces "
                              "(e.g. the operator's artifacts dir or out/)")
        self._reports: dict[tuple, object] = {}

    def sessions(self) -> list[dict]:
        out = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            d = Path(dirpath)
            depth = len(d.relative_to(self.root).parts)
            dirnames[:] = sorted(n for n in dirnames if not n.startswith(".") and depth < MAX_DEPTH)
            tables = [n for n in dirnames if n in schema.TABLES]
            if tables and any(any(f.endswith(".parquet") for f in os.listdir(d / t)) for t in tables):
                out.append(self._entry(d, "segments"))
                dirnames[:] = [n for n in dirnames if n not in schema.TABLES]
            for f in sorted(filenames):
                if f.endswith(".duckdb") and not f.startswith(".") and f != "live.duckdb":
                    out.append(self._entry(d / f, "artifact" if (d / "report.json").is_file() else "duckdb"))
            if len(out) >= MAX_SESSIONS:
                break
        return sorted(out, key=lambda e: e["session"])[:MAX_SESSIONS]

    def _entry(self, path: Path, kind: str) -> dict:
        st = path.stat()
        size = st.st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*.parquet"))
        return {"session": path.relative_to(self.root).as_posix() or ".", "kind": kind,
                "bytes": size, "modified_ns": st.st_mtime_ns}

    def resolve(self, session: str) -> Path:
        if not isinstance(session, str) or not session.strip():
            raise ToolError("session is required: one of the names list_sessions returns")
        path = (self.root / session).resolve()
        if not path.is_relative_to(self.root):
            raise ToolError(f"session {session!r} is outside the root folder; use a name from list_sessions")
        if not path.exists():
            raise ToolError(f"no session {session!r} under the root; call list_sessions for the names")
        return path

    def report(self, session: str):
        """(Report, open connection) of a session, judged in windows as `ingero report` judges it
        (memory bounded by a window, whatever the session's length)."""
        from ingero.readonly_sql import open_source
        from ingero.segment_views import analyse_trace

        path = self.resolve(session)
        with tool_errors():
            con = open_source(path)
        try:
            with tool_errors():
                return analyse_trace(con), con
        except BaseException:
            con.close()
            raise


def _rank_brief(r) -> dict:
    return {"rank": r.rank, "node": r.node, "pod": r.pod, "collectives": r.collectives,
            "p50_ms": round(r.p50_ms, 3), "p99_ms": round(r.p99_ms, 3), "late_ms": round(r.late_ms, 3),
            "late_z": r.late_z, "last_share": round(r.last_share, 3), "retransmits": r.retransmits,
            "retransmits_in_collectives": r.retransmits_in_window,
            "offcpu_ms": {k: round(v, 1) for k, v in r.offcpu_ms.items()}}


def make_server(root: Path, name: str = "ingero", limits: readonly_sql.Limits = QUERY_LIMITS):
    from mcp.server.mcpserver import MCPServer
    from mcp.types import ToolAnnotations

    traces = Traces(root)
    ro = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
    server = MCPServer(
        name, instructions=(
            "Ingero traces distributed training jobs (NCCL collectives, TCP retransmits, scheduler stalls per "
            "rank) and names the straggler rank. Start with list_sessions, then straggler_report on a session; "
            "drill into a rank with rank_detail; for anything else use describe_tables and query (read-only SQL)."))

    @server.tool(annotations=ro, description=(
        "List the traces (sessions) available under the server's root folder. Returns {root, sessions: [{session, "
        "kind, bytes, modified_ns}]}; pass `session` to the other tools. kind is 'artifact' (the operator's "
        "merged trace of a TraceSession, with report.json beside it), 'duckdb' (a trace file from ingero trace, "
        "lab or merge) or 'segments' (one node's raw Parquet segment folder). Prefer artifacts and merged "
        ".duckdb files: they hold every node of a job."))
    def list_sessions() -> dict:
        return {"root": str(traces.root), "sessions": traces.sessions()}

    @server.tool(annotations=ro, description=(
        "The straggler verdict of one trace: which rank slows the job, the cause (network, cpu-contention, io, "
        "compute/unknown), one sentence of evidence, a robust score, the step time it costs (ms and %), whether "
        "a whole node is slow together, plus step time, collective and retransmit counts, warnings and a "
        "per-rank table (p50/p99 collective ms, arrival lateness ms and its robust z, share of collectives "
        "where it arrived last, retransmits on its own connections, off-CPU ms by reason). verdict: straggler, "
        "none (judged: no rank stands out), cannot-judge (the trace cannot support a verdict, cannot_judge says "
        "why: not an all-clear) or hang (hang: who waits in what, who never came); covered_ranks: the ranks a "
        "verdict on part of the job covers. Args: session (a name from list_sessions)."))
    def straggler_report(session: str) -> dict:
        rep, con = traces.report(session)
        con.close()
        return {"session": session, "verdict": rep.verdict, "cannot_judge": rep.cannot_judge,
                "covered_ranks": rep.covered_ranks, "hang": asdict(rep.hang) if rep.hang else None,
                "straggler": asdict(rep.straggler) if rep.straggler else None,
                "step_ms": round(rep.step_ms, 3), "collectives": rep.collectives,
                "retransmits": rep.retransmits, "warnings": rep.warnings,
                "ranks": [_rank_brief(r) for r in rep.ranks]}

    @server.tool(annotations=ro, description=(
        "Everything about one rank of a trace: per-op call counts and p50/p99 ms (null: not measured, in no "
        "judged window of a sampled session), arrival lateness against its peers, retransmits on its own "
        "connections (and inside its collectives), off-CPU ms by reason (runqueue = CPU contention, io = "
        "blocked on disk, sleep = waiting), and its `latest` collectives: the ones where it arrived latest after "
        "the median of its peers (op, comm, seq, late_ms, ms). Args: session (from list_sessions), rank (global "
        "rank, as in straggler_report), latest (how many, default 5, at most 50)."))
    def rank_detail(session: str, rank: int, latest: int = 5) -> dict:
        rep, con = traces.report(session)
        try:
            row = next((r for r in rep.ranks if r.rank == rank), None)
            if row is None:
                raise ToolError(f"rank {rank} is not in {session}; ranks there: {[r.rank for r in rep.ranks]}")
            with tool_errors():
                worst = _latest(con, rank, max(1, min(int(latest), 50)))
        finally:
            con.close()
        out = _rank_brief(row)
        out.update(session=session, pid=row.pid, slow_collectives=row.slow_collectives,
                   per_op={op: {k: round(v, 3) if isinstance(v, float) else v for k, v in d.items()}
                           for op, d in row.per_op.items()},
                   is_straggler=bool(rep.straggler and rep.straggler.rank == rank),
                   latest=[{"op": op, "comm": c, "seq": s, "late_ms": round(lt, 3), "ms": round(ms, 3)}
                           for op, c, s, lt, ms in worst])
        return out

    @server.tool(annotations=ro, description=(
        "The tables of an Ingero trace with their columns, types and what one row is, plus example queries. "
        "All *_ns columns are nanoseconds; timestamp_ns is wall-clock (Unix epoch) already corrected for each "
        "node's clock offset. In nccl_events, rank/nranks are the rank in the communicator and global_rank the "
        "torchrun RANK. Call this before writing SQL for the query tool."))
    def describe_tables() -> dict:
        return {"tables": {n: {"doc": t.doc, "columns": dict(t.columns)} for n, t in schema.TABLES.items()},
                "examples": EXAMPLES}

    @server.tool(annotations=ro, description=(
        "Run one read-only SQL statement (DuckDB dialect: SELECT, WITH, EXPLAIN) on a trace and get "
        "{columns, types, rows, truncated}. Writes, COPY, ATTACH, file functions and extensions are refused "
        "by the engine; at most 1000 rows (max_rows) and ~1 MB come back and a query stops after 15 s, so "
        "aggregate (GROUP BY) rather than fetching raw events. Args: session (from list_sessions), sql, "
        "max_rows (default 100). See describe_tables for the tables."))
    def query(session: str, sql: str, max_rows: int = 100) -> dict:
        path = traces.resolve(session)
        try:
            narrowed = limits.narrowed(max_rows=max_rows)
        except ValueError:
            raise ToolError("max_rows must be a finite number (at most 1000 rows come back)") from None
        with tool_errors():
            res = readonly_sql.query(path, sql, narrowed)
        return {"session": session, **res.to_dict()}

    return server
