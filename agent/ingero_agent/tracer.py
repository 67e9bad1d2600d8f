"""The tracing loop: drain rings, rescan targets, write segments, stop cleanly.

The loop sleeps in epoll on the ring buffers (``ringbuf.RingWaiter``) and
works on timers. The probes write without waking it until a ring is a
quarter full (the watermark in bpf/ingero.h), so the rings are drained
right before each segment roll (every ``roll_s``) and at once for a burst,
with three quarters of the ring still free; a quiet ring costs nothing in
between. (With bcc's callback reader, the fallback, rings are polled every
``poll_s``.) Targets are rescanned once a second (new pod cgroups, clock
offset; state tables are written at each roll) and by quick scans (new
processes in known target cgroups, libraries of young ones) every
``quick_scan_s`` while something is new, backing off to the full-scan
period while nothing changes; an exec by a target process (``exec_notes``)
wakes the loop for a quick scan 20 ms later.
On SIGINT/SIGTERM or at the end of --duration the rings are drained until
empty, the final segments and the DuckDB file are written: nothing the
kernel recorded is dropped on the way out.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ingero import __version__, schema
from ingero.errors import IngeroError, NotPermitted
from ingero.store import SegmentWriter, build_duckdb
from ingero.families import RINGS, rings_of
from ingero.schema import Op
from ingero_agent.decode import DECODERS, Identity, Registry, mono_to_wall, op_name
from ingero_agent.devinflight import Reader as DeviceReader, read_all as read_device
from ingero_agent.inflight import FrameReader, snapshot
from ingero_agent.probes import ProbeConfig, Probes
from ingero_agent.procinfo import int_or_none
from ingero_agent.rdma import RdmaSampler
from ingero_agent.records import NCCL_F_PENDING
from ingero_agent.stackscan import StackScanner, scan_supported
from ingero_agent.targets import TargetSet, load_pods

# creations whose rank is the process's rank in a fresh world
RANKED_INIT_OPS = (Op.COMM_INIT_RANK, Op.COMM_INIT_RANK_CONFIG, Op.COMM_INIT_RANK_SCALABLE)


@dataclass
class TraceOptions:
    segments: Path
    node: str
    session_id: str
    probe_config: ProbeConfig
    out: Path | None = None
    duration_s: float | None = None
    nccl_libs: list[tuple[Path, tuple[int, int], dict[str, int]]] = field(default_factory=list)
    profiler_libs: list[tuple[Path, tuple[int, int]]] = field(default_factory=list)   # attached up front
    ready_file: Path | None = None
    pods_file: Path | None = None   # re-read on SIGHUP (the agent's re-plan); without it SIGHUP stops
    done_file: Path | None = None   # touched when the last segments are written
    quiet: bool = False
    poll_s: float = 0.05       # drain period when the rings cannot wake the tracer (callback reader)
    quick_scan_s: float = 0.1  # new processes in known target cgroups, libraries of young ones;
    #                            doubles while nothing is new, up to scan_s
    exec_scan_delay_s: float = 0.02   # quick scan this long after a target process's exec
    #                            (its loader maps the libraries meanwhile), at most every quick_scan_s
    scan_s: float = 1.0        # full rescan: also new pod/container cgroups, clock offset
    progress_s: float = 1.0
    roll_s: float = 2.0        # segment roll period: drain, state tables, write segments
    rdma_s: float = 1.0        # RDMA port counters read this often (0: not at all)
    sysfs: Path | None = None  # the sysfs holding class/infiniband (default: /sys)


class Tracer:
    def __init__(self, opts: TraceOptions, targets: TargetSet, log=None):
        self.opts = opts
        self.targets = targets
        self.log = log or (lambda msg: print(f"ingero: {msg}", file=sys.stderr, flush=True))
        self.events = {r: 0 for r in RINGS}   # per ring
        # the holders of connections the kernel gave no owner are looked up in the targets' /proc
        self.registry = Registry(proc=getattr(targets, "proc", Path("/proc")))
        self.comm_rows: list[dict] = []
        self.init_rank: dict[int, tuple[int, int]] = {}   # pid -> (nranks, rank) of its widest comm
        self.nccl_pids: set[int] = set()
        self._unknown_pids: set[int] = set()   # reported by the kernel, gone before we looked
        self.lost = {f: 0 for f in self.events}
        self._stop = False
        self._reload = False
        self._news = False                     # a scan or the kernel showed something new
        self.quick_every = 0.0                 # current quick-scan period (backs off)
        self.drains = 0
        self._state_rows: dict[str, list[dict]] = {}   # state tables as last handed to the writer
        self.loop_cpu_s = self.loop_wall_s = None   # this process's CPU (all threads) while tracing
        self.status = "running"
        self.probes: Probes | None = None
        self.writer: SegmentWriter | None = None
        self.frames: FrameReader | None = None           # open NCCL calls (ingero_agent.inflight)
        self.stacks: StackScanner | None = None          # calls entered before the probes attached
        self.inflight: dict[tuple[int, int], dict] = {}  # (pid, tid) -> its last nccl_inflight row
        self.device = DeviceReader()                     # operations open in the profiler plugin
        self.device_open: dict[int, list[dict]] = {}     # pid -> its last nccl_device_inflight rows
        self.device_s = 0.0                              # time spent reading the plugin's tables, all rolls
        self.inflight_s = 0.0                            # time spent reading them, all rolls
        self._noted_threads = False
        self.rdma: RdmaSampler | None = None             # RDMA port counters (ingero_agent.rdma)

    # ---- lifecycle -----------------------------------------------------------
    def request_stop(self, *_):
        self._stop = True
        if self.probes is not None and self.probes.waiter is not None:
            self.probes.waiter.notify()

    def request_reload(self, *_):
        self._reload = True
        if self.probes is not None and self.probes.waiter is not None:
            self.probes.waiter.notify()

    def run(self) -> int:
        old = {s: signal.signal(s, self.request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        # SIGHUP: re-read the pods file and keep tracing (the communicators seen so far stay
        # known, which a restart would lose); with no pods file, a hang-up stops cleanly
        old[signal.SIGHUP] = signal.signal(signal.SIGHUP, self.request_reload if self.opts.pods_file
                                           else self.request_stop)
        self.started_ns = time.time_ns()
        self.offset_ns, self.clock_rtt_ns = mono_to_wall()   # _finish writes state with it, even
        t_load = time.monotonic()                              # after a failed start
        try:
            self.probes = Probes(self.opts.probe_config)
            for note in self.probes.notes:
                self.log(f"note: {note}")
            if "nccl" in self.opts.probe_config.families:
                self.frames = FrameReader(self.probes.bpf, "-DINGERO_TASK_STORAGE=1" in self.probes.cflags)
                if scan_supported():
                    self.stacks = StackScanner(getattr(self.targets, "proc", Path("/proc")))
            self.writer = SegmentWriter(self.opts.segments, self.opts.node, self.opts.session_id,
                                        roll_seconds=self.opts.roll_s)
            for path, key, syms in self.opts.nccl_libs:
                self._attach(path, key, syms)
                self.targets.mark_library_attached(key)
            for path, key in self.opts.profiler_libs:
                self._attach_profiler(path, key)
                self.targets.mark_library_attached(key)
            self.offset_ns, self.clock_rtt_ns = mono_to_wall()
            self._scan()
            gone = self.targets.pids_gone()
            if gone is not None and len(gone) == len(self.targets.pids):
                raise IngeroError(f"pid {', '.join(map(str, gone))} exited before the probes were attached "
                                  f"(loading them took {time.monotonic() - t_load:.1f} s); start the trace "
                                  "earlier, or trace the job's cgroup (--cgroup) to follow new processes")
            self._put_inflight()     # at attach: the calls threads were inside already (a hung job)
            self._put_device_inflight()
            if self.opts.ready_file:
                Path(self.opts.ready_file).touch()
            self.log(f"tracing {','.join(self.opts.probe_config.families)} for "
                     f"{self.targets.describe()} on node {self.opts.node}, session "
                     f"{self.opts.session_id} (probes loaded in {time.monotonic() - t_load:.1f} s, "
                     f"{self.probes.compiled} in {self.probes.compile_cpu_s:.1f} s of CPU); "
                     "Ctrl-C to stop")
            cpu0, wall0 = _cpu_seconds(), time.monotonic()
            self._loop()
            self.loop_cpu_s, self.loop_wall_s = _cpu_seconds() - cpu0, time.monotonic() - wall0
            self.status = "stopped" if self._stop else "completed"
        except BaseException:
            self.status = "failed"
            raise
        finally:
            try:
                self._finish()
            finally:
                for s, h in old.items():
                    # stopped by a signal: one more (a second Ctrl-C, an agent's retry) while the
                    # process exits must not kill a finished trace (Python's exit puts its default
                    # back for every signal with a Python handler: ignored, it stays ignored)
                    signal.signal(s, signal.SIG_IGN if self._stop and s in (signal.SIGINT, signal.SIGTERM) else h)
        return 0

    def _loop(self) -> None:
        o = self.opts
        waiter = self.probes.waiter
        if waiter is not None:
            for fam in self.probes.rings:
                self.probes.arm_wakeup(fam)
        t0 = time.monotonic()
        deadline = t0 + o.duration_s if o.duration_s is not None else None
        self.quick_every = o.quick_scan_s
        next_scan = t0 + o.scan_s
        next_quick = t0 + o.quick_scan_s
        last_exec_scan, exec_pending = -float("inf"), False
        gone_since = None        # since when every --pid target has exited
        next_roll = t0 + o.roll_s
        next_poll = t0 + o.poll_s if waiter is None else float("inf")
        next_progress = t0 + o.progress_s if not o.quiet else float("inf")
        self.rdma = RdmaSampler(o.sysfs) if o.rdma_s > 0 else None
        next_rdma = t0 if self.rdma is not None else float("inf")
        end = deadline if deadline is not None else float("inf")
        while not self._stop:
            now = time.monotonic()
            due = min(next_scan, next_quick, next_roll, next_poll, next_progress, next_rdma, end)
            woke = False
            if due > now:
                if waiter is not None:
                    woke = waiter.wait(due - now)
                else:
                    time.sleep(due - now)
                now = time.monotonic()
            if self._stop or now >= end:
                break
            if self._reload:
                self._reload = False
                self._reload_pods()
                next_scan = now + o.scan_s
                next_quick = now + self._next_quick_period()
            if self._exec_noted():   # a target process exec'd: quick scan soon
                self.quick_every = o.quick_scan_s
                next_quick = min(next_quick, max(now + o.exec_scan_delay_s,
                                                 last_exec_scan + o.quick_scan_s))
                exec_pending = True
            if woke or now >= next_roll or now >= next_poll:
                self._drain()
                next_poll = now + o.poll_s if waiter is None else next_poll
            if now >= next_quick and exec_pending:   # at most every quick_scan_s for execs
                exec_pending, last_exec_scan = False, now
            if now >= next_scan:
                self._scan()
                self._put_device_inflight()    # a process's proxy summaries die with it: read often
                next_scan = now + o.scan_s
                gone = self.targets.pids_gone()
                if not gone or len(gone) < len(self.targets.pids):
                    gone_since = None
                elif gone_since is None:
                    gone_since = now
                elif now - gone_since >= o.scan_s:   # a scan later: their last events are drained
                    self.log(f"every target process exited (pid {', '.join(map(str, gone))}); stopping")
                    break
                next_quick = now + self._next_quick_period()
            elif now >= next_quick:
                self._scan(quick=True)
                next_quick = now + self._next_quick_period()
            if now >= next_rdma:
                self._sample_rdma()
                next_rdma = now + o.rdma_s
            if now >= next_roll:
                self._put_state()
                self.writer.flush(wait=False)
                next_roll = now + o.roll_s
            if now >= next_progress:
                self._progress(now - t0)
                next_progress = now + o.progress_s

    def _reload_pods(self) -> None:
        try:
            spec = load_pods(self.opts.pods_file)
        except IngeroError as e:
            self.log(f"kept the previous pods: {e}")
            return
        self.targets.replace_pods(spec)
        self._scan()
        self._news = True
        self.log(f"re-read {self.opts.pods_file}: {len(self.targets.pods)} pods, "
                 f"{sum(p.alive for p in self.targets.processes.values())} target processes")

    def _next_quick_period(self) -> float:
        """Quick scans every quick_scan_s while something is new; doubling to scan_s otherwise."""
        o = self.opts
        if self._news:
            self.quick_every = o.quick_scan_s
        else:
            self.quick_every = min(o.scan_s, max(o.quick_scan_s, 2 * self.quick_every))
        self._news = False
        return self.quick_every

    def _exec_noted(self) -> bool:
        notes = self.probes.exec_notes
        return notes is not None and len(notes.read()) > 0

    def _finish(self) -> None:
        if self.probes is None:
            return
        try:
            if self.writer is not None:
                for _ in range(100):   # until every ring is empty
                    if not self._drain():
                        break
                self.ended_ns = time.time_ns()
                self._put_state()
                self.writer.close()
                self._summary()
                if self.opts.out is not None:
                    build_duckdb([self.opts.segments], self.opts.out)
                    self.log(f"wrote {self.opts.out} (segments in {self.opts.segments})")
                if self.opts.done_file:
                    Path(self.opts.done_file).touch()
        finally:
            # Everything recorded is on disk before this: detaching waits for the kernel
            # (a grace period per uprobe_multi link, side by side; ~0.1 s per probe where
            # each uprobe is a perf event)
            t0 = time.monotonic()
            self.probes.close()
            self.log(f"probes detached in {time.monotonic() - t0:.2f} s")

    # ---- steps -----------------------------------------------------------------
    def _attach(self, path, key, syms) -> None:
        names = self.probes.attach_library(path, key, syms)
        if names:
            missing = [n for n in syms if n not in names]
            self.log(f"attached {len(names)} NCCL functions in {path}"
                     + (f" (aliases skipped: {','.join(missing)})" if missing else ""))

    def _attach_profiler(self, path, key) -> None:
        """The profiler plugin's probe; a plugin this agent cannot read is noted, not fatal."""
        try:
            if self.probes.attach_profiler(path, key):
                self.log(f"attached the NCCL profiler probe in {path}")
        except IngeroError as e:
            self.log(f"note: {e}")

    def _drain(self) -> int:
        got = 0
        self.drains += 1
        for fam, ring in self.probes.rings.items():
            arr = ring.read()
            if len(arr):
                got += len(arr)
                self._handle(fam, arr)
                if self.probes.waiter is not None:
                    self.probes.arm_wakeup(fam)
        return got

    def _handle(self, fam: str, arr: np.ndarray) -> None:
        pids = [p for p in np.unique(arr["pid"]).tolist()
                if p and p not in self.registry.by_pid and p not in self._unknown_pids]
        if pids:   # started and traced between two scans: identify it now (or, gone, by its cgroup)
            self._news = True
            first = np.unique(arr["pid"], return_index=True)
            cgroup_of = dict(zip(first[0].tolist(), arr["cgroup_id"][first[1]].tolist()))
            self.targets.learn(pids, cgroup_of)
            self._unknown_pids.update(p for p in pids if p not in self.targets.processes)
            self._update_registry()
        if fam == "nccl":
            self._note_comms(arr)
        elif fam == "nccl_profiler":
            self.nccl_pids.update(np.unique(arr["pid"]).tolist())
        cols = DECODERS[fam](arr, self.offset_ns, self.registry)
        if fam == "tcp" and self.registry.sockets is not None:
            for note in self.registry.sockets.take_notes():
                self.log(f"note: {note}")
        self.writer.append(RINGS[fam].table, cols)
        self.events[fam] += len(arr)

    def _note_comms(self, a: np.ndarray) -> None:
        self.nccl_pids.update(np.unique(a["pid"]).tolist())
        # ncclInProgress (7) is success: a non-blocking init has its handle already; a
        # non-blocking split/shrink has none yet (NCCL_F_PENDING) but its identity counts.
        ok = np.isin(a["ret"], schema.NCCL_OK_RETS)
        made = (a["comm"] != 0) | ((a["flags"] & NCCL_F_PENDING) != 0)
        sel = np.flatnonzero(np.isin(a["op"], schema.COMM_CREATE_OPS) & ok & made)
        changed = False
        for r in a[sel]:
            pid, rank, nranks, op = int(r["pid"]), int(r["rank"]), int(r["nranks"]), Op(int(r["op"]))
            self.comm_rows.append({
                "pid": pid, "comm": int(r["comm"]), "comm_id_hash": int(r["comm_hash"]),
                "rank": rank, "nranks": nranks, "op": op.name,
                "parent_hash": int(r["parent_hash"]) if op in schema.DERIVED_COMM_OPS else None,
                # COMM_GROW of an existing rank: the parent's grow number (ingero/comms.py)
                "color": (int(r["color"]) if op == Op.COMM_SPLIT or (op == Op.COMM_GROW and int(r["parent_hash"]))
                          else None),
                "split_key": int(r["key"]) if op == Op.COMM_SPLIT else None,
                "timestamp_ns": int(r["ts_ns"]) + self.offset_ns,
            })
            if op in RANKED_INIT_OPS and rank >= 0 and nranks > self.init_rank.get(pid, (-1, -1))[0]:
                self.init_rank[pid] = (nranks, rank)
                changed = True
        if changed:
            self._update_registry()

    def _scan(self, quick: bool = False) -> None:
        snap = self.targets.scan(quick=quick)
        if snap.new_processes or snap.new_libraries or snap.awaiting_library:
            self._news = True
        self.probes.set_targets(snap.cgroup_ids, snap.tgids, snap.ips)
        for note in snap.notes:
            self.log(f"note: {note}")
        for path, key, syms in snap.new_libraries:
            self._attach(path, key, syms)
        for path, key in snap.new_profilers:
            self._attach_profiler(path, key)
        if quick:
            if snap.new_processes:
                self._update_registry()
            return
        self.offset_ns, self.clock_rtt_ns = mono_to_wall()
        self._update_registry()

    def _update_registry(self) -> None:
        reg = self.registry
        for p in self.targets.processes.values():
            rank = p.rank
            if rank is None and p.pid in self.init_rank:
                rank = self.init_rank[p.pid][1]
            reg.by_pid[p.pid] = Identity(rank, p.pod.name if p.pod else None,
                                         p.pod.namespace if p.pod else None)
        # Address -> every (pod, rank) with it: hostNetwork pods share the node's address, a
        # pod may run several ranks; the registry names only what they agree on.
        owners: dict[str, list[Identity]] = {}
        for pod in self.targets.pods:
            ranks = {reg.by_pid[p.pid].rank for p in self.targets.processes.values()
                     if p.pod is pod and p.pid in reg.by_pid and reg.by_pid[p.pid].rank is not None}
            for ip in pod.ips:
                owners.setdefault(ip, []).extend(Identity(r, pod.name, pod.namespace)
                                                 for r in (sorted(ranks) or [None]))
        reg.set_addresses(owners)

    def _put_rows(self, table: str, rows: list[dict]) -> None:
        """Hand a state table to the writer when it changed since the last roll (its file stays)."""
        if self._state_rows.get(table) == rows:
            return
        self.writer.put_rows(table, rows)
        self._state_rows[table] = list(rows)

    def _put_state(self) -> None:
        rows = []
        for p in self.targets.processes.values():
            if p.nccl_key is None and "RANK" not in p.env and p.pid not in self.nccl_pids:
                continue
            ident = self.registry.by_pid.get(p.pid)
            e = p.env
            rows.append({
                "pid": p.pid, "rank": ident.rank if ident else None,
                "local_rank": int_or_none(e.get("LOCAL_RANK")), "world_size": int_or_none(e.get("WORLD_SIZE")),
                "local_world_size": int_or_none(e.get("LOCAL_WORLD_SIZE")),
                "group_rank": int_or_none(e.get("GROUP_RANK")), "run_id": e.get("TORCHELASTIC_RUN_ID"),
                "master_addr": e.get("MASTER_ADDR"), "master_port": int_or_none(e.get("MASTER_PORT")),
                "cgroup_id": p.cgroup_id, "cgroup_path": str(p.cgroup_path) if p.cgroup_path else None,
                "pod": p.pod.name if p.pod else None, "namespace": p.pod.namespace if p.pod else None,
                "process": p.name, "nccl_lib": str(p.nccl_path) if p.nccl_path else None,
                "addresses": ",".join(p.pod.ips) if p.pod and p.pod.ips else None,
                "first_seen_ns": p.first_seen_ns,
            })
        self._put_rows("ranks", rows)
        self._put_rows("comms", self.comm_rows)
        self._put_inflight()
        self._put_device_inflight()
        totals = []
        for tgid, reason, total, intervals in self.probes.sched_totals():
            ident = self.registry.by_pid.get(tgid)
            totals.append({"pid": tgid, "rank": ident.rank if ident else None,
                           "reason": schema.OFFCPU_REASONS.get(reason), "total_ns": total,
                           "intervals": intervals})
        self._put_rows("sched_totals", totals)
        if self.rdma is not None:
            self._put_rows("rdma_ports", self.rdma.port_rows())
            self._put_rows("rdma_ranks", self.rdma.rank_rows(
                [(r["pid"], r["rank"], self.targets.processes[r["pid"]].env) for r in rows],
                getattr(self.targets, "proc", Path("/proc"))))
        lost = self.probes.lost()
        for fam, ring in self.probes.rings.items():
            lost[fam] += ring.skipped
        self.lost = lost
        ended = getattr(self, "ended_ns", None)
        uname = os.uname()
        self._put_rows("nodes", [{
            "hostname": uname.nodename, "kernel": uname.release, "agent_version": __version__,
            "mono_to_wall_ns": self.offset_ns, "clock_offset_ns": None,
            "clock_rtt_ns": self.clock_rtt_ns,
            **{f"lost_{f}": lost[f] for f in lost}, **{f"events_{f}": self.events[f] for f in self.events},
            "started_ns": self.started_ns, "ended_ns": ended,
        }])
        self._put_rows("sessions", [{
            "started_ns": self.started_ns, "ended_ns": ended,
            "probes": ",".join(self.opts.probe_config.families),
            "targets": self.targets.describe(), "status": self.status,
        }])

    def _sample_rdma(self) -> None:
        mono = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        rows = self.rdma.sample(mono)
        if rows:
            dev, port, name, delta, interval = zip(*rows)
            self.writer.append("rdma_counters", {
                "timestamp_ns": np.full(len(rows), mono + self.offset_ns, np.int64), "device": list(dev),
                "port": list(port), "counter": list(name), "delta": list(delta), "interval_ns": list(interval)})

    def _put_inflight(self) -> None:
        """Each NCCL process's threads now: state, and the NCCL call each is inside, if any
        (a thread that is gone keeps its last row: a rank killed inside a call shows it)."""
        if self.frames is None:
            return
        t0 = time.perf_counter()
        pids = [p.pid for p in self.targets.processes.values()
                if p.alive and (p.nccl_key is not None or p.pid in self.nccl_pids)]
        mono = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        for row in snapshot(self.frames, getattr(self.targets, "proc", Path("/proc")), pids, self.offset_ns,
                            mono + self.offset_ns, lambda pid: getattr(self.registry.by_pid.get(pid), "rank", None),
                            stacks=self._stack_calls if self.stacks is not None else None, previous=self.inflight):
            self.inflight[(row["pid"], row["tid"])] = row
        if not self.frames.threads_readable and not self._noted_threads:
            self._noted_threads = True
            self.log("note: this kernel opens no pidfd of a thread (PIDFD_THREAD, Linux 6.9): calls in "
                     "flight are seen on each process's main thread only")
        self._put_rows("nccl_inflight", list(self.inflight.values()))
        self.inflight_s += time.perf_counter() - t0

    def _put_device_inflight(self) -> None:
        """The operations the profiler plugin of each process holds open (a process that is gone
        keeps its last rows: a collective its rank died in shows it), and its proxy summaries."""
        t0 = time.perf_counter()
        # every NCCL process: NCCL loads the plugin at its first communicator, after its library
        pids = [p.pid for p in self.targets.processes.values()
                if p.alive and (p.nccl_key is not None or p.pid in self.nccl_pids)]
        now = time.clock_gettime_ns(time.CLOCK_MONOTONIC) + self.offset_ns
        rank_of = lambda pid: getattr(self.registry.by_pid.get(pid), "rank", None)  # noqa: E731
        open_rows, proxy = read_device(self.device, pids, self.offset_ns, now, rank_of)
        self.device_open.update(open_rows)
        self._put_rows("nccl_device_inflight", [r for rows in self.device_open.values() for r in rows])
        if proxy:
            self.writer.append("nccl_proxy", {c: [r[c] for r in proxy] for c in proxy[0]})
        self.device_s += time.perf_counter() - t0

    def _stack_calls(self, pid: int, tids: list[int]) -> dict[int, str]:
        """tid -> the op of the NCCL API call the thread is inside, read from its stack."""
        p = self.targets.processes.get(pid)
        if p is None or p.nccl_path is None:
            return {}
        return {tid: op_name(fn) for tid, fn in
                self.stacks.calls(pid, tids, p.nccl_path, p.nccl_key, p.nccl_symbols).items()}

    def _progress(self, elapsed: float) -> None:
        lost = self.probes.lost()
        ev = " ".join(f"{r} {self.events[r]}" for r in self._rings())
        ls = "/".join(str(lost[r]) for r in self._rings())
        live = sum(1 for p in self.targets.processes.values() if p.alive)
        self.log(f"{elapsed:5.0f}s events: {ev}; lost {ls}; {live} target processes")

    def _rings(self) -> list[str]:
        return [r.name for r in rings_of(self.opts.probe_config.families)]

    def _summary(self) -> None:
        ev = ", ".join(f"{self.events[r]} {r}" for r in self._rings())
        lost = ", ".join(f"{self.lost[r]} {r}" for r in self._rings())
        self.log(f"{self.status}: recorded {ev} events; lost {lost}; "
                 f"{len(self.comm_rows)} communicators, {self.writer.segments_written} segment files")
        if self.loop_cpu_s is not None and self.loop_wall_s:
            self.log(f"tracing used {self.loop_cpu_s:.2f} s CPU in {self.loop_wall_s:.1f} s "
                     f"({100 * self.loop_cpu_s / self.loop_wall_s:.2f}% of a core), "
                     f"{self.drains} ring drains, {self.inflight_s * 1e3:.0f} ms reading calls in flight, "
                     f"{self.device_s * 1e3:.0f} ms reading the profiler plugin's tables")


def _cpu_seconds() -> float:
    """User + system CPU of this process, every thread."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def require_privileges() -> None:
    """Tracing needs root or CAP_BPF+CAP_PERFMON (or CAP_SYS_ADMIN)."""
    if os.geteuid() == 0:
        return
    caps = 0
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                caps = int(line.split()[1], 16)
    except OSError:
        pass
    if caps & (1 << 21) or (caps & (1 << 39) and caps & (1 << 38)):
        return
    raise NotPermitted("tracing needs root (or CAP_BPF and CAP_PERFMON): run with sudo or in a "
                       "privileged agent container")
