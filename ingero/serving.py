"""Bounded HTTP serving: every port of Ingero (agent API and metrics, operator artifacts and
metrics, MCP over HTTP) is an asyncio server whose connections are ``Bounded``.

An event loop holds a connection for a few kilobytes and no thread, and each server
keeps them within ``Bounds``:

* at most ``max_connections`` are open, and half of them from one client address. A
  connection past either bound takes the slot of the oldest one (of that address, past
  its share) that has no request in progress (a half-open or idle peer); when every one
  is in a request, it is answered ``503`` with ``Retry-After`` and closed, never reset
  (a TLS connection past the bound is closed: it cannot be answered before its
  handshake). One address crowding the port thus drops its own stalled connections,
  not those of other clients;
* a connection with no request in progress for ``idle_timeout_s`` (a peer that never
  finishes its headers, a TLS client that never says hello, an idle keep-alive) is
  aborted: a sweep once a second looks at every connection;
* a peer that reads none of its answer for ``idle_timeout_s`` is aborted (a slow reader
  of a download frees its slot and whatever waits on it).

So a slowloris of any size costs memory in proportion to ``max_connections`` and never
keeps a legitimate request out: a new client takes a slot from the stalled ones. Request
bodies are bounded by each server (size, and the time to arrive).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import threading
from asyncio import sslproto
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger("ingero.serving")
CHUNK = 256 << 10            # bytes of a file read and sent at a time


@dataclass(frozen=True)
class Bounds:
    """What one server allows its clients; units in the names."""

    max_connections: int = 256     # a few KiB each on the loop; past it idle ones are dropped
    idle_timeout_s: float = 10.0   # no request in progress, or the answer unread, this long: closed
    retry_after_s: int = 1         # what a 503 past the bound tells the client


def _refusal(retry_after_s: int) -> bytes:
    body = b'{"error": "too many connections; retry shortly"}'
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: "
            + str(retry_after_s).encode() + b"\r\nContent-Length: " + str(len(body)).encode()
            + b"\r\nConnection: close\r\n\r\n" + body)


class Slots:
    """The open connections of one server, oldest first (used on its event loop only)."""

    def __init__(self, bounds: Bounds):
        self.bounds = bounds
        self.limit = bounds.max_connections
        self.per_address = max(1, bounds.max_connections // 2)
        self.conns: dict["Bounded", None] = {}
        self.by_address: dict[str, int] = {}
        self.refusing = 0                  # connections being answered 503
        self.dropped = 0                   # idle connections closed to make room
        self._sweeper: asyncio.TimerHandle | None = None

    @property
    def open(self) -> int:
        return len(self.conns)

    def admit(self, conn: "Bounded") -> bool:
        crowded = self.by_address.get(conn.address, 0) >= self.per_address
        if crowded or len(self.conns) >= self.limit:
            oldest_idle = next((c for c in self.conns if not c.busy()
                                and (not crowded or c.address == conn.address)), None)
            if oldest_idle is None:
                return False
            self.release(oldest_idle)
            oldest_idle.abort()
            self.dropped += 1
        self.conns[conn] = None
        self.by_address[conn.address] = self.by_address.get(conn.address, 0) + 1
        if self._sweeper is None:
            self._sweeper = conn.loop_of().call_later(1.0, self._sweep)
        return True

    def release(self, conn: "Bounded") -> None:
        if conn not in self.conns:
            return
        del self.conns[conn]
        left = self.by_address.pop(conn.address) - 1
        if left:
            self.by_address[conn.address] = left

    def _sweep(self) -> None:
        self._sweeper = None
        if not self.conns:
            return
        loop = next(iter(self.conns)).loop_of()
        now = loop.time()
        for c in list(self.conns):
            if c.busy():
                c.idle_since = now
            elif now - c.idle_since > self.bounds.idle_timeout_s:
                self.release(c)
                c.abort()
        self._sweeper = loop.call_later(1.0, self._sweep)


class Bounded:
    """Mixin for an asyncio HTTP protocol (before it in the bases): the connection holds a
    slot of `slots` from accept to close. Subclasses say when a request is in progress
    (``busy``) and call ``touch`` when one starts or ends."""

    def _bound(self, slots: Slots, loop: asyncio.AbstractEventLoop) -> None:
        self._slots, self._bloop = slots, loop
        self._raw: asyncio.BaseTransport | None = None
        self._refused = self._refusing = False
        self._stall: asyncio.TimerHandle | None = None
        self.idle_since = loop.time()

    def loop_of(self) -> asyncio.AbstractEventLoop:
        return self._bloop

    def busy(self) -> bool:
        raise NotImplementedError

    def touch(self) -> None:
        self.idle_since = self._bloop.time()

    def abort(self) -> None:
        if self._raw is not None:
            self._raw.abort()

    def can_answer_503(self) -> bool:
        return True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._raw = transport
        peer = transport.get_extra_info("peername")
        self.address = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if self._slots.admit(self):
            self.open_connection(transport)
            return
        self._refused = True
        if not self.can_answer_503() or self._slots.refusing >= self._slots.limit:
            transport.abort()
            return
        # answer, stop writing, and drop what the client still sends for a moment: a close
        # with its request unread would reset the connection and lose the answer
        self._slots.refusing += 1
        self._refusing = True
        transport.write(_refusal(self._slots.bounds.retry_after_s))
        if transport.can_write_eof():
            transport.write_eof()
        self._stall = self._bloop.call_later(2.0, transport.abort)

    def open_connection(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self._refused:
            super().data_received(data)

    def eof_received(self):
        if self._refused:
            self._raw.close()
            return None
        return super().eof_received()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._stall is not None:
            self._stall.cancel()
        if self._refusing:
            self._refusing = False
            self._slots.refusing -= 1
        if self._refused:
            return
        self._slots.release(self)
        super().connection_lost(exc)

    def pause_writing(self) -> None:       # the peer's window is full: it is not reading
        super().pause_writing()
        if self._stall is None:
            self._stall = self._bloop.call_later(self._slots.bounds.idle_timeout_s, self.abort)

    def resume_writing(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        super().resume_writing()


class _ServerTLS(sslproto.SSLProtocol):
    """asyncio's TLS protocol, reading a TLS record (at most 16 KiB) at a time: asyncio's own
    holds a 256 KiB read buffer per connection from accept on, 64 MiB for 256 half-open peers."""

    max_size = 16 << 10


async def _start_tls(loop: asyncio.AbstractEventLoop, raw: asyncio.BaseTransport, protocol: asyncio.Protocol,
                     ctx: ssl.SSLContext, timeout_s: float) -> asyncio.Transport:
    """``loop.start_tls(raw, protocol, ctx, server_side=True)`` with _ServerTLS (its steps, in its order)."""
    waiter = loop.create_future()
    tls = _ServerTLS(loop, protocol, ctx, waiter, server_side=True, ssl_handshake_timeout=timeout_s,
                     ssl_shutdown_timeout=timeout_s, call_connection_made=False)
    raw.pause_reading()
    raw.set_protocol(tls)
    made, resumed = loop.call_soon(tls.connection_made, raw), loop.call_soon(raw.resume_reading)
    try:
        await waiter
    except BaseException:
        raw.close()
        made.cancel()
        resumed.cancel()
        raise
    return tls._app_transport


class Connection(Bounded, RequestHandler):
    """aiohttp's request handler, bounded; with `tls`, it runs the handshake itself (bounded
    by the idle timeout) so that a client that never says hello stalls nobody. Requests the
    HTTP parser refuses are answered by `error_answer(status, one line)`."""

    def __init__(self, manager: web.Server, slots: Slots, tls: ssl.SSLContext | None = None,
                 error_answer: Callable[[int, str], web.StreamResponse] | None = None, **kw):
        loop = asyncio.get_running_loop()
        idle = slots.bounds.idle_timeout_s
        # lingering: after an answer sent before its request's body was read (a 408 or a 413),
        # the rest is read and dropped for at most the idle timeout, then the connection closes
        super().__init__(manager, loop=loop, keepalive_timeout=idle, lingering_time=idle, **kw)
        self._bound(slots, loop)
        self._tls, self._error_answer = tls, error_answer
        self._handshaking: asyncio.Task | None = None

    def busy(self) -> bool:
        return self._request_in_progress

    def can_answer_503(self) -> bool:
        return self._tls is None

    def open_connection(self, transport: asyncio.BaseTransport) -> None:
        if self._tls is None:
            RequestHandler.connection_made(self, transport)
            return
        transport.pause_reading()               # no byte reaches the parser before the handshake
        self._handshaking = self._loop.create_task(self._handshake(transport))

    async def _handshake(self, raw: asyncio.BaseTransport) -> None:
        idle = self._slots.bounds.idle_timeout_s
        if raw.is_closing():         # dropped before its turn came: no TLS state to hold for it
            self._slots.release(self)
            return
        try:
            tls = await _start_tls(self._loop, raw, self, self._tls, idle)
        except Exception as e:                  # failed, timed out or reset: start_tls closed it
            log.debug("TLS handshake with %s failed: %s", raw.get_extra_info("peername"), e)
            tls = None
        if tls is None or tls.is_closing():     # (None: closed under the handshake, by the sweep)
            raw.abort()
            self._slots.release(self)
            return
        self._raw = tls
        RequestHandler.connection_made(self, tls)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.transport is None and not self._refused:      # lost during the TLS handshake
            self._slots.release(self)
            return
        super().connection_lost(exc)

    async def _handle_request(self, *args, **kw):
        self.touch()
        try:
            return await super()._handle_request(*args, **kw)
        finally:
            self.touch()

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if self._error_answer is None:
            return super().handle_error(request, status, exc, message)
        if request.writer.output_size > 0:     # part of an answer left already: only closing is left
            raise ConnectionError("the answer was already under way")
        if status >= 500:
            log.error("%s %s failed", request.method, request.path, exc_info=exc)
        why = (message or (str(exc) if exc else "") or "").strip().splitlines()
        text = why[0].rstrip(":") if why else f"status {status}"
        resp = self._error_answer(status, f"malformed request: {text}" if status == 400 else text)
        resp.force_close()
        return resp


def uvicorn_protocol(slots: Slots) -> type:
    """uvicorn's h11 protocol, bounded by `slots` (for an ASGI app: ``uvicorn.Config(http=...)``).
    With TLS, uvicorn's transport hands the connection over after the handshake, which
    asyncio bounds at 60 s."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class BoundedH11(Bounded, H11Protocol):
        def __init__(self, *args, **kw):
            H11Protocol.__init__(self, *args, **kw)
            self._bound(slots, self.loop)

        def busy(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def on_response_complete(self) -> None:
            self.touch()
            super().on_response_complete()

    return BoundedH11


async def start(app: web.Application, sock: socket.socket, slots: Slots, tls: ssl.SSLContext | None = None,
                error_answer=None, shutdown_timeout: float = 2.0, **handler_kw):
    """Serve `app` on the bound `sock` with bounded connections, on the running loop.
    Returns (runner, asyncio server): close the server, then ``await runner.cleanup()``."""
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: Connection(runner.server, slots, tls, error_answer, **handler_kw), sock=sock)
    return runner, server


def bind(port: int, address: str = "0.0.0.0") -> socket.socket:
    """A listening socket, bound now so that a taken port fails at start."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    return socket.create_server((address.strip("[]"), port), family=family, backlog=512)


class ServerThread:
    """`app` served on `sock` in a daemon thread with its own event loop (beside a main loop
    or thread that must not be delayed by it)."""

    def __init__(self, app: web.Application, sock: socket.socket, bounds: Bounds = Bounds(), name: str = "http"):
        self.app, self.sock = app, sock
        self.slots = Slots(bounds)
        self.port = sock.getsockname()[1]
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"ingero-{name}", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.runner, self.server = self.loop.run_until_complete(start(self.app, self.sock, self.slots,
                                                                          access_log=None))
        except BaseException as e:      # noqa: BLE001 - handed to start()
            self._error = e
            self._started.set()
            return
        self._started.set()
        self.loop.run_forever()
        self.server.close()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()

    def start(self) -> "ServerThread":
        self._thread.start()
        self._started.wait(10)
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
        self.sock.close()


class BodyRefused(Exception):
    """A request body refused by `read_body`: `status` 413 (too large) or 408 (too slow)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


async def read_body(request: web.Request, max_bytes: int, within_s: float) -> bytes:
    """The request body, all of it within `within_s` (a client trickling a byte at a time
    must not hold its slot for long) and at most `max_bytes` of it; BodyRefused otherwise."""
    if (request.content_length or 0) > max_bytes:
        raise BodyRefused(413, f"body larger than {max_bytes} bytes")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(within_s):
            while chunk := await request.content.readany():
                size += len(chunk)
                if size > max_bytes:
                    raise BodyRefused(413, f"body larger than {max_bytes} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise BodyRefused(408, f"the body did not arrive within {within_s:g} s") from None
    return b"".join(chunks)


async def stream_file(request: web.Request, path: Path, pool: Executor | None, headers: dict) -> web.StreamResponse:
    """`path` as the answer, read in CHUNK pieces in `pool` and sent as the peer takes them
    (a peer that stops reading is dropped by its connection's bound, not waited for)."""
    loop = asyncio.get_running_loop()
    f = await loop.run_in_executor(pool, open, path, "rb")
    try:
        left = os.fstat(f.fileno()).st_size
        resp = web.StreamResponse(headers=headers)
        resp.content_length = left
        await resp.prepare(request)
        if request.method == "HEAD":
            return resp
        while left > 0:
            chunk = await loop.run_in_executor(pool, f.read, min(CHUNK, left))
            if not chunk:                # cut short under us: the client must not take it as whole
                raise ConnectionError(f"{path.name} ended {left} bytes early")
            left -= len(chunk)
            await resp.write(chunk)
        await resp.write_eof()
        return resp
    finally:
        f.close()


def metrics_app(registry) -> web.Application:
    """GET /metrics of a prometheus_client `registry` (any path, as prometheus_client serves
    it). Collecting runs in one thread of its own; scrapes that arrive while it runs share
    its result, so a crowd of scrapers costs one collection."""
    import gzip
    from concurrent.futures import ThreadPoolExecutor

    from prometheus_client.exposition import choose_encoder

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metrics-collect")
    running: dict[str, asyncio.Future] = {}

    def collect(accept: str) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept)
        return encoder(registry), content_type

    async def metrics(request: web.Request) -> web.Response:
        accept = request.headers.get("Accept", "")
        fut = running.get(accept)
        if fut is None:
            fut = running[accept] = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(
                pool, collect, accept))
            fut.add_done_callback(lambda _: running.pop(accept, None))
        body, content_type = await asyncio.shield(fut)
        resp = web.Response(body=body, headers={"Content-Type": content_type})
        if "gzip" in request.headers.get("Accept-Encoding", "") and len(body) > 1024:
            resp.body = await asyncio.get_running_loop().run_in_executor(pool, gzip.compress, body)
            resp.headers["Content-Encoding"] = "gzip"
        return resp

    app = web.Application()
    app.router.add_get("/{tail:.*}", metrics)
    app.on_cleanup.append(lambda _: asyncio.to_thread(pool.shutdown, True))
    return app


def serve_metrics(registry, port: int, address: str = "0.0.0.0", bounds: Bounds = Bounds()) -> ServerThread:
    """`registry` on http://address:port/metrics, bounded, in a thread of its own."""
    return ServerThread(metrics_app(registry), bind(port, address), bounds, "metrics").start()
