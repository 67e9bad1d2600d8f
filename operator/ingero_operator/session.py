"""What the handlers do with a TraceSession: start, refresh while running, gather, stop.

Everything the operator must remember across its own restarts is in the
resource's status (phase, sessionId, startTime, deadline, nodes); what lives
only in memory here (download cursors, which plan each agent got) is
rebuilt on the next refresh: agent plans are idempotent and fetched segments
are recognised on disk.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import kopf

from ingero.errors import IngeroError
from ingero.http_client import new_session
from ingero_operator import artifact_server, metrics
from ingero_operator import plan as planning
from ingero_operator.agents import AgentBroke, AgentClient, AgentUnreachable, agent_tls
from ingero_operator.gather import LocalSession, build_artifact, fetch_new, ingest_and_analyse, unheard
from ingero_operator.kube import Kube, KubeError
from ingero_operator.settings import Settings
from ingero_operator.settings import GROUP, VERSION
from ingero_operator.status import (bounded_warnings, lifecycle, node_row, now_iso, parse_iso, report_status,
                                    straggler_message, verdict_message)

log = logging.getLogger("ingero.operator")
ACTIVE = ("running", "starting")


@dataclass
class Ref:
    namespace: str
    name: str
    uid: str
    generation: int | None = None

    @property
    def sid(self) -> str:
        return planning.session_id(self.namespace, self.name, self.uid)


@dataclass
class Live:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    cursors: dict = field(default_factory=dict)    # node -> segment listing cursor (mtime ns)
    clocks: dict = field(default_factory=dict)     # node -> (offset ns, rtt ns)
    planned: dict = field(default_factory=dict)    # node -> pod uids the agent last got
    failures: dict = field(default_factory=dict)   # node -> tracer starts that failed
    sticky: list = field(default_factory=list)     # warnings kept until the end
    conditions: list | None = None                 # as last written (None: take the status')
    unreachable: set = field(default_factory=set)  # nodes whose AgentUnreachable was posted
    announced: tuple | None = None                 # (who, cause) of the last StragglerDetected Event
    hung: str | None = None                        # who the last Hung Event named
    pending: str | None = None                     # the Pending reason last logged
    done: bool = False


class Controller:
    def __init__(self, settings: Settings, kube: Kube):
        self.s = settings
        self.kube = kube
        self.live: dict[str, Live] = {}
        self._http: aiohttp.ClientSession | None = None

    def _state(self, ref: Ref) -> Live:
        return self.live.setdefault(ref.uid, Live())

    def local(self, ref: Ref) -> LocalSession:
        # keyed by UID too: a new TraceSession reusing a deleted one's name starts empty
        return LocalSession(self.s.artifacts_dir / ref.namespace / f"{ref.name}-{(ref.uid or 'nouid')[:8]}")

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
        await self.kube.close()

    def event(self, ref: Ref, type_: str, reason: str, message: str) -> None:
        """An Event on the TraceSession (kopf posts it in the background; `kubectl describe`
        lists it). Outside kopf's handlers (unit tests driving the controller) nothing is posted."""
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TraceSession",
                "metadata": {"namespace": ref.namespace, "name": ref.name, "uid": ref.uid}}
        try:
            kopf.event(body, type=type_, reason=reason, message=message[:1000])
        except LookupError:          # no kopf context: no poster to hand it to
            log.debug("event %s on %s/%s not posted (no operator context)", reason, ref.namespace, ref.name)

    async def patch(self, ref: Ref, status: dict) -> None:
        try:
            await self.kube.patch_status(ref.namespace, ref.name, status)
        except KubeError as e:
            raise kopf.TemporaryError(f"cannot write status: {e}", delay=2) from e
        metrics.observe(ref.uid, ref.namespace, ref.name, status)

    async def transition(self, ref: Ref, status: dict, phase: str, reason: str | None, message: str,
                         **fields) -> None:
        """Write `phase` with its message and every lifecycle condition (status.lifecycle);
        `fields` go into the same status patch. StragglerDetected follows the straggler the
        status holds after the patch."""
        live = self._state(ref)
        old = live.conditions if live.conditions is not None else (status or {}).get("conditions")
        straggler = fields["straggler"] if "straggler" in fields else (status or {}).get("straggler")
        verdict = fields["verdict"] if "verdict" in fields else (status or {}).get("verdict")
        conds = lifecycle(phase, reason, message, ref.generation, old, straggler if phase != "Failed" else None,
                          verdict)
        await self.patch(ref, {"phase": phase, "message": message, "observedGeneration": ref.generation,
                               **fields, "conditions": conds})
        live.conditions = conds

    async def pending(self, ref: Ref, status: dict, reason: str, message: str, delay: float, **fields) -> float:
        """Phase Pending with `reason`; one INFO line when the reason changes, not one per
        look. Returns `delay`: when to look again (handlers.wait_quietly does)."""
        await self.transition(ref, status, "Pending", reason, message, **fields)
        live = self._state(ref)
        if live.pending != reason:
            live.pending = reason
            log.info("%s/%s: pending (%s): %s; looking again every %g s", ref.namespace, ref.name, reason,
                     message, self.s.timing.pending_retry_s)
        return delay

    async def fail(self, ref: Ref, status: dict, reason: str, message: str, **fields) -> None:
        """Phase Failed: conditions Failed=True/Ready=False with `reason`, a Failed warning Event."""
        await self.transition(ref, status, "Failed", reason, message, endTime=now_iso(), **fields)
        self.event(ref, "Warning", "Failed", message)
        log.warning("%s/%s: failed (%s): %s", ref.namespace, ref.name, reason, message)

    def _post_unreachable(self, ref: Ref, live: Live, rows: list[dict], warnings: list[str]) -> None:
        """One AgentUnreachable warning per node that became unreachable (again), not one per retry."""
        down = {r["name"] for r in rows if not r["agentReached"]}
        for node in sorted(down - live.unreachable):
            why = next((w for w in warnings if w.startswith(f"node {node}:")), f"node {node}: no answer")
            self.event(ref, "Warning", "AgentUnreachable", why)
        live.unreachable = down

    def _post_straggler(self, ref: Ref, live: Live, straggler: dict | None, final: bool) -> None:
        """A StragglerDetected Event when a verdict names a rank or group, or another one or another
        cause; the final verdict confirming the live one posts nothing new."""
        if not straggler:
            return
        key = (straggler.get("who"), straggler.get("cause"))
        if key != live.announced:
            live.announced = key
            self.event(ref, "Warning", "StragglerDetected",
                       straggler_message(straggler) + ("" if final else " (live verdict)"))

    def _post_verdict(self, ref: Ref, live: Live, verdict: dict | None, final: bool) -> None:
        """A Hung Event when a verdict finds the job hung (again, or other ranks missing); a
        CannotJudge Event when the final verdict cannot be reached (live, the Judged
        condition says so: the first seconds of every session hold too few steps)."""
        kind = (verdict or {}).get("kind")
        if kind == "hang" and verdict.get("who") != live.hung:
            live.hung = verdict.get("who")
            self.event(ref, "Warning", "Hung", f"{verdict.get('reason') or verdict.get('who')}"
                                               f"{'' if final else ' (live verdict)'}")
        elif kind != "hang":
            live.hung = None
        if final and kind == "cannot-judge":
            self.event(ref, "Warning", "CannotJudge", f"no verdict: {verdict.get('reason')}")

    async def agents(self) -> dict[str, AgentClient]:
        a = self.s.agent
        if self._http is None or self._http.closed:
            self._http = new_session()
        try:
            pods = await self.kube.list_pods(self.s.namespace, a.labels)
            token = await self.kube.secret_value(self.s.namespace, a.token_secret, a.token_key)
        except KubeError as e:
            raise kopf.TemporaryError(f"cannot find the agents: {e} (agent Pods labelled "
                                      f"{planning.label_selector(a.labels)} and Secret {self.s.namespace}/"
                                      f"{a.token_secret} key {a.token_key} are needed)", delay=5) from e
        tls = agent_tls(a)
        try:
            ctx = tls.context() if tls else None     # read again on every call: certificates rotate
        except IngeroError as e:
            raise kopf.TemporaryError(str(e), delay=30) from e
        return {node: AgentClient(node, host, port, token, a, self._http, ctx)
                for node, (host, port) in planning.agent_endpoints(pods, a.port_name).items()}

    async def pods(self, ref: Ref, spec: planning.SessionSpec) -> list[dict]:
        try:
            return await self.kube.list_pods(ref.namespace, spec.match_labels)
        except KubeError as e:
            raise kopf.TemporaryError(f"cannot list pods: {e}", delay=5) from e

    def parse(self, ref: Ref, spec: dict) -> planning.SessionSpec:
        try:
            return planning.parse_spec(spec)
        except planning.SpecError as e:
            raise kopf.PermanentError(str(e)) from e

    # ---- start ---------------------------------------------------------------------
    async def start(self, ref: Ref, spec_doc: dict, status: dict) -> float | None:
        """Trace the session's pods. None once it is Running; while it has to wait (no pod
        yet, no agent reached) it is Pending and this returns the seconds after which to
        look again: waiting is the normal state of a session applied before its job, so
        it is no error (no kopf.TemporaryError, which kopf logs at ERROR on every retry)."""
        try:
            spec = planning.parse_spec(spec_doc)
        except planning.SpecError as e:
            await self.fail(ref, status, "InvalidSpec", str(e))
            raise kopf.PermanentError(str(e)) from e
        live = self._state(ref)
        async with live.lock:
            pods = [p for p in await self.pods(ref, spec) if not planning.pod_finished(p)]
            sel = planning.label_selector(spec.match_labels)
            if not pods:
                now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
                since = parse_iso(status.get("pendingSince")) or now
                if spec.duration_s and (now - since).total_seconds() >= spec.duration_s:
                    # a session with a duration ends after it, pods or not
                    msg = (f"no running pod matched {sel} in namespace {ref.namespace} within "
                           f"durationSeconds ({spec.duration_s}); check the selector")
                    await self.fail(ref, status, "NoPods", msg)
                    raise kopf.PermanentError(msg)
                msg = f"no running pod matches {sel} in namespace {ref.namespace}; waiting for the job"
                delay = self.s.timing.pending_retry_s
                if spec.duration_s:   # look again at the latest when the duration is up
                    delay = max(0.5, min(delay, spec.duration_s - (now - since).total_seconds()))
                return await self.pending(ref, status, "WaitingForPods", msg, delay, sessionId=ref.sid,
                                          pendingSince=since.isoformat().replace("+00:00", "Z"))
            start = parse_iso(status.get("startTime")) or dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
            deadline = start + dt.timedelta(seconds=spec.duration_s) if spec.duration_s else None
            rows, warnings = await self._reconcile(ref, spec, live, pods, deadline)
            self._post_unreachable(ref, live, rows, warnings)
            if not any(r["agentReached"] for r in rows):
                msg = "no ingero agent could be reached: " + "; ".join(warnings)
                return await self.pending(ref, status, "AgentUnreachable", msg, self.s.timing.pending_retry_s,
                                          nodes=rows)
            msg = f"tracing {len(pods)} pods on {len(rows)} nodes ({sel})"
            await self.transition(ref, status, "Running", "Tracing", msg, sessionId=ref.sid,
                                  startTime=start.isoformat().replace("+00:00", "Z"),
                                  deadline=deadline.isoformat().replace("+00:00", "Z") if deadline else None,
                                  nodes=rows, warnings=bounded_warnings(warnings, self.s.gather))
            self.event(ref, "Normal", "Tracing", msg)
            log.info("%s/%s: %s", ref.namespace, ref.name, msg)
            live.pending = None
            return None

    async def _reconcile(self, ref: Ref, spec, live: Live, pods: list[dict], deadline) -> tuple[list, list]:
        """Make every node's agent trace its pods (re-plan on restart or new pods)."""
        by_node, unscheduled = planning.group_by_node(pods)
        agents = await self.agents()
        warnings = [f"pod {n} is not scheduled yet" for n in unscheduled]
        remaining = None
        if deadline is not None:
            remaining = max(1.0, (deadline - dt.datetime.now(dt.timezone.utc)).total_seconds())
            remaining += self.s.timing.tracer_grace_s

        async def one(node: str, entries: list[dict]):
            client = agents.get(node)
            if client is None:
                return node_row(node, False, "no-agent", len(entries), None, None), \
                    f"node {node}: no ingero agent Pod found there; its pods are not traced"
            body = planning.node_plan(ref.sid, entries, spec, remaining)
            uids = sorted(e["uid"] for e in entries)
            try:
                info = await client.session(ref.sid)
                state = (info or {}).get("state")
                if state == "failed":
                    live.failures[node] = live.failures.get(node, 0) + 1
                if live.failures.get(node, 0) > 3:
                    return node_row(node, True, state, len(entries), info, live.clocks.get(node)), \
                        f"node {node}: the tracer keeps failing: {(info or {}).get('log_tail') or '?'}"
                if state not in ACTIVE or live.planned.get(node) != uids:
                    info = await client.start(body)
                    live.planned[node] = uids
                if node not in live.clocks:
                    live.clocks[node] = await client.clock_offset(self.s.timing.clock_samples)
                return node_row(node, True, info.get("state"), len(entries), info, live.clocks[node]), None
            except AgentUnreachable as e:
                live.planned.pop(node, None)
                return node_row(node, False, None, len(entries), None, live.clocks.get(node)), f"node {node}: {e}"

        results = await asyncio.gather(*(one(n, e) for n, e in sorted(by_node.items())))
        rows = [r for r, _ in results]
        warnings += [w for _, w in results if w]
        return rows, warnings

    # ---- while running ---------------------------------------------------------------
    async def refresh(self, ref: Ref, spec_doc: dict, status: dict) -> None:
        live = self._state(ref)
        if live.done:
            return
        try:
            spec = planning.parse_spec(spec_doc)
        except planning.SpecError as e:   # the spec was edited into one the operator refuses
            async with live.lock:
                if live.done:
                    return
                live.done = True
                await self.stop_everywhere(ref)
                await self.fail(ref, status, "InvalidSpec", f"the edited spec is refused: {e}")
            return
        deadline = parse_iso(status.get("deadline"))
        if status.get("phase") == "Gathering":
            return await self.finish(ref, spec, status, "resuming an interrupted gather")
        pods = await self.pods(ref, spec)
        if deadline and dt.datetime.now(dt.timezone.utc) >= deadline:
            return await self.finish(ref, spec, status, f"durationSeconds ({spec.duration_s}) reached")
        if not pods:
            return await self.finish(ref, spec, status, "the selected pods are gone")
        if all(planning.pod_finished(p) for p in pods):
            return await self.finish(ref, spec, status, "every selected pod has finished")
        async with live.lock:
            if live.done:
                return
            rows, warnings = await self._reconcile(ref, spec, live, pods, deadline)
            self._post_unreachable(ref, live, rows, warnings)
            fetched = await self._fetch_all(ref, live, [r["name"] for r in rows if r["agentReached"]])
            warnings += fetched
            patch = {"nodes": rows}
            try:
                t_live = time.monotonic()
                rep, world = await asyncio.to_thread(ingest_and_analyse, self.local(ref),
                                                     {n: c[0] for n, c in live.clocks.items()},
                                                     _slow_ms(spec), self.s.timing.live_window_s)
                metrics.DURATION.labels("live_analysis").observe(time.monotonic() - t_live)
                unheard(self.local(ref), rows, rep)
                patch.update(report_status(rep, world, self.s.gather))
                warnings += rep.warnings
            except Exception as e:  # live analysis is best effort; the final one decides
                warnings.append(f"live analysis failed: {type(e).__name__}: {e}")
            patch["warnings"] = bounded_warnings(live.sticky + warnings, self.s.gather)
            await self.transition(ref, status, "Running", "Tracing", status.get("message") or "tracing", **patch)
            self._post_straggler(ref, live, patch.get("straggler", status.get("straggler")), final=False)
            self._post_verdict(ref, live, patch.get("verdict"), final=False)

    async def _fetch_all(self, ref: Ref, live: Live, nodes: list[str], since_zero: bool = False) -> list[str]:
        agents = await self.agents()
        sem = asyncio.Semaphore(self.s.gather.concurrency)
        local = self.local(ref)

        async def one(node):
            client = agents.get(node)
            if client is None:
                return f"node {node}: no agent to fetch segments from"
            try:
                since = 0 if since_zero else live.cursors.get(node, 0)
                live.cursors[node], _, refused = await fetch_new(client, ref.sid, local, since, sem, self.s.gather)
                live.sticky.extend(w for w in refused if w not in live.sticky)
            except AgentUnreachable as e:
                return f"node {node}: {e}"
            return None

        return [w for w in await asyncio.gather(*(one(n) for n in nodes)) if w]

    # ---- the end ---------------------------------------------------------------------
    async def finish(self, ref: Ref, spec, status: dict, reason: str) -> None:
        live = self._state(ref)
        async with live.lock:
            if live.done:
                return
            await self.transition(ref, status, "Gathering", "Gathering", f"gathering: {reason}")
            t0 = time.monotonic()
            local = self.local(ref)
            nodes = sorted({n["name"] for n in status.get("nodes") or []} | set(live.planned) | set(local.nodes()))
            agents = await self.agents()
            gathered, warnings, rows = await self._gather_nodes(ref, live, agents, nodes)
            self._post_unreachable(ref, live, rows, warnings)
            metrics.DURATION.labels("gather").observe(time.monotonic() - t0)
            try:
                t_merge = time.monotonic()
                rep, world = await asyncio.to_thread(build_artifact, local,
                                                     {n: c[0] for n, c in live.clocks.items()}, _slow_ms(spec),
                                                     self.s.timing.final_max_calls)
            except Exception as e:
                msg = f"merging the segments failed: {type(e).__name__}: {e}"
                await self.fail(ref, status, "MergeFailed", msg, nodes=rows)
                live.done = True
                return
            metrics.DURATION.labels("merge_and_analysis").observe(time.monotonic() - t_merge)
            unheard(local, (status.get("nodes") or []) + rows, rep)    # status: the pods each node had selected
            warnings = bounded_warnings(live.sticky + warnings + rep.warnings, self.s.gather)
            # the report's own warnings are in `warnings` already: they must not replace the
            # operator's (a node unreachable while gathering was lost from report.json)
            full = {**rep.to_dict(), "sessionId": ref.sid, "reason": reason, "nodes": rows,
                    "warnings": warnings, "worldSize": world}
            local.report.write_text(json.dumps(full, indent=2, default=str) + "\n")
            (local.root / "owner.json").write_text(json.dumps(
                {"namespace": ref.namespace, "name": ref.name, "uid": ref.uid}) + "\n")
            msg = f"completed ({reason}); gathered {len(gathered)}/{len(nodes)} nodes in {time.monotonic() - t0:.1f} s"
            artifact = {"path": str(local.artifact), "report": str(local.report),
                        "bytes": local.artifact.stat().st_size, "readKey": artifact_server.write_key(local.root)}
            if self.s.artifact_service:
                artifact["proxy"] = artifact_server.proxy_path(self.s.namespace, self.s.artifact_service,
                                                               ref.namespace, ref.name)
            if spec.retention_h:
                end = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=spec.retention_h)
                artifact["expiresAt"] = end.replace(microsecond=0).isoformat().replace("+00:00", "Z")
            verdict = report_status(rep, world, self.s.gather)
            await self.transition(ref, status, "Completed", "Completed", msg, endTime=now_iso(), nodes=rows,
                                  warnings=warnings, artifact=artifact, **verdict)
            live.done = True
            self.event(ref, "Warning" if len(gathered) < len(nodes) else "Normal", "Gathered",
                       f"gathered {len(gathered)}/{len(nodes)} nodes; artifact {artifact['path']} "
                       f"({artifact['bytes']:,} bytes)")
            st = verdict.get("straggler")
            self._post_straggler(ref, live, st, final=True)
            self._post_verdict(ref, live, verdict["verdict"], final=True)
            self.event(ref, "Normal", "Completed", msg + "; " + verdict_message(verdict["verdict"], st))
            for who in self.cap_artifacts(keep=local.root):
                other = Ref(who.get("namespace", ""), who.get("name", ""), who.get("uid"), None)
                try:
                    await self.kube.patch_status(other.namespace, other.name, {"artifact": {"deleted": True}})
                except (KubeError, aiohttp.ClientError):
                    pass        # the session itself is gone: nothing to mark
                self.event(other, "Normal", "ArtifactExpired",
                           f"the merged trace ({who['bytes']:,} bytes) was deleted, the oldest, to keep the "
                           f"artifact folder under --artifacts-max-bytes {self.s.artifacts_max_bytes:,}")
            log.info("%s/%s: %s", ref.namespace, ref.name, msg)
            for node in gathered:   # the artifact holds their data now
                try:
                    await agents[node].delete(ref.sid)
                except AgentUnreachable:
                    pass

    async def _gather_nodes(self, ref: Ref, live: Live, agents: dict, nodes: list[str]):
        """Stop, measure the clock, fetch everything; per node, with retries."""
        t = self.s.timing
        sem = asyncio.Semaphore(self.s.gather.concurrency)
        local = self.local(ref)

        async def one(node):
            client, err, state = agents.get(node), None, None
            for attempt in range(t.gather_retries):
                if client is None:
                    err = "could not be reached while gathering (no ingero agent Pod found on the node)"
                    break
                try:
                    t0 = time.monotonic()
                    info = await client.stop(ref.sid)
                    t1 = time.monotonic()
                    live.clocks[node] = await client.clock_offset(t.clock_samples)
                    _, n, refused = await fetch_new(client, ref.sid, local, 0, sem, self.s.gather)
                    live.sticky.extend(w for w in refused if w not in live.sticky)
                    log.info("%s/%s: node %s stopped in %.1f s, %d new segment files fetched in %.1f s",
                             ref.namespace, ref.name, node, t1 - t0, n, time.monotonic() - t1)
                    return True, node_row(node, True, (info or {}).get("state", "unknown"),
                                          (info or {}).get("pods", 0), info, live.clocks[node]), None
                except AgentBroke as e:      # the same again on a retry
                    err, state = f"failed: {e}", "failed"
                    break
                except AgentUnreachable as e:
                    err = f"could not be reached while gathering ({e})"
                    await asyncio.sleep(t.retry_backoff_s * (attempt + 1))
            have = sum(1 for _ in local.node_dir(node).rglob("*.parquet")) if local.node_dir(node).exists() else 0
            part = f"{have} segment files fetched earlier are included" if have else "no data from it"
            return False, node_row(node, state is not None, state, 0, None, live.clocks.get(node)), \
                f"node {node} {err}; the report is partial: {part}"

        results = await asyncio.gather(*(one(n) for n in nodes))
        gathered = [n for n, (ok, _, _) in zip(nodes, results) if ok]
        return gathered, [w for _, _, w in results if w], [r for _, r, _ in results]

    async def stop_everywhere(self, ref: Ref) -> None:
        """Finalizer fallback: ask every agent to stop the session; dead agents are skipped."""
        try:
            agents = await self.agents()
        except kopf.TemporaryError as e:
            log.warning("%s/%s: cannot stop probes: %s", ref.namespace, ref.name, e)
            return

        async def one(client):
            try:
                await asyncio.wait_for(client.stop(ref.sid), timeout=self.s.agent.request_timeout_s)
            except (AgentUnreachable, asyncio.TimeoutError):
                pass

        await asyncio.gather(*(one(c) for c in agents.values()))

    # ---- retention -----------------------------------------------------------------
    async def delete_after_ttl(self, ref: Ref, spec_doc: dict, status: dict) -> None:
        """spec.ttlSecondsAfterFinished: once it has passed since endTime, delete the merged
        trace and the TraceSession (this uid only), as a Job's TTL controller does."""
        try:
            ttl = planning.parse_spec(spec_doc).ttl_s
        except planning.SpecError:
            ttl = spec_doc.get("ttlSecondsAfterFinished") if isinstance(spec_doc, dict) else None
            ttl = ttl if isinstance(ttl, int) and not isinstance(ttl, bool) and 0 <= ttl <= \
                planning.MAXIMUM["spec.ttlSecondsAfterFinished"] else None
        end = parse_iso(status.get("endTime"))
        if ttl is None or end is None or dt.datetime.now(dt.timezone.utc) < end + dt.timedelta(seconds=ttl):
            return
        async with self._state(ref).lock:   # after a gather still finishing (events, caps) is done
            await self._delete_now(ref, ttl, status)

    async def _delete_now(self, ref: Ref, ttl: int, status: dict) -> None:
        self.event(ref, "Normal", "Deleted", f"ttlSecondsAfterFinished ({ttl}) passed since {status.get('endTime')}: "
                                             "deleting the session and its merged trace")
        log.info("%s/%s: ttlSecondsAfterFinished (%s s) passed; deleting it", ref.namespace, ref.name, ttl)
        shutil.rmtree(self.local(ref).root, ignore_errors=True)
        try:
            await self.kube.delete_session(ref.namespace, ref.name, ref.uid)
        except (KubeError, aiohttp.ClientError) as e:
            raise kopf.TemporaryError(f"cannot delete after ttlSecondsAfterFinished: {e}", delay=10) from e

    def cap_artifacts(self, keep: Path) -> list[dict]:
        """--artifacts-max-bytes: delete the oldest merged traces (never `keep`, the one just
        written) until the folder holds at most that many bytes. Returns the owners of the
        deleted ones ({namespace, name, uid, bytes})."""
        cap = self.s.artifacts_max_bytes
        if not cap:
            return []
        folders = []
        for owner in self.s.artifacts_dir.glob("*/*/owner.json"):
            root = owner.parent
            try:
                who = json.loads(owner.read_text())
                size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
                when = owner.stat().st_mtime
            except (OSError, ValueError):
                continue
            folders.append((when, root, size, who))
        total = sum(f[2] for f in folders)
        gone = []
        for when, root, size, who in sorted(folders, key=lambda f: f[0]):
            if total <= cap:
                break
            if root == keep:
                continue
            shutil.rmtree(root, ignore_errors=True)
            total -= size
            gone.append({**who, "bytes": size})
        if total > cap:
            log.warning("the artifact folder holds %d bytes, over --artifacts-max-bytes %d: the newest merged "
                        "trace alone is larger", total, cap)
        return gone

    def forget(self, ref: Ref) -> None:
        metrics.forget(ref.uid)
        self.live.pop(ref.uid, None)


def _slow_ms(spec) -> float | None:
    """spec.thresholds.slowCollectiveMs (already validated when the session started)."""
    if isinstance(spec, planning.SessionSpec):
        return spec.slow_collective_ms
    try:
        return planning.parse_spec(spec).slow_collective_ms
    except planning.SpecError:
        return None
