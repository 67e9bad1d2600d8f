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
``{"error": "..."}``.
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import re
import resource
import signal
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from ingero import __version__, logs, readonly_sql
from ingero.errors import IngeroError
from ingero.tokens import read_token
from ingero_agent.api import ApiError, SessionManager, parse_plan
from ingero_agent.queries import QueryService

log = logging.getLogger("ingero.agent")
MAX_BODY = 4 << 20   # bytes; a plan for a few thousand pods fits
ROUTES = [
    ("GET", re.compile(r"^/healthz$"), "healthz"),
    ("GET", re.compile(r"^/v1/time$"), "time"),
    ("POST", re.compile(r"^/v1/sessions$"), "start"),
    ("GET", re.compile(r"^/v1/sessions/([^/]+)$"), "get"),
    ("POST", re.compile(r"^/v1/sessions/([^/]+)/stop$"), "stop"),
    ("GET", re.compile(r"^/v1/sessions/([^/]+)/segments$"), "segments"),
    ("GET", re.compile(r"^/v1/sessions/([^/]+)/segments/([^/]+)/([^/]+)$"), "download"),
    ("DELETE", re.compile(r"^/v1/sessions/([^/]+)$"), "delete"),
    ("POST", re.compile(r"^/v1/query$"), "query"),
]


# Connections: a client that connects and sends nothing (or stalls mid-request, or idles on a
# keep-alive connection) is dropped after IDLE_TIMEOUT_S, and at most MAX_CONNECTIONS are
# served at once; more are closed at once. Before, 1,500 half-open connections without a
# token held 1,503 threads for good.
IDLE_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64


class Handler(BaseHTTPRequestHandler):
    server_version = f"ingero-agent/{__version__}"
    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT_S   # socket timeout of every read and write (StreamRequestHandler)
    # Headers and body leave in two writes: without TCP_NODELAY the body waits for the
    # client's (delayed) ACK, which adds milliseconds to every round trip of a keep-alive
    # connection and skews the NTP-style clock samples taken on it.
    disable_nagle_algorithm = True

    # set by make_server
    manager = None
    queries = None
    token: bytes = b""
    quiet = False

    def log_message(self, fmt, *args):
        if not self.quiet:
            log.info("%s %s", self.address_string(), fmt % args)

    def _send(self, status: int, doc) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _authorized(self) -> bool:
        got = self.headers.get("Authorization", "")
        scheme, _, value = got.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), self.token)

    def _body(self):
        text = (self.headers.get("Content-Length") or "0").strip()
        if not text.isdigit():
            self.close_connection = True     # the body's end is unknown: this connection is done
            raise ApiError(400, f"Content-Length {text[:40]!r} is not a byte count")
        n = int(text)
        if n > MAX_BODY:
            self.close_connection = True
            raise ApiError(413, f"body larger than {MAX_BODY} bytes")
        raw = self.rfile.read(n) if n else b""
        try:
            return json.loads(raw or b"{}")
        except RecursionError:
            raise ApiError(400, "body nests too deeply to be a plan or a query") from None
        except ValueError:
            raise ApiError(400, "body is not JSON") from None

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        for m, pattern, name in ROUTES:
            match = pattern.match(url.path)
            if match and m == method:
                break
        else:
            known = any(p.match(url.path) for _, p, _ in ROUTES)
            self._send(405 if known else 404, {"error": f"no {method} {url.path}"})
            return
        if name != "healthz" and not self._authorized():
            self._send(401, {"error": "missing or wrong bearer token"})
            return
        try:
            getattr(self, "do_" + name)(*match.groups(), query=parse_qs(url.query))
        except ApiError as e:
            self._send(e.status, {"error": str(e)})
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as e:  # keep serving; report what broke
            self._send(500, {"error": f"{type(e).__name__}: {e}"})

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def do_DELETE(self):
        self._dispatch("DELETE")

    # ---- endpoints -------------------------------------------------------------
    def do_healthz(self, query):
        self._send(200, {"ok": True, "node": self.manager.node, "version": __version__})

    def do_time(self, query):
        self._send(200, {"wall_ns": time.time_ns(), "mono_ns": time.monotonic_ns()})

    def do_start(self, query):
        status, info = self.manager.start(parse_plan(self._body()))
        self._send(status, info)

    def do_get(self, sid, query):
        self._send(200, self.manager.info(self.manager.get(sid)))

    def do_stop(self, sid, query):
        self._body()
        self._send(200, self.manager.stop(sid))

    def do_segments(self, sid, query):
        try:
            since = int((query.get("since") or ["0"])[0])
        except ValueError:
            raise ApiError(400, "since must be an integer (mtime in ns)") from None
        self._send(200, self.manager.list_segments(sid, since))

    def do_download(self, sid, table, name, query):
        path = self.manager.segment_path(sid, table, name)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            self.send_response(200)
            self.send_header("Content-Type", "application/vnd.apache.parquet")
            self.send_header("Content-Length", str(size))
            self.end_headers()
            while chunk := f.read(1 << 16):
                self.wfile.write(chunk)

    def do_delete(self, sid, query):
        self.manager.delete(sid)
        self._send(200, {"session_id": sid, "deleted": True})

    def do_query(self, query):
        self._send(200, self.queries.query(self._body()))


class BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most `slots` of them; a connection past that is closed."""

    daemon_threads = True
    slots: threading.BoundedSemaphore

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise IngeroError(f"--listen {text!r} is not HOST:PORT; use e.g. 127.0.0.1:9464 or 0.0.0.0:9464")
    return host.strip("[]") or "0.0.0.0", int(port)


def make_server(manager: SessionManager, listen: tuple[str, int], token: bytes,
                tls: tuple[Path, Path] | None = None, quiet: bool = False,
                client_ca: Path | None = None, queries: QueryService | None = None,
                max_connections: int = MAX_CONNECTIONS, idle_timeout_s: float = IDLE_TIMEOUT_S) -> ThreadingHTTPServer:
    handler = type("BoundHandler", (Handler,), {"manager": manager, "token": token, "quiet": quiet,
                                                "queries": queries or QueryService(manager)})
    family = socket.AF_INET6 if ":" in listen[0] else socket.AF_INET
    srv = type("AgentServer", (BoundedServer,), {"address_family": family})(listen, handler)
    srv.slots = threading.BoundedSemaphore(max_connections)
    handler.timeout = idle_timeout_s
    if tls:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(str(tls[0]), str(tls[1]))
        except (OSError, ssl.SSLError) as e:
            raise IngeroError(f"cannot load --tls-cert {tls[0]} / --tls-key {tls[1]}: {e}") from None
        if client_ca is not None:
            try:
                ctx.load_verify_locations(cafile=str(client_ca))
            except (OSError, ssl.SSLError) as e:
                raise IngeroError(f"cannot load --tls-client-ca {client_ca}: {e}; pass the PEM bundle of "
                                  "the CA that signs client certificates") from None
            ctx.verify_mode = ssl.CERT_REQUIRED
        # the handshake runs in the connection's own thread (on its first read, under the idle
        # timeout), not in accept(): a client that never says hello must not stall the server
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True, do_handshake_on_connect=False)
    return srv


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
    r.add_argument("--max-memory-mb", type=int, default=1536, metavar="MB",
                   help="the agent's own process (queries included; not its tracers) may use this "
                   "much data memory; past it a query fails with an out-of-memory error instead of "
                   "the kernel killing the agent (default 1536: 3/4 of the chart's 2 GiB limit)")
    r.add_argument("--cgroup-root", type=Path, help="cgroup v2 folder holding the pods "
                   "(default: the cgroup2 mount)")
    r.add_argument("--ready-file", type=Path, help="touch this file once listening")
    r.add_argument("--quiet", action="store_true", help="no request log")
    logs.add_arguments(r)
    p.set_defaults(_agent_parser=p)
    return p


def bound_memory(mb: int) -> None:
    """Bound this process's data memory (soft RLIMIT_DATA; tracers it starts drop it).

    DuckDB's memory_limit does not cover every allocation: `SELECT repeat('x', 900000000)`
    drove an agent past 3.7 GB, and under the pod's limit the kernel killed it. With the
    bound, such an allocation fails inside DuckDB (an out-of-memory error the query returns
    as a 400) and the agent keeps serving."""
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    want = mb << 20
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (want, hard))


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
    if args.cgroup_root is not None and not args.cgroup_root.is_dir():
        raise IngeroError(f"--cgroup-root {args.cgroup_root} is not a folder; pass the cgroup v2 "
                          "folder that holds the pods")
    logs.setup(args.log_format, args.log_level, "ingero.agent")
    listen = parse_listen(args.listen)
    token = read_token(args.token_file)
    bound_memory(args.max_memory_mb)
    try:
        manager = SessionManager(args.data_dir, args.node, args.cgroup_root)
    except OSError as e:
        raise IngeroError(f"--data-dir {args.data_dir}: {e.strerror}; pass a writable folder") from None
    try:
        limits = readonly_sql.Limits(timeout_s=args.query_timeout, max_rows=args.query_max_rows,
                                     max_bytes=args.query_max_bytes,
                                     memory_limit=f"{max(64, args.max_memory_mb // 3)}MB")
        srv = make_server(manager, listen, token, (args.tls_cert, args.tls_key) if args.tls_cert else None,
                          quiet=args.quiet, client_ca=args.tls_client_ca,
                          queries=QueryService(manager, limits))
    except OSError as e:
        raise IngeroError(f"cannot listen on {args.listen}: {e.strerror}; pick a free port") from None
    stop = threading.Event()

    def on_signal(*_):
        stop.set()
        threading.Thread(target=srv.shutdown, daemon=True).start()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    scheme = "https" if args.tls_cert else "http"
    log.info("node %s, %s://%s%s, data %s, %d sessions on disk; queries: %g s, %d rows, %d bytes at most",
             args.node, scheme, args.listen, " (client certificates required)" if args.tls_client_ca else "",
             manager.data, len(manager.sessions), args.query_timeout, args.query_max_rows, args.query_max_bytes)
    if args.ready_file:
        args.ready_file.touch()
    try:
        srv.serve_forever(poll_interval=0.2)
    finally:
        manager.shutdown()
        srv.server_close()
    return 0
