"""Helpers shared by the benchmarks: compiling small C programs, root checks."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"


def need_root(what: str) -> None:
    if os.geteuid() != 0:
        sys.exit(f"{what}: needs root (eBPF); run as root")


def compile_c(out: Path, sources: list[str], shared: bool = False, libs: tuple[str, ...] = (),
              includes: tuple[Path, ...] = ()) -> Path:
    """gcc -O2 the given files of bench/csrc into `out`."""
    cmd = ["gcc", "-O2", "-g", *(f"-I{d}" for d in includes), "-o", str(out)] + [str(CSRC / s) for s in sources]
    if shared:
        cmd[1:1] = ["-shared", "-fPIC"]
    subprocess.run(cmd + list(libs), check=True)
    return out


def run_loop(loop: Path, lib: Path, n: int, before_go=None) -> float:
    """Run a bench/csrc loop (`loop LIB N`: prints "ready", waits for a line, prints ns
    per iteration); `before_go(pid)` runs once it is ready and may return a callable
    run after it ends."""
    p = subprocess.Popen([str(loop), str(lib), str(n)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    after = before_go(p.pid) if before_go else None
    p.stdin.write("go\n")
    p.stdin.flush()
    ns = float(p.stdout.readline())
    p.wait()
    if after:
        after()
    return ns


def cgroup_ids(path: Path) -> list[int]:
    """The cgroup ids (directory inode numbers) of `path` and its ancestors below
    the cgroup v2 mount, outermost first."""
    from ingero.lab.cgroups import CGROUP_ROOT
    rel = path.relative_to(CGROUP_ROOT).parts
    return [os.stat(CGROUP_ROOT.joinpath(*rel[:i + 1])).st_ino for i in range(len(rel))]


def run_loop_traced(loop: Path, lib: Path, n: int, probes, ring: str,
                    drain_s: float | str | None, target: str = "pid") -> tuple[float, int]:
    """run_loop with the loop's process as the probes' only target and `ring` drained
    every `drain_s` by a thread of this process (as the agent would, in its own);
    drain_s None: read once, after the loop (the ring must hold its records);
    "agent": drained as the agent does (woken by the ring once a quarter of it is
    unread, or every 2 s).
    `target`: how the filter finds the loop: "pid" (its tgid); or the loop is moved
    into a cgroup <mount>/ingero-bench-<pid>/pod/container and found by that
    cgroup ("cgroup", as the agent's targets: every cgroup of a pod is in the map)
    or by the outermost one ("ancestor": the filter walks up two levels, as for a
    container cgroup created since the agent's last scan). Returns (ns per iteration, records read)."""
    got, stop = [0], threading.Event()

    def drain():
        if drain_s == "agent":   # as the agent: sleep in epoll until a quarter of the ring
            while not stop.is_set():   # is unread (or 2 s, its segment roll), then drain
                probes.arm_wakeup(ring)
                probes.waiter.wait(2.0)
                got[0] += len(probes.rings[ring].read())
            return
        while not stop.wait(drain_s):
            got[0] += len(probes.rings[ring].read())

    t = threading.Thread(target=drain, daemon=True)

    def go(pid):
        if target == "pid":
            probes.set_targets(set(), {pid}, set())
        else:   # a pod-like cgroup of its own: <mount>/ingero-bench-<our pid>/pod/container
            from ingero.lab.cgroups import CGROUP_ROOT
            cg = CGROUP_ROOT / f"ingero-bench-{os.getpid()}" / "pod" / "container"
            cg.mkdir(parents=True, exist_ok=True)
            (cg / "cgroup.procs").write_text(str(pid))
            ids = cgroup_ids(cg)
            probes.set_targets({ids[-1] if target == "cgroup" else ids[0]}, set(), set())
        if drain_s is not None:
            t.start()

        def done():
            stop.set()
            if drain_s is not None:
                if drain_s == "agent":
                    probes.waiter.notify()
                t.join()
            got[0] += len(probes.rings[ring].read())
            if target != "pid":   # the loop has exited: its cgroups are empty
                from ingero.lab.cgroups import CGROUP_ROOT
                top = CGROUP_ROOT / f"ingero-bench-{os.getpid()}"
                for d in (top / "pod" / "container", top / "pod", top):
                    d.rmdir()
        return done

    return run_loop(loop, lib, n, go), got[0]
