"""Talking to the node agents: their HTTP API, and NTP-style clock offsets.

Clock offset of a node: NTP-style, several samples of the agent's
``/v1/time``, the lowest round trip wins (``ingero.clock``, shared with
``ingero fleet``). A node timestamp ts is then ``ts - offset`` on the
operator's clock.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import time
from pathlib import Path

import aiohttp

from ingero.clock import ClockSample, estimate_offset  # noqa: F401  (re-exported)
from ingero_operator.settings import AgentSettings


class AgentUnreachable(Exception):
    """The agent did not answer (or answered an error); the message names the node."""


class AgentClient:
    def __init__(self, node: str, host: str, port: int, token: str, settings: AgentSettings,
                 http: aiohttp.ClientSession):
        self.node = node
        scheme = "https" if settings.tls else "http"
        self.base = f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"
        self.settings = settings
        self.http = http
        self.headers = {"Authorization": f"Bearer {token}"}
        self.ssl: ssl.SSLContext | bool = False
        self.tls_kw: dict = {}
        if settings.tls:
            self.ssl = ssl.create_default_context(cafile=settings.ca_file)
            if settings.client_cert_file:      # agents started with --tls-client-ca ask for it
                self.ssl.load_cert_chain(settings.client_cert_file, settings.client_key_file)
            if settings.tls_server_name:
                self.tls_kw = {"server_hostname": settings.tls_server_name}

    def __repr__(self) -> str:
        return f"agent on {self.node} ({self.base})"

    async def _json(self, method: str, path: str, timeout_s: float | None = None, ok404: bool = False,
                    **kw):
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.settings.request_timeout_s)
        try:
            async with self.http.request(method, self.base + path, headers=self.headers, ssl=self.ssl,
                                         timeout=timeout, **self.tls_kw, **kw) as resp:
                doc = await resp.json(content_type=None)
                if resp.status == 404 and ok404:
                    return None
                if resp.status >= 400:
                    raise AgentUnreachable(f"{self} answered {resp.status}: {(doc or {}).get('error')}")
                return doc
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            raise AgentUnreachable(f"{self} unreachable: {type(e).__name__} {e}".strip()) from e

    async def time_sample(self) -> ClockSample:
        t0 = time.time_ns()
        doc = await self._json("GET", "/v1/time")
        return ClockSample(t0, int(doc["wall_ns"]), time.time_ns())

    async def clock_offset(self, samples: int) -> tuple[int, int]:
        got = [await self.time_sample() for _ in range(max(1, samples))]
        return estimate_offset(got)

    async def start(self, plan: dict) -> dict:
        return await self._json("POST", "/v1/sessions", json=plan)

    async def session(self, sid: str) -> dict | None:
        """The agent's view of the session; None when it does not know it."""
        return await self._json("GET", f"/v1/sessions/{sid}", ok404=True)

    async def stop(self, sid: str) -> dict | None:
        return await self._json("POST", f"/v1/sessions/{sid}/stop", json={}, ok404=True,
                                timeout_s=self.settings.stop_timeout_s)

    async def delete(self, sid: str) -> None:
        await self._json("DELETE", f"/v1/sessions/{sid}", ok404=True, timeout_s=self.settings.stop_timeout_s)

    async def segments(self, sid: str, since_ns: int = 0) -> dict | None:
        return await self._json("GET", f"/v1/sessions/{sid}/segments", params={"since": str(since_ns)},
                                ok404=True)

    async def download(self, sid: str, table: str, name: str, dest: Path, mtime_ns: int) -> int:
        """Fetch one segment to `dest` (atomically; mtime set to the agent's). Returns bytes."""
        timeout = aiohttp.ClientTimeout(total=self.settings.download_timeout_s)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.part")
        try:
            async with self.http.get(f"{self.base}/v1/sessions/{sid}/segments/{table}/{name}",
                                     headers=self.headers, ssl=self.ssl, timeout=timeout,
                                     **self.tls_kw) as resp:
                if resp.status != 200:
                    raise AgentUnreachable(f"{self} answered {resp.status} for segment {table}/{name}")
                n = 0
                with open(tmp, "wb") as f:
                    async for chunk in resp.content.iter_chunked(1 << 16):
                        f.write(chunk)
                        n += len(chunk)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            tmp.unlink(missing_ok=True)
            raise AgentUnreachable(f"{self} unreachable while fetching {table}/{name}: "
                                   f"{type(e).__name__}") from e
        os.utime(tmp, ns=(mtime_ns, mtime_ns))
        os.replace(tmp, dest)
        return n
