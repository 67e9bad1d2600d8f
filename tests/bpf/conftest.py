"""Real-eBPF test harness: root only; builds the C fixtures, makes cgroups,
runs `ingero trace` as a subprocess and opens what it wrote."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import bpf_reason, test_cgroup_prefix

FIXTURES = Path(__file__).parent / "fixtures"


def pytest_collection_modifyitems(config, items):
    reason = bpf_reason()
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.bpf)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def fake_nccl(tmp_path_factory) -> dict[str, Path]:
    """The fake NCCL library and the driver that calls it (see fixtures/)."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: cannot build the NCCL fixtures")
    d = tmp_path_factory.mktemp("fakenccl")
    lib = d / "libfakenccl.so"
    subprocess.run(["gcc", "-O1", "-fPIC", "-shared", "-o", str(lib), str(FIXTURES / "fakenccl.c")],
                   check=True)
    drv = d / "driver"
    subprocess.run(["gcc", "-O1", "-o", str(drv), str(FIXTURES / "driver.c"), f"-L{d}",
                    "-lfakenccl", f"-Wl,-rpath,{d}"], check=True)
    return {"lib": lib, "driver": drv, "dir": d}


def cgroup2_mount() -> Path:
    from ingero_agent.cgroups import cgroup2_mount as find
    m = find()
    if m is None:
        pytest.skip("no cgroup v2 file system is mounted")
    return m


@pytest.fixture
def make_cgroup():
    """make_cgroup() -> a new empty cgroup v2 folder, removed (with its processes) at the end."""
    made: list[Path] = []

    def make() -> Path:
        d = cgroup2_mount() / f"{test_cgroup_prefix()}{uuid.uuid4().hex[:8]}"
        d.mkdir()
        made.append(d)
        return d

    yield make
    for d in reversed(made):
        remove_cgroup_tree(d)


def remove_cgroup_tree(top: Path) -> None:
    """Kill every process in `top` and below, and remove its folders deepest first (a cgroup
    folder with children cannot be removed: the tests' pod folders leaked that way)."""
    for _ in range(100):
        if not top.exists():
            return
        folders = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
        for d in folders + [top]:
            try:
                for pid in (d / "cgroup.procs").read_text().split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                d.rmdir()
            except OSError:
                pass
        time.sleep(0.05)
    raise RuntimeError(f"could not remove test cgroup {top}")


def spawn(argv: list[str], cgroup: Path | None = None, **kw) -> subprocess.Popen:
    """Start argv, first moving the process into `cgroup` (before exec)."""
    if cgroup is not None:
        argv = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cgroup), *argv]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def nccl_probes(fake, pages: int):
    """The agent's NCCL probes (one ring of `pages` pages) on the fake library, no targets yet."""
    from ingero_agent.elfsyms import nccl_symbols
    from ingero_agent.probes import ProbeConfig, Probes

    p = Probes(ProbeConfig(families=("nccl",), ringbuf_pages=pages, self_tgid=os.getpid()))
    st = os.stat(fake["lib"])
    p.attach_library(fake["lib"], (st.st_dev, st.st_ino), nccl_symbols(fake["lib"]))
    return p


def drive(p, fake, tmp_path: Path, iters: int) -> subprocess.Popen:
    """Run the driver (ITERS all-reduces and 19 other calls) as the probes' only target."""
    go = tmp_path / f"go-{uuid.uuid4().hex}"   # the driver waits for it: targets are set first
    drv = spawn([str(fake["driver"]), str(iters), "1", "0", "1", str(go)])
    p.set_targets(set(), {drv.pid}, set())
    go.touch()
    assert drv.wait(60) == 0
    return drv


class TraceRun:
    """`ingero trace` in the background; its stderr is collected line by line."""

    def __init__(self, tmp: Path, args: list[str], name: str = "t"):
        self.out = tmp / f"{name}.duckdb"
        self.ready = tmp / f"{name}.ready"
        argv = [sys.executable, "-m", "ingero", "trace", "--out", str(self.out),
                "--ready-file", str(self.ready), "--node", "test-node", *args]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._wait(lambda: self.ready.exists(), 90, "ready file")

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def _wait(self, cond, timeout, what):
        deadline = time.monotonic() + timeout
        while not cond():
            if self.proc.poll() is not None:
                self._reader.join(5)
                raise AssertionError(f"tracer exited ({self.proc.returncode}) before {what}:\n"
                                     + "\n".join(self.lines))
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} after {timeout}s:\n" + "\n".join(self.lines))
            time.sleep(0.02)

    def wait_for_line(self, text: str, timeout: float = 20) -> None:
        self._wait(lambda: any(text in line for line in self.lines), timeout, repr(text))

    def stop(self, timeout: float = 60) -> TraceRun:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        rc = self.proc.wait(timeout)
        self._reader.join(5)
        assert rc == 0, "\n".join(self.lines)
        return self

    def query(self, sql: str, params=()) -> list[tuple]:
        import duckdb
        con = duckdb.connect(str(self.out), read_only=True)
        try:
            return con.execute(sql, params).fetchall()
        finally:
            con.close()


@pytest.fixture
def trace(tmp_path):
    runs: list[TraceRun] = []

    def start(*args: str, name: str = "t") -> TraceRun:
        r = TraceRun(tmp_path, list(args), name)
        runs.append(r)
        return r

    yield start
    for r in runs:
        if r.proc.poll() is None:
            r.proc.kill()
            r.proc.wait()
