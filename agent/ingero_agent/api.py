"""The agent's sessions: one ``ingero trace`` process per TraceSession, and its segments on disk.

``server.py`` puts this behind HTTP; this module knows nothing about HTTP.

Layout below the data directory (nothing is ever written outside it)::

    DATA/sessions/<id>/plan.json      what the operator asked for (kept across restarts)
    DATA/sessions/<id>/pods.json      the pods file handed to `ingero trace --pods`
    DATA/sessions/<id>/segments/      Parquet segments (resumed by a restarted tracer)
    DATA/sessions/<id>/ready          present once the probes are attached
    DATA/sessions/<id>/stopped        present once the operator stopped the session
    DATA/sessions/<id>/tracer.log     the tracer's output

A session found on disk with no tracer (the agent restarted) is reported as
``interrupted``; the operator's reconcile then posts the plan again, which
starts a new tracer that continues writing the same segment folder.
"""

from __future__ import annotations

import ctypes
import ipaddress
import json
import logging
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from ingero import readonly_sql, schema
from ingero.families import NAMES as PROBES
from ingero_agent import probecache

log = logging.getLogger("ingero.agent")

SESSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
SEGMENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,250}\.parquet$")
PR_SET_PDEATHSIG = 1


class ApiError(Exception):
    """A request the agent refuses: HTTP status and a one-line reason."""

    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


def check_session_id(sid) -> str:
    if not isinstance(sid, str) or not SESSION_ID.match(sid) or ".." in sid:
        raise ApiError(400, f"session id {sid!r} is invalid: use 1-128 letters, digits, '.', '_' "
                            "or '-', starting with a letter or digit")
    return sid


def check_segment(table: str, name: str) -> tuple[str, str]:
    if table not in schema.TABLES:
        raise ApiError(404, f"unknown table {table!r}: use one of {', '.join(schema.TABLES)}")
    if not SEGMENT_NAME.match(name) or ".." in name:
        raise ApiError(400, f"segment name {name!r} is invalid: a .parquet file name without '/' or '..'")
    return table, name


def _str_list(value, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ApiError(400, f"{where} must be a list of strings")
    return value


@dataclass
class Plan:
    """What to trace on this node for one session."""

    session_id: str
    pods: list[dict]
    probes: list[str] = field(default_factory=lambda: list(PROBES))
    nccl_lib: str | None = None
    sched_min_us: float | None = None
    duration_s: float | None = None
    rdma_s: float | None = None

    def same_probes(self, other: "Plan") -> bool:
        """True when only the pods differ: the running tracer can take the new pods."""
        return (self.probes == other.probes and self.nccl_lib == other.nccl_lib
                and self.sched_min_us == other.sched_min_us and self.duration_s == other.duration_s
                and self.rdma_s == other.rdma_s)

    def same_targets(self, other: "Plan") -> bool:
        """True when `other` traces exactly the same thing (the duration may differ)."""
        key = lambda p: sorted(json.dumps(x, sort_keys=True) for x in p.pods)  # noqa: E731
        return (key(self) == key(other) and self.probes == other.probes
                and self.nccl_lib == other.nccl_lib and self.sched_min_us == other.sched_min_us
                and self.rdma_s == other.rdma_s)


def parse_plan(body) -> Plan:
    """Check a POST /v1/sessions body; ApiError(400) names the bad field."""
    if not isinstance(body, dict):
        raise ApiError(400, "body must be a JSON object with session_id and pods")
    sid = check_session_id(body.get("session_id"))
    pods_in = body.get("pods")
    if not isinstance(pods_in, list):
        raise ApiError(400, "pods must be a list of {name, namespace, uid, containers, ips}")
    pods = []
    for i, p in enumerate(pods_in):
        where = f"pods[{i}]"
        if not isinstance(p, dict) or not all(isinstance(p.get(k), str) and p.get(k) for k in ("name", "uid")):
            raise ApiError(400, f"{where} needs string 'name' and 'uid'")
        for k in ("namespace", "node"):
            if p.get(k) is not None and not isinstance(p[k], str):
                raise ApiError(400, f"{where}.{k} must be a string")
        if not isinstance(p.get("containers") or [], list):
            raise ApiError(400, f"{where}.containers must be a list of {{name, id}}")
        containers = []
        for j, c in enumerate(p.get("containers") or []):
            if not isinstance(c, dict) or not isinstance(c.get("id", ""), str):
                raise ApiError(400, f"{where}.containers[{j}] must be {{name, id}}")
            containers.append({"name": str(c.get("name") or ""), "id": c.get("id") or ""})
        ips = _str_list(p.get("ips"), f"{where}.ips")
        for ip in ips:
            try:
                ipaddress.ip_address(ip)
            except ValueError:
                raise ApiError(400, f"{where}.ips: {ip!r} is not an IP address") from None
        pods.append({"name": p["name"], "namespace": p.get("namespace") or "default",
                     "uid": p["uid"], "node": p.get("node"),
                     "containers": containers, "ips": ips})
    probes = _str_list(body.get("probes"), "probes") or list(PROBES)
    bad = [p for p in probes if p not in PROBES]
    if bad:
        raise ApiError(400, f"unknown probe {bad[0]!r}: use {', '.join(PROBES)}")
    nccl_lib = body.get("nccl_lib")
    if nccl_lib is not None and (not isinstance(nccl_lib, str) or not nccl_lib.startswith("/")):
        raise ApiError(400, "nccl_lib must be an absolute path")
    nums = {}
    for k, most in (("sched_min_us", 60e6), ("duration_s", 30 * 24 * 3600.0), ("rdma_s", 3600.0)):
        v = body.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= most):
            raise ApiError(400, f"{k} must be a number from 0 to {most:g}")
        nums[k] = float(v) if v is not None else None
    if nums["duration_s"] == 0:
        nums["duration_s"] = None
    if nums["rdma_s"] is not None and 0 < nums["rdma_s"] < 0.1:
        raise ApiError(400, "rdma_s must be 0 (off) or from 0.1 to 3600")
    return Plan(sid, pods, [p for p in PROBES if p in probes], nccl_lib, **nums)


def _pdeathsig():
    """In the child: get SIGTERM (flush and exit) when the agent dies, and none of the
    memory bound the agent's own process keeps for its queries (readonly_sql.bound_process)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    readonly_sql.unbound_process()


class _Spawner(threading.Thread):
    """Starts every tracer from one long-lived thread: PR_SET_PDEATHSIG fires when
    the *thread* that forked exits, so request threads must not fork."""

    def __init__(self):
        super().__init__(name="ingero-spawner", daemon=True)
        self.jobs: queue.Queue = queue.Queue()

    def run(self):
        while True:
            argv, log, env, fut = self.jobs.get()
            try:
                with open(log, "ab") as f:
                    fut.set_result(subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env,
                                                    stdin=subprocess.DEVNULL, preexec_fn=_pdeathsig))
            except Exception as e:  # handed to the request thread
                fut.set_exception(e)

    def popen(self, argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
        fut: Future = Future()
        self.jobs.put((argv, log, env, fut))
        return fut.result(timeout=30)


@dataclass
class Session:
    id: str
    dir: Path
    plan: Plan
    proc: subprocess.Popen | None = None
    signalled: bool = False   # proc has had its SIGINT (stop); it only detaches once `done` exists
    started_ns: int | None = None
    starts: int = 0
    replans: int = 0          # pod lists handed to the running tracer (SIGHUP)

    @property
    def segments(self) -> Path:
        return self.dir / "segments"

    @property
    def stopped(self) -> bool:
        return (self.dir / "stopped").exists()

    def state(self) -> str:
        if self.stopped and (self.dir / "done").exists():
            return "stopped"   # its tracer may still be detaching probes; the data is complete
        if self.proc is not None and self.proc.poll() is None:
            return "running" if (self.dir / "ready").exists() else "starting"
        if self.stopped:
            return "stopped"
        if self.proc is None:
            return "interrupted"
        return "finished" if self.proc.returncode == 0 else "failed"


class SessionManager:
    """Every session of this agent; thread-safe (one lock, held briefly except in stop)."""

    def __init__(self, data_dir: Path, node: str, cgroup_root: Path | None = None,
                 trace_cmd: list[str] | None = None, stop_timeout_s: float = 30.0, max_bytes: int | None = None):
        self.data = Path(data_dir).resolve()
        self.max_bytes = max_bytes    # finished sessions are deleted, oldest first, beyond this
        self.root = self.data / "sessions"
        self.root.mkdir(parents=True, exist_ok=True)
        self.node = node
        self.cgroup_root = cgroup_root
        self.trace_cmd = trace_cmd or [sys.executable, "-m", "ingero", "trace"]
        self.stop_timeout_s = stop_timeout_s
        self.lock = threading.RLock()
        self.sessions: dict[str, Session] = {}
        self._meta_cache: dict[tuple, int] = {}
        self._spawner = _Spawner()
        self._spawner.start()
        for d in sorted(self.root.iterdir()):
            try:
                plan = Plan(**json.loads((d / "plan.json").read_text()))
                self.sessions[check_session_id(d.name)] = Session(d.name, d, plan)
            except (OSError, ValueError, TypeError, ApiError):
                continue  # not a session folder of ours

    # ---- paths -----------------------------------------------------------------
    def _inside(self, path: Path) -> Path:
        real = Path(os.path.realpath(path))
        if not real.is_relative_to(self.data):
            raise ApiError(400, "path leaves the data directory")
        return real

    def get(self, sid: str) -> Session:
        check_session_id(sid)
        with self.lock:
            s = self.sessions.get(sid)
        if s is None:
            raise ApiError(404, f"session {sid} is not known on node {self.node}")
        return s

    # ---- lifecycle -----------------------------------------------------------------
    def start(self, plan: Plan) -> tuple[int, dict]:
        """Start, resume or re-plan a session. Returns (HTTP status, session info)."""
        with self.lock:
            s = self.sessions.get(plan.session_id)
            if s is not None and s.state() in ("running", "starting") and s.plan.same_targets(plan):
                return 200, self.info(s)
            if s is not None and s.state() == "running" and s.plan.same_probes(plan):
                # Only the pods changed (a restarted rank is a new pod): the running tracer
                # re-reads the pods file on SIGHUP. Restarting it instead would lose the
                # communicators it saw created, and with them the other ranks' matching.
                self._write_pods(s, plan)
                s.plan = plan
                (s.dir / "plan.json").write_text(json.dumps(asdict(plan), indent=2))
                s.proc.send_signal(signal.SIGHUP)
                s.replans += 1
                return 200, self.info(s)
            if s is not None and s.state() in ("running", "starting"):
                self._stop_proc(s)  # other probes: restart the tracer on the same segments
            created = s is None
            if created:
                self.cap(keep=plan.session_id)   # room for the new one
            if s is None:
                d = self._inside(self.root / plan.session_id)
                s = Session(plan.session_id, d, plan)
            s.plan = plan
            s.dir.mkdir(parents=True, exist_ok=True)
            (s.dir / "stopped").unlink(missing_ok=True)
            (s.dir / "ready").unlink(missing_ok=True)
            (s.dir / "done").unlink(missing_ok=True)
            (s.dir / "plan.json").write_text(json.dumps(asdict(plan), indent=2))
            self._write_pods(s, plan)
            s.proc = self._spawner.popen(self._argv(s), s.dir / "tracer.log", self._env())
            s.signalled = False
            s.started_ns = time.time_ns()
            s.starts += 1
            self.sessions[s.id] = s
            return (201 if created else 200), self.info(s)

    def _write_pods(self, s: Session, plan: Plan) -> None:
        """The pods file of `ingero trace --pods`, replaced atomically (a tracer may read it)."""
        doc = {"node": self.node, "pods": [dict(p, node=p.get("node") or self.node) for p in plan.pods]}
        if self.cgroup_root is not None:
            doc["cgroup_root"] = str(self.cgroup_root)
        tmp = s.dir / "pods.json.tmp"
        tmp.write_text(json.dumps(doc, indent=2))
        os.replace(tmp, s.dir / "pods.json")

    def _env(self) -> dict[str, str]:
        """A tracer's environment: the agent's, with the compiled probes kept in the node's
        cache folder, or in the data folder where that cannot be written (a container's root
        file system is read-only); INGERO_BPF_CACHE, when set, says where."""
        where = probecache.DEFAULT_DIR
        if not probecache.writable(where):
            where = self.data / "bpf-cache"
        return {probecache.ENV: str(where), **os.environ}

    def _argv(self, s: Session) -> list[str]:
        p = s.plan
        argv = [*self.trace_cmd, "--pods", str(s.dir / "pods.json"), "--node", self.node,
                "--segments", str(s.segments), "--session-id", s.id,
                "--ready-file", str(s.dir / "ready"), "--done-file", str(s.dir / "done"), "--quiet", "--probes", ",".join(p.probes)]
        if p.nccl_lib:
            argv += ["--nccl-lib", p.nccl_lib]
        if p.sched_min_us is not None:
            argv += ["--sched-min-us", str(p.sched_min_us)]
        if p.rdma_s is not None:
            argv += ["--rdma-seconds", str(p.rdma_s)]
        if p.duration_s:
            argv += ["--duration", f"{p.duration_s:g}s"]
        return argv

    def _stop_proc(self, s: Session) -> None:
        """SIGINT the tracer; return once its last segments are on disk (its `done`
        file) or it has exited. Detaching uprobes afterwards takes it seconds more,
        which nobody needs to wait for: nor does a second stop (or the DELETE after a
        stop) of a tracer that has written `done` already."""
        if s.proc is None or s.proc.poll() is not None:
            return
        done = s.dir / "done"
        if s.signalled and done.exists():
            return
        done.unlink(missing_ok=True)
        s.signalled = True
        s.proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + self.stop_timeout_s
        while s.proc.poll() is None and not done.exists():
            if time.monotonic() > deadline:
                s.proc.kill()
                s.proc.wait()
                return
            time.sleep(0.05)

    def stop(self, sid: str) -> dict:
        """Stop tracing (idempotent): SIGINT the tracer and wait for its last segments."""
        s = self.get(sid)
        (s.dir / "stopped").touch()
        self._stop_proc(s)
        self.cap(keep=sid)
        return self.info(s)

    def cap(self, keep: str | None = None) -> list[str]:
        """--data-max-bytes: delete stopped, finished or failed sessions (never a running,
        starting or interrupted one, nor `keep`), oldest stop first, until the data folder
        holds at most that many bytes. Returns the deleted session ids."""
        if not self.max_bytes:
            return []
        with self.lock:
            sessions = list(self.sessions.values())

        def size(d: Path) -> int:
            return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())

        sizes = {s.id: size(s.dir) for s in sessions if s.dir.is_dir()}
        total = sum(sizes.values())
        done = [s for s in sessions if s.id != keep and s.id in sizes
                and s.state() in ("stopped", "finished", "failed")]
        when = {s.id: (s.dir / "stopped").stat().st_mtime if s.stopped else s.dir.stat().st_mtime for s in done}
        gone = []
        for s in sorted(done, key=lambda s: when[s.id]):
            if total <= self.max_bytes:
                break
            with self.lock:
                self.sessions.pop(s.id, None)
            shutil.rmtree(self._inside(s.dir), ignore_errors=True)
            total -= sizes[s.id]
            gone.append(s.id)
            log.warning("session %s deleted (%d bytes, stopped the longest ago) to keep %s under --data-max-bytes %d",
                        s.id, sizes[s.id], self.data, self.max_bytes)
        if total > self.max_bytes:
            log.warning("%s holds %d bytes, over --data-max-bytes %d, in sessions still tracing or resumable",
                        self.data, total, self.max_bytes)
        return gone

    def delete(self, sid: str) -> None:
        s = self.get(sid)
        self.stop(sid)
        with self.lock:
            self.sessions.pop(sid, None)
        shutil.rmtree(self._inside(s.dir), ignore_errors=True)

    def shutdown(self) -> None:
        """Agent exit: stop tracers but keep sessions resumable (no 'stopped' mark)."""
        with self.lock:
            sessions = list(self.sessions.values())
        for s in sessions:
            self._stop_proc(s)

    # ---- reading -----------------------------------------------------------------
    def _files(self, s: Session):
        for table in schema.TABLES:
            d = s.segments / table
            if not d.is_dir():
                continue
            for f in sorted(d.iterdir()):
                if SEGMENT_NAME.match(f.name):
                    yield table, f

    def _rows(self, f: Path, st: os.stat_result) -> int:
        key = (str(f), st.st_size, st.st_mtime_ns)
        if key not in self._meta_cache:
            try:
                self._meta_cache[key] = pq.read_metadata(f).num_rows
            except (OSError, ValueError):
                return 0
        return self._meta_cache[key]

    def counts(self, s: Session) -> tuple[dict, dict, int]:
        """({event table: rows}, {ring: events lost}, bytes on disk) of a session so far."""
        events = {t: 0 for t in schema.EVENT_TABLES}
        lost: dict = {}
        size = 0
        for table, f in self._files(s):
            try:
                st = f.stat()
            except FileNotFoundError:
                continue
            size += st.st_size
            if table in events:
                events[table] += self._rows(f, st)
            elif table == "nodes":
                try:
                    cols = [c for c in pq.read_schema(f).names if c.startswith("lost_")]   # one per ring
                    for r in pq.read_table(f, columns=cols).to_pylist():
                        for c, v in r.items():
                            lost[c[len("lost_"):]] = lost.get(c[len("lost_"):], 0) + (v or 0)
                except (OSError, ValueError):
                    pass
        return events, lost, size

    def all_sessions(self) -> list[Session]:
        with self.lock:
            return list(self.sessions.values())

    def info(self, s: Session) -> dict:
        events, lost_by_ring, _ = self.counts(s)
        lost = sum(lost_by_ring.values())
        proc = s.proc
        return {"session_id": s.id, "node": self.node, "state": s.state(),
                "pods": len(s.plan.pods), "probes": s.plan.probes, "events": sum(events.values()),
                "events_by_table": events, "lost": lost, "starts": s.starts, "replans": s.replans,
                "exit_code": proc.returncode if proc is not None and proc.poll() is not None else None,
                "log_tail": self.log_tail(s) if s.state() == "failed" else None}

    def log_tail(self, s: Session, lines: int = 5) -> str:
        try:
            return "\n".join((s.dir / "tracer.log").read_text(errors="replace").strip().splitlines()[-lines:])
        except OSError:
            return ""

    def list_segments(self, sid: str, since_ns: int = 0) -> dict:
        s = self.get(sid)
        out, cursor = [], since_ns
        for table, f in self._files(s):
            try:
                st = f.stat()
            except FileNotFoundError:
                continue
            cursor = max(cursor, st.st_mtime_ns)
            if st.st_mtime_ns > since_ns:
                out.append({"table": table, "name": f.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
        return {"session_id": sid, "node": self.node, "state": s.state(), "cursor": cursor, "segments": out}

    def segment_path(self, sid: str, table: str, name: str) -> Path:
        s = self.get(sid)
        check_segment(table, name)
        path = self._inside(s.segments / table / name)
        if not path.is_file():
            raise ApiError(404, f"segment {table}/{name} not found in session {sid}")
        return path
