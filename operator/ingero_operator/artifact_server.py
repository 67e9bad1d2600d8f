"""The operator's artifact server: finished TraceSession artifacts over HTTP, read only.

    GET /v1/artifacts/<namespace>/<name>/report.json?key=K     the full report (JSON)
    GET /v1/artifacts/<namespace>/<name>/trace.duckdb?key=K    the merged trace file
    GET /v1/artifacts/<namespace>/<name>/artifact.tar?key=K    the whole folder, streamed: trace.duckdb,
                                                               report.json and the node segments its
                                                               views read (what `ingero report` takes)

Clients reach it through the API server's service proxy,
``/api/v1/namespaces/<ns>/services/<svc>:artifacts/proxy/v1/artifacts/...``
(``kubectl ingero``, ``kubectl get --raw``), so Kubernetes RBAC (``services/proxy``
on the operator's Service) decides who may knock at all. The proxy does not
pass on who the caller is, so the key decides which artifact: a random
per-session secret the operator writes into the folder and into the session's
``status.artifact.readKey`` when it completes, so only whoever may read that
TraceSession (its namespace's RBAC) can name its artifact. Errors are
Kubernetes ``Status`` objects, which kubectl prints as ``Error from server
(NotFound): <message>``.

It runs in its own thread with its own event loop, beside kopf's: a large
download never delays a handler. Its connections are bounded as every Ingero
port is (``ingero.serving``: a cap, idle and half-open peers dropped, a reader
that stops reading dropped after the idle timeout). Looking an artifact up,
reading files and writing tar streams run in three pools of their own, so slow
readers of tar streams never hold up a lookup or a file; at most TAR_STREAMS
tar streams run at once, one more is answered 503 with Retry-After. Names in
the URL are checked (DNS names, a URL-safe key, one of three files) and the
folder is resolved inside the artifacts folder; nothing else on disk can be
named.
"""

from __future__ import annotations

import asyncio
import hmac
import io
import logging
import os
import re
import secrets
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from aiohttp import web

from ingero import serving

log = logging.getLogger("ingero.operator.artifacts")

KEY_FILE = "artifact.key"          # in the session folder; never served
FILES = {"report.json": "application/json", "trace.duckdb": "application/octet-stream",
         "artifact.tar": "application/x-tar"}
NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")            # a DNS label
NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")               # a DNS subdomain
KEY = re.compile(r"[A-Za-z0-9_-]{16,128}")
UID8 = re.compile(r"[0-9a-z-]{8}")                                       # session folder: <name>-<uid[:8]>
TAR_STREAMS = 4            # a thread each while it runs; a stalled reader is dropped after the idle timeout


def write_key(folder: Path) -> str:
    """A new read key for the artifact in `folder`, stored beside it (owner-only)."""
    key = secrets.token_urlsafe(24)
    tmp = folder / f".{KEY_FILE}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key)
    os.replace(tmp, folder / KEY_FILE)
    return key


def proxy_path(operator_namespace: str, service: str, namespace: str, name: str) -> str:
    """Where a client finds the artifact of `namespace/name` through the API server."""
    return f"/api/v1/namespaces/{operator_namespace}/services/{service}/proxy/v1/artifacts/{namespace}/{name}"


def find(root: Path, namespace: str, name: str, key: str) -> Path | None:
    """The completed artifact folder of `namespace/name` whose read key is `key`, or None.
    The names must have been checked (NAMESPACE, NAME, KEY) by the caller."""
    base = (root / namespace).resolve()
    if not base.is_relative_to(root.resolve()) or not base.is_dir():
        return None
    for d in base.iterdir():
        if not (d.name.startswith(name + "-") and UID8.fullmatch(d.name[len(name) + 1:])) or d.is_symlink():
            continue
        try:
            stored = (d / KEY_FILE).read_text().strip()
        except OSError:
            continue
        if hmac.compare_digest(stored.encode(), key.encode()) and (d / "report.json").is_file():
            return d
    return None


def members(folder: Path) -> list[tuple[Path, str]]:
    """(file, name in the tar) for an artifact folder: the trace, the report, and the node
    segments the trace's views read by relative path. Not the key, not the live database."""
    out = [(folder / n, n) for n in ("trace.duckdb", "report.json") if (folder / n).is_file()]
    nodes = folder / "work" / "nodes"
    if nodes.is_dir():
        out += [(p, p.relative_to(folder).as_posix()) for p in sorted(nodes.rglob("*.parquet"))
                if p.is_file() and not p.is_symlink() and not p.name.startswith(".")]
    return out


class _Sink(io.RawIOBase):
    """A file the tar writer (a worker thread) writes into; each write goes out on the
    response in the server's loop and waits for it (so memory stays at one buffer)."""

    def __init__(self, resp: web.StreamResponse, loop: asyncio.AbstractEventLoop):
        super().__init__()
        self.resp, self.loop = resp, loop

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        asyncio.run_coroutine_threadsafe(self.resp.write(bytes(b)), self.loop).result()
        return len(b)


def write_tar(files: list[tuple[Path, str]], out) -> None:
    with tarfile.open(fileobj=out, mode="w|", bufsize=1 << 20, format=tarfile.PAX_FORMAT) as tar:
        for path, arcname in files:
            info = tar.gettarinfo(str(path), arcname)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mode = 0o644
            with open(path, "rb") as f:
                tar.addfile(info, f)


def status_error(code: int, reason: str, message: str) -> web.Response:
    """An error as the API server words it: kubectl shows `Error from server (<reason>): <message>`."""
    return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                              "message": message, "reason": reason, "code": code}, status=code)


def make_app(root: Path) -> web.Application:
    root = Path(root)
    lookups = ThreadPoolExecutor(2, thread_name_prefix="artifact-lookup")
    reads = ThreadPoolExecutor(4, thread_name_prefix="artifact-read")
    tars = ThreadPoolExecutor(TAR_STREAMS, thread_name_prefix="artifact-tar")
    tar_slots = asyncio.Semaphore(TAR_STREAMS)

    async def artifact(request: web.Request) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        ns, name, file = (request.match_info[k] for k in ("namespace", "name", "file"))
        if file not in FILES:
            return status_error(404, "NotFound", f"no file {file[:80]!r}: ask for one of {', '.join(FILES)}")
        if not NAMESPACE.fullmatch(ns) or not NAME.fullmatch(name):
            return status_error(400, "BadRequest", "namespace and name must be Kubernetes names")
        key = request.query.get("key", "")
        if not KEY.fullmatch(key):
            return status_error(400, "BadRequest", "the key= parameter is missing or malformed: pass the "
                                "session's status.artifact.readKey")
        folder = await loop.run_in_executor(lookups, find, root, ns, name, key)
        if folder is None:
            return status_error(404, "NotFound", f"no artifact of TraceSession {ns}/{name} with this key: "
                                "it expired, was deleted, or the operator's artifacts folder was lost")
        if file != "artifact.tar":
            return await serving.stream_file(request, folder / file, reads, {"Content-Type": FILES[file]})
        if tar_slots.locked():
            busy = status_error(503, "ServiceUnavailable", f"{TAR_STREAMS} artifact.tar downloads are under "
                                "way; retry shortly")
            busy.headers["Retry-After"] = "5"
            return busy
        async with tar_slots:
            files = await loop.run_in_executor(lookups, members, folder)
            resp = web.StreamResponse(headers={"Content-Type": FILES[file],
                                               "Content-Disposition": f'attachment; filename="{name}.tar"'})
            await resp.prepare(request)
            if request.method == "HEAD":
                return resp
            try:
                await loop.run_in_executor(tars, write_tar, files, _Sink(resp, loop))
            except (ConnectionError, OSError) as e:    # the client went away, or a file vanished mid-way
                log.warning("artifact %s/%s: the tar stream stopped: %s", ns, name, e)
                return resp
            await resp.write_eof()
            return resp

    async def close_pools(_app) -> None:
        for pool in (lookups, reads, tars):
            pool.shutdown(wait=False, cancel_futures=True)

    app = web.Application()
    app.router.add_get("/v1/artifacts/{namespace}/{name}/{file}", artifact)
    app.on_cleanup.append(close_pools)
    return app


def serve(root: Path, port: int, address: str = "0.0.0.0", bounds: serving.Bounds = serving.Bounds()) \
        -> serving.ServerThread:
    """The artifact server on its own bounded port, in a daemon thread with its own loop."""
    return serving.ServerThread(make_app(root), serving.bind(port, address), bounds, "artifacts").start()
