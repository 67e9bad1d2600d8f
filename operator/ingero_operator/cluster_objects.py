"""The Kubernetes objects the demo registers: namespaces, the token Secret, agent and rank Pods.

They look like what a real cluster holds for the same things, so the
operator code that reads them is the code that runs against a real cluster:
agent Pods as the Helm chart's DaemonSet creates them, rank Pods as a Job's
(labels, nodeName, podIPs, containerStatuses with containerd ids).
"""

from __future__ import annotations

import base64
import secrets
import socket

from ingero_operator.settings import AGENT_LABELS

SYSTEM_NS = "ingero-system"
TOKEN_SECRET = "ingero-agent-token"


def identity(component: str) -> str:
    """The service account a component runs as (operator, agent-<node>), as the chart names them."""
    return f"system:serviceaccount:{SYSTEM_NS}:ingero-{component.split('-', 1)[0]}"


def new_token() -> str:
    return secrets.token_hex(32)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def token_secret(token: str) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": TOKEN_SECRET, "namespace": SYSTEM_NS},
            "data": {"token": base64.b64encode(token.encode()).decode()}}


def agent_pod(node: str, port: int, ip: str = "127.0.0.1") -> dict:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"ingero-agent-{node}", "namespace": SYSTEM_NS, "labels": dict(AGENT_LABELS)},
        "spec": {"nodeName": node, "containers": [{"name": "agent", "image": "ingero-agent",
                                                   "ports": [{"name": "api", "containerPort": port}]}]},
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": ip},
    }


def job_name(lab) -> str:
    return f"lab-{lab.run_id}"


def rank_pod(lab, rp) -> dict:
    """A lab rank as a Job's Pod: its uid and container id are those of its cgroup."""
    pod = rp.pod
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": pod.name, "namespace": pod.namespace, "uid": pod.uid,
                     "labels": {"job-name": job_name(lab), "app.kubernetes.io/name": "lab-worker",
                                "ingero.io/rank": str(rp.rank)}},
        "spec": {"nodeName": rp.node.name, "containers": [{"name": "trainer", "image": "ingero-lab-worker"}]},
        "status": {"phase": "Running", "podIP": pod.ips[0] if pod.ips else None,
                   "podIPs": [{"ip": ip} for ip in pod.ips],
                   "containerStatuses": [{"name": "trainer", "ready": True,
                                          "containerID": f"containerd://{pod.container_id}"}]},
    }


OPERATOR_LABELS = {"app.kubernetes.io/name": "ingero", "app.kubernetes.io/component": "operator"}
OPERATOR_SERVICE = "ingero-operator"


def operator_pod(artifact_port: int, ip: str = "127.0.0.1") -> dict:
    """The operator's Pod as the chart's Deployment makes it: its artifact server's port named."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "ingero-operator-0", "namespace": SYSTEM_NS, "labels": dict(OPERATOR_LABELS)},
        "spec": {"containers": [{"name": "operator", "image": "ingero-operator",
                                 "ports": [{"name": "artifacts", "containerPort": artifact_port}]}]},
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]},
    }


def operator_service(port: int = 8082) -> dict:
    """The chart's operator Service: port `artifacts` to the pods' container port of that name."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": OPERATOR_SERVICE, "namespace": SYSTEM_NS, "labels": dict(OPERATOR_LABELS)},
        "spec": {"selector": dict(OPERATOR_LABELS),
                 "ports": [{"name": "artifacts", "port": port, "targetPort": "artifacts", "protocol": "TCP"}]},
    }
