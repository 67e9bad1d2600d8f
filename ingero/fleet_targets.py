"""Which agents `ingero fleet` asks: explicit ``name=host:port`` entries, or the cluster's agent Pods.

Agents are found as the operator finds them: Pods labelled
``app.kubernetes.io/name=ingero,app.kubernetes.io/component=agent`` in the
agent namespace, one per node, reached at ``status.podIP`` and the container
port named ``api``; the bearer token is the Secret ``ingero-agent-token``
(key ``token``) there. ``--selector`` narrows the nodes to those running the
job's pods. The Kubernetes API is read with ``kubectl`` (so every
authentication a kubeconfig can hold works as it does for kubectl).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from urllib.parse import quote

from ingero.errors import IngeroError
from ingero.kubectl import Kubectl as BaseKubectl

AGENT_SELECTOR = "app.kubernetes.io/name=ingero,app.kubernetes.io/component=agent"
TOKEN_SECRET, TOKEN_KEY = "ingero-agent-token", "token"


@dataclass(frozen=True)
class Target:
    node: str
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_entry(text: str) -> tuple[str, Target | None]:
    """``name=host:port`` -> (name, Target); a bare ``name`` -> (name, None)."""
    name, sep, addr = text.strip().partition("=")
    if not name:
        raise IngeroError(f"--nodes entry {text!r} has no node name: use NAME=HOST:PORT or NAME")
    if not sep:
        return name, None
    host, colon, port = addr.rpartition(":")
    host = host.strip("[]")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise IngeroError(f"--nodes entry {text!r}: {addr!r} is not HOST:PORT (e.g. 10.0.0.7:9464)")
    return name, Target(name, host, int(port))


def parse_nodes(text: str | None) -> tuple[list[Target], list[str]]:
    """``a=h:p,b,...`` -> (explicit targets, names to look up), duplicates refused."""
    targets, names, seen = [], [], set()
    for entry in (text or "").split(","):
        if not entry.strip():
            continue
        name, target = parse_entry(entry)
        if name in seen:
            raise IngeroError(f"--nodes names node {name} twice; give each node once")
        seen.add(name)
        (targets.append(target) if target else names.append(name))
    return targets, names


def agent_endpoints(agent_pods: list[dict], port_name: str = "api") -> dict[str, tuple[str, int]]:
    """node -> (address, port) of the agent Pod running there (status.podIP + port `port_name`)."""
    out = {}
    for pod in agent_pods:
        spec, status = pod.get("spec") or {}, pod.get("status") or {}
        node, ip = spec.get("nodeName"), status.get("podIP")
        if not node or not ip or status.get("phase") not in (None, "Running"):
            continue
        for c in spec.get("containers") or []:
            for p in c.get("ports") or []:
                if p.get("name") == port_name and p.get("containerPort"):
                    out[node] = (ip, int(p["containerPort"]))
    return out


class Kubectl(BaseKubectl):
    """The few reads `ingero fleet` makes, through kubectl."""

    def __init__(self, kubeconfig: str | None = None, context: str | None = None, timeout_s: float = 20.0):
        super().__init__(kubeconfig, context, timeout_s=timeout_s,
                         missing_fix="install it, or name every agent as --nodes NAME=HOST:PORT with --token-file")

    def pods(self, namespace: str | None, selector: str) -> list[dict]:
        """Pods matching a label selector (equality terms are checked here too)."""
        base = f"/api/v1/namespaces/{quote(namespace)}/pods" if namespace else "/api/v1/pods"
        items = self.get(f"{base}?labelSelector={quote(selector)}").get("items") or []
        terms = [t.split("=", 1) for t in selector.split(",") if "=" in t and "!" not in t]
        return [p for p in items if all(((p.get("metadata") or {}).get("labels") or {}).get(k.strip()) == v.strip()
                                         for k, v in terms)]

    def agent_targets(self, namespace: str) -> dict[str, Target]:
        return {node: Target(node, host, port)
                for node, (host, port) in agent_endpoints(self.pods(namespace, AGENT_SELECTOR)).items()}

    def job_nodes(self, namespace: str | None, selector: str) -> set[str]:
        return {n for p in self.pods(namespace, selector) if (n := (p.get("spec") or {}).get("nodeName")) is not None}

    def token(self, namespace: str) -> str:
        doc = self.get(f"/api/v1/namespaces/{quote(namespace)}/secrets/{TOKEN_SECRET}")
        raw = (doc.get("data") or {}).get(TOKEN_KEY)
        if not raw:
            raise IngeroError(f"secret {namespace}/{TOKEN_SECRET} has no key {TOKEN_KEY!r}; "
                              "pass --token-file")
        return base64.b64decode(raw).decode().strip()


def resolve(nodes: str | None, selector: str | None, namespace: str | None, agent_namespace: str,
            kube: Kubectl) -> tuple[list[Target], list[str]]:
    """The agents to ask, and warnings for nodes that have none."""
    explicit, names = parse_nodes(nodes)
    if explicit and not names and not selector:
        return explicit, []
    found = kube.agent_targets(agent_namespace)
    warnings = []
    if selector:
        wanted = kube.job_nodes(namespace, selector)
        if not wanted:
            raise IngeroError(f"no pod matches --selector {selector} in "
                              f"{'namespace ' + namespace if namespace else 'any namespace'}")
        names = sorted(set(names) | wanted) if names else sorted(wanted)
    elif not names and not explicit:
        names = sorted(found)
    have = {t.node for t in explicit}
    out = list(explicit)
    for n in names:
        if n in have:
            continue
        if n in found:
            out.append(found[n])
        else:
            warnings.append(f"node {n}: no ingero agent Pod found there (namespace {agent_namespace}); left out")
    if not out:
        raise IngeroError(f"no ingero agent found (agent Pods labelled {AGENT_SELECTOR} in namespace "
                          f"{agent_namespace}); pass --agent-namespace or --nodes NAME=HOST:PORT")
    return sorted(out, key=lambda t: t.node), warnings
