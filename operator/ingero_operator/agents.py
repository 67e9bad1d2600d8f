"""Talking to the node agents: their HTTP API, and NTP-style clock offsets.

The HTTP itself (bearer token, TLS and mutual TLS, timeouts, one-line errors)
is ``ingero.http_client.Agent``, shared with ``ingero fleet``. Clock offset of
a node: NTP-style, several samples of the agent's ``/v1/time``, the lowest
round trip wins (``ingero.clock``). A node timestamp ts is then ``ts - offset``
on the operator's clock.
"""

from __future__ import annotations

import ssl
import time
from pathlib import Path

import aiohttp

from ingero.clock import ClockSample, estimate_offset  # noqa: F401  (re-exported)
from ingero.http_client import Agent, AgentError, Tls
from ingero_operator.settings import AgentSettings


class AgentUnreachable(AgentError):
    """The agent did not answer (or answered an error); the message names the node."""


class AgentBroke(AgentUnreachable):
    """The agent's answer broke a bound the operator sets (a listing or segment larger than
    allowed, more data than the node or session may send): not retried, the node counts as
    failed; the message names the node."""


def agent_tls(settings: AgentSettings) -> Tls | None:
    """How the operator reaches agents over https (None: plain http)."""
    if not settings.tls:
        return None
    return Tls(settings.ca_file, settings.client_cert_file, settings.client_key_file, settings.tls_server_name)


class AgentClient(Agent):
    def __init__(self, node: str, host: str, port: int, token: str, settings: AgentSettings,
                 http: aiohttp.ClientSession, ssl_context: ssl.SSLContext | None = None):
        super().__init__(host, port, token, http, agent_tls(settings), ssl_context, settings.request_timeout_s)
        self.node = node
        self.settings = settings

    def __repr__(self) -> str:
        return f"agent on {self.node} ({self.base})"

    def error(self, message: str, status: int | None = None) -> Exception:
        return AgentUnreachable(f"{self}: {message}", status)

    def over_limit(self, message: str) -> Exception:
        return AgentBroke(f"{self}: {message}")

    async def time_sample(self) -> ClockSample:
        t0 = time.time_ns()
        wall = await self.wall_ns()
        return ClockSample(t0, wall, time.time_ns())

    async def start(self, plan: dict) -> dict:
        return await self.call("POST", "/v1/sessions", plan)

    async def session(self, sid: str) -> dict | None:
        """The agent's view of the session; None when it does not know it."""
        return await self.call("GET", f"/v1/sessions/{sid}", missing_ok=True)

    async def stop(self, sid: str) -> dict | None:
        return await self.call("POST", f"/v1/sessions/{sid}/stop", {}, missing_ok=True,
                               timeout_s=self.settings.stop_timeout_s)

    async def delete(self, sid: str) -> None:
        await self.call("DELETE", f"/v1/sessions/{sid}", missing_ok=True, timeout_s=self.settings.stop_timeout_s)

    async def segments(self, sid: str, since_ns: int = 0) -> dict | None:
        return await self.call("GET", f"/v1/sessions/{sid}/segments", params={"since": str(since_ns)},
                               missing_ok=True, max_bytes=self.settings.listing_max_bytes)

    async def download(self, sid: str, table: str, name: str, dest: Path, mtime_ns: int, max_bytes: int) -> int:
        """Fetch one segment to `dest` (atomically; mtime set to the agent's), at most
        `max_bytes` of it. Returns bytes."""
        return await self.fetch(f"/v1/sessions/{sid}/segments/{table}/{name}", dest,
                                self.settings.download_timeout_s, mtime_ns, max_bytes,
                                self.settings.download_idle_s)
