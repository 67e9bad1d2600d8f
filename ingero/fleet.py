"""Fan one read-only query out to every node's agent and join the answers into one table.

Each node is asked in its own thread: first its clock offset (NTP-style,
``ingero.clock``: several ``GET /v1/time`` samples on one connection, the
lowest round trip wins), then ``POST /v1/query``. The answers become one
table with ``node`` first. Wall-clock instants in the answer
(``WALL_CLOCK_COLUMNS``, by column name) are moved onto this machine's
clock: ``ts - offset``, as the operator does when it merges segments.

A node that is down, slow (no answer within the timeout), refuses the query
or answers with other columns than the others is left out with a warning
naming it and why; the query fails only when every node failed.
"""

from __future__ import annotations

import http.client
import json
import ssl
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from ingero.clock import measure_offset
from ingero.errors import IngeroError
from ingero.fleet_targets import Target

# Columns that hold wall-clock instants (ns since the epoch) in Ingero's tables.
WALL_CLOCK_COLUMNS = ("timestamp_ns", "started_ns", "ended_ns", "first_seen_ns")
_INT_TYPES = ("BIGINT", "HUGEINT", "INTEGER", "UBIGINT", "UHUGEINT")
SOCKET_MARGIN_S = 1.0     # beyond the query timeout, for the agent's own "interrupted" answer to arrive


@dataclass
class Tls:
    """https to the agents: CA bundle (None: system store), client certificate, expected name."""

    ca_file: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    server_name: str | None = None

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.client_cert:
            try:
                ctx.load_cert_chain(self.client_cert, self.client_key)
            except (OSError, ssl.SSLError) as e:
                raise IngeroError(f"cannot load --tls-client-cert {self.client_cert}: {e}") from None
        return ctx


class AgentError(Exception):
    """One node's failure; the message says why (it follows the node's name in the warning)."""


class _HTTPS(http.client.HTTPSConnection):
    """https that checks the certificate against `server_name` rather than the address dialled
    (agents are reached by pod IP; one DaemonSet-wide certificate names a Service)."""

    def __init__(self, host: str, port: int, ctx: ssl.SSLContext, server_name: str | None, timeout: float):
        super().__init__(host, port, timeout=timeout, context=ctx)
        self.tls_ctx, self.server_name = ctx, server_name

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self.sock = self.tls_ctx.wrap_socket(self.sock, server_hostname=self.server_name or self.host)


class AgentHTTP:
    """A keep-alive connection to one agent (stdlib only: the CLI runs anywhere)."""

    def __init__(self, target: Target, token: str, timeout_s: float, tls: Tls | None = None,
                 ssl_context: ssl.SSLContext | None = None):
        self.target = target
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        if tls is not None:
            self.conn: http.client.HTTPConnection = _HTTPS(
                target.host, target.port, ssl_context or tls.context(), tls.server_name, timeout_s)
        else:
            self.conn = http.client.HTTPConnection(target.host, target.port, timeout=timeout_s)

    def call(self, method: str, path: str, body=None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        try:
            self.conn.request(method, path, body=data, headers=self.headers)
            resp = self.conn.getresponse()
            raw = resp.read()
        except TimeoutError:
            raise AgentError(f"slow: no answer within {self.conn.timeout:g} s") from None
        except ssl.SSLError as e:
            raise AgentError(f"TLS handshake with {self.target.address} failed: {e.reason or e}") from None
        except (OSError, http.client.HTTPException) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else (str(e) or type(e).__name__)
            raise AgentError(f"unreachable at {self.target.address} ({why})") from None
        try:
            doc = json.loads(raw or b"{}")
        except ValueError:
            raise AgentError(f"answered {resp.status} with something that is not JSON") from None
        if resp.status == 401:
            raise AgentError("refused the bearer token (401): pass the agents' token with --token-file")
        if resp.status == 404 and path == "/v1/query":
            raise AgentError("has no query endpoint (404): upgrade its agent")
        if resp.status >= 400:
            raise AgentError(f"answered {resp.status}: {(doc or {}).get('error') or resp.reason}")
        return doc

    def wall_ns(self) -> int:
        return int(self.call("GET", "/v1/time")["wall_ns"])

    def close(self) -> None:
        self.conn.close()


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


def ask(target: Target, token: str, sql: str, timeout_s: float, session_id: str | None = None,
        max_rows: int | None = None, tls: Tls | None = None, clock_samples: int = 8,
        ssl_context: ssl.SSLContext | None = None) -> NodeAnswer:
    """One node: its clock offset, then the query. Never raises; errors land in `error`."""
    ans = NodeAnswer(target.node)
    # the socket waits a little longer than the agent's own query bound, so its 408 still arrives
    agent = AgentHTTP(target, token, timeout_s + SOCKET_MARGIN_S, tls, ssl_context)
    try:
        ans.offset_ns, ans.rtt_ns = measure_offset(agent.wall_ns, clock_samples)
        body = {"sql": sql, "timeout_s": timeout_s}
        if session_id:
            body["session_id"] = session_id
        if max_rows is not None:
            body["max_rows"] = max_rows
        doc = agent.call("POST", "/v1/query", body)
        ans.columns, ans.types, ans.rows = list(doc["columns"]), list(doc["types"]), list(doc["rows"])
        ans.truncated = doc.get("truncated")
    except AgentError as e:
        ans.error = str(e)
    except (KeyError, TypeError, ValueError) as e:
        ans.error = f"answered something that is not an Ingero agent's answer ({type(e).__name__})"
    finally:
        agent.close()
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
    """Ask every target in parallel; a node with no answer after `timeout_s` (+1.5 s) is slow."""
    if not targets:
        raise IngeroError("no node to ask: pass --nodes or a kubeconfig with agent Pods")
    ctx = tls.context() if tls is not None else None
    pool = ThreadPoolExecutor(max_workers=min(32, len(targets)), thread_name_prefix="fleet")
    futures = {pool.submit(ask, t, token, sql, timeout_s, session_id, max_rows, tls, clock_samples, ctx): t
               for t in targets}
    deadline = time.monotonic() + timeout_s + SOCKET_MARGIN_S + 0.5
    wait(futures, timeout=max(0.0, deadline - time.monotonic()))
    answers = []
    for fut, t in futures.items():
        if fut.done():
            answers.append(fut.result())
        else:
            answers.append(NodeAnswer(t.node, error=f"slow: no answer within {timeout_s:g} s"))
    pool.shutdown(wait=False, cancel_futures=True)
    return combine(sorted(answers, key=lambda a: a.node), show_clock)
