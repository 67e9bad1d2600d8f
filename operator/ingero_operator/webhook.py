"""Mutating admission webhook: Ingero's NCCL profiler plugin into the training pods that opt in.

    ingero operator run --webhook-port 9443 --webhook-cert tls.crt --webhook-key tls.key \\
        --profiler-plugin-dir /var/lib/ingero/plugin

Served by an Ingero server (``WebhookServer``, kopf's admission server protocol) inside the
operator process, on its event loop and bounded like every Ingero port (``ingero.serving``):
HTTPS with the given certificate (re-read when the files change), at most MAX_CONNECTIONS
connections, a review body of at most MAX_REVIEW_BYTES arriving within the idle timeout,
REVIEWS_AT_ONCE parsed and answered at once. kopf does not manage the
``MutatingWebhookConfiguration``: the chart ships it (templates/webhook.yaml), so the
operator needs no RBAC on admissionregistration.k8s.io.

Two webhooks of that configuration call two handlers (the URL path names the
handler, as kopf routes ``/<handler id>``):

* ``/profiler-pod``: pods labelled ``ingero.io/profiler: enabled`` (objectSelector);
* ``/profiler-namespace``: pods in namespaces labelled ``ingero.io/profiler: enabled``
  (namespaceSelector) whose own label is not ``enabled`` (the first hook's) nor
  ``disabled`` (a pod's opt-out).

Each handler checks the pod's label again; an AdmissionReview carries no namespace
labels, so the namespace opt-in is the API server's namespaceSelector alone (reading
Namespaces here would need cluster-wide RBAC for one fact the API server already
checked). Every container gets ``NCCL_PROFILER_PLUGIN=<dir>/libnccl-profiler-ingero.so``
and a read-only mount of the host folder ``<dir>`` (volume ``ingero-profiler-plugin``,
``hostPath`` type ``DirectoryOrCreate``: a node without the agent does not stop the
pod; NCCL then logs that it found no plugin and runs on without it). A pod that
already has the volume, sets ``NCCL_PROFILER_PLUGIN`` itself, or mounts something at
``<dir>`` is left as it is. A handler never denies a pod: any error is logged and the
pod is admitted unchanged (and the configuration's failurePolicy is Ignore). Only
CREATE reviews are injected. A request that is no AdmissionReview kopf can serve
(not JSON, nested too deeply, a missing or null ``request``, too large, too slow, ...) is
answered with a 4xx AdmissionReview whose ``response.status`` names the problem in one
line, before kopf sees it.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import logging
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from aiohttp import web

from ingero import serving
from ingero.errors import IngeroError

LABEL = "ingero.io/profiler"
ENABLED, DISABLED = "enabled", "disabled"
POD_HOOK, NAMESPACE_HOOK = "profiler-pod", "profiler-namespace"
VOLUME = "ingero-profiler-plugin"
ENV = "NCCL_PROFILER_PLUGIN"
LIB_NAME = "libnccl-profiler-ingero.so"   # ingero_agent.profiler_build.LIB_NAME (the agent is not imported)
DEFAULT_PLUGIN_DIR = "/var/lib/ingero/plugin"
MAX_REVIEW_BYTES = 2 << 20   # a CREATE review carries one pod, at most etcd's 1.5 MiB object
MAX_CONNECTIONS = 64         # the API server keeps a few; 64 x MAX_REVIEW_BYTES bounds the bodies
REVIEWS_AT_ONCE = 4          # parsed and answered at once, so parsed bodies stay a few times that
MAX_DEPTH = 64               # levels of nesting; a pod has about 10, kopf's recursion allows some 300
CERT_CHECK_S = 60.0          # how often the certificate files are read for a renewal

log = logging.getLogger("ingero.operator.webhook")


@dataclass
class WebhookConfig:
    address: str
    cert: Path
    key: Path
    plugin_dir: str = DEFAULT_PLUGIN_DIR

    @property
    def plugin(self) -> str:
        return f"{self.plugin_dir}/{LIB_NAME}"


def check_config(cfg: WebhookConfig) -> WebhookConfig:
    """Fail now, in one line naming the flag, on what would fail later inside kopf."""
    d = PurePosixPath(cfg.plugin_dir)
    if not d.is_absolute() or d == PurePosixPath("/") or ".." in d.parts or any(c.isspace() for c in cfg.plugin_dir):
        raise IngeroError(f"--profiler-plugin-dir {cfg.plugin_dir!r} must be an absolute folder below / "
                          "(the agent's profilerPlugin.hostPath)")
    cfg.plugin_dir = str(d)
    for flag, path in (("--webhook-cert", cfg.cert), ("--webhook-key", cfg.key)):
        if not Path(path).is_file():
            raise IngeroError(f"{flag} {path} does not exist; pass the webhook's PEM file "
                              "(the chart mounts its <fullname>-webhook-tls Secret)")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cfg.cert, cfg.key)
    except (ssl.SSLError, OSError) as e:
        raise IngeroError(f"--webhook-cert {cfg.cert} / --webhook-key {cfg.key}: cannot load them "
                          f"({getattr(e, 'reason', None) or e}); pass a PEM certificate and its own key") from None
    return cfg


def skip_reason(pod: dict, plugin_dir: str) -> str | None:
    """Why the plugin is not injected into `pod` (None: inject it)."""
    spec = pod.get("spec") or {}
    containers = spec.get("containers") or []
    if not containers:
        return "it has no containers"
    if any(v.get("name") == VOLUME for v in spec.get("volumes") or []):
        return f"it already has the volume {VOLUME}"
    target = PurePosixPath(plugin_dir)
    for c in containers:
        if any(e.get("name") == ENV for e in c.get("env") or []):
            return f"container {c.get('name')} sets {ENV} itself"
        for m in c.get("volumeMounts") or []:
            if PurePosixPath(m.get("mountPath") or "/") == target:
                return f"container {c.get('name')} already mounts something at {plugin_dir}"
    return None


def inject(pod: dict, plugin_dir: str) -> bool:
    """Add the env variable, the volume and the read-only mounts to `pod` in place; False
    (and nothing changed) when skip_reason() names a reason."""
    if skip_reason(pod, plugin_dir) is not None:
        return False
    spec = pod["spec"]
    spec.setdefault("volumes", []).append(
        {"name": VOLUME, "hostPath": {"path": plugin_dir, "type": "DirectoryOrCreate"}})
    for c in spec["containers"]:
        c.setdefault("env", []).append({"name": ENV, "value": f"{plugin_dir}/{LIB_NAME}"})
        c.setdefault("volumeMounts", []).append({"name": VOLUME, "mountPath": plugin_dir, "readOnly": True})
    return True


OPERATIONS = ("CREATE", "UPDATE", "DELETE", "CONNECT")


def review_problem(doc) -> str | None:
    """What makes `doc` no AdmissionReview request that kopf can serve, in words (None: it is one)."""
    if not isinstance(doc, dict):
        return "an AdmissionReview must be a JSON object"
    req = doc.get("request")
    if not isinstance(req, dict):
        return "the AdmissionReview has no request object"
    if not isinstance(req.get("uid"), str) or not req["uid"]:
        return "request.uid must be a non-empty string"
    if req.get("operation") not in OPERATIONS:
        return f"request.operation must be one of {', '.join(OPERATIONS)}"
    res = req.get("resource")
    if not isinstance(res, dict) or not all(isinstance(res.get(k), str) for k in ("group", "version", "resource")):
        return "request.resource must be {group, version, resource} strings"
    if (res["group"], res["version"], res["resource"]) != ("", "v1", "pods"):
        return "request.resource must be pods (group \"\", version v1): these hooks admit pods only"
    if not isinstance(req.get("userInfo"), dict):
        return "request.userInfo must be an object"
    objs = [req.get(k) for k in ("object", "oldObject")]
    if not any(isinstance(o, dict) for o in objs) or any(o is not None and not isinstance(o, dict) for o in objs):
        return "request.object (or oldObject) must be an object"
    if any(isinstance(o, dict) and not isinstance(o.get("metadata") or {}, dict) for o in objs):
        return "request.object.metadata must be an object"
    return None


def _pod_name(pod) -> str:
    try:
        meta = pod.get("metadata") or {}
        return f"{meta.get('namespace') or '?'}/{meta.get('name') or (meta.get('generateName') or '?') + '*'}"
    except Exception:
        return "?"


def mutate(body, patch, hook: str, plugin_dir: str, operation: str = "CREATE") -> str:
    """One admission of a pod through `hook`; what was done, in words (also logged)."""
    try:
        pod = copy.deepcopy(dict(body))
        label = ((pod.get("metadata") or {}).get("labels") or {}).get(LABEL)
        if operation != "CREATE":
            what = f"not injected: operation {operation}, only CREATE is injected"
        elif hook == POD_HOOK and label != ENABLED:
            what = f"not injected: its label {LABEL} is {label!r}, not {ENABLED!r}"
        elif hook == NAMESPACE_HOOK and label == DISABLED:
            what = f"not injected: the pod opts out ({LABEL}={DISABLED})"
        elif (reason := skip_reason(pod, plugin_dir)) is not None:
            what = f"not injected: {reason}"
        else:
            patch.fns.append(lambda raw: inject(raw, plugin_dir))
            what = f"injected into {len(pod['spec']['containers'])} container(s)"
    except Exception as e:   # never deny a pod for our sake: admit it unchanged
        patch.clear()
        what = f"not injected: {type(e).__name__}: {e}"
        log.warning("profiler plugin for pod %s (%s): %s", _pod_name(body), hook, what)
        return what
    log.info("profiler plugin for pod %s (%s): %s", _pod_name(pod), hook, what)
    return what


def refusal(status: int, message: str, uid: str = "") -> web.Response:
    """An AdmissionReview answering a request it could not review: `status` and the one-line
    `message` both as the HTTP status and in ``response.status`` (the API server applies the
    failure policy to any HTTP error)."""
    return web.json_response({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                              "response": {"uid": uid, "allowed": False,
                                           "status": {"code": status, "message": message}}}, status=status)


def _depth(doc) -> int:
    """How deeply `doc`'s lists and objects nest (counted without recursion)."""
    deepest, level = 0, [(doc, 1)]
    while level:
        node, d = level.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, d)
            level.extend((v, d + 1) for v in (node.values() if isinstance(node, dict) else node))
    return deepest


def _loads(body: bytes):
    """(the document, None) or (None, why it is no AdmissionReview)."""
    too_deep = f"body nests too deeply to be an AdmissionReview (more than {MAX_DEPTH} levels)"
    try:
        doc = json.loads(body)
    except RecursionError:
        return None, too_deep
    except ValueError:
        return None, "body is not JSON: send an AdmissionReview"
    if _depth(doc) > MAX_DEPTH:        # kopf copies and compares the object recursively
        return None, too_deep
    return doc, review_problem(doc)


class WebhookServer:
    """kopf's admission server protocol (``settings.admission.server``): called with kopf's
    `fn`, it serves the hooks on `sock` until cancelled and yields the client config once.
    Every review is checked (review_problem) before `fn` sees it."""

    def __init__(self, cfg: WebhookConfig, sock: socket.socket, bounds: serving.Bounds = serving.Bounds(
            max_connections=MAX_CONNECTIONS), cert_check_s: float = CERT_CHECK_S):
        self.cfg, self.sock, self.cert_check_s = cfg, sock, cert_check_s
        self.slots = serving.Slots(bounds)

    def _cert_digest(self) -> bytes:
        return hashlib.sha256(Path(self.cfg.cert).read_bytes() + Path(self.cfg.key).read_bytes()).digest()

    async def __call__(self, fn):
        import kopf

        idle = self.slots.bounds.idle_timeout_s
        reviews = asyncio.Semaphore(REVIEWS_AT_ONCE)

        async def review(request: web.Request) -> web.Response:
            try:
                body = await serving.read_body(request, MAX_REVIEW_BYTES, idle)
            except serving.BodyRefused as e:
                log.warning("admission request to %s refused: %s", request.path, e)
                return refusal(e.status, str(e))
            async with reviews:
                doc, problem = _loads(body)
                if problem is not None:
                    log.warning("admission request to %s refused: %s", request.path, problem)
                    req = doc.get("request") if isinstance(doc, dict) else None
                    uid = req.get("uid") if isinstance(req, dict) and isinstance(req.get("uid"), str) else ""
                    return refusal(400, problem, uid)
                peer = request.transport.get_extra_info("peercert") if request.transport else None
                return web.json_response(await fn(doc, webhook=request.match_info.route.name,
                                                  headers=dict(request.headers), sslpeer=peer))

        async def elsewhere(request: web.Request) -> web.Response:
            return refusal(404, f"no admission webhook at {request.method} {request.path}: "
                                f"POST an AdmissionReview to /{POD_HOOK} or /{NAMESPACE_HOOK}")

        app = web.Application(client_max_size=MAX_REVIEW_BYTES)
        for hook in (POD_HOOK, NAMESPACE_HOOK):
            app.router.add_post(f"/{hook}", review, name=hook)
        app.router.add_route("*", "/{tail:.*}", elsewhere)
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(self.cfg.cert, self.cfg.key)
        digest = self._cert_digest()
        runner, server = await serving.start(app, self.sock, self.slots, tls, refusal, access_log=None)
        try:
            port = self.sock.getsockname()[1]
            yield kopf.WebhookClientConfig(url=f"https://{self.cfg.address}:{port}")
            while True:                     # new handshakes take a renewed certificate
                await asyncio.sleep(self.cert_check_s)
                try:
                    if (now := self._cert_digest()) != digest:
                        tls.load_cert_chain(self.cfg.cert, self.cfg.key)
                        digest = now
                        log.info("webhook certificate %s re-read", self.cfg.cert)
                except (OSError, ssl.SSLError) as e:      # half-written: the next check reads it again
                    log.warning("webhook certificate %s not re-read: %s", self.cfg.cert, e)
        finally:
            server.close()
            await runner.cleanup()


def register(cfg: WebhookConfig, sock: socket.socket) -> None:
    """Register the admission handlers, and a WebhookServer on the bound `sock`, with kopf's
    default registry."""
    import kopf

    @kopf.on.startup(id="profiler-webhook-server")
    async def webhook_server(settings: kopf.OperatorSettings, **_):
        settings.admission.server = WebhookServer(cfg, sock)
        settings.admission.managed = None   # the chart's MutatingWebhookConfiguration
        log.info("profiler plugin webhook on https://%s:%d/{%s,%s}, plugin %s", cfg.address,
                 sock.getsockname()[1], POD_HOOK, NAMESPACE_HOOK, cfg.plugin)

    for hook in (POD_HOOK, NAMESPACE_HOOK):
        def handler(body, patch, operation, _hook=hook, **_):
            mutate(body, patch, _hook, cfg.plugin_dir, operation)

        kopf.on.mutate(group="", version="v1", plural="pods", id=hook, operations=["CREATE"],
                       ignore_failures=True)(handler)
