"""Mutating admission webhook: Ingero's NCCL profiler plugin into the training pods that opt in.

    ingero operator run --webhook-port 9443 --webhook-cert tls.crt --webhook-key tls.key \\
        --profiler-plugin-dir /var/lib/ingero/plugin

Served by kopf's own ``WebhookServer`` (HTTPS with the given certificate, re-read
when the files change) inside the operator process; kopf does not manage the
``MutatingWebhookConfiguration``: the chart ships it (templates/webhook.yaml), so
the operator needs no RBAC on admissionregistration.k8s.io.

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
(not JSON, nested too deeply, a missing or null ``request``, ...) is answered 400
with the problem in one line, before kopf sees it.
"""

from __future__ import annotations

import copy
import json
import logging
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ingero.errors import IngeroError

LABEL = "ingero.io/profiler"
ENABLED, DISABLED = "enabled", "disabled"
POD_HOOK, NAMESPACE_HOOK = "profiler-pod", "profiler-namespace"
VOLUME = "ingero-profiler-plugin"
ENV = "NCCL_PROFILER_PLUGIN"
LIB_NAME = "libnccl-profiler-ingero.so"   # ingero_agent.profiler_build.LIB_NAME (the agent is not imported)
DEFAULT_PLUGIN_DIR = "/var/lib/ingero/plugin"

log = logging.getLogger("ingero.operator.webhook")


@dataclass
class WebhookConfig:
    port: int
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
    if not 1 <= cfg.port <= 65535:
        raise IngeroError(f"--webhook-port {cfg.port} is out of range: use 1 to 65535")
    for flag, path in (("--webhook-cert", cfg.cert), ("--webhook-key", cfg.key)):
        if not Path(path).is_file():
            raise IngeroError(f"{flag} {path} does not exist; pass the webhook's PEM file "
                              "(the chart mounts its <fullname>-webhook-tls Secret)")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cfg.cert, cfg.key)
    except (ssl.SSLError, OSError) as e:
        raise IngeroError(f"--webhook-cert {cfg.cert} / --webhook-key {cfg.key}: cannot load them "
                          f"({getattr(e, 'reason', None) or e}); pass a PEM certificate and its own key") from None
    # kopf's server binds with SO_REUSEPORT, which would share a port taken by another
    # server doing the same: a plain bind tells that the port is free.
    family = socket.AF_INET6 if ":" in cfg.address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((cfg.address, cfg.port))
    except OSError as e:
        raise IngeroError(f"--webhook-port {cfg.port} on {cfg.address}: {e.strerror or e}; pick a free port") \
            from None
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
    if not isinstance(req.get("userInfo"), dict):
        return "request.userInfo must be an object"
    objs = [req.get(k) for k in ("object", "oldObject")]
    if not any(isinstance(o, dict) for o in objs) or any(o is not None and not isinstance(o, dict) for o in objs):
        return "request.object (or oldObject) must be an object"
    if any(isinstance(o, dict) and not isinstance(o.get("metadata") or {}, dict) for o in objs):
        return "request.object.metadata must be an object"
    return None


async def serve_checked(serve, fn, request):
    """kopf's `serve`(fn, request) for an AdmissionReview; anything else a 400 naming the problem
    (kopf would answer it 500 and log a traceback)."""
    from aiohttp import web

    try:
        problem = review_problem(json.loads(await request.text()))
    except RecursionError:
        problem = "body nests too deeply to be an AdmissionReview"
    except ValueError:
        problem = "body is not JSON: send an AdmissionReview"
    if problem is None:
        return await serve(fn, request)
    log.warning("admission request to %s refused: %s", request.path, problem)
    return web.Response(status=400, text=problem)


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


def register(cfg: WebhookConfig) -> None:
    """Register the admission handlers and kopf's webhook server with kopf's default registry."""
    import kopf

    class CheckedServer(kopf.WebhookServer):
        @staticmethod
        async def _serve(fn, request):
            return await serve_checked(kopf.WebhookServer._serve, fn, request)

    @kopf.on.startup(id="profiler-webhook-server")
    async def webhook_server(settings: kopf.OperatorSettings, **_):
        settings.admission.server = CheckedServer(addr=cfg.address, port=cfg.port, certfile=str(cfg.cert),
                                                  pkeyfile=str(cfg.key))
        settings.admission.managed = None   # the chart's MutatingWebhookConfiguration
        log.info("profiler plugin webhook on https://%s:%d/{%s,%s}, plugin %s", cfg.address, cfg.port,
                 POD_HOOK, NAMESPACE_HOOK, cfg.plugin)

    for hook in (POD_HOOK, NAMESPACE_HOOK):
        def handler(body, patch, operation, _hook=hook, **_):
            mutate(body, patch, _hook, cfg.plugin_dir, operation)

        kopf.on.mutate(group="", version="v1", plural="pods", id=hook, operations=["CREATE"],
                       ignore_failures=True)(handler)
