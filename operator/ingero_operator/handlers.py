"""kopf handlers for TraceSession: small functions; the work is in ``session.Controller``.

Import this module only after ``settings.SETTINGS`` is final (the CLI does):
the timer interval is read at import time.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import shutil
import socket

import kopf

from ingero_operator.kube import Kube, login
from ingero_operator.session import Controller, Ref
from ingero_operator.settings import GROUP, PLURAL, SETTINGS, VERSION
from ingero_operator.status import parse_iso

RES = (GROUP, VERSION, PLURAL)


def _ref(meta) -> Ref:
    return Ref(meta["namespace"], meta["name"], meta["uid"], meta.get("generation"))


def _running(status, **_) -> bool:
    return (status or {}).get("phase") in ("Running", "Gathering")


def _pending(status, **_) -> bool:
    return (status or {}).get("phase") == "Pending"


def _finished_with_ttl(spec, status, **_) -> bool:
    return (status or {}).get("phase") in ("Completed", "Failed") and \
        (spec or {}).get("ttlSecondsAfterFinished") is not None


def _expiring(status, **_) -> bool:
    art = (status or {}).get("artifact") or {}
    return (status or {}).get("phase") == "Completed" and bool(art.get("expiresAt")) and not art.get("deleted")


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger, **_):
    settings.persistence.finalizer = "ingero.io/finalizer"
    settings.posting.level = logging.WARNING
    # Events show `From: ingero-operator` (kubectl describe), and which replica (pod) posted them
    settings.posting.reporting_component = "ingero-operator"
    settings.posting.reporting_instance = socket.gethostname()
    settings.watching.server_timeout = 300
    # The CRDs are installed before the operator starts (Helm's crds/), so kopf's runtime
    # watch of CustomResourceDefinitions (and of Namespaces, with --watch-namespace) is not
    # needed, nor the RBAC it would take; a CRD added later is seen after a restart.
    settings.scanning.disabled = True
    memo.controller = Controller(SETTINGS, Kube(login(settings)))
    logger.info("ingero operator settings: %s", SETTINGS.describe())


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_):
    await memo.controller.close()


@kopf.on.create(*RES)
async def start(spec, status, meta, memo: kopf.Memo, **_):
    await memo.controller.start(_ref(meta), dict(spec), dict(status))     # Pending: wait_quietly goes on


@kopf.daemon(*RES, when=_pending)
async def wait_quietly(spec, status, meta, memo: kopf.Memo, stopped: kopf.DaemonStopped, **_):
    """A Pending session looks for its pods (and agents) again until it starts, fails or
    goes: a daemon, so the waiting logs nothing per look (Controller.pending logs each
    reason once). Also picks up a session left Pending by an operator restart."""
    delay = SETTINGS.timing.pending_retry_s
    while not stopped:
        await stopped.wait(delay)
        if stopped:
            return
        delay = await memo.controller.start(_ref(meta), dict(spec), dict(status))
        if delay is None:
            return


@kopf.timer(*RES, interval=SETTINGS.timing.refresh_interval_s, when=_running)
async def refresh(spec, status, meta, memo: kopf.Memo, **_):
    await memo.controller.refresh(_ref(meta), dict(spec), dict(status))


@kopf.on.delete(*RES)
async def stop(spec, status, meta, memo: kopf.Memo, logger, **_):
    ctl, ref = memo.controller, _ref(meta)
    if (status or {}).get("phase") in ("Running", "Gathering"):
        try:
            spec_ = ctl.parse(ref, dict(spec))
            await asyncio.wait_for(ctl.finish(ref, spec_, dict(status), "the session was deleted"),
                                        timeout=ctl.s.timing.delete_gather_timeout_s)
        except Exception as e:  # never block the deletion: stop the probes and go
            logger.warning(f"gather on delete incomplete ({type(e).__name__}: {e}); stopping probes")
    if (status or {}).get("phase") not in ("Completed", "Failed"):
        await ctl.stop_everywhere(ref)
    ctl.forget(ref)


@kopf.timer(*RES, interval=max(1.0, 5 * SETTINGS.timing.refresh_interval_s), when=_finished_with_ttl)
async def ttl_after_finished(spec, status, meta, memo: kopf.Memo, **_):
    await memo.controller.delete_after_ttl(_ref(meta), dict(spec), dict(status))


@kopf.timer(*RES, interval=300, when=_expiring)
async def expire(status, meta, memo: kopf.Memo, logger, **_):
    art = status["artifact"]
    if dt.datetime.now(dt.timezone.utc) < parse_iso(art["expiresAt"]):
        return
    root = memo.controller.local(_ref(meta)).root
    shutil.rmtree(root, ignore_errors=True)
    logger.info(f"artifact {root} expired and was deleted")
    await memo.controller.patch(_ref(meta), {"artifact": {"deleted": True}})
    memo.controller.event(_ref(meta), "Normal", "ArtifactExpired",
                          f"the merged trace {root} was deleted (retention ended {art['expiresAt']})")
