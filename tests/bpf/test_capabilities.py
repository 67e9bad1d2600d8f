"""The agent container's capabilities (charts/ingero/templates/_agent_security.tpl), each proven.

`ingero trace`, the agent's real work, runs as uid 0 under setpriv with the
bounding set limited to a capability list (for uid 0 the permitted and
effective sets after exec are the bounding set; inheritable and ambient are
cleared), like the agent container, which drops ALL and adds the chart's list.
Its target is a process of another user (uid 65534) that links an NCCL
library and carries torchrun variables in its environment.

With exactly the chart's list the trace reads the rank, world size and run id
(the environment of another user's process, without CAP_DAC_READ_SEARCH),
attaches the NCCL uprobes through /proc/<pid>/root and records every call,
with RLIMIT_MEMLOCK at 64 KiB and no CAP_SYS_RESOURCE. Without any one of the
listed capabilities it fails in the way that capability's reason predicts.
The uprobes are uprobe_multi links (Linux 6.6), which need no tracefs. Where they
are perf events instead and tracefs is read-only, they cannot attach (the perf
uprobe PMU needs CAP_SYS_ADMIN from 6.16): why the agent's tracefs is writable.
The chart's list must equal the list proven here.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.bpf.conftest import FIXTURES

# The chart's list, in the template's order, and the bit of each in CapEff.
PROVEN = ("BPF", "PERFMON", "SYS_PTRACE")
CAP_BIT = {"DAC_READ_SEARCH": 2, "SYS_PTRACE": 19, "SYS_RESOURCE": 24, "PERFMON": 38, "BPF": 39}
NOBODY = 65534
MEMLOCK = 64 * 1024          # far below one ring buffer (2048 pages): accounted, it would fail
ITERS = 50                   # the driver makes ITERS all-reduces and 19 other calls
ENV = {"PATH": "/usr/bin:/bin", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
       "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "caps-test",
       "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"}


def _setpriv(caps) -> list[str]:
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    bounding = ",".join(["-all"] + [f"+{c.lower()}" for c in caps])
    return ["setpriv", f"--bounding-set={bounding}", "--inh-caps=-all", "--ambient-caps=-all"]


def _kernel_at_least(major: int, minor: int) -> bool:
    rel = os.uname().release.split("-")[0].split(".")
    return (int(rel[0]), int(rel[1])) >= (major, minor)


# From 5.11 BPF memory is charged to the memory cgroup, not RLIMIT_MEMLOCK: the traces then
# run with a 64 KiB hard limit that only CAP_SYS_RESOURCE could raise.
MEMLOCK_UNCHARGED = _kernel_at_least(5, 11)


@pytest.fixture(scope="module")
def lib_dir():
    """The fake NCCL library and its driver in a folder every user may read (the test's
    tmp_path is root's, mode 0700, which a uid 65534 process cannot enter), as deep as a
    pip-installed NCCL in a container (bcc's own uprobe event name for it would be too long)."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: cannot build the NCCL fixtures")
    top = Path(tempfile.mkdtemp(prefix="ingero-caps-"))
    d = top / "opt/conda/lib/python3.11/site-packages/nvidia/nccl/lib"
    d.mkdir(parents=True)
    for p in [d, *d.parents]:
        if p == top.parent:
            break
        p.chmod(0o755)
    subprocess.run(["gcc", "-O1", "-fPIC", "-shared", "-o", str(d / "libfakenccl.so"),
                    str(FIXTURES / "fakenccl.c")], check=True)
    subprocess.run(["gcc", "-O1", "-o", str(d / "driver"), str(FIXTURES / "driver.c"), f"-L{d}",
                    "-lfakenccl", f"-Wl,-rpath,{d}"], check=True)
    yield d
    shutil.rmtree(top)


def _start_rank(d: Path) -> tuple[subprocess.Popen, Path]:
    """The driver as uid/gid 65534, waiting for its go file; returns once it runs the driver."""
    go = d / f"go-{time.monotonic_ns()}"
    p = subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                          str(d / "driver"), str(ITERS), "2", "3", "4", str(go)],
                         env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if (os.readlink(f"/proc/{p.pid}/exe") == str(d / "driver")
                    and "libfakenccl.so" in Path(f"/proc/{p.pid}/maps").read_text()):
                break
        except OSError:
            pass
        time.sleep(0.01)
    status = Path(f"/proc/{p.pid}/status").read_text()
    assert f"Uid:\t{NOBODY}\t{NOBODY}" in status, status
    return p, go


def _capeff(pid: int) -> int:
    line = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
                if ln.startswith("CapEff:"))
    return int(line.split()[1], 16)


def _mask(caps) -> int:
    return sum(1 << CAP_BIT[c] for c in caps)


def _limit_memlock():
    if MEMLOCK_UNCHARGED:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (MEMLOCK, MEMLOCK))


def _memlock_of(pid: int) -> str:
    return next(ln for ln in Path(f"/proc/{pid}/limits").read_text().splitlines()
                if ln.startswith("Max locked memory"))


# Run a command in a mount namespace of its own in which tracefs is read-only (as the
# preflight container mounts it).
READ_ONLY_TRACEFS = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                     "for m in /sys/kernel/tracing /sys/kernel/debug/tracing; do "
                     "if mountpoint -q $m; then mount -o remount,bind,ro $m || exit 97; fi; done; "
                     'exec "$@"', "sh"]


def _tracefs_uprobes(tracer_pid: int) -> int:
    """How many uprobe events the tracer `tracer_pid` has defined in tracefs (uprobe_names)."""
    try:
        text = Path("/sys/kernel/tracing/uprobe_events").read_text()
    except OSError:
        return 0
    return sum(f"_ingero_{tracer_pid}_" in ln for ln in text.splitlines())


def trace(caps, d: Path, tmp: Path, wrap: tuple[str, ...] = ()) -> dict:
    """`ingero trace --pid <rank> --probes nccl` with only `caps` (run through `wrap`);
    what it printed and recorded."""
    rank, go = _start_rank(d)
    name = "-".join(caps) + ("-wrapped" if wrap else "")
    out, ready = tmp / f"{name}.duckdb", tmp / f"{name}.ready"
    argv = list(wrap) + _setpriv(caps) + [sys.executable, "-m", "ingero", "trace", "--pid", str(rank.pid),
                             "--probes", "nccl", "--out", str(out), "--ready-file", str(ready),
                             "--node", "caps-node"]
    t = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         preexec_fn=_limit_memlock)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(ln.rstrip("\n") for ln in t.stderr), daemon=True)
    reader.start()
    capeff = memlock = None
    t0 = time.monotonic()
    try:
        deadline = time.monotonic() + 90
        while not ready.exists() and t.poll() is None and time.monotonic() < deadline:
            try:
                if capeff is None and os.readlink(f"/proc/{t.pid}/exe") == os.path.realpath(sys.executable):
                    capeff = _capeff(t.pid)      # after setpriv's exec: the tracer's own set
                    memlock = _memlock_of(t.pid).split()[3:5]
            except (OSError, StopIteration):
                pass                         # exited already
            time.sleep(0.02)
        assert ready.exists() or t.poll() is not None, "no ready file after 90 s:\n" + "\n".join(lines)
        t_ready = time.monotonic()
        in_tracefs = _tracefs_uprobes(t.pid)
        go.touch()
        assert rank.wait(30) == 0, rank.stderr.read()
        t_stop = time.monotonic()
        if t.poll() is None:
            t.send_signal(signal.SIGINT)     # the events still in the ring are drained at stop
        rc = t.wait(90)
        t_end = time.monotonic()
    finally:
        for p in (rank, t):
            if p.poll() is None:
                p.kill()
                p.wait()
    reader.join(5)
    res = {"in_tracefs": in_tracefs, "left_in_tracefs": _tracefs_uprobes(t.pid),
           "rc": rc, "lines": lines, "log": "\n".join(lines), "capeff": capeff, "memlock": memlock,
           "pid": rank.pid, "lib_dir": d, "seconds": {"ready": t_ready - t0, "stop": t_end - t_stop}}
    if out.exists():
        import duckdb
        con = duckdb.connect(str(out), read_only=True)
        res["events"] = con.execute("SELECT COUNT(*) FROM nccl_events WHERE pid = ?",
                                    [rank.pid]).fetchone()[0]
        res["ranks"] = con.execute("SELECT pid, rank, local_rank, world_size, run_id, master_addr, nccl_lib "
                                   "FROM ranks").fetchall()
        con.close()
    return res


PROBE = """
import json, sys
from ingero_agent.procinfo import LibraryFinder, read_environ
pid = int(sys.argv[1])
try:
    open(f"/proc/{pid}/environ", "rb").read()
    environ_file = "read"
except OSError as e:
    environ_file = e.strerror
print(json.dumps({"environ_file": environ_file, "env": read_environ(pid),
                  "libs": [str(p) for p, _, _ in LibraryFinder().find_all(pid)]}))
"""


def procinfo(caps, pid: int) -> dict:
    """What the agent's /proc readers see of process `pid` with only `caps`."""
    r = subprocess.run(_setpriv(caps) + [sys.executable, "-c", PROBE, str(pid)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def without(cap: str) -> tuple[str, ...]:
    return tuple(c for c in PROVEN if c != cap)


def test_the_charts_capability_list_is_the_proven_list():
    from tests.chart.chartlib import container, find, render
    sc = container(render(), "DaemonSet", "agent")["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": list(PROVEN)}
    pod = find(render(), "DaemonSet")["spec"]["template"]["spec"]
    pre = next(c for c in pod["initContainers"] if c["name"] == "preflight")["securityContext"]
    assert pre["capabilities"] == sc["capabilities"]


@pytest.fixture(scope="module")
def chart_run(lib_dir, tmp_path_factory):
    """One trace with exactly the chart's list, shared by the tests that read it."""
    return trace(PROVEN, lib_dir, tmp_path_factory.mktemp("caps"))


def test_with_the_charts_list_another_users_rank_is_identified_and_every_call_recorded(chart_run):
    r = chart_run
    assert r["capeff"] == _mask(PROVEN)            # exactly the list: no DAC_*, no SYS_RESOURCE
    assert r["rc"] == 0, r["log"]
    lib = f"/proc/{r['pid']}/root{r['lib_dir']}/libfakenccl.so"
    assert f"ingero: attached 21 NCCL functions in {lib}" in r["lines"], r["log"]
    assert r["events"] == ITERS + 19
    # The environment of a uid 65534 process, read without CAP_DAC_READ_SEARCH.
    assert r["ranks"] == [(r["pid"], 3, 1, 4, "caps-test", "10.1.2.3", lib)]
    if _kernel_at_least(6, 6):
        # uprobe_multi links, made with CAP_BPF and CAP_PERFMON: no uprobe event in tracefs
        assert r["in_tracefs"] == 0 and r["left_in_tracefs"] == 0, r
        assert not any("uprobe_multi" in ln for ln in r["lines"]), r["log"]


def test_the_environ_file_is_refused_without_dac_read_search_and_read_from_memory(lib_dir):
    rank, go = _start_rank(lib_dir)
    try:
        seen = procinfo(PROVEN, rank.pid)
        assert seen["environ_file"] == "Permission denied"    # mode 0400, owned by uid 65534
        assert seen["env"] == {k: v for k, v in ENV.items() if k != "PATH"}
        assert seen["libs"] == [f"/proc/{rank.pid}/root{lib_dir}/libfakenccl.so"]
        blind = procinfo(without("SYS_PTRACE"), rank.pid)
        assert blind == {"environ_file": "Permission denied", "env": {}, "libs": []}
    finally:
        rank.kill()
        rank.wait()


def test_without_bpf_no_map_can_be_created(lib_dir, tmp_path):
    r = trace(without("BPF"), lib_dir, tmp_path)
    assert r["capeff"] == _mask(without("BPF"))
    assert r["rc"] != 0 and "events" not in r
    assert any(ln.startswith("ingero: the kernel refused to create a BPF map (Operation not permitted): "
                             "the tracer needs CAP_BPF") for ln in r["lines"]), r["log"]
    assert not any(ln.startswith("could not open bpf map") for ln in r["lines"]), r["log"]  # no compile ran


def test_without_perfmon_the_maps_are_made_but_the_tracing_programs_are_refused(lib_dir, tmp_path):
    r = trace(without("PERFMON"), lib_dir, tmp_path)
    assert r["capeff"] == _mask(without("PERFMON"))
    assert r["rc"] != 0 and "events" not in r
    assert not any(ln.startswith("could not open bpf map") for ln in r["lines"]), r["log"]
    # refused once, by the check before any compile (no fallback compile tried after it)
    assert r["lines"].count("bpf: Failed to load program: Operation not permitted") == 1, r["log"]
    assert any(ln.startswith("ingero: the kernel refused to load a BPF tracing program (Operation not "
                             "permitted): the tracer needs CAP_PERFMON") for ln in r["lines"]), r["log"]


def test_without_sys_ptrace_another_users_process_is_invisible(lib_dir, tmp_path):
    r = trace(without("SYS_PTRACE"), lib_dir, tmp_path)
    assert r["capeff"] == _mask(without("SYS_PTRACE"))
    assert r["rc"] == 0, r["log"]                  # the trace runs, but sees nothing of the rank:
    assert not any("NCCL functions" in ln for ln in r["lines"]), r["log"]   # maps unreadable
    assert r["events"] == 0
    assert r["ranks"] == []                        # no library, no environment: no rank row


def test_sys_resource_is_not_needed_here_memlock_is_not_charged(chart_run):
    """Kernels from 5.11 charge BPF memory to the memory cgroup, not RLIMIT_MEMLOCK: the
    chart's-list trace ran with a 64 KiB hard limit (its 8 MiB ring alone is far more) that
    it could not raise, and bcc, which tries to raise it only when creating a map fails
    with EPERM, did not fail. Older kernels need agent.extraCapabilities: [SYS_RESOURCE]."""
    if not MEMLOCK_UNCHARGED:
        pytest.skip(f"kernel {os.uname().release} charges BPF maps to RLIMIT_MEMLOCK: "
                    "SYS_RESOURCE is needed here (agent.extraCapabilities)")
    r = chart_run
    assert r["memlock"] == [str(MEMLOCK), str(MEMLOCK)]     # soft and hard, in the tracer
    assert not _mask(["SYS_RESOURCE"]) & r["capeff"]
    assert r["rc"] == 0 and r["events"] == ITERS + 19, r["log"]


def test_sys_ptrace_also_lets_the_agent_attach_to_another_users_process():
    """Said in the template and docs: CAP_SYS_PTRACE is not read-only. With it (and no
    new privileges, as allowPrivilegeEscalation: false sets) PTRACE_ATTACH to any
    process succeeds unless Yama's ptrace_scope is 3; without it, EPERM."""
    code = ("import ctypes, os, sys; libc = ctypes.CDLL(None, use_errno=True); pid = int(sys.argv[1]); "
            "r = libc.ptrace(16, pid, 0, 0); e = ctypes.get_errno(); "
            "r == 0 and (os.waitpid(pid, 0), libc.ptrace(17, pid, 0, 0)); print(r, e)")
    victim = subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                               "sleep", "600"])
    try:
        time.sleep(0.2)
        scope = Path("/proc/sys/kernel/yama/ptrace_scope")
        expect_attach = not (scope.exists() and scope.read_text().strip() == "3")
        for caps, ok in ((PROVEN, expect_attach), (without("SYS_PTRACE"), False)):
            r = subprocess.run(_setpriv(caps) + ["--no-new-privs", sys.executable, "-c", code,
                                                  str(victim.pid)],
                               capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stderr
            assert r.stdout.split() == (["0", "0"] if ok else ["-1", "1"]), (caps, r.stdout)
        assert victim.poll() is None               # detached, still running
    finally:
        victim.kill()
        victim.wait()


def test_without_sys_admin_perf_event_uprobes_need_a_writable_tracefs(lib_dir, tmp_path, monkeypatch):
    """Why the chart mounts tracefs writable into the agent container: where the uprobes
    are perf events (a kernel without uprobe_multi links; forced here) the perf uprobe PMU
    refuses a process without CAP_SYS_ADMIN since Linux 6.16 (ba677dbe77af, also in stable
    kernels from July 2025), and bcc then creates the uprobes in tracefs's uprobe_events.
    With tracefs read-only, the NCCL uprobes cannot be attached."""
    if shutil.which("unshare") is None or shutil.which("mountpoint") is None:
        pytest.skip("unshare and mountpoint (util-linux) are needed")
    monkeypatch.setenv("INGERO_UPROBE_MULTI", "0")
    r = trace(PROVEN, lib_dir, tmp_path, wrap=tuple(READ_ONLY_TRACEFS))
    assert r["capeff"] == _mask(PROVEN), r["log"]
    if r["rc"] == 0 and not _kernel_at_least(6, 16):
        pytest.skip(f"kernel {os.uname().release}: its uprobe PMU still takes CAP_PERFMON")
    assert r["rc"] != 0 and r.get("events", 0) == 0, r["log"]
    assert any(ln.startswith("ingero: attaching the uprobes of 21 NCCL functions in ") and
               "failed (Failed to attach BPF to uretprobe)" in ln and "that tracefs is mounted writable" in ln
               for ln in r["lines"]), r["log"]


def test_a_killed_tracers_uprobe_events_are_removed_by_the_next_tracer_with_its_pid(lib_dir):
    """A tracer killed by SIGKILL leaves its tracefs uprobe events; a later tracer given
    the same pid would fail to create them again (EEXIST). It removes them first, and
    leaves other tracers' events alone."""
    from ingero_agent.elfsyms import nccl_symbols
    from ingero_agent.uprobe_names import remove_stale, tracefs_dir, write_events

    lib = lib_dir / "libfakenccl.so"
    off = nccl_symbols(lib)["ncclAllReduce"]
    events = tracefs_dir() / "uprobe_events"
    me, other = os.getpid(), os.getppid()
    mine, theirs = f"p_ingero_{me}_0_0x{off:x}", f"p_ingero_{other}_0_0x{off:x}"
    for name in (mine, theirs):
        write_events(events, f"p:uprobes/{name} {lib}:0x{off:x}\n")
    try:
        assert remove_stale(me) == [f"uprobes/{mine}"]
        left = events.read_text()
        assert mine not in left and theirs in left
    finally:
        for name in (mine, theirs):
            try:
                write_events(events, f"-:uprobes/{name}\n")
            except OSError:
                pass                             # removed by the test already
