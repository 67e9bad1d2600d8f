"""Ingero's HTTP client side, on one stack (aiohttp): every call to a node agent (the
operator's, ``ingero fleet``'s) and the operator's Kubernetes API calls.

* ``tls_context``: a client TLS context from a CA (file, PEM text, or the system
  store), an optional client certificate (files, or PEM text as a kubeconfig holds
  it: loaded through a private folder removed at once) and ``insecure``. ``Tls`` is
  the agents' form of it, plus the name expected in their certificates; files it
  cannot load are a one-line ``IngeroError``.
* ``new_session``: a connection pool with default headers and a total timeout per call;
  ``request_sync``: one call from synchronous code (the demo's embedded cluster).
* ``Agent``: one node agent: bearer token, JSON in and out, a segment streamed to a
  file, NTP-style clock samples; every failure is an ``AgentError`` whose one line
  says why (slow, unreachable, TLS, the HTTP status with the agent's own reason).
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from ingero.clock import measure_offset
from ingero.errors import IngeroError


def tls_context(ca_file: str | None = None, ca_data: str | None = None, cert_file: str | None = None,
                key_file: str | None = None, cert_data: bytes | str | None = None,
                key_data: bytes | str | None = None, insecure: bool = False) -> ssl.SSLContext:
    """A client context (OSError or ssl.SSLError for files or text it cannot load). A
    client certificate given as PEM text is written to a private folder for
    load_cert_chain (which wants files) and removed as soon as it is loaded."""
    ctx = ssl.create_default_context()
    if insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if ca_file or ca_data:
        ctx.load_verify_locations(cafile=ca_file, cadata=ca_data)
    if cert_data and key_data:
        with tempfile.TemporaryDirectory(prefix="ingero-tls-") as d:
            cert, key = Path(d) / "cert.pem", Path(d) / "key.pem"
            for path, blob in ((cert, cert_data), (key, key_data)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(blob if isinstance(blob, bytes) else blob.encode())
            ctx.load_cert_chain(cert, key)
    elif cert_file:
        ctx.load_cert_chain(cert_file, key_file)
    return ctx


@dataclass(frozen=True)
class Tls:
    """https to the agents: CA bundle (None: system store), client certificate (mutual
    TLS), and the name their certificates must carry (they are dialled by pod IP, and one
    DaemonSet-wide certificate names a Service; None: the address dialled)."""

    ca_file: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    server_name: str | None = None

    def context(self) -> ssl.SSLContext:
        try:
            return tls_context(self.ca_file, cert_file=self.client_cert, key_file=self.client_key)
        except (OSError, ssl.SSLError) as e:
            raise IngeroError(f"cannot load the TLS files for the agents (CA {self.ca_file or 'system store'}, "
                              f"client certificate {self.client_cert or 'none'}): {e}") from None


def new_session(headers: dict | None = None, timeout_s: float | None = None, limit: int = 100) -> aiohttp.ClientSession:
    """A pool of at most `limit` connections; `timeout_s` bounds each call (None: per call)."""
    return aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=limit),
                                 timeout=aiohttp.ClientTimeout(total=timeout_s))


def request_sync(method: str, url: str, body: bytes | None = None, headers: dict | None = None,
                 timeout_s: float = 15.0, loop: asyncio.AbstractEventLoop | None = None) -> tuple[int, bytes]:
    """One request from synchronous code: (status, body). It runs on `loop` when given (an
    event loop running in another thread), else on a short-lived loop of its own."""
    async def one() -> tuple[int, bytes]:
        async with new_session(timeout_s=timeout_s) as http:
            async with http.request(method, url, data=body, headers=headers) as resp:
                return resp.status, await resp.read()
    if loop is None:
        return asyncio.run(one())
    return asyncio.run_coroutine_threadsafe(one(), loop).result(timeout_s + 5)


class AgentError(Exception):
    """One agent call failed; the message says why in one line. `status`: the HTTP status
    when the agent answered one."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class AgentOverLimit(AgentError):
    """An agent's answer broke a bound (larger than it may be): retrying gets the same."""


MAX_ANSWER_BYTES = 64 << 20   # a JSON answer (a query's rows are capped well below by the agent)


def describe(e: BaseException, address: str, timeout_s: float | None) -> str:
    """One line for a failed call to `address`."""
    if isinstance(e, asyncio.TimeoutError):
        return f"slow: no answer within {timeout_s:g} s"
    if isinstance(e, aiohttp.ClientConnectorCertificateError):
        cert = e.certificate_error
        why = getattr(cert, "verify_message", None) or getattr(cert, "reason", None) or cert
        return f"TLS handshake with {address} failed: certificate verify failed: {why}"
    if isinstance(e, aiohttp.ClientSSLError):
        return f"TLS handshake with {address} failed: {e.os_error.reason or e.os_error}"
    if isinstance(e, aiohttp.ClientConnectorError):
        err = e.os_error
        why = os.strerror(err.errno) if err.errno else (err.strerror or str(err))
        return f"unreachable at {address} ({why})"
    why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"unreachable at {address} ({why})"


class Agent:
    """One node agent's API, through a shared `http` session."""

    def __init__(self, host: str, port: int, token: str, http: aiohttp.ClientSession, tls: Tls | None = None,
                 ssl_context: ssl.SSLContext | None = None, timeout_s: float = 10.0):
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.base = f"{'https' if tls else 'http'}://{self.address}"
        self.http = http
        self.timeout_s = timeout_s
        self.headers = {"Authorization": f"Bearer {token}"}
        self.ssl: ssl.SSLContext | bool = (ssl_context or tls.context()) if tls else False
        self.tls_kw = {"server_hostname": tls.server_name} if tls and tls.server_name else {}

    def error(self, message: str, status: int | None = None) -> Exception:
        """The exception a failure raises (subclasses name the node their own way)."""
        return AgentError(message, status)

    def over_limit(self, message: str) -> Exception:
        """The exception an answer larger than its bound raises."""
        return AgentOverLimit(message)

    def _request(self, method: str, path: str, timeout_s: float | None, idle_s: float | None = None, **kw):
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s, sock_read=idle_s)
        return self.http.request(method, self.base + path, headers=self.headers, ssl=self.ssl, timeout=timeout,
                                 **self.tls_kw, **kw)

    async def _body(self, resp, path: str, max_bytes: int, into=None) -> bytes | int:
        """The answer's body (or, with `into`, a file: the bytes written there), refused past
        `max_bytes` before more of it is read."""
        if (resp.content_length or 0) > max_bytes:
            raise self.over_limit(f"answered {resp.content_length} bytes for {path}; at most {max_bytes} expected")
        got, n = bytearray(), 0
        async for chunk in resp.content.iter_chunked(1 << 16):
            n += len(chunk)
            if n > max_bytes:
                raise self.over_limit(f"answered more than {max_bytes} bytes for {path}")
            if into is None:
                got += chunk
            else:
                into.write(chunk)
        return bytes(got) if into is None else n

    async def call(self, method: str, path: str, body=None, *, params: dict | None = None,
                   timeout_s: float | None = None, missing_ok: bool = False, max_bytes: int = MAX_ANSWER_BYTES):
        """The agent's JSON answer (at most `max_bytes` of it); None for a 404 when `missing_ok`."""
        try:
            async with self._request(method, path, timeout_s, json=body, params=params) as resp:
                status, reason, raw = resp.status, resp.reason, await self._body(resp, path, max_bytes)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise self.error(describe(e, self.address, timeout_s or self.timeout_s)) from None
        if status == 404 and missing_ok:
            return None
        try:
            doc = json.loads(raw or b"{}")
        except ValueError:
            raise self.error(f"answered {status} with something that is not JSON", status) from None
        if status >= 400:
            why = doc.get("error") if isinstance(doc, dict) else None
            raise self.error(f"answered {status}: {why or reason}", status)
        return doc

    async def wall_ns(self) -> int:
        doc = await self.call("GET", "/v1/time")
        try:
            return int(doc["wall_ns"])
        except (KeyError, TypeError, ValueError):
            raise self.error("answered /v1/time without a wall clock: is it an Ingero agent?") from None

    async def clock_offset(self, samples: int = 8) -> tuple[int, int]:
        """(offset_ns, rtt_ns) of the agent's clock against ours (``ingero.clock``)."""
        return await measure_offset(self.wall_ns, samples)

    async def fetch(self, path: str, dest: Path, timeout_s: float, mtime_ns: int | None = None,
                    max_bytes: int | None = None, idle_s: float | None = None) -> int:
        """Stream `path` into `dest` (atomically: a hidden part file renamed at the end, its
        mtime set first when given); refused past `max_bytes`, or when no byte came for
        `idle_s`. Returns the bytes written."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.part")
        try:
            async with self._request("GET", path, timeout_s, idle_s) as resp:
                if resp.status != 200:
                    raise self.error(f"answered {resp.status} for {path}", resp.status)
                with open(tmp, "wb") as f:
                    n = await self._body(resp, path, max_bytes if max_bytes is not None else 1 << 62, into=f)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            tmp.unlink(missing_ok=True)
            why = f"sent no byte for {idle_s:g} s" if isinstance(e, aiohttp.SocketTimeoutError) and idle_s \
                else describe(e, self.address, timeout_s)
            raise self.error(f"{why} while fetching {path}") from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if mtime_ns is not None:
            os.utime(tmp, ns=(mtime_ns, mtime_ns))
        os.replace(tmp, dest)
        return n
