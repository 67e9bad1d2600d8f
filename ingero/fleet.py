"""Fan one read-only query out to every node's agent and join the answers into one table.

Every node is asked at once (one event loop, ``ingero.http_client``): first its
clock offset (NTP-style, ``ingero.clock``: several ``GET /v1/time`` samples on
one keep-alive connection, the lowest round trip wins), then ``POST /v1/query``.
The answers become one table with ``node`` first. Wall-clock instants in the
answer (``WALL_CLOCK_COLUMNS``, by column name) are moved onto this machine's
clock: ``ts - offset``, as the operator does when it merges segments.

A node that is down, slow (no answer within the timeout), refuses the query
or answers with other columns than the others is left out with a warning
naming it and why; the query fails only when every node failed.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import Counter
from dataclasses import dataclass, field

from ingero.errors import IngeroError
from ingero.fleet_targets import Target
from ingero.http_client import Agent, AgentError, Tls, new_session

# Columns that hold wall-clock instants (ns since the epoch) in Ingero's tables.
WALL_CLOCK_COLUMNS = ("timestamp_ns", "started_ns", "ended_ns", "first_seen_ns", "seen_ns", "since_ns")
_INT_TYPES = ("BIGINT", "HUGEINT", "INTEGER", "UBIGINT", "UHUGEINT")
SOCKET_MARGIN_S = 1.0     # beyond the query timeout, for the agent's own "interrupted" answer to arrive


@dataclass
class NodeAnswer:
    node: str
    columns: list[str] = field(default_factory=list)
    types: list[str] = field(default_factory=list)
    rows: list[list] = field(default_factory=list)
    truncated: str | None = None
    offset_ns: int | None = None
    rtt_ns: int | None = None
    error: str | None = None


@dataclass
class FleetResult:
    columns: list[str]
    rows: list[list]
    answers: list[NodeAnswer]
    warnings: list[str]


def _reason(e: AgentError) -> str:
    """The warning's reason, with the fix for the failures a user of the CLI can fix."""
    if e.status == 401:
        return "refused the bearer token (401): pass the agents' token with --token-file"
    if e.status == 404 and "no POST /v1/query" in str(e):
        return "has no query endpoint (404): upgrade its agent"
    return str(e)


async def ask(http, target: Target, token: str, sql: str, timeout_s: float, session_id: str | None = None,
              max_rows: int | None = None, tls: Tls | None = None, clock_samples: int = 8,
              ssl_context: ssl.SSLContext | None = None) -> NodeAnswer:
    """One node: its clock offset, then the query. Never raises; errors land in `error`."""
    ans = NodeAnswer(target.node)
    # each call waits a little longer than the agent's own query bound, so its 408 still arrives
    agent = Agent(target.host, target.port, token, http, tls, ssl_context, timeout_s + SOCKET_MARGIN_S)
    try:
        ans.offset_ns, ans.rtt_ns = await agent.clock_offset(clock_samples)
        body = {"sql": sql, "timeout_s": timeout_s}
        if session_id:
            body["session_id"] = session_id
        if max_rows is not None:
            body["max_rows"] = max_rows
        doc = await agent.call("POST", "/v1/query", body)
        ans.columns, ans.types, ans.rows = list(doc["columns"]), list(doc["types"]), list(doc["rows"])
        ans.truncated = doc.get("truncated")
    except AgentError as e:
        ans.error = _reason(e)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        ans.error = f"answered something that is not an Ingero agent's answer ({type(e).__name__})"
    return ans


def correct_clock(ans: NodeAnswer) -> None:
    """Move wall-clock instant columns of one answer onto our clock (ts - offset)."""
    if not ans.offset_ns:
        return
    idx = [i for i, (c, t) in enumerate(zip(ans.columns, ans.types))
           if c in WALL_CLOCK_COLUMNS and t.upper() in _INT_TYPES]
    for row in ans.rows:
        for i in idx:
            if isinstance(row[i], int):
                row[i] -= ans.offset_ns


def combine(answers: list[NodeAnswer], show_clock: bool = False) -> FleetResult:
    """One table, `node` first; nodes whose columns differ from the majority are left out."""
    warnings = [f"node {a.node} left out: {a.error}" for a in answers if a.error]
    good = [a for a in answers if not a.error]
    if not good:
        raise IngeroError("every node failed: " + "; ".join(f"{a.node}: {a.error}" for a in answers))
    shapes = Counter(tuple(a.columns) for a in good)
    top = max(shapes.values())
    ref = next(tuple(a.columns) for a in good if shapes[tuple(a.columns)] == top)
    rows: list[list] = []
    for a in good:
        if tuple(a.columns) != ref:
            warnings.append(f"node {a.node} left out: it returned columns {list(a.columns)} "
                            f"where the other nodes returned {list(ref)}")
            continue
        correct_clock(a)
        if a.truncated:
            warnings.append(f"node {a.node}: answer cut at the agent's {a.truncated} limit "
                            "(narrow the query or lower --max-rows)")
        extra = [a.offset_ns, a.rtt_ns] if show_clock else []
        rows += [[a.node, *extra, *r] for r in a.rows]
    cols = ["node", *(["clock_offset_ns", "clock_rtt_ns"] if show_clock else []), *ref]
    return FleetResult(cols, rows, answers, warnings)


def fan_out(targets: list[Target], token: str, sql: str, timeout_s: float = 10.0,
            session_id: str | None = None, max_rows: int | None = None, tls: Tls | None = None,
            show_clock: bool = False, clock_samples: int = 8) -> FleetResult:
    """Ask every target at once; a node with no answer after `timeout_s` (+1.5 s) is slow."""
    if not targets:
        raise IngeroError("no node to ask: pass --nodes or a kubeconfig with agent Pods")
    ctx = tls.context() if tls is not None else None

    async def every_node() -> list[NodeAnswer]:
        async with new_session(limit=2 * len(targets)) as http:
            tasks = {asyncio.ensure_future(ask(http, t, token, sql, timeout_s, session_id, max_rows, tls,
                                               clock_samples, ctx)): t for t in targets}
            await asyncio.wait(tasks, timeout=timeout_s + SOCKET_MARGIN_S + 0.5)
            for task in tasks:
                task.cancel()            # the slow ones
            return [task.result() if task.done() and not task.cancelled()
                    else NodeAnswer(t.node, error=f"slow: no answer within {timeout_s:g} s")
                    for task, t in tasks.items()]

    return combine(sorted(asyncio.run(every_node()), key=lambda a: a.node), show_clock)
