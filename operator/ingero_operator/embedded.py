"""An in-process Kubernetes API for the whole flow on one machine (kmock's KubernetesEmulator).

The emulator stores objects and serves discovery, CRUD and watch. This module
adds what the operator and kubectl rely on from a real API server:

* metadata: uid, creationTimestamp, generation (bumped on spec changes) and
  resourceVersion (JSON-patch ``test`` ops against it work, as kopf uses them);
* the status subresource: ``/status`` writes change only status, other
  writes never change status;
* admission for TraceSessions: defaults from the CRD's openAPIV3Schema, then
  validation with ``jsonschema``; a bad object gets ``422 Invalid`` naming
  the field, as the real API server answers;
* list kinds and server-side Table output with the CRD's printer columns
  (each with its priority: kubectl shows priority 1 only with ``-o wide``),
  so plain ``kubectl get tracesessions`` shows Phase, Straggler, Cause, ...;
* ``metadata.generateName`` (kopf posts its Events with it) and
  ``fieldSelector`` on lists and watches (``metadata.name``, as ``kubectl
  wait`` asks; ``involvedObject.*``, as ``kubectl describe`` asks for Events);
* watch streams typed ``application/json`` (kubectl's decoder refuses others);
* status writes validated against the CRD's schema too, as the real API
  server does;
* the core group's discovery document says ``groupVersion: v1``; a missing object is
  ``404 NotFound``, a second one of a name ``409 AlreadyExists``, in the API server's
  words (``pods "x" not found``);
* the service proxy, ``/api/v1/namespaces/<ns>/services/[https:]<name>[:<port>]/proxy/<path>``
  (embedded_proxy.py): the Service's port, then its Endpoints object or, when it has
  none (no endpoints controller runs here), the Running pods its selector matches,
  and the request forwarded with the response streamed back.
"""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import json
import threading
import uuid
from pathlib import Path

import attrs
import jsonpatch
import jsonschema
import kmock
import yaml
from kmock._internal import rendering
from kmock._internal.k8s import KubernetesObjectConflictError   # not exported by kmock

from ingero.errors import IngeroError
from ingero.http_client import request_sync
from ingero_operator import embedded_proxy, tables

# Namespaces are discovered (kopf waits for them) but hold no objects: the emulator reads
# /api/v1/namespaces/<x> as a namespace prefix, so a cluster-wide operator is used.
CORE = {"pods": "Pod", "secrets": "Secret", "events": "Event", "configmaps": "ConfigMap",
        "namespaces": "Namespace", "services": "Service", "endpoints": "Endpoints"}
CRD_RES = "apiextensions.k8s.io/v1/customresourcedefinitions"


def load_crd(path: Path) -> dict:
    return yaml.safe_load(Path(path).read_text())


def merge_diff(old, new):
    """A JSON merge patch turning `old` into `new` (None deletes a key; lists are replaced)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    out = {k: None for k in old if k not in new}
    for k, v in new.items():
        if k not in old:
            out[k] = v
        elif old[k] != v:
            out[k] = merge_diff(old[k], v)
    return out


def merge_apply(old, patch):
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(old) if isinstance(old, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_apply(out.get(k), v)
    return out


def apply_defaults(obj, schema) -> None:
    """Fill absent properties that have a `default` in a structural schema (in place)."""
    if not isinstance(obj, dict) or not isinstance(schema, dict):
        return
    for key, sub in (schema.get("properties") or {}).items():
        if key not in obj and "default" in sub:
            obj[key] = copy.deepcopy(sub["default"])
        if key in obj:
            apply_defaults(obj[key], sub)


def field_path(parts) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def describe_error(e: jsonschema.ValidationError) -> tuple[str, str, str]:
    """(field, reason, message) in the API server's words."""
    path = list(e.absolute_path)
    if e.validator == "required":
        missing = e.message.split("'")[1]
        return field_path(path + [missing]), "FieldValueRequired", "Required value"
    fld = field_path(path) or "<root>"
    if e.validator == "enum":
        allowed = ", ".join(json.dumps(v) for v in e.validator_value)
        return fld, "FieldValueNotSupported", f"Unsupported value: {json.dumps(e.instance)}: supported values: {allowed}"
    if e.validator in ("minimum", "maximum"):
        bound = "greater" if e.validator == "minimum" else "less"
        return fld, "FieldValueInvalid", (f"Invalid value: {json.dumps(e.instance)}: {fld} in body should be "
                                          f"{bound} than or equal to {e.validator_value}")
    if e.validator in ("minProperties", "minItems", "minLength"):
        return fld, "FieldValueInvalid", f"Invalid value: {json.dumps(e.instance)}: {fld} in body should have at least {e.validator_value} {'properties' if e.validator == 'minProperties' else 'items' if e.validator == 'minItems' else 'chars'}"
    if e.validator == "type":
        return fld, "FieldValueTypeInvalid", (f"Invalid value: {json.dumps(e.instance)}: {fld} in body must be "
                                              f"of type {e.validator_value}")
    return fld, "FieldValueInvalid", f"Invalid value: {e.message}"


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    crd: dict = attrs.field(factory=dict)
    extra_crds: list = attrs.field(factory=list)   # served as plain resources (e.g. kopf peering)
    _rv: int = attrs.field(default=0, init=False)
    cr: kmock.resource = attrs.field(default=None, init=False)
    version: dict = attrs.field(factory=dict, init=False)
    schema: dict = attrs.field(factory=dict, init=False)
    validator: jsonschema.Draft7Validator = attrs.field(default=None, init=False)
    kinds: dict = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        names = self.crd["spec"]["names"]
        g, v = self.crd["spec"]["group"], self.crd["spec"]["versions"][0]["name"]
        self.cr = kmock.resource(g, v, names["plural"])
        self.version = self.crd["spec"]["versions"][0]
        self.schema = self.version["schema"]["openAPIV3Schema"]
        self.validator = jsonschema.Draft7Validator(self.schema)
        self.resources[f"{g}/{v}/{names['plural']}"] = kmock.ResourceInfo(
            kind=names["kind"], singular=names["singular"], shortnames=set(names.get("shortNames", [])),
            categories=set(names.get("categories", [])), namespaced=True, subresources={"status"},
            verbs={"get", "list", "watch", "create", "patch", "delete"})
        self.kinds = {self.cr: names["kind"]}
        for plural, kind in CORE.items():
            self.resources[f"v1/{plural}"] = kmock.ResourceInfo(
                kind=kind, singular=kind.lower(), namespaced=plural != "namespaces",
                subresources={"status"} if plural == "pods" else set(),
                verbs={"get", "list", "watch", "create", "patch", "delete"})
            self.kinds[kmock.resource("", "v1", plural)] = kind
        for crd in self.extra_crds:
            n, g, v = crd["spec"]["names"], crd["spec"]["group"], crd["spec"]["versions"][0]
            self.resources[f"{g}/{v['name']}/{n['plural']}"] = kmock.ResourceInfo(
                kind=n["kind"], singular=n["singular"], shortnames=set(n.get("shortNames", [])),
                namespaced=crd["spec"]["scope"] == "Namespaced", subresources=set(v.get("subresources") or {}),
                verbs={"get", "list", "watch", "create", "patch", "delete"})
            self.kinds[kmock.resource(g, v["name"], n["plural"])] = n["kind"]
        self.resources[CRD_RES] = kmock.ResourceInfo(
            kind="CustomResourceDefinition", singular="customresourcedefinition", namespaced=False,
            verbs={"get", "list", "watch", "create", "patch", "delete"})
        self.kinds[kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")] = \
            "CustomResourceDefinition"

    # ---- admission ----------------------------------------------------------------
    def _current(self, request) -> dict | None:
        key = (request.resource, request.namespace, request.name)
        if key in self.objects and not self.objects[key].deleted:
            return copy.deepcopy(dict(self.objects[key].raw))
        return None

    def _invalid(self, obj: dict, errors: list) -> kmock.KubernetesError:
        causes = [dict(zip(("field", "reason", "message"), describe_error(e))) for e in errors]
        name = (obj.get("metadata") or {}).get("name", "")
        kind = self.kinds[self.cr]
        text = ", ".join(f"{c['field']}: {c['message']}" for c in causes)
        return kmock.KubernetesError(
            status=422, reason="Invalid", message=f'{kind}.{self.cr.group} "{name}" is invalid: {text}',
            details={"name": name, "group": self.cr.group, "kind": kind, "causes": causes})

    def _admit(self, request):
        current = self._current(request)
        if request.action == kmock.action.CREATE:
            new = copy.deepcopy(request.data)
            meta = new.setdefault("metadata", {})
            # A given uid is kept: the demo registers pods whose uid names their cgroup.
            meta.setdefault("uid", str(uuid.uuid4()))
            if not meta.get("name") and meta.get("generateName"):     # kopf's Events: "kopf-event-"
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            if not meta.get("name"):
                raise kmock.KubernetesError(status=422, reason="Invalid",
                                            message="metadata.name: Required value: name or generateName is required")
            meta.update(generation=1,
                        creationTimestamp=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
            meta.setdefault("namespace", request.namespace) if request.namespace else None
            base = {}
        else:
            if current is None:
                return request  # the emulator answers 404
            if isinstance(request.data, list):
                try:
                    new = jsonpatch.apply_patch(current, request.data)
                except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                    raise kmock.KubernetesError(status=422, reason="Invalid", message=f"JSON patch: {e}")
            else:
                new = merge_apply(current, request.data or {})
            info = self.resources[request.resource] if request.resource in self.resources else None
            if info is not None and "status" in info.subresources:
                if request.subresource == "status":
                    new = dict(current, status=new.get("status"))
                elif "status" in current:
                    new["status"] = current["status"]
            base, new = current, copy.deepcopy(new)   # new shares sub-dicts with current
            if new.get("spec") != current.get("spec"):
                new["metadata"]["generation"] = int(current["metadata"].get("generation") or 1) + 1
        if request.resource == self.cr:   # status writes are validated too, as the real API server does
            if request.subresource is None:
                apply_defaults(new, self.schema)
            errors = sorted(self.validator.iter_errors(new), key=lambda e: list(e.absolute_path))
            if errors:
                raise self._invalid(new, errors)
        self._rv += 1
        new["metadata"]["resourceVersion"] = str(self._rv)
        data = new if request.action == kmock.action.CREATE else merge_diff(base, new)
        # Same request object (the emulator tracks it by identity), new body.
        object.__setattr__(request, "data", data)
        return request

    async def _serve_version(self, request):
        doc = await super()._serve_version(request)
        if str(doc.get("groupVersion", "")).startswith("/"):   # the core group is "v1", not "/v1"
            doc["groupVersion"] = doc["groupVersion"][1:]
        for r in doc.get("resources", []):
            if "/" in r["name"]:  # subresources carry no short names (kubectl warns otherwise)
                r["shortNames"], r["categories"] = [], []
        return doc

    async def _handle(self, request: rendering.Request):
        proxied = embedded_proxy.PROXY.fullmatch(request.url.raw_path)
        if proxied:
            return await embedded_proxy.forward(self, request, *proxied.groups())
        if request.resource is not None and request.action in (kmock.action.CREATE, kmock.action.UPDATE):
            request = self._admit(request)
        if request.resource is not None and request.resource.plural and request.action == kmock.action.LIST:
            return await self._list(request)
        if request.resource is not None and request.action == kmock.action.WATCH:
            # kubectl (client-go) decodes a watch stream only when it is typed as JSON
            return await rendering.Response(payload=self._serve_watch(request),
                                            headers={"Content-Type": "application/json"})(request)
        if request.resource == self.cr and request.action == kmock.action.FETCH and not request.subresource \
                and "as=Table" in self._accept(request):
            obj = self._current(request)
            if obj is None:
                raise self._not_found(request)
            doc = tables.table([obj], self.version["additionalPrinterColumns"], wide=True)
            return await rendering.Response(payload=doc)(request)
        try:
            return await super()._handle(request)
        except kmock.KubernetesObjectNotFoundError:
            raise self._not_found(request) from None
        except KubernetesObjectConflictError:
            name = ((request.data or {}).get("metadata") or {}).get("name")
            raise self._status_error(request, 409, "AlreadyExists", name, "already exists") from None

    @classmethod
    def _not_found(cls, request) -> kmock.KubernetesError:
        return cls._status_error(request, 404, "NotFound", request.name, "not found")

    @staticmethod
    def _status_error(request, code: int, reason: str, name: str | None, what: str) -> kmock.KubernetesError:
        """An error as the API server words it: kubectl prints `... (NotFound): pods "x" not found`."""
        res = request.resource
        kind = f"{res.plural}.{res.group}" if res.group else res.plural
        return kmock.KubernetesError(status=code, reason=reason, message=f'{kind} "{name}" {what}',
                                     details={"name": name, "group": res.group, "kind": res.plural})

    async def _serve_watch(self, request):
        """Watch from a resourceVersion without gaps: the bus position is marked under the
        same lock that orders every write, before the snapshot is taken."""
        yield b""
        bus = self._buses[request.resource]
        async with self._lock:
            marker = await bus.mark()
            objs = [copy.deepcopy(dict(o.raw)) for (res, ns, name), o in self.objects.items()
                    if res == request.resource and not o.deleted and self._wanted(request, ns, name)]
        since = int(request.params.get("resourceVersion") or 0)

        def selected(obj: dict) -> bool:   # kubectl wait watches with fieldSelector=metadata.name=x
            return tables.fields_match(obj, request.params.get("fieldSelector", "")) \
                and tables.selector_matches(obj, request.params.get("labelSelector", ""))
        try:
            for obj in objs:
                if int(obj.get("metadata", {}).get("resourceVersion") or 0) > since and selected(obj):
                    yield {"type": "MODIFIED" if since else "ADDED", "object": obj}
            async for event in bus.stream(since=marker):
                obj = event.get("object") or {}
                meta = obj.get("metadata") or {}
                if self._wanted(request, meta.get("namespace"), meta.get("name")) and selected(obj):
                    yield event
        finally:
            await bus.unmark(marker)

    @staticmethod
    def _accept(request) -> str:
        return next((v for k, v in request.headers.items() if k.lower() == "accept"), "")

    @staticmethod
    def _wanted(request, namespace, name) -> bool:
        return ((request.namespace is None or namespace == request.namespace)
                and (request.name is None or name == request.name))

    async def _list(self, request):
        """Lists with kind and labelSelector; Tables for kubectl when it asks for them."""
        async with self._lock:
            items = [copy.deepcopy(dict(o.raw)) for (res, ns, _), o in self.objects.items()
                     if res == request.resource and not o.deleted
                     and (request.namespace is None or ns == request.namespace)]
        items = [i for i in items if tables.selector_matches(i, request.params.get("labelSelector", ""))
                 and tables.fields_match(i, request.params.get("fieldSelector", ""))]
        items.sort(key=lambda i: ((i.get("metadata") or {}).get("namespace") or "", i["metadata"]["name"]))
        kind = self.kinds.get(request.resource, "Object")
        accept = self._accept(request)
        if "as=Table" in accept:
            cols = self.version["additionalPrinterColumns"] if request.resource == self.cr else []
            doc = tables.table(items, cols, wide=True)   # kubectl hides priority > 0 columns unless -o wide
        else:
            doc = {"apiVersion": str(request.resource.version if not request.resource.group
                                     else f"{request.resource.group}/{request.resource.version}"),
                   "kind": f"{kind}List", "metadata": {"resourceVersion": str(self._rv)}, "items": items}
        return await rendering.Response(payload=doc)(request)


class EmbeddedCluster:
    """The emulator on 127.0.0.1 in a background thread, plus a small synchronous client."""

    def __init__(self, crd_path: Path, workdir: Path, extra_crds: tuple[Path, ...] = ()):
        self.crd = load_crd(crd_path)
        self.extra_crds = [doc for p in extra_crds for doc in yaml.safe_load_all(Path(p).read_text()) if doc]
        self.emulator: Emulator | None = None   # iterating it gives every request served so far
        self.workdir = Path(workdir)
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ingero-kmock", daemon=True)

    def _run(self) -> None:
        async def main():
            self._stop = asyncio.Event()
            async with Emulator(crd=self.crd, extra_crds=self.extra_crds) as k, \
                    kmock.Server(k, host="127.0.0.1") as srv:
                self.emulator = k
                self.url = str(srv.url).rstrip("/")
                self._ready.set()
                await self._stop.wait()
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(main())
        except BaseException as e:  # reported by start()
            self._error = e
            self._ready.set()

    def start(self) -> "EmbeddedCluster":
        self._thread.start()
        if not self._ready.wait(20) or self._error:
            raise IngeroError(f"the embedded API server did not start: {self._error}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.kubeconfig = self.kubeconfig_as(None)
        return self

    def kubeconfig_as(self, identity: str | None) -> Path:
        """A kubeconfig whose requests carry `identity` as bearer token. The emulator
        authorizes nothing, but the token tells who made each recorded request, as a
        service account's token does on a real API server."""
        path = self.workdir / (f"kubeconfig-{identity.rsplit(':', 1)[-1]}" if identity else "kubeconfig")
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "ingero-embedded",
            "clusters": [{"name": "ingero-embedded", "cluster": {"server": self.url}}],
            "users": [{"name": "ingero-embedded", "user": {"token": identity} if identity else {}}],
            "contexts": [{"name": "ingero-embedded",
                          "context": {"cluster": "ingero-embedded", "user": "ingero-embedded",
                                      "namespace": "default"}}]}))
        return path

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)

    def request(self, method: str, path: str, body=None, content_type: str = "application/json"):
        data = json.dumps(body).encode() if body is not None else None
        status, raw = request_sync(method, self.url + path, data, {"Content-Type": content_type}, loop=self._loop)
        return status, json.loads(raw or b"{}")

    def create(self, path: str, obj: dict) -> dict:
        code, doc = self.request("POST", path, obj)
        if code >= 300:
            raise IngeroError(f"embedded API: POST {path} failed ({code}): {doc.get('message')}")
        return doc

    def patch(self, path: str, patch: dict) -> dict:
        code, doc = self.request("PATCH", path, patch, "application/merge-patch+json")
        if code >= 300:
            raise IngeroError(f"embedded API: PATCH {path} failed ({code}): {doc.get('message')}")
        return doc

    def get(self, path: str) -> dict | None:
        code, doc = self.request("GET", path)
        return doc if code == 200 else None
