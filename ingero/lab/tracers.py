"""``--trace`` for lab runs: one ``ingero trace`` per lab node, then one merged trace.duckdb.

Each tracer runs on the host (root namespace, outside the lab cgroups, so a
node kill does not stop it), watches the pods in ``DIR/pods-<node>.json``
and writes Parquet segments to ``DIR/nodes/<node>.duckdb.segments/``. It
signals readiness by creating ``DIR/nodes/<node>.ready``; it is stopped with
SIGINT after the ranks exit and then writes ``DIR/nodes/<node>.duckdb``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ingero.errors import IngeroError


@dataclass
class NodeTracer:
    node: str
    proc: subprocess.Popen
    out: Path
    ready: Path
    log: Path

    @property
    def segments(self) -> Path:
        return self.out.with_name(self.out.name + ".segments")

    def stderr_tail(self, lines: int = 15) -> str:
        return _tail(self.log, lines)


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except FileNotFoundError:
        return ""


def start_tracers(out_dir: Path, pods_files: dict[str, Path], nccl_lib: Path | None = None,
                  profiler_lib: Path | None = None, probes: str | None = None) -> list[NodeTracer]:
    """Start one tracer per node ({node name: pods file}).

    `nccl_lib` attaches the NCCL probes to that library file before any rank
    exists (as a TraceSession's ncclLibPath does): the lab's ranks create
    their communicators within milliseconds of starting, faster than a
    tracer's periodic scan would find the library in their maps, and a
    communicator whose creation was missed has no rank or id hash.
    `profiler_lib` does the same for Ingero's NCCL profiler plugin, which
    the ranks load at their first communicator. `probes`: the families to attach
    (`ingero trace --probes`; None: the tracer's default).
    """
    tracers = []
    nodes_dir = out_dir / "nodes"
    nodes_dir.mkdir(parents=True, exist_ok=True)
    for node, pods in pods_files.items():
        out, ready, log = nodes_dir / f"{node}.duckdb", nodes_dir / f"{node}.ready", nodes_dir / f"{node}.tracer.log"
        ready.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "ingero", "trace", "--pods", str(pods), "--node", node,
                "--out", str(out), "--ready-file", str(ready), "--quiet"]
        if nccl_lib is not None:
            argv += ["--nccl-lib", str(nccl_lib)]
        if profiler_lib is not None:
            argv += ["--profiler-lib", str(profiler_lib)]
        if probes:
            argv += ["--probes", probes]
        with open(log, "wb") as f:
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        tracers.append(NodeTracer(node, proc, out, ready, log))
    return tracers


def wait_ready(tracers: list[NodeTracer], timeout_s: float = 120.0) -> None:
    """Block until every tracer has written its ready file; IngeroError if one dies or is late."""
    deadline = time.monotonic() + timeout_s
    pending = list(tracers)
    while pending:
        for t in list(pending):
            if t.ready.exists():
                pending.remove(t)
            elif t.proc.poll() is not None:
                raise IngeroError(f"tracer for {t.node} exited {t.proc.returncode} before it was ready:\n"
                                  f"{t.stderr_tail()}")
        if pending and time.monotonic() > deadline:
            raise IngeroError(f"tracer for {pending[0].node} not ready after {timeout_s:.0f} s "
                              f"(no {pending[0].ready}); its log: {pending[0].log}")
        time.sleep(0.1)


def stop_tracers(tracers: list[NodeTracer], timeout_s: float = 60.0) -> dict[str, int]:
    """SIGINT every tracer, wait for it (SIGKILL after `timeout_s`, once it has written its
    threads' stacks to its log); returns {node: exit code}."""
    for t in tracers:
        if t.proc.poll() is None:
            t.proc.send_signal(signal.SIGINT)
    codes = {}
    deadline = time.monotonic() + timeout_s
    for t in tracers:
        try:
            codes[t.node] = t.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            t.proc.send_signal(signal.SIGUSR1)
            try:
                codes[t.node] = t.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                t.proc.kill()
                codes[t.node] = t.proc.wait()
            with open(t.log, "a") as f:
                f.write(f"ingero lab: the tracer had not stopped {timeout_s:.0f} s after SIGINT; "
                        "its threads' stacks are above\n")
    return codes


def merge(tracers: list[NodeTracer], dest: Path) -> Path:
    """Build one DuckDB file from every node's segments."""
    try:
        from ingero.store import build_duckdb
    except ImportError as e:
        raise IngeroError(f"cannot merge traces: ingero.store is not available ({e}); "
                          f"the per-node segments are in {dest.parent / 'nodes'}") from e
    dirs = [t.segments for t in tracers if t.segments.exists()]
    if not dirs:
        raise IngeroError(f"no tracer wrote segments (looked for {tracers[0].segments if tracers else '-'}); "
                          "see the tracer logs in " + str(dest.parent / "nodes"))
    build_duckdb(dirs, dest)
    return dest


def start_lab_tracers(lab, after_s: float | None = None, folder: str = "") -> list[NodeTracer]:
    """A tracer per node of a LabRun, attached to its NCCL library (and profiler plugin) up
    front, stopped when the lab closes; returns once every tracer is ready.

    `after_s`: start them this long after the ranks started (call it after start_ranks), as a
    user or a TraceSession on running pods would: each finds the library in the ranks' maps,
    and `lab.notes["trace_ready_ns"]` says when they were all ready. `folder`: their output
    under lab.out (a second set of tracers beside the first)."""
    if after_s is not None:
        time.sleep(max(0.0, lab.ranks_started_ns / 1e9 + after_s - time.time()))
    tracers = start_tracers(lab.out / folder if folder else lab.out, {n.name: lab.pods_file(n) for n in lab.nodes},
                           nccl_lib=lab.binaries.libnccl if after_s is None else None,
                           profiler_lib=lab.cfg.profiler_plugin if after_s is None else None,
                           probes=lab.cfg.probes)
    lab.on_close.append(lambda: stop_tracers(tracers, timeout_s=10))
    wait_ready(tracers)
    if after_s is not None:
        lab.notes["trace_ready_ns"] = time.time_ns()
    return tracers


@dataclass
class TracedRun:
    db: Path                   # the merged trace.duckdb
    report: dict               # the lab's lab.json
    codes: dict                # rank -> exit code
    stops: dict                # node -> tracer exit code
    late_db: Path | None = None   # the trace started `late_after_s` into the run (run_traced)
    logs: dict = field(default_factory=dict)   # node -> tracer log

    def stops_told(self) -> str:
        """The tracers' exit codes, and the log's end of each that did not exit 0."""
        tails = [f"--- {node} ({self.logs[node]}):\n" + _tail(self.logs[node], 40)
                 for node, code in self.stops.items() if code != 0 and node in self.logs]
        return "\n".join([f"tracer exit codes {self.stops}"] + tails)


def run_traced(cfg, log=lambda _m: None, late_after_s: float | None = None) -> TracedRun:
    """One lab run with a tracer per lab node started before any rank, stopped after the
    last, and their traces merged (what `ingero lab run --trace` does). `late_after_s`: a
    second tracer per node, started that long after the ranks (`ingero lab run --trace-after`),
    its trace merged apart (lab.out/late/trace.duckdb)."""
    from ingero.lab.runner import LabRun

    with LabRun(cfg, log=log) as lab:
        tracers = start_lab_tracers(lab)
        lab.start_ranks()
        late = start_lab_tracers(lab, after_s=late_after_s, folder="late") if late_after_s is not None else []
        codes = lab.wait()
        stops = {**stop_tracers(tracers), **{f"late/{n}": c for n, c in stop_tracers(late).items()}}
        report = lab.report()
    logs = {**{t.node: t.log for t in tracers}, **{f"late/{t.node}": t.log for t in late}}
    return TracedRun(db=merge(tracers, lab.out / "trace.duckdb"), report=report, codes=codes, stops=stops,
                     late_db=merge(late, lab.out / "late" / "trace.duckdb") if late else None, logs=logs)
