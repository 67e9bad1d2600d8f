"""The embedded API server's service proxy, as kube-apiserver serves it.

    /api/v1/namespaces/<ns>/services/<id>/proxy[/<path>]     <id>: name, name:port or scheme:name:port

The port is the Service port of that name (or number; without one, the Service's
unnamed port). The backend is an address of the Service's Endpoints object on
that port, else (no endpoints controller runs here) a Running pod its selector
matches, on the port's targetPort (a number, or a container port's name). The
request goes there with the caller's headers minus Authorization (the API server
consumes the credentials and does not pass the caller's identity on), and the
response comes back as it streams, status and body untouched. An `https:`
backend is not verified, as kube-apiserver does not verify it either (it dials
pod IPs). Errors are those of the real API server: 404 for a missing Service,
503 ServiceUnavailable for no endpoint or an unreachable one.
"""

from __future__ import annotations

import re

import aiohttp
import kmock
import yarl
from aiohttp import web

PROXY = re.compile(r"/api/v1/namespaces/([^/]+)/services/([^/]+)/proxy(/.*)?")
SERVICES, ENDPOINTS, PODS = (kmock.resource("", "v1", p) for p in ("services", "endpoints", "pods"))
PASSED_BACK = ("Content-Type", "Content-Length", "Content-Disposition", "Content-Encoding", "Last-Modified",
               "ETag", "Accept-Ranges", "Content-Range")
NOT_FORWARDED = {"authorization", "host", "connection", "keep-alive", "transfer-encoding", "upgrade",
                 "proxy-authorization", "te", "trailer", "content-length"}


def split_id(ident: str) -> tuple[str, str, str]:
    """(scheme, name, port) of a proxy id, as utilnet.SplitSchemeNamePort reads it."""
    parts = ident.split(":")
    if len(parts) == 1:
        return "http", parts[0], ""
    if len(parts) == 2:
        return "http", parts[0], parts[1]
    if len(parts) == 3 and parts[0] in ("http", "https"):
        return parts[0], parts[1], parts[2]
    raise kmock.KubernetesError(status=400, reason="BadRequest", message=f'invalid service request "{ident}"')


def _unavailable(message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=503, reason="ServiceUnavailable", message=message)


def _labels_match(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def backend(objects: dict, namespace: str, ident: str) -> tuple[str, str, int]:
    """(scheme, address, port) the request for service `ident` goes to."""
    scheme, name, port = split_id(ident)
    svc = objects.get((SERVICES, namespace, name))
    if svc is None:
        raise kmock.KubernetesError(status=404, reason="NotFound", message=f'services "{name}" not found')
    ports = (svc.get("spec") or {}).get("ports") or []
    if port.isdigit():
        found = next((p for p in ports if int(p.get("port", -1)) == int(port)), None)
        if found is None:
            raise _unavailable(f'no service port {port} found for service "{name}"')
        port = found.get("name") or ""
    sp = next((p for p in ports if (p.get("name") or "") == port), None)
    if sp is None:
        raise _unavailable(f'no endpoints available for service "{ident}"')
    eps = objects.get((ENDPOINTS, namespace, name))
    if eps is not None:
        for subset in eps.get("subsets") or []:
            ep = next((p for p in subset.get("ports") or [] if (p.get("name") or "") == port), None)
            addrs = subset.get("addresses") or []
            if ep is not None and addrs:
                return scheme, addrs[0]["ip"], int(ep["port"])
        raise _unavailable(f'no endpoints available for service "{ident}"')
    target = sp.get("targetPort", sp.get("port"))
    selector = (svc.get("spec") or {}).get("selector") or {}
    for (res, ns, _), pod in sorted(objects.items(), key=lambda kv: str(kv[0][2])):
        if res != PODS or ns != namespace:
            continue
        status, meta = pod.get("status") or {}, pod.get("metadata") or {}
        if status.get("phase") != "Running" or not status.get("podIP") \
                or not _labels_match(selector, meta.get("labels") or {}):
            continue
        if isinstance(target, int) or str(target).isdigit():
            return scheme, status["podIP"], int(target)
        for c in (pod.get("spec") or {}).get("containers") or []:
            for cp in c.get("ports") or []:
                if cp.get("name") == target:
                    return scheme, status["podIP"], int(cp["containerPort"])
    raise _unavailable(f'no endpoints available for service "{ident}"')


async def forward(emulator, request, namespace: str, ident: str, rest: str | None) -> web.StreamResponse:
    async with emulator._lock:
        objects = {key: dict(o.raw) for key, o in emulator.objects.items() if not o.deleted
                   and key[0] in (SERVICES, ENDPOINTS, PODS)}
    scheme, addr, port = backend(objects, namespace, ident)
    host = f"[{addr}]" if ":" in addr else addr
    raw = request._raw_request
    query = raw.raw_path.partition("?")[2]               # as the client sent it, not re-encoded
    url = yarl.URL(f"{scheme}://{host}:{port}{rest or '/'}" + (f"?{query}" if query else ""), encoded=True)
    headers = {k: v for k, v in request.headers.items() if k.lower() not in NOT_FORWARDED}
    try:
        async with aiohttp.ClientSession(auto_decompress=False) as http, \
                http.request(request.method, url, headers=headers, data=await raw.read() or None,
                             allow_redirects=False, ssl=False) as up:
            resp = web.StreamResponse(status=up.status, headers={k: up.headers[k] for k in PASSED_BACK
                                                                 if k in up.headers})
            await resp.prepare(raw)
            async for chunk in up.content.iter_chunked(1 << 16):
                await resp.write(chunk)
            await resp.write_eof()
            return resp
    except aiohttp.ClientConnectorError as e:
        raise _unavailable(f"error trying to reach service: dial tcp {host}:{port}: {e.os_error}") from None
