"""The few Kubernetes API calls the handlers make beyond what kopf does for them.

Credentials come from kopf's own login functions (in-cluster service account,
else the kubeconfig), so the operator needs no Kubernetes client library and
behaves the same against the embedded API server and a real cluster.
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl

import aiohttp
import kopf

from ingero.http_client import describe, new_session, tls_context
from ingero_operator.settings import GROUP, PLURAL, VERSION

TIMEOUT_S = 30.0     # one API call

class KubeError(Exception):
    """The API server refused a call (its HTTP status), or did not answer (status 0)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if not info.server.startswith("https"):
        return False
    ca_data = info.ca_data.decode() if isinstance(info.ca_data, bytes) else info.ca_data
    return tls_context(ca_file=info.ca_path, ca_data=None if info.ca_path else ca_data,
                       cert_file=info.certificate_path, key_file=info.private_key_path,
                       cert_data=info.certificate_data, key_data=info.private_key_data, insecure=bool(info.insecure))


def login(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    """In-cluster service account first, then $KUBECONFIG / ~/.kube/config."""
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise kopf.PermanentError("no Kubernetes credentials: no service account and no kubeconfig")
    return info


class Kube:
    def __init__(self, info: kopf.ConnectionInfo):
        self.base = info.server.rstrip("/")
        self.headers = dict(info.as_http_headers())
        self.ssl = _ssl_context(info)
        self._session: aiohttp.ClientSession | None = None

    async def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = new_session(self.headers, timeout_s=TIMEOUT_S)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _call(self, method: str, path: str, **kw) -> dict:
        http = await self._http()
        try:
            async with http.request(method, self.base + path, ssl=self.ssl, **kw) as resp:
                try:
                    doc = await resp.json(content_type=None)
                except ValueError:
                    doc = {"message": (await resp.text())[:200]}
                if resp.status >= 400:
                    raise KubeError(resp.status, (doc or {}).get("message") or resp.reason or "error")
                return doc
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise KubeError(0, f"API server {describe(e, self.base, TIMEOUT_S)}") from e

    async def list_pods(self, namespace: str | None, labels: dict) -> list[dict]:
        """Pods matching every label (the selector is also checked here: some API
        emulators ignore labelSelector)."""
        sel = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        path = f"/api/v1/namespaces/{namespace}/pods" if namespace else "/api/v1/pods"
        doc = await self._call("GET", path, params={"labelSelector": sel})
        items = doc.get("items") or []
        return [p for p in items
                if all(((p.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in labels.items())]

    async def secret_value(self, namespace: str, name: str, key: str) -> str:
        doc = await self._call("GET", f"/api/v1/namespaces/{namespace}/secrets/{name}")
        if key in (doc.get("stringData") or {}):
            return doc["stringData"][key]
        raw = (doc.get("data") or {}).get(key)
        if raw is None:
            raise KubeError(404, f"secret {namespace}/{name} has no key {key!r}")
        return base64.b64decode(raw).decode().strip()

    async def delete_session(self, namespace: str, name: str, uid: str) -> None:
        """Delete a TraceSession, only the one with this uid (a precondition: a new session
        reusing the name is left alone); already gone is fine."""
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}"
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": uid},
                "propagationPolicy": "Background"}
        try:
            await self._call("DELETE", path, data=json.dumps(body), headers={"Content-Type": "application/json"})
        except KubeError as e:
            if e.status not in (404, 409):
                raise

    async def patch_status(self, namespace: str, name: str, status: dict) -> dict:
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}/status"
        return await self._call("PATCH", path, data=json.dumps({"status": status}),
                                headers={"Content-Type": "application/merge-patch+json"})
