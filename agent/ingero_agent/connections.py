"""The agent API's connections: aiohttp's request handler, plus the bounds it lacks.

aiohttp accepts every connection and never times out a peer that stops reading,
so each accepted TCP connection is one ``Connection`` that

* holds one of the server's ``max_connections`` slots from accept to close, the TLS
  handshake included; past the bound a connection is closed at once;
* runs the TLS handshake itself (``loop.start_tls``), bounded by the idle timeout, so a
  client that never says hello holds a slot for that long and stalls nobody;
* is aborted when its first request has not arrived ``idle_timeout_s`` after accept
  (aiohttp before aio-libs/aiohttp#13681 waits for it forever), or when the peer has not
  read any of our answer for that long (aiohttp waits for it forever); between requests
  aiohttp's keep-alive timeout (the same value) closes it, and the server bounds a
  stalled request body;
* answers requests the HTTP parser refuses (a negative Content-Length, a broken request
  line) with the API's one-line JSON error instead of aiohttp's plain-text page.

TCP_NODELAY is on for every connection (asyncio and aiohttp both set it), and an answer
leaves in one write: it never waits for the client's delayed ACK, which would add
milliseconds to the NTP-style clock samples the operator takes on /v1/time.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Callable

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger("ingero.agent")


class Slots:
    """How many connections are open, at most `limit` (used on the event loop only)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.open = 0

    def take(self) -> bool:
        if self.open >= self.limit:
            return False
        self.open += 1
        return True

    def give_back(self) -> None:
        self.open -= 1


class Connection(RequestHandler):
    def __init__(self, manager: web.Server, slots: Slots, tls: ssl.SSLContext | None, idle_timeout_s: float,
                 error_answer: Callable[[int, str], web.StreamResponse], **kw):
        # lingering: after an answer sent before its request's body was read (a 408 or a 413),
        # the rest is read and dropped for at most the idle timeout, then the connection closes
        super().__init__(manager, loop=asyncio.get_running_loop(), keepalive_timeout=idle_timeout_s,
                         lingering_time=idle_timeout_s, **kw)
        self._slots, self._tls, self._idle_s = slots, tls, idle_timeout_s
        self._error_answer = error_answer
        self._has_slot = False
        self._served = False                    # a request has arrived on this connection
        self._raw: asyncio.BaseTransport | None = None
        self._first: asyncio.TimerHandle | None = None
        self._stall: asyncio.TimerHandle | None = None
        self._handshaking: asyncio.Task | None = None

    # ---- accept, TLS, close ---------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._slots.take():
            transport.abort()                   # past the bound: closed at once
            return
        self._has_slot = True
        self._raw = transport
        self._first = self._loop.call_later(self._idle_s, self._no_request)
        if self._tls is None:
            super().connection_made(transport)
            return
        transport.pause_reading()               # no byte reaches the parser before the handshake
        self._handshaking = self._loop.create_task(self._handshake(transport))

    async def _handshake(self, raw: asyncio.BaseTransport) -> None:
        try:
            tls = await self._loop.start_tls(raw, self, self._tls, server_side=True,
                                             ssl_handshake_timeout=self._idle_s,
                                             ssl_shutdown_timeout=self._idle_s)
        except Exception as e:                  # failed, timed out or reset: start_tls closed it
            log.debug("TLS handshake with %s failed: %s", raw.get_extra_info("peername"), e)
            tls = None
        if tls is None or tls.is_closing():     # (None: closed under the handshake, by _no_request)
            raw.abort()
            self._give_back()
            return
        super().connection_made(tls)

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)
        self._give_back()

    def _give_back(self) -> None:
        for timer in (self._first, self._stall):
            if timer is not None:
                timer.cancel()
        if self._has_slot:
            self._has_slot = False
            self._slots.give_back()

    def _abort(self) -> None:
        transport = self.transport or self._raw
        if transport is not None:
            transport.abort()

    # ---- idle peers -----------------------------------------------------------
    def request_arrived(self) -> None:
        self._served = True

    def _no_request(self) -> None:
        if not self._served:
            self._abort()

    def pause_writing(self) -> None:            # the peer's window is full: it is not reading
        super().pause_writing()
        self._stall = self._loop.call_later(self._idle_s, self._abort)

    def resume_writing(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        super().resume_writing()

    # ---- requests the parser refused ----------------------------------------
    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        self._served = True
        if request.writer.output_size > 0:     # part of an answer left already: only closing is left
            raise ConnectionError("the answer was already under way")
        if status >= 500:
            log.error("%s %s failed", request.method, request.path, exc_info=exc)
        why = (message or (str(exc) if exc else "") or "").strip().splitlines()
        text = why[0].rstrip(":") if why else f"status {status}"
        resp = self._error_answer(status, f"malformed request: {text}" if status == 400 else text)
        resp.force_close()
        return resp
