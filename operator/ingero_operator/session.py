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
import time
from dataclasses import dataclass, field

import aiohttp
import kopf

from ingero.errors import IngeroError
from ingero.http_client import new_session
from ingero_operator import metrics
from ingero_operator import plan as planning
from ingero_operator.agents import AgentClient, AgentUnreachable, agent_tls
from ingero_operator.gather import LocalSession, build_artifact, fetch_new, ingest_and_analyse
from ingero_operator.kube import Kube, KubeError
from ingero_operator.settings import Settings
from ingero_operator.settings import GROUP, VERSION
from ingero_operator.status import bounded_warnings, lifecycle, node_row, now_iso, parse_iso, report_status

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
    announced: str | None = None                   # the live straggler an Event was posted for
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
    async def start(self, ref: Ref, spec_doc: dict, status: dict) -> None:
        try:
            spec = planning.parse_spec(spec_doc)
        except planning.SpecError as e:
            await self.patch(ref, {"phase": "Failed", "message": str(e), "observedGeneration": ref.generation,
                                   "conditions": lifecycle("Failed", "InvalidSpec", str(e), ref.generation,
                                                           status.get("conditions"))})
            self.event(ref, "Warning", "Failed", str(e))
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
                    await self.patch(ref, {"phase": "Failed", "message": msg, "observedGeneration": ref.generation,
                                           "conditions": lifecycle("Failed", "NoPods", msg, ref.generation,
                                                                   status.get("conditions"))})
                    self.event(ref, "Warning", "Failed", msg)
                    raise kopf.PermanentError(msg)
                msg = f"no running pod matches {sel} in namespace {ref.namespace}; waiting for the job"
                await self.patch(ref, {"phase": "Pending", "message": msg, "sessionId": ref.sid,
                                       "pendingSince": since.isoformat().replace("+00:00", "Z"),
                                       "observedGeneration": ref.generation,
                                       "conditions": lifecycle("Pending", "WaitingForPods", msg, ref.generation,
                                                               status.get("conditions"))})
                delay = self.s.timing.pending_retry_s
                if spec.duration_s:   # look again at the latest when the duration is up
                    delay = max(0.5, min(delay, spec.duration_s - (now - since).total_seconds()))
                raise kopf.TemporaryError(msg, delay=delay)
            start = parse_iso(status.get("startTime")) or dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
            deadline = start + dt.timedelta(seconds=spec.duration_s) if spec.duration_s else None
            rows, warnings = await self._reconcile(ref, spec, live, pods, deadline)
            if not any(r["agentReached"] for r in rows):
                msg = "no ingero agent could be reached: " + "; ".join(warnings)
                await self.patch(ref, {"phase": "Pending", "message": msg, "nodes": rows,
                                       "observedGeneration": ref.generation,
                                       "conditions": lifecycle("Pending", "AgentUnreachable", msg, ref.generation,
                                                               status.get("conditions"))})
                self.event(ref, "Warning", "AgentUnreachable", msg)
                raise kopf.TemporaryError(msg, delay=self.s.timing.pending_retry_s)
            msg = f"tracing {len(pods)} pods on {len(rows)} nodes ({sel})"
            await self.patch(ref, {
                "phase": "Running", "sessionId": ref.sid, "message": msg,
                "startTime": start.isoformat().replace("+00:00", "Z"),
                "deadline": deadline.isoformat().replace("+00:00", "Z") if deadline else None,
                "nodes": rows, "warnings": bounded_warnings(warnings, self.s.gather),
                "observedGeneration": ref.generation,
                "conditions": lifecycle("Running", "Tracing", msg, ref.generation, status.get("conditions"))})
            self.event(ref, "Normal", "Tracing", msg)
            log.info("%s/%s: %s", ref.namespace, ref.name, msg)

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
        spec = self.parse(ref, spec_doc)
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
            fetched = await self._fetch_all(ref, live, [r["name"] for r in rows if r["agentReached"]])
            warnings += fetched
            patch = {"nodes": rows}
            try:
                t_live = time.monotonic()
                rep, world = await asyncio.to_thread(ingest_and_analyse, self.local(ref),
                                                     {n: c[0] for n, c in live.clocks.items()},
                                                     _slow_ms(spec), self.s.timing.live_window_s,
                                                     self.s.timing.live_full_max_calls)
                metrics.DURATION.labels("live_analysis").observe(time.monotonic() - t_live)
                patch.update(report_status(rep, world, self.s.gather))
                warnings += rep.warnings
                st = patch.get("straggler")
                patch["conditions"] = lifecycle("Running", "Tracing", status.get("message") or "tracing",
                                                ref.generation, status.get("conditions"), straggler=st)
                who = (st or {}).get("who")
                if who and who != live.announced:
                    live.announced = who
                    self.event(ref, "Warning", "StragglerDetected",
                               f"{who}: cause {st.get('cause')}, saves {st.get('savingPct')}% of the step (live)")
            except Exception as e:  # live analysis is best effort; the final one decides
                warnings.append(f"live analysis failed: {type(e).__name__}: {e}")
            patch["warnings"] = bounded_warnings(live.sticky + warnings, self.s.gather)
            await self.patch(ref, patch)

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
                live.cursors[node], _, refused = await fetch_new(client, ref.sid, local, since, sem)
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
            await self.patch(ref, {"phase": "Gathering", "message": f"gathering: {reason}",
                                   "conditions": lifecycle("Gathering", "Gathering", f"gathering: {reason}",
                                                           ref.generation, status.get("conditions"))})
            t0 = time.monotonic()
            local = self.local(ref)
            nodes = sorted({n["name"] for n in status.get("nodes") or []} | set(live.planned) | set(local.nodes()))
            agents = await self.agents()
            gathered, warnings, rows = await self._gather_nodes(ref, live, agents, nodes)
            metrics.DURATION.labels("gather").observe(time.monotonic() - t0)
            try:
                t_merge = time.monotonic()
                rep, world = await asyncio.to_thread(build_artifact, local,
                                                     {n: c[0] for n, c in live.clocks.items()}, _slow_ms(spec),
                                                     self.s.timing.final_max_calls)
            except Exception as e:
                msg = f"merging the segments failed: {type(e).__name__}: {e}"
                await self.patch(ref, {"phase": "Failed", "message": msg, "endTime": now_iso(), "nodes": rows,
                                       "conditions": lifecycle("Failed", "MergeFailed", msg, ref.generation,
                                                               status.get("conditions"))})
                self.event(ref, "Warning", "Failed", msg)
                live.done = True
                return
            metrics.DURATION.labels("merge_and_analysis").observe(time.monotonic() - t_merge)
            warnings = bounded_warnings(live.sticky + warnings + rep.warnings, self.s.gather)
            # the report's own warnings are in `warnings` already: they must not replace the
            # operator's (a node unreachable while gathering was lost from report.json)
            full = {**rep.to_dict(), "sessionId": ref.sid, "reason": reason, "nodes": rows,
                    "warnings": warnings, "worldSize": world}
            local.report.write_text(json.dumps(full, indent=2, default=str) + "\n")
            msg = f"completed ({reason}); gathered {len(gathered)}/{len(nodes)} nodes in {time.monotonic() - t0:.1f} s"
            artifact = {"path": str(local.artifact), "report": str(local.report),
                        "bytes": local.artifact.stat().st_size}
            if spec.retention_h:
                end = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=spec.retention_h)
                artifact["expiresAt"] = end.replace(microsecond=0).isoformat().replace("+00:00", "Z")
            verdict = report_status(rep, world, self.s.gather)
            await self.patch(ref, {
                "phase": "Completed", "message": msg, "endTime": now_iso(), "nodes": rows,
                "warnings": warnings, "artifact": artifact, **verdict,
                "conditions": lifecycle("Completed", "Completed", msg, ref.generation, status.get("conditions"),
                                        straggler=verdict.get("straggler"), verdict=True)})
            live.done = True
            self.event(ref, "Normal", "Gathered", f"gathered {len(gathered)}/{len(nodes)} nodes; artifact "
                                                  f"{artifact['path']} ({artifact['bytes']:,} bytes)")
            st = verdict.get("straggler")
            if st:
                self.event(ref, "Warning", "StragglerDetected",
                           f"{st.get('who')}: cause {st.get('cause')}, saves {st.get('savingPct')}% of the step")
            self.event(ref, "Normal", "Completed", msg)
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
            client, err = agents.get(node), None
            for attempt in range(t.gather_retries):
                if client is None:
                    err = "no ingero agent Pod found on the node"
                    break
                try:
                    t0 = time.monotonic()
                    info = await client.stop(ref.sid)
                    t1 = time.monotonic()
                    live.clocks[node] = await client.clock_offset(t.clock_samples)
                    _, n, refused = await fetch_new(client, ref.sid, local, 0, sem)
                    live.sticky.extend(w for w in refused if w not in live.sticky)
                    log.info("%s/%s: node %s stopped in %.1f s, %d new segment files fetched in %.1f s",
                             ref.namespace, ref.name, node, t1 - t0, n, time.monotonic() - t1)
                    return True, node_row(node, True, (info or {}).get("state", "unknown"),
                                          (info or {}).get("pods", 0), info, live.clocks[node]), None
                except AgentUnreachable as e:
                    err = str(e)
                    await asyncio.sleep(t.retry_backoff_s * (attempt + 1))
            have = sum(1 for _ in local.node_dir(node).rglob("*.parquet")) if local.node_dir(node).exists() else 0
            part = f"{have} segment files fetched earlier are included" if have else "no data from it"
            return False, node_row(node, False, None, 0, None, live.clocks.get(node)), \
                f"node {node} could not be reached while gathering ({err}); the report is partial: {part}"

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
