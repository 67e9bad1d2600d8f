"""Operator settings: one object of small dataclasses; every field says its unit and why.

Resolved once at start (``Settings.from_env``) and logged; the CLI flags and
``INGERO_*`` environment variables fill it.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

GROUP, VERSION, PLURAL = "ingero.io", "v1alpha1", "tracesessions"
AGENT_LABELS = {"app.kubernetes.io/name": "ingero", "app.kubernetes.io/component": "agent"}


@dataclass
class AgentSettings:
    """How the operator finds and talks to the node agents."""

    labels: dict = field(default_factory=lambda: dict(AGENT_LABELS))  # agent Pods carry these
    port_name: str = "api"                 # container port name of the agent API
    token_secret: str = "ingero-agent-token"  # Secret in the operator's namespace, key `token`
    token_key: str = "token"
    tls: bool = False                      # https to the agents (they serve --tls-cert/--tls-key)
    ca_file: str | None = None             # CA bundle for agent certificates (None: system store)
    tls_server_name: str | None = None     # name checked in agent certificates (agents are reached
                                           # by pod IP, so one DaemonSet-wide certificate names a
                                           # Service instead); None: the address itself
    client_cert_file: str | None = None    # certificate (and key) the operator presents to agents
    client_key_file: str | None = None     # started with --tls-client-ca (mutual TLS); None: none
    request_timeout_s: float = 10.0        # one API call; a tracer start returns at once
    stop_timeout_s: float = 45.0           # a stop waits for the tracer's last flush (~1-3 s)
    download_timeout_s: float = 120.0      # one segment file (a few MB at most)
    download_idle_s: float = 20.0          # a download that sends no byte this long is dropped
    listing_max_bytes: int = 48 << 20      # a segment listing (up to ~160 bytes an entry) larger than
                                           # this is refused: the agent is broken or hostile


@dataclass
class TimingSettings:
    refresh_interval_s: float = 2.0        # live status refresh while Running: a straggler shows up
                                           # within one step of the agents' 2 s segment roll
    live_window_s: float = 6.0             # the live verdict judges the last this many seconds (and
                                           # >= 40 steps) alone, so a fault starting mid-session is named
                                           # within about half of it (bench/time_to_straggler.py), and a
                                           # refresh costs the same at any session length
                                           # (bench/live_refresh.py); 0: the whole session every refresh
    final_max_calls: int = 1_250_000       # the final verdict judges a session with more NCCL calls in
                                           # windows of whole steps holding about this many each (the
                                           # last up to 1.5x): 2.5 M-call windows peaked at 1.96 GiB
                                           # (docs/benchmarks.md), and the chart's operator limit is 2 GiB
    clock_samples: int = 8                 # /v1/time round trips per node; the lowest RTT wins
    pending_retry_s: float = 5.0           # no pods matched yet: look again this often
    gather_retries: int = 3                # attempts per node before it counts as unreachable
    retry_backoff_s: float = 1.0           # between those attempts
    delete_gather_timeout_s: float = 30.0  # a deleted running session gathers at most this long
    tracer_grace_s: float = 120.0          # tracers stop by themselves this long after the deadline
                                           # (if the operator is gone); 0 = no limit


@dataclass
class GatherSettings:
    concurrency: int = 8                   # segment downloads in flight across all nodes
    ranks_table_rows: int = 8              # ranks written into status (worst first); all in report.json
    evidence_chars: int = 400              # status strings are bounded; full text in report.json
    max_warnings: int = 10
    listing_max_entries: int = 250_000     # segments one listing may name: the final gather lists a
                                           # whole session, and an agent rolls a file per busy table
                                           # every 2 s (~1.5 a second: about two days)
    size_slack_bytes: int = 1 << 20        # a segment may exceed its listed size by this much (state
                                           # tables are rewritten between listing and download)
    node_max_bytes: int = 32 << 30         # segments one node may send a session (--node-max-bytes)
    session_max_bytes: int = 128 << 30     # segments all nodes may send a session (--session-max-bytes)


@dataclass
class Settings:
    artifacts_dir: Path = Path("/var/lib/ingero/artifacts")  # <dir>/<namespace>/<name>-<uid8>/trace.duckdb
    artifacts_max_bytes: int | None = None  # the oldest merged traces are deleted beyond this
    namespace: str = "ingero-system"       # where the agent token Secret lives
    artifact_service: str | None = None    # NAME:PORT of the operator's Service in `namespace` that
                                           # fronts the artifact server (--artifact-service); written
                                           # into status.artifact.proxy; None: no proxy path written
    agent: AgentSettings = field(default_factory=AgentSettings)
    timing: TimingSettings = field(default_factory=TimingSettings)
    gather: GatherSettings = field(default_factory=GatherSettings)

    @classmethod
    def from_env(cls, env=None) -> "Settings":
        env = os.environ if env is None else env
        s = cls()
        if env.get("INGERO_ARTIFACTS_DIR"):
            s.artifacts_dir = Path(env["INGERO_ARTIFACTS_DIR"])
        s.namespace = env.get("INGERO_NAMESPACE") or env.get("POD_NAMESPACE") or s.namespace
        if env.get("INGERO_AGENT_TLS", "").lower() in ("1", "true", "yes"):
            s.agent.tls = True
        s.agent.ca_file = env.get("INGERO_AGENT_CA_FILE") or s.agent.ca_file
        s.agent.tls_server_name = env.get("INGERO_AGENT_TLS_SERVER_NAME") or s.agent.tls_server_name
        s.agent.client_cert_file = env.get("INGERO_AGENT_CLIENT_CERT") or s.agent.client_cert_file
        s.agent.client_key_file = env.get("INGERO_AGENT_CLIENT_KEY") or s.agent.client_key_file
        s.agent.token_secret = env.get("INGERO_AGENT_TOKEN_SECRET") or s.agent.token_secret
        if env.get("INGERO_ARTIFACTS_MAX_BYTES"):
            s.artifacts_max_bytes = int(env["INGERO_ARTIFACTS_MAX_BYTES"])
        if env.get("INGERO_REFRESH_INTERVAL_S"):
            s.timing.refresh_interval_s = float(env["INGERO_REFRESH_INTERVAL_S"])
        return s

    def describe(self) -> str:
        d = asdict(self)
        d["artifacts_dir"] = str(self.artifacts_dir)
        return ", ".join(f"{k}={v}" for k, v in d.items())


SETTINGS = Settings.from_env()
