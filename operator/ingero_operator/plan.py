"""From a TraceSession and the cluster's Pods to one plan per node (pure functions).

The agent API takes, per node, the session id and the pods to trace with
their UIDs and container ids (the agent maps those to cgroups itself), the
probe families, an optional NCCL library and thresholds.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from ingero.families import NAMES as PROBES
from ingero.fleet_targets import agent_endpoints  # noqa: F401  (shared with `ingero fleet`)

FINISHED_PHASES = ("Succeeded", "Failed")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
# a label key: an optional DNS-subdomain prefix and "/", then a name in label-value syntax
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                        r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
MAX_LABELS = 64     # the CRD's maxProperties of spec.selector.matchLabels


class SpecError(ValueError):
    """A TraceSession spec the operator cannot run; the message names the field."""


@dataclass
class SessionSpec:
    match_labels: dict
    duration_s: int | None = None
    probes: tuple = PROBES
    slow_collective_ms: float | None = None
    sched_min_us: float | None = None
    rdma_s: float | None = None       # RDMA counters' sampling period; 0: off
    nccl_lib: str | None = None
    retention_h: int | None = None
    ttl_s: int | None = None


# The largest value of each number in a spec; the CRD's schema has the same `maximum`s
# (tests/chart/test_crds.py checks that they agree). Beyond them a value is a mistake, and
# some (durationSeconds 1e12) overflow date arithmetic.
MAXIMUM = {
    "spec.durationSeconds": 30 * 24 * 3600,           # a month of tracing
    "spec.thresholds.slowCollectiveMs": 3_600_000,    # an hour
    "spec.thresholds.schedMinMicros": 60_000_000,     # a minute
    "spec.rdmaSeconds": 3600,                         # an hour between two counter reads
    "spec.artifact.retentionHours": 24 * 366,         # a year
    "spec.ttlSecondsAfterFinished": 366 * 24 * 3600,  # a year
}


def _number(v, where: str, minimum: float, integer: bool = False):
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not float(v).is_integer()):
        raise SpecError(f"{where} must be {'an integer' if integer else 'a number'}, got {v!r}")
    if not minimum <= v <= MAXIMUM[where]:
        raise SpecError(f"{where} must be between {minimum:g} and {MAXIMUM[where]}, got {v!r}")
    return int(v) if integer else float(v)


def parse_spec(spec) -> SessionSpec:
    """Check a spec (the API server's schema does too; this guards other paths in)."""
    if not isinstance(spec, dict):
        raise SpecError("spec is missing")
    sel = spec.get("selector")
    labels = sel.get("matchLabels") if isinstance(sel, dict) else None
    if not isinstance(labels, dict) or not labels:
        raise SpecError("spec.selector.matchLabels is required and needs at least one label")
    if len(labels) > MAX_LABELS:
        raise SpecError(f"spec.selector.matchLabels has {len(labels)} labels; at most {MAX_LABELS}")
    for k, v in labels.items():
        prefix, _, name = k.rpartition("/")
        if not _LABEL_KEY.match(k) or len(prefix) > 253 or len(name) > 63:
            raise SpecError(f"spec.selector.matchLabels: {k!r} is not a valid label key")
        if not isinstance(v, str) or not _LABEL_VALUE.match(v) or len(v) > 63:
            raise SpecError(f"spec.selector.matchLabels.{k}: {v!r} is not a valid label value")
    probes = spec.get("probes")
    if probes is None:
        probes = list(PROBES)
    if not isinstance(probes, list) or not probes:
        raise SpecError("spec.probes must be a non-empty list of nccl, tcp, sched")
    for i, p in enumerate(probes):
        if p not in PROBES:
            raise SpecError(f"spec.probes[{i}]: unsupported value {p!r}; use nccl, tcp or sched")
    th = spec.get("thresholds") or {}
    if not isinstance(th, dict):
        raise SpecError("spec.thresholds must be an object")
    lib = spec.get("ncclLibPath")
    if lib is not None and (not isinstance(lib, str) or not lib.startswith("/") or len(lib) > 4096
                            or any(ord(c) < 0x20 or c == "\x7f" for c in lib)):
        raise SpecError(f"spec.ncclLibPath must be an absolute path without control characters, got {lib!r}")
    art = spec.get("artifact") or {}
    rdma_s = _number(spec.get("rdmaSeconds"), "spec.rdmaSeconds", 0)
    if rdma_s is not None and 0 < rdma_s < 0.1:
        raise SpecError(f"spec.rdmaSeconds must be 0 (off) or at least 0.1, got {rdma_s!r}")
    return SessionSpec(
        match_labels=dict(labels),
        duration_s=_number(spec.get("durationSeconds"), "spec.durationSeconds", 1, integer=True),
        probes=tuple(p for p in PROBES if p in probes),
        slow_collective_ms=_number(th.get("slowCollectiveMs"), "spec.thresholds.slowCollectiveMs", 0),
        sched_min_us=_number(th.get("schedMinMicros"), "spec.thresholds.schedMinMicros", 0),
        rdma_s=rdma_s,
        nccl_lib=lib,
        retention_h=_number(art.get("retentionHours") if isinstance(art, dict) else None,
                            "spec.artifact.retentionHours", 1, integer=True),
        ttl_s=_number(spec.get("ttlSecondsAfterFinished"), "spec.ttlSecondsAfterFinished", 0, integer=True),
    )


def label_selector(labels: dict) -> str:
    """matchLabels as the API's labelSelector query value."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def matches(pod: dict, labels: dict) -> bool:
    have = (pod.get("metadata") or {}).get("labels") or {}
    return all(have.get(k) == v for k, v in labels.items())


def session_id(namespace: str, name: str, uid: str) -> str:
    """Stable, agent-safe id: the same TraceSession always maps to the same id."""
    raw = f"{namespace}.{name}.{(uid or '')[:8]}"
    return re.sub(r"[^A-Za-z0-9_.-]", "-", raw)[:128].strip(".-") or "session"


def pod_finished(pod: dict) -> bool:
    return (pod.get("status") or {}).get("phase") in FINISHED_PHASES


def pod_entry(pod: dict) -> dict:
    """One pod as the agent's pods file wants it."""
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    containers = [{"name": c.get("name") or "", "id": c.get("containerID") or ""}
                  for c in status.get("containerStatuses") or [] if c.get("containerID")]
    ips = [x.get("ip") for x in status.get("podIPs") or [] if isinstance(x, dict)]
    if not ips and status.get("podIP"):
        ips = [status["podIP"]]
    good = []
    for ip in ips:
        try:
            ipaddress.ip_address(ip)
            good.append(ip)
        except (TypeError, ValueError):
            pass
    return {"name": meta.get("name"), "namespace": meta.get("namespace") or "default",
            "uid": meta.get("uid"), "node": spec.get("nodeName"), "containers": containers, "ips": good}


def group_by_node(pods: list[dict]) -> tuple[dict[str, list[dict]], list[str]]:
    """Running-or-pending pods by node, and the names of pods not yet scheduled."""
    by_node: dict[str, list[dict]] = {}
    unscheduled = []
    for pod in pods:
        entry = pod_entry(pod)
        if not entry["uid"] or not entry["name"]:
            continue
        if not entry["node"]:
            unscheduled.append(entry["name"])
            continue
        by_node.setdefault(entry["node"], []).append(entry)
    for entries in by_node.values():
        entries.sort(key=lambda e: e["name"])
    return by_node, unscheduled


def node_plan(sid: str, pods: list[dict], spec: SessionSpec, duration_s: float | None = None) -> dict:
    """The POST /v1/sessions body for one node."""
    body = {"session_id": sid, "pods": pods, "probes": list(spec.probes)}
    if spec.nccl_lib:
        body["nccl_lib"] = spec.nccl_lib
    if spec.sched_min_us is not None:
        body["sched_min_us"] = spec.sched_min_us
    if spec.rdma_s is not None:
        body["rdma_s"] = spec.rdma_s
    if duration_s:
        body["duration_s"] = round(duration_s, 3)
    return body
