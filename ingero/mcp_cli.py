"""`ingero mcp`: Ingero's traces as tools for an AI assistant (Model Context Protocol).

    ingero mcp --root out/                                   stdio (the assistant starts it)
    ingero mcp --root /var/lib/ingero/artifacts --http 127.0.0.1:8765 --token-file token

Tools: list_sessions, straggler_report, rank_detail, describe_tables, query
(read-only, bounded SQL). Over HTTP (streamable HTTP at /mcp) every request
needs ``Authorization: Bearer <token>``; --tls-cert/--tls-key serve https.
Its connections are bounded as every Ingero port is (``ingero.serving``).

Memory: a query's DuckDB memory is --query-memory-mb, and the whole process is
bounded by --max-memory-mb (its data memory), so a query that allocates beyond
them (``repeat('x', 1073741000)``) is a tool error naming both flags, not a
server gone; at most TOOL_THREADS tool calls run at once.

A client configuration for stdio, e.g.::

    {"mcpServers": {"ingero": {"command": "ingero", "args": ["mcp", "--root", "/path/to/traces"]}}}
"""

from __future__ import annotations

import argparse
import hmac
import os
import sys
from pathlib import Path

from ingero.errors import IngeroError
from ingero.tokens import read_token


def add_parser(sub):
    p = sub.add_parser("mcp", help="serve traces to AI assistants over MCP (stdio or streamable HTTP)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=Path(os.environ.get("INGERO_MCP_ROOT") or "."),
                   help="folder holding the traces (default: $INGERO_MCP_ROOT or the current folder)")
    p.add_argument("--http", metavar="HOST:PORT", help="serve streamable HTTP here instead of stdio")
    p.add_argument("--token-file", type=Path, help="bearer token every HTTP request must carry (required with --http)")
    p.add_argument("--tls-cert", type=Path, help="serve https with this certificate (PEM)")
    p.add_argument("--tls-key", type=Path, help="... and this key (PEM)")
    p.add_argument("--query-memory-mb", type=int, default=256, metavar="MB",
                   help="DuckDB memory of one `query` tool call (default 256)")
    p.add_argument("--max-memory-mb", type=int, default=2048, metavar="MB",
                   help="data memory of the whole server (default 2048; 0: no bound); a query past "
                   "it is a tool error")
    return p


class BearerAuth:
    """ASGI middleware: 401 for any HTTP request without ``Authorization: Bearer <token>``."""

    def __init__(self, app, token: bytes):
        self.app, self.token = app, token

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            scheme, _, value = got.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(value.strip(), self.token):
                body = b'{"error": "missing or wrong bearer token"}'
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"www-authenticate", b'Bearer realm="ingero"'),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def _token(path: Path | None) -> bytes:
    if path is None:
        raise IngeroError("--http needs --token-file: every HTTP request must carry that bearer token")
    return read_token(path)


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise IngeroError(f"--http {text!r} is not HOST:PORT; use e.g. 127.0.0.1:8765")
    return host.strip("[]") or "127.0.0.1", int(port)


def run(args) -> int:
    try:
        import mcp  # noqa: F401
    except ImportError:
        raise IngeroError("the MCP SDK is not installed: pip install 'mcp>=2,<3' (or ingero[mcp])") from None
    import dataclasses

    import anyio

    from ingero import readonly_sql, serving
    from ingero.mcp_server import QUERY_LIMITS, TOOL_THREADS, make_server

    if bool(args.tls_cert) != bool(args.tls_key):
        raise IngeroError("https needs both --tls-cert and --tls-key")
    if not 16 <= args.query_memory_mb <= 1 << 20 or not (args.max_memory_mb == 0 or 256 <= args.max_memory_mb):
        raise IngeroError("--query-memory-mb must be 16 to 1048576 and --max-memory-mb 0 (no bound) or >= 256")
    bound = f" and --max-memory-mb {args.max_memory_mb}" if args.max_memory_mb else ""
    limits = dataclasses.replace(QUERY_LIMITS, memory_mb=args.query_memory_mb,
                                 memory_flags=f"--query-memory-mb {args.query_memory_mb} (one query){bound}")
    server = make_server(args.root, limits=limits)
    if args.max_memory_mb:
        readonly_sql.bound_process(args.max_memory_mb, limits, TOOL_THREADS, "--max-memory-mb / --query-memory-mb")

    async def serve(run) -> None:
        anyio.to_thread.current_default_thread_limiter().total_tokens = TOOL_THREADS
        await run()

    if not args.http:
        if args.tls_cert or args.token_file:
            raise IngeroError("--token-file and --tls-* apply to --http only; stdio needs neither")
        anyio.run(serve, server.run_stdio_async)
        return 0
    import uvicorn

    host, port = _listen(args.http)
    app = BearerAuth(server.streamable_http_app(host=host), _token(args.token_file))
    ssl = {"ssl_certfile": str(args.tls_cert), "ssl_keyfile": str(args.tls_key)} if args.tls_cert else {}
    slots = serving.Slots(serving.Bounds())
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", http=serving.uvicorn_protocol(slots),
                            backlog=512, **ssl)
    scheme = "https" if args.tls_cert else "http"
    print(f"ingero mcp: {scheme}://{args.http}/mcp (bearer token required), traces under "
          f"{Path(args.root).resolve()}", file=sys.stderr, flush=True)
    try:
        anyio.run(serve, uvicorn.Server(config).serve)
    except KeyboardInterrupt:
        pass
    return 0
