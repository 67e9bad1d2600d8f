"""Shared test setup: the repo root on sys.path (for bench.synthetic) and skip helpers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def root_reason() -> str | None:
    """Why root-only tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root (eBPF, network namespaces, cgroups); run `make test` as root"
    return None


def bpf_reason() -> str | None:
    """Why real-eBPF tests cannot run here, or None when they can."""
    reason = root_reason()
    if reason:
        return reason
    try:
        import bcc  # noqa: F401
    except ImportError:
        return "bcc is not importable: install Debian's python3-bpfcc and use a venv with --system-site-packages"
    try:
        from ingero_agent.headers import ensure_kernel_build_dir, ensure_tracefs
        ensure_kernel_build_dir()
        ensure_tracefs()
    except Exception as e:  # the message names what is missing
        return f"eBPF prerequisites missing: {e}"
    return None


def wait_until(pred, timeout_s: float, what: str, every: float = 0.1):
    """pred()'s first truthy answer, polled every `every` seconds; an AssertionError naming
    `what` after timeout_s."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


# ---- CI means it: with CI=true a skipped suite is a failure --------------------------------
# The eBPF, lab, cluster, chart, images and unit suites exist to run in CI (root, bcc, network
# namespaces, Helm's engine, a docker daemon the images suite starts are all there). A machine
# that lacks one of them would otherwise pass CI green with the suite silently skipped. Only
# the kind e2e (tests/e2e: kind, which no CI machine of this kind has) may skip.

import pytest  # noqa: E402

MAY_SKIP_IN_CI = ("tests/e2e/",)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if not (rep.skipped and in_ci()) or hasattr(rep, "wasxfail"):
        return
    where = _where(item)
    if where.startswith(MAY_SKIP_IN_CI):
        return
    reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
    rep.outcome = "failed"
    rep.longrepr = (f"CI=true: {where} must run in CI, but it skipped: {reason} "
                    "(fix the machine's setup in the Makefile, not the test)")


# ---- two workers: the lab one job at a time, the rest beside it ----------------------------
# `make test` runs pytest-xdist with two workers (-n 2). The lab's jobs (every
# lab verdict: whole flows, layouts, GPU-like, cpu-hog) and the eBPF tests that time the
# machine (device-clock fit, off-CPU totals, ring wake-ups, the agent under load) form one
# group: they run one after another in one worker, first, as they would in a serial run, with
# CI's background load beside them (background_load). The other worker takes everything else
# a file at a time (unit, chart, the probe and capability tests, each in its own cgroups:
# test_cgroup_prefix), the files of most tests first, and the lab worker joins it when the lab
# is done. SPREAD files come last a test at a time: independent cases of seconds each (no
# module fixture), they fill the end of the run on both workers, so that neither ends alone
# in a long file.

# The lab group begins with the images' checks (IMAGES_FIRST): their fixture waits for the images'
# build, which `make test` starts before pytest (Makefile, images-started), so that no lab job
# runs beside a build while the other worker goes on with its files.

IMAGES_FIRST = "tests/images/"
IMAGES_WAIT_S = 1500      # a cold build beside a load of 30 took 14 min
SERIAL = ("tests/cluster/", "tests/lab/", "tests/bpf/test_lab_", "tests/bpf/test_nccl_profiler.py",
          "tests/bpf/test_sched_probes.py", "tests/bpf/test_ring_wakeups.py", "tests/bpf/test_agent_load.py",
          "tests/chart/test_rbac.py",    # its recorded flow runs a traced lab job (ingero demo)
          IMAGES_FIRST)
SPREAD = ("tests/unit/test_verdict_matrix.py",)


def _where(item) -> str:
    return Path(str(item.fspath)).resolve().relative_to(ROOT).as_posix()


# Lab jobs that repeat a fault another CI test covers in another shape (a job or a device)
# carry @pytest.mark.extended: `make test` leaves them out (deselected, not skipped), `make
# test-lab-all` (INGERO_TEST_LAB_ALL=1) runs them too. Every fault keeps a CI job per device.
LAB_ALL = os.environ.get("INGERO_TEST_LAB_ALL") == "1"


def pytest_collection_modifyitems(config, items):
    """The lab group first (the images' checks at its head), in its files' order, then the other
    files, those of most tests first, and the SPREAD files last (a serial run sees the same
    order, which is also the order of the work units of `-n N`); the extended lab jobs only with
    INGERO_TEST_LAB_ALL=1. A test that uses the images is marked `images` (`make test-images`)."""
    for it in items:
        if "images" in getattr(it, "fixturenames", ()):
            it.add_marker(pytest.mark.images)
            it.add_marker(pytest.mark.timeout(IMAGES_WAIT_S + 300))   # the first waits for the build
    if not LAB_ALL:
        out = [it for it in items if it.get_closest_marker("extended")]
        if out:
            config.hook.pytest_deselected(items=out)
            items[:] = [it for it in items if not it.get_closest_marker("extended")]
    where = {id(it): _where(it) for it in items}
    count: dict[str, int] = {}
    for w in where.values():
        count[w] = count.get(w, 0) + 1

    def rank(it) -> tuple:
        w = where[id(it)]
        if w.startswith(SERIAL):
            return (0, 0 if w.startswith(IMAGES_FIRST) else 1)
        return (2, 0) if w.startswith(SPREAD) else (1, -count[w])

    items.sort(key=rank)      # stable: each file's tests keep their order


def pytest_xdist_make_scheduler(config, log):
    """The work units of `-n N` (the load modes): the lab group is one unit, every other test
    file one, each test of a SPREAD file one; handed out in the collection's order
    (pytest_collection_modifyitems), not xdist's (units of most tests first, which put two
    files of more tests than the lab group before it). (xdist's own `--dist loadgroup` would
    group from xdist_group marks, but its renamed node ids have no effect since pytest 9.2.)"""
    if config.getvalue("dist") not in ("load", "loadscope", "loadfile", "loadgroup"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class LabThenFiles(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "lab" if path.startswith(SERIAL) else nodeid if path.startswith(SPREAD) else path

    return LabThenFiles(config, log)


# ---- nothing the suite creates in the cgroup tree outlives it -----------------------------
# Test cgroups carry this process's pid (tests/bpf/conftest.py), so a suite running beside
# another one on the same machine judges only its own. Lab runs check their own cgroups and
# namespaces in tests/lab.

CGROUP_ROOT = Path("/sys/fs/cgroup/unified")


def test_cgroup_prefix() -> str:
    return f"ingero-test-{os.getpid()}-"


@pytest.fixture(scope="session", autouse=True)
def no_leftover_cgroups():
    """Fails the run (an error at the last teardown) if a test left a cgroup folder behind."""
    yield
    try:
        left = sorted(p.name for p in CGROUP_ROOT.iterdir() if p.name.startswith(test_cgroup_prefix()))
    except OSError:
        left = []
    if left:
        pytest.fail(f"the tests left cgroup folders behind: {', '.join(left)}")


@pytest.fixture(autouse=True)
def own_data_limit():
    """The test process's data-memory limit as it was before each test: a CLI run in-process
    (`ingero query`, `ingero mcp`) bounds the process it runs in (readonly_sql.bound_process),
    and a test process left under another's bound cannot start threads."""
    import resource

    before = resource.getrlimit(resource.RLIMIT_DATA)
    yield
    if resource.getrlimit(resource.RLIMIT_DATA) != before:
        resource.setrlimit(resource.RLIMIT_DATA, before)


# ---- the agent and operator images -------------------------------------------------------
# Built as `make images` builds them (scripts/images.sh: a Debian base made from the mirror, no
# image registry pull; a docker daemon started when none runs). A first build on a machine costs
# ~110 s of CPU (dpkg, pip, layer copies; ~300 MB fetched); docker's layer cache keeps the base,
# the Debian packages and the dependencies (rebuilt when pyproject.toml changes), so a later
# build redoes only the project's own layers. `make test` starts the build before pytest, and
# the lab group's first tests wait for it (IMAGES_FIRST). tests/images checks what was built; the
# whole flow's lossy-link job runs every component from its image (tests/cluster).


def images_reason() -> str | None:
    """Why the images cannot be built and run here, or None when they can."""
    import shutil

    reason = bpf_reason()
    if reason:
        return reason
    for tool in ("docker", "kubectl"):
        if not shutil.which(tool):
            return f"{tool} is not installed: `make test` installs it"
    return None


@pytest.fixture(scope="session")
def images() -> dict[str, str]:
    """component -> the image `make images` built (waits for a build already under way)."""
    import subprocess

    reason = images_reason()
    if reason:
        pytest.skip(reason)
    daemon = subprocess.run(["bash", "scripts/docker-daemon.sh"], cwd=ROOT, capture_output=True, text=True)
    if daemon.returncode:
        pytest.skip(daemon.stderr.strip())
    proc = subprocess.run(["bash", "scripts/images.sh"], cwd=ROOT, capture_output=True, text=True,
                          timeout=IMAGES_WAIT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    names = proc.stdout.split()
    return {"agent": names[0], "operator": names[1]}


CI_BACKGROUND_LOAD = 2


def background_load() -> int:
    """Busy processes (`--background-load`, ingero/lab/load.py) beside the lab verdict tests:
    those that call this (tests/cluster/test_whole_flow.py, tests/bpf/test_lab_layout.py,
    tests/bpf/test_lab_gpu.py). INGERO_TEST_BACKGROUND_LOAD=N sets it (0: none); unset, it is
    CI_BACKGROUND_LOAD (2) with CI=true and 0 otherwise. A verdict that holds only on a quiet
    machine is a wrong verdict, so CI judges them on a busy one (bench/verdict_lab.py counts
    right verdicts under load over more runs)."""
    env = os.environ.get("INGERO_TEST_BACKGROUND_LOAD", "").strip()
    if env:
        return int(env)
    return CI_BACKGROUND_LOAD if in_ci() else 0


def pytest_report_header(config):
    n = background_load()
    why = "INGERO_TEST_BACKGROUND_LOAD" if os.environ.get("INGERO_TEST_BACKGROUND_LOAD", "").strip() else \
        ("CI=true" if in_ci() else "default")
    return f"lab verdict tests: background load {n} busy processes ({why})"
