"""`ingero agent serve`: the node agent's HTTP API, used by the operator.

    GET    /healthz                                   no token needed
    GET    /v1/time                                   {"wall_ns", "mono_ns"} for clock estimation
    POST   /v1/sessions                               start / resume / re-plan (idempotent)
    GET    /v1/sessions/<id>                          state, events so far, lost events
    POST   /v1/sessions/<id>/stop                     stop tracing (idempotent), waits for the tracer
    GET    /v1/sessions/<id>/segments[?since=NS]      segment files changed after NS (mtime)
    GET    /v1/sessions/<id>/segments/<table>/<name>  one segment file
    DELETE /v1/sessions/<id>                          stop and remove the session's data
    POST   /v1/query                                  read-only, bounded SQL over the sessions' segments

Every endpoint but /healthz needs ``Authorization: Bearer <token>`` (the
content of --token-file, compared in constant time). TLS when --tls-cert
and --tls-key are given; with --tls-client-ca every client must also present
a certificate signed by that CA (checked in the handshake). Errors are JSON
``{"error": "..."}`` with a one-line reason, malformed requests included.

aiohttp serves it on one asyncio event loop. /healthz and /v1/time answer on the
loop itself, so a clock sample never queues behind other work; everything that
blocks (DuckDB queries, starting and stopping tracers, reading segments and their
metadata, JSON of large bodies) runs in a pool of WORKERS threads, and at most
QueryService.slots queries run at once (a query waits QUERY_SLOT_WAIT_S for a slot,
then gets 429 with Retry-After). A segment is streamed from its file in pieces.
Connections are bounded as every Ingero port is (``ingero.serving``): at most
MAX_CONNECTIONS open, a new client takes the slot of the oldest idle or half-open
one, past that a 503 with Retry-After; a connection with no request for
IDLE_TIMEOUT_S, or whose peer does not read the answer, is closed. No thread is
started per connection, so --max-memory-mb holds the workers' stacks and the queries.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import signal
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Callable

from aiohttp import web

from ingero import __version__, logs, readonly_sql, serving
from ingero.errors import IngeroError
from ingero.tokens import read_token
from ingero_agent.api import ApiError, SessionManager, parse_plan
from ingero_agent.queries import QueryService

log = logging.getLogger("ingero.agent")
MAX_BODY = 4 << 20          # bytes; a plan for a few thousand pods fits
IDLE_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 512       # a few KiB each on the event loop
WORKERS = 8                 # threads for blocking work (each reserves a stack under --max-memory-mb)
QUERY_SLOT_WAIT_S = 1.0
QUERY_SLOTS = 2             # queries at once
SERVER = f"ingero-agent/{__version__}"
ACCESS_LOG_FORMAT = '%a "%r" %s %b %Tf'


def json_body(status: int, body: bytes) -> web.Response:
    return web.Response(status=status, body=body, content_type="application/json", headers={"Server": SERVER})


def answer(status: int, doc) -> web.Response:
    return json_body(status, json.dumps(doc).encode())


def error_answer(status: int, message: str) -> web.Response:
    return answer(status, {"error": message})


def _loads(raw: bytes):
    try:
        return json.loads(raw or b"{}")
    except RecursionError:
        raise ApiError(400, "body nests too deeply to be a plan or a query") from None
    except ValueError:
        raise ApiError(400, "body is not JSON") from None


class AgentServer:
    """The API on its listening socket. serve_forever() runs it on an event loop of its
    own in the calling thread until shutdown() (from another thread) or stop_soon() (from
    a signal handler); server_close() releases the socket."""

    def __init__(self, manager: SessionManager, queries: QueryService, sock: socket.socket, token: bytes,
                 tls: ssl.SSLContext | None = None, quiet: bool = False,
                 max_connections: int = MAX_CONNECTIONS, idle_timeout_s: float = IDLE_TIMEOUT_S):
        self.manager, self.queries, self.socket, self.token, self.tls = manager, queries, sock, token, tls
        self.quiet, self.idle_timeout_s = quiet, idle_timeout_s
        self.slots = serving.Slots(serving.Bounds(max_connections, idle_timeout_s))
        self.pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="agent-work")
        self.loop = asyncio.new_event_loop()
        self._stop = self.loop.create_future()
        self._started, self._done = threading.Event(), threading.Event()
        self.wall_ns = time.time_ns          # the clock /v1/time reports
        self.requests = None                 # a prometheus Counter (node, route, status), with --metrics-port

    @property
    def server_address(self):
        return self.socket.getsockname()

    # ---- running -------------------------------------------------------------------
    def serve_forever(self) -> None:
        self._started.set()
        try:
            self.loop.run_until_complete(self._serve())
        finally:
            self.loop.close()
            self._done.set()

    async def _serve(self) -> None:
        app = web.Application(middlewares=[self._guard], client_max_size=MAX_BODY)
        app.add_routes([
            web.get("/healthz", self.healthz, name="healthz", allow_head=False),
            web.get("/v1/time", self.time, allow_head=False),
            web.post("/v1/sessions", self.start),
            web.get("/v1/sessions/{sid}", self.get, allow_head=False),
            web.post("/v1/sessions/{sid}/stop", self.stop),
            web.get("/v1/sessions/{sid}/segments", self.segments, allow_head=False),
            web.get("/v1/sessions/{sid}/segments/{table}/{name}", self.download, allow_head=False),
            web.delete("/v1/sessions/{sid}", self.delete),
            web.post("/v1/query", self.query),
        ])
        self._query_slots = asyncio.Semaphore(self.queries.slots)
        runner, server = await serving.start(app, self.socket, self.slots, self.tls, error_answer,
                                             access_log=None if self.quiet else log,
                                             access_log_format=ACCESS_LOG_FORMAT)
        try:
            await self._stop
        finally:
            server.close()
            await runner.cleanup()
            for task in asyncio.all_tasks() - {asyncio.current_task()}:
                task.cancel()                # TLS handshakes still under way
            self.pool.shutdown(wait=False, cancel_futures=True)

    def stop_soon(self) -> None:
        try:
            self.loop.call_soon_threadsafe(lambda: self._stop.done() or self._stop.set_result(None))
        except RuntimeError:                 # the loop has ended already
            pass

    def shutdown(self) -> None:
        self.stop_soon()
        if self._started.is_set():
            self._done.wait()

    def server_close(self) -> None:
        self.socket.close()

    # ---- around every request --------------------------------------------------
    def _authorized(self, request: web.Request) -> bool:
        scheme, _, value = request.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            value.strip().encode("utf-8", "surrogateescape"), self.token)

    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        routing = request.match_info.http_exception
        if routing is not None:              # no such path (404) or not with this method (405)
            return error_answer(routing.status, f"no {request.method} {request.path}")
        if request.match_info.route.name != "healthz" and not self._authorized(request):
            return error_answer(401, "missing or wrong bearer token")
        try:
            resp = await handler(request)
            self._count(request, resp.status)
            return resp
        except ApiError as e:
            self._count(request, e.status)
            resp = error_answer(e.status, str(e))
            resp.headers.update(e.headers)
            return resp
        except ConnectionError:
            raise
        except Exception as e:               # keep serving; report what broke
            log.exception("%s %s failed", request.method, request.path)
            return error_answer(500, f"{type(e).__name__}: {e}".strip().splitlines()[0])

    def _count(self, request: web.Request, status: int) -> None:
        if self.requests is not None:        # by route pattern, not path: bounded labels
            self.requests.labels(self.manager.node, request.match_info.route.resource.canonical, str(status)).inc()

    async def _blocking(self, fn: Callable, *args):
        return await self.loop.run_in_executor(self.pool, fn, *args)

    async def _worked(self, fn: Callable[[], tuple[int, object]]) -> web.Response:
        """Run `fn` -> (status, document) in the pool, JSON encoding included."""
        def encoded():
            status, doc = fn()
            return status, json.dumps(doc).encode()
        return json_body(*await self._blocking(encoded))

    async def _body(self, request: web.Request) -> bytes:
        """The request body: 413 past MAX_BODY, 408 unless all of it arrives within the idle timeout."""
        try:
            return await serving.read_body(request, MAX_BODY, self.idle_timeout_s)
        except serving.BodyRefused as e:
            raise ApiError(e.status, str(e)) from None

    @asynccontextmanager
    async def _query_slot(self):
        try:
            async with asyncio.timeout(QUERY_SLOT_WAIT_S):
                await self._query_slots.acquire()
        except TimeoutError:
            raise ApiError(429, "every query slot of this agent is busy; retry shortly",
                           {"Retry-After": "1"}) from None
        try:
            yield
        finally:
            self._query_slots.release()

    # ---- endpoints -------------------------------------------------------------
    async def healthz(self, request: web.Request) -> web.Response:
        return answer(200, {"ok": True, "node": self.manager.node, "version": __version__})

    async def time(self, request: web.Request) -> web.Response:
        return answer(200, {"wall_ns": self.wall_ns(), "mono_ns": time.monotonic_ns()})

    async def start(self, request: web.Request) -> web.Response:
        raw = await self._body(request)
        return await self._worked(lambda: self.manager.start(parse_plan(_loads(raw))))

    async def get(self, request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        return await self._worked(lambda: (200, self.manager.info(self.manager.get(sid))))

    async def stop(self, request: web.Request) -> web.Response:
        raw = await self._body(request)
        sid = request.match_info["sid"]

        def stop():
            _loads(raw)                      # an empty body or {}; anything else is refused
            return 200, self.manager.stop(sid)
        return await self._worked(stop)

    async def segments(self, request: web.Request) -> web.Response:
        try:
            since = int(request.query.get("since", "0"))
        except ValueError:
            raise ApiError(400, "since must be an integer (mtime in ns)") from None
        sid = request.match_info["sid"]
        return await self._worked(lambda: (200, self.manager.list_segments(sid, since)))

    async def download(self, request: web.Request) -> web.StreamResponse:
        m = request.match_info
        path = await self._blocking(self.manager.segment_path, m["sid"], m["table"], m["name"])
        return await serving.stream_file(request, path, self.pool, {"Server": SERVER,
                                         "Content-Type": "application/vnd.apache.parquet"})

    async def delete(self, request: web.Request) -> web.Response:
        sid = request.match_info["sid"]

        def delete():
            self.manager.delete(sid)
            return 200, {"session_id": sid, "deleted": True}
        return await self._worked(delete)

    async def query(self, request: web.Request) -> web.Response:
        raw = await self._body(request)
        job = await self._blocking(lambda: self.queries.prepare(_loads(raw)))
        async with self._query_slot():
            return await self._worked(lambda: (200, self.queries.run(job)))


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise IngeroError(f"--listen {text!r} is not HOST:PORT; use e.g. 127.0.0.1:9464 or 0.0.0.0:9464")
    return host.strip("[]") or "0.0.0.0", int(port)


def tls_context(cert: Path, key: Path, client_ca: Path | None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as e:
        raise IngeroError(f"cannot load --tls-cert {cert} / --tls-key {key}: {e}") from None
    if client_ca is not None:
        try:
            ctx.load_verify_locations(cafile=str(client_ca))
        except (OSError, ssl.SSLError) as e:
            raise IngeroError(f"cannot load --tls-client-ca {client_ca}: {e}; pass the PEM bundle of "
                              "the CA that signs client certificates") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def make_server(manager: SessionManager, listen: tuple[str, int], token: bytes,
                tls: tuple[Path, Path] | None = None, quiet: bool = False,
                client_ca: Path | None = None, queries: QueryService | None = None,
                max_connections: int = MAX_CONNECTIONS, idle_timeout_s: float = IDLE_TIMEOUT_S) -> AgentServer:
    """The agent API listening on `listen` (bound here: connections queue until serve_forever)."""
    ctx = tls_context(tls[0], tls[1], client_ca) if tls else None
    sock = socket.socket(socket.AF_INET6 if ":" in listen[0] else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(listen)
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return AgentServer(manager, queries or QueryService(manager), sock, token, ctx, quiet,
                       max_connections, idle_timeout_s)


def add_parser(sub):
    p = sub.add_parser("agent", help="run the node agent's HTTP API (for the operator)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_subparsers(dest="agent_command", metavar="ACTION")
    r = s.add_parser("serve", help="serve the agent API", epilog="example:\n  ingero agent serve "
                     "--node $NODE_NAME --listen 0.0.0.0:9464 --data-dir /var/lib/ingero "
                     "--token-file /etc/ingero/token", formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--node", default=os.environ.get("NODE_NAME"), help="this node's name (default $NODE_NAME)")
    r.add_argument("--listen", default="127.0.0.1:9464", help="HOST:PORT (default 127.0.0.1:9464)")
    r.add_argument("--data-dir", type=Path, required=True, help="sessions and segments live here")
    r.add_argument("--token-file", type=Path, required=True, help="file holding the bearer token")
    r.add_argument("--tls-cert", type=Path, help="serve HTTPS with this certificate (PEM)")
    r.add_argument("--tls-key", type=Path, help="... and this private key (PEM)")
    r.add_argument("--tls-client-ca", type=Path, help="require client certificates signed by this CA (PEM)")
    r.add_argument("--query-timeout", type=float, default=10.0, metavar="S",
                   help="POST /v1/query: interrupt a query after this long (default 10)")
    r.add_argument("--query-max-rows", type=int, default=10_000, metavar="N",
                   help="POST /v1/query: rows returned at most (default 10000)")
    r.add_argument("--query-max-bytes", type=int, default=4 << 20, metavar="B",
                   help="POST /v1/query: JSON bytes of rows returned at most (default 4 MiB)")
    r.add_argument("--max-memory-mb", type=int, default=768, metavar="MB",
                   help="the agent's own process (queries included; not its tracers) may use this "
                   "much data memory; past it a query fails with an out-of-memory error instead of "
                   "the kernel killing the agent (default 768). It must "
                   f"hold {QUERY_SLOTS} queries of --query-memory-mb and "
                   f"{readonly_sql.PROCESS_RESERVE_MB} MiB for the agent itself")
    r.add_argument("--query-memory-mb", type=int, default=192, metavar="MB",
                   help="POST /v1/query: DuckDB memory of one query (default 192); a query needing "
                   "more is refused in one line naming this flag")
    r.add_argument("--query-threads", type=int, default=2, metavar="N",
                   help="POST /v1/query: DuckDB threads of one query (default 2)")
    r.add_argument("--data-max-bytes", type=int, default=0, metavar="B",
                   help="keep --data-dir under B bytes: when a session starts or stops, finished ones are "
                   "deleted, the one stopped longest ago first (never one still tracing); default 0, no cap")
    r.add_argument("--cgroup-root", type=Path, help="cgroup v2 folder holding the pods "
                   "(default: the cgroup2 mount)")
    r.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics (plain HTTP, no token) at http://ADDR:PORT/metrics: sessions "
                   "by state, events and lost events per session and ring, segment bytes, data folder size, "
                   "API connections and requests")
    r.add_argument("--metrics-address", default="0.0.0.0", metavar="ADDR", help="address of --metrics-port")
    r.add_argument("--ready-file", type=Path, help="touch this file once listening")
    r.add_argument("--quiet", action="store_true", help="no request log")
    logs.add_arguments(r)
    p.set_defaults(_agent_parser=p)
    return p


def run(args) -> int:
    if getattr(args, "agent_command", None) != "serve":
        args._agent_parser.print_help()
        return 2
    if not args.node:
        raise IngeroError("--node is missing: pass the node name (or set NODE_NAME)")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise IngeroError("TLS needs both --tls-cert and --tls-key")
    if args.tls_client_ca and not args.tls_cert:
        raise IngeroError("--tls-client-ca needs TLS: pass --tls-cert and --tls-key too")
    if args.query_timeout <= 0 or args.query_max_rows < 1 or args.query_max_bytes < 1024:
        raise IngeroError("--query-timeout must be > 0, --query-max-rows >= 1 and --query-max-bytes >= 1024")
    if not 256 <= args.max_memory_mb <= 1 << 20:
        raise IngeroError(f"--max-memory-mb {args.max_memory_mb} is out of range: use 256 to 1048576")
    if not 16 <= args.query_memory_mb <= 1 << 20 or not 1 <= args.query_threads <= 256:
        raise IngeroError("--query-memory-mb must be 16 to 1048576 and --query-threads 1 to 256")
    if args.cgroup_root is not None and not args.cgroup_root.is_dir():
        raise IngeroError(f"--cgroup-root {args.cgroup_root} is not a folder; pass the cgroup v2 "
                          "folder that holds the pods")
    logs.setup(args.log_format, args.log_level, "ingero.agent")
    listen = parse_listen(args.listen)
    token = read_token(args.token_file)
    limits = readonly_sql.Limits(timeout_s=args.query_timeout, max_rows=args.query_max_rows,
                                 max_bytes=args.query_max_bytes, memory_mb=args.query_memory_mb,
                                 threads=args.query_threads,
                                 memory_flags=f"--query-memory-mb {args.query_memory_mb} (one query) and "
                                 f"--max-memory-mb {args.max_memory_mb} (the agent)")
    readonly_sql.bound_process(args.max_memory_mb, limits, QUERY_SLOTS, "--max-memory-mb / --query-memory-mb")
    if args.data_max_bytes < 0:
        raise IngeroError("--data-max-bytes must be >= 0 (0: no cap)")
    try:
        manager = SessionManager(args.data_dir, args.node, args.cgroup_root, max_bytes=args.data_max_bytes or None)
    except OSError as e:
        raise IngeroError(f"--data-dir {args.data_dir}: {e.strerror}; pass a writable folder") from None
    try:
        srv = make_server(manager, listen, token, (args.tls_cert, args.tls_key) if args.tls_cert else None,
                          quiet=args.quiet, client_ca=args.tls_client_ca,
                          queries=QueryService(manager, limits, QUERY_SLOTS))
    except OSError as e:
        raise IngeroError(f"cannot listen on {args.listen}: {e.strerror}; pick a free port") from None
    if args.metrics_port is not None:
        from ingero_agent import metrics

        reg, srv.requests = metrics.registry(manager, srv.slots)
        try:
            metrics.serve(reg, args.metrics_port, args.metrics_address)
        except OSError as e:
            raise IngeroError(f"cannot serve metrics on {args.metrics_address}:{args.metrics_port}: "
                              f"{e.strerror}; pick a free --metrics-port") from None
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: srv.stop_soon())
    scheme = "https" if args.tls_cert else "http"
    log.info("node %s, %s://%s%s, data %s, %d sessions on disk; queries: %g s, %d rows, %d bytes at most",
             args.node, scheme, args.listen, " (client certificates required)" if args.tls_client_ca else "",
             manager.data, len(manager.sessions), args.query_timeout, args.query_max_rows, args.query_max_bytes)
    if args.ready_file:
        args.ready_file.touch()
    try:
        srv.serve_forever()
    finally:
        manager.shutdown()
        srv.server_close()
    return 0
