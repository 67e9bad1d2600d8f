"""NCCL uprobes against a fake libnccl with the real signatures.

The driver (fixtures/driver.c) makes a known sequence of calls; every
argument it passes must come back exactly: stack-passed arguments (stream,
ncclReduce's comm), the by-value ncclUniqueId hashed with the splitmix64
fold, per-communicator seq, group flags, split/InitAll communicators, and
ncclBcast counted once although it calls ncclBroadcast inside.
"""

from __future__ import annotations

import os

import pytest

M64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def fold(uid: bytes) -> int:
    h = 0
    for i in range(16):
        h = splitmix64(h ^ int.from_bytes(uid[8 * i:8 * i + 8], "little"))
    return h


def ids(seed: int) -> tuple[bytes, bytes]:
    """The two unique ids the driver builds from SEED (see driver.c)."""
    a = bytes((seed * 31 + i) & 0xFF for i in range(128))
    b = bytes(a[i] if i < 64 else (~a[i]) & 0xFF for i in range(128))
    return a, b


COLS = ("op, rank, nranks, comm_id_hash, seq, count, bytes, datatype, reduce_op, peer, ret, "
        "in_group, stream, parent_hash, color, split_key")


def expected_rows(iters: int, seed: int, rank: int, nranks: int) -> list[tuple]:
    id1, id2 = ids(seed)
    h1, h2 = fold(id1), fold(id2)
    child = splitmix64(h1 ^ splitmix64(rank % 2) ^ 0)
    rows = [
        ("COMM_INIT_RANK", rank, nranks, h1, None, None, None, None, None, None, 0, False, None, None, None, None),
        ("COMM_INIT_RANK_CONFIG", rank, nranks, h2, None, None, None, None, None, None, 0, False, None, None, None, None),
    ]
    rows += [("ALL_REDUCE", rank, nranks, h1, i, 1000 + i, 4 * (1000 + i), "float32", "sum", None, 0, False,
              0x5000 + i, None, None, None) for i in range(iters)]
    rows += [
        ("REDUCE", rank, nranks, h1, iters, 77, 616, "int64", "max", 1, 0, False, 0xABC, None, None, None),
        ("GROUP_START", -1, -1, 0, None, None, None, None, None, None, 0, False, None, None, None, None),
        ("SEND", rank, nranks, h1, 0, 10, 20, "float16", None, (rank + 1) % nranks, 0, True, 1, None, None, None),
        ("RECV", rank, nranks, h1, 1, 10, 20, "float16", None, (rank + nranks - 1) % nranks, 7, True, 1,
         None, None, None),
        ("GROUP_END", -1, -1, 0, None, None, None, None, None, None, 0, False, None, None, None, None),
        ("BROADCAST", rank, nranks, h1, iters + 1, 33, 33, "int8", None, 0, 0, False, 2, None, None, None),
        ("ALL_REDUCE", rank, nranks, h2, 0, 5, 20, "float32", "sum", None, 0, False, 3, None, None, None),
        ("COMM_SPLIT", -1, -1, child, None, None, None, None, None, None, 0, False, None, h1, rank % 2, rank),
        ("ALL_REDUCE", -1, -1, child, 0, 8, 64, "float64", "avg", None, 0, False, 4, None, None, None),
    ]
    # InitAll: one record per communicator; its hash depends on pointer and time (checked apart)
    return rows


def run_driver(fake, go, iters, seed, rank, nranks, cgroup=None, mode=None, env=None):
    from tests.bpf.conftest import spawn
    argv = [str(fake["driver"]), str(iters), str(seed), str(rank), str(nranks), str(go)]
    if mode:
        argv.append(mode)
    return spawn(argv, cgroup, env=env)


def test_every_call_of_a_traced_pid_is_recorded_with_exact_arguments(fake_nccl, trace, tmp_path):
    go = tmp_path / "go"
    iters, seed, rank, nranks = 5, 9, 1, 4
    drv = run_driver(fake_nccl, go, iters, seed, rank, nranks, env=dict(os.environ, RANK="1", WORLD_SIZE="4"))
    t = trace("--pid", str(drv.pid), "--probes", "nccl")
    go.touch()
    assert drv.wait(30) == 0
    t.stop()
    rows = t.query(f"SELECT {COLS} FROM nccl_events WHERE pid = ? ORDER BY timestamp_ns", [drv.pid])
    want = expected_rows(iters, seed, rank, nranks)
    assert rows[:len(want)] == want
    rest = rows[len(want):]
    init_all = [r for r in rest if r[0] == "COMM_INIT_ALL"]
    assert [(r[1], r[2], r[5]) for r in init_all] == [(0, 2, 2), (1, 2, 2)]
    assert init_all[0][3] == init_all[1][3] != 0
    ar = [r for r in rest if r[0] == "ALL_REDUCE"]
    assert [(r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8]) for r in ar] == \
        [(1, 2, init_all[0][3], 0, 9, 36, "int32", "min")]
    assert [r[0] for r in rest].count("COMM_DESTROY") == 5 and len(rows) == len(want) + 8
    assert all(d > 0 for (d,) in t.query("SELECT duration_ns FROM nccl_events WHERE op = 'ALL_REDUCE'"))
    # ranks and comms state tables
    assert t.query("SELECT pid, rank, world_size, process FROM ranks") == [(drv.pid, 1, 4, "driver")]
    id1, id2 = ids(seed)
    comms = t.query("SELECT op, comm_id_hash, rank, nranks, parent_hash, color FROM comms ORDER BY timestamp_ns")
    assert comms[:3] == [("COMM_INIT_RANK", fold(id1), rank, nranks, None, None),
                         ("COMM_INIT_RANK_CONFIG", fold(id2), rank, nranks, None, None),
                         ("COMM_SPLIT", splitmix64(fold(id1) ^ splitmix64(1) ^ 0), -1, -1, fold(id1), 1)]
    assert t.query("SELECT lost_nccl, events_nccl FROM nodes") == [(0, len(rows))]


def test_ids_sharing_their_first_64_bytes_hash_differently():
    a, b = ids(9)
    assert a[:64] == b[:64] and a != b and fold(a) != fold(b)


def test_only_processes_in_the_target_cgroup_are_recorded_even_when_started_later(
        fake_nccl, trace, make_cgroup, tmp_path):
    cg = make_cgroup()
    t = trace("--cgroup", str(cg), "--probes", "nccl")
    go = tmp_path / "go"
    inside = run_driver(fake_nccl, go, 4, 3, 0, 2, cgroup=cg)       # started after tracing began
    t.wait_for_line("attached")                                     # its library was found
    outside = run_driver(fake_nccl, go, 4, 3, 1, 2)                 # same library, root cgroup
    go.touch()
    assert inside.wait(30) == 0 and outside.wait(30) == 0
    t.stop()
    per_pid = dict(t.query("SELECT pid, COUNT(*) FROM nccl_events GROUP BY pid"))
    assert per_pid == {inside.pid: 4 + 19}          # iters + 19 other calls
    seqs = t.query("SELECT seq FROM nccl_events WHERE op = 'ALL_REDUCE' AND comm_id_hash = ? "
                   "ORDER BY timestamp_ns", [fold(ids(3)[0])])
    assert [s for (s,) in seqs] == [0, 1, 2, 3]


def test_nccl_lib_attaches_up_front_so_a_new_process_is_traced_from_its_first_call(
        fake_nccl, trace, make_cgroup, tmp_path):
    cg = make_cgroup()
    t = trace("--cgroup", str(cg), "--probes", "nccl", "--nccl-lib", str(fake_nccl["lib"]))
    go = tmp_path / "go"
    go.touch()                                  # no waiting: calls start at once
    drv = run_driver(fake_nccl, go, 2, 4, 0, 1, cgroup=cg)
    assert drv.wait(30) == 0
    t.stop()
    first = t.query("SELECT op, comm_id_hash FROM nccl_events ORDER BY timestamp_ns LIMIT 1")
    assert first == [("COMM_INIT_RANK", fold(ids(4)[0]))]
    assert t.query("SELECT COUNT(*) FROM nccl_events") == [(2 + 19,)]


def test_calls_on_a_communicator_created_before_tracing_are_flagged_unknown(fake_nccl, trace, tmp_path):
    go = tmp_path / "go"
    drv = run_driver(fake_nccl, go, 3, 5, 2, 4, mode="early")
    assert drv.stdout.readline().strip() == "inited"     # communicator made before tracing
    t = trace("--pid", str(drv.pid), "--probes", "nccl")
    go.touch()
    assert drv.wait(30) == 0
    t.stop()
    rows = t.query("SELECT op, rank, nranks, comm_id_hash, seq, count FROM nccl_events ORDER BY timestamp_ns")
    assert rows == [("ALL_REDUCE", -1, -1, 0, i, 1000 + i) for i in range(3)] + \
        [("COMM_DESTROY", -1, -1, 0, None, None)]


def test_a_call_that_never_returns_does_not_silence_the_thread(fake_nccl, trace, tmp_path):
    # The frame of a call whose return is never seen is replaced by the next
    # call made at the same stack depth (here ncclGroupStart); from then on
    # every call is recorded again. (Calls made deeper than the lost one, e.g.
    # with stack-passed arguments, count as nested until that happens.)
    go = tmp_path / "go"
    drv = run_driver(fake_nccl, go, 4, 6, 0, 2, mode="escape")
    t = trace("--pid", str(drv.pid), "--probes", "nccl")
    go.touch()
    assert drv.wait(30) == 0
    t.stop()
    rows = t.query("SELECT op, seq, count FROM nccl_events ORDER BY timestamp_ns")
    # ncclCommAbort left by longjmp: no record; every later call still is one
    assert rows == [("COMM_INIT_RANK", None, None), ("COMM_INIT_RANK", None, None),
                    ("GROUP_START", None, None), ("GROUP_END", None, None)] + \
        [("ALL_REDUCE", i, 1000 + i) for i in range(4)] + [("COMM_DESTROY", None, None)]


def test_a_new_pods_file_on_sighup_adds_a_pod_and_keeps_the_communicators_already_seen(
        fake_nccl, trace, make_cgroup, tmp_path):
    import json
    import signal
    import uuid

    root = make_cgroup()
    uid_a, uid_b = uuid.uuid4().hex, uuid.uuid4().hex
    (root / f"pod{uid_a}").mkdir()
    (root / f"pod{uid_b}").mkdir()
    pods = tmp_path / "pods.json"

    def write_pods(*uids):
        tmp = tmp_path / "pods.json.tmp"
        tmp.write_text(json.dumps({"node": "test-node", "cgroup_root": str(root), "pods": [
            {"name": f"w-{u[:4]}", "namespace": "ml", "uid": u} for u in uids]}))
        tmp.replace(pods)

    write_pods(uid_a)
    t = trace("--pods", str(pods), "--probes", "nccl", "--nccl-lib", str(fake_nccl["lib"]))
    go = tmp_path / "go"
    a = run_driver(fake_nccl, go, 3, 6, 0, 2, cgroup=root / f"pod{uid_a}", mode="early")
    assert a.stdout.readline().strip() == "inited"          # its communicator, seen by the tracer
    b = run_driver(fake_nccl, go, 2, 7, 1, 2, cgroup=root / f"pod{uid_b}")   # not a target yet
    write_pods(uid_a, uid_b)                                  # the re-plan: a restarted rank's new pod
    t.proc.send_signal(signal.SIGHUP)
    t.wait_for_line("2 pods")
    go.touch()
    assert a.wait(30) == 0 and b.wait(30) == 0
    t.stop()
    # a restarted tracer would have lost a's communicator: hash 0, rank -1 (see the test above)
    assert t.query("SELECT rank, nranks, comm_id_hash, seq FROM nccl_events WHERE pid = ? AND op = 'ALL_REDUCE' "
                   "ORDER BY timestamp_ns", [a.pid]) == [(0, 2, fold(ids(6)[0]), i) for i in range(3)]
    assert t.query("SELECT COUNT(*) FROM nccl_events WHERE pid = ?", [b.pid]) == [(2 + 19,)]
    assert t.query("SELECT pod FROM ranks WHERE pid = ?", [b.pid]) == [(f"w-{uid_b[:4]}",)]


def test_sighup_without_a_pods_file_stops_the_trace_and_keeps_every_event(fake_nccl, trace, make_cgroup, tmp_path):
    import signal

    cg = make_cgroup()
    t = trace("--cgroup", str(cg), "--probes", "nccl", "--nccl-lib", str(fake_nccl["lib"]))
    go = tmp_path / "go"
    go.touch()
    drv = run_driver(fake_nccl, go, 2, 8, 0, 1, cgroup=cg)
    assert drv.wait(30) == 0
    t.proc.send_signal(signal.SIGHUP)
    assert t.proc.wait(60) == 0
    t.stop()
    assert t.query("SELECT COUNT(*) FROM nccl_events") == [(2 + 19,)]


def test_with_pods_the_library_path_is_resolved_in_each_pods_own_file_system(
        fake_nccl, trace, make_cgroup, tmp_path):
    # A container sees its own file at the library path (here: a copy bind-mounted over it
    # in a private mount namespace, so another inode than the agent's file). The process
    # appears 1 s before it loads the library and calls ncclCommInitRank at once: only a
    # library attached through its /proc/<pid>/root beforehand sees that first call.
    import json
    import shutil
    import uuid

    if shutil.which("unshare") is None:
        import pytest
        pytest.skip("unshare (util-linux) is not installed: cannot make a private mount namespace")
    root = make_cgroup()
    uid = uuid.uuid4().hex
    (root / f"pod{uid}").mkdir()
    pods = tmp_path / "pods.json"
    pods.write_text(json.dumps({"node": "test-node", "cgroup_root": str(root), "pods": [
        {"name": "w-0", "namespace": "ml", "uid": uid}]}))
    own = tmp_path / "containers-copy.so"
    shutil.copy(fake_nccl["lib"], own)
    lib = str(fake_nccl["lib"])
    # a second path that exists nowhere: not an error with pods, but named for the pod
    t = trace("--pods", str(pods), "--probes", "nccl", "--nccl-lib", lib,
              "--nccl-lib", "/opt/ingero-nowhere/libnccl.so.2")
    go = tmp_path / "go"
    go.touch()                                       # no waiting: calls start at once
    from tests.bpf.conftest import spawn
    drv = spawn(["unshare", "-m", "--propagation", "private", "sh", "-c",
                 'mount --bind "$0" "$1" && sleep 1 && exec "$2" 2 9 0 1 "$3"',
                 str(own), lib, str(fake_nccl["driver"]), str(go)], root / f"pod{uid}")
    assert drv.wait(30) == 0, drv.stderr.read()
    t.stop()
    assert os.stat(own).st_ino != os.stat(lib).st_ino
    first = t.query("SELECT op, comm_id_hash FROM nccl_events ORDER BY timestamp_ns LIMIT 1")
    assert first == [("COMM_INIT_RANK", fold(ids(9)[0]))]
    assert t.query("SELECT COUNT(*) FROM nccl_events") == [(2 + 19,)]
    assert [ln for ln in t.lines if "/opt/ingero-nowhere/libnccl.so.2 is not in pod ml/w-0's file system" in ln]


SHRINK_SALT = 0x5348524B00000000   # bpf/nccl.c NCCL_SHRINK_SALT
GROW_SALT = 0x47524F5700000000     # bpf/nccl.c NCCL_GROW_SALT


def expected_newer_rows(seed: int, rank: int, nranks: int, ret: int) -> list[tuple]:
    """What driver.c's "newer" mode must produce (rank 1 of 4; ret 7 when non-blocking)."""
    id1, id2 = ids(seed)
    h1 = fold(id1)                                  # InitRankScalable: the FIRST of the ids
    shrunk = splitmix64(h1 ^ SHRINK_SALT ^ 0)
    child = splitmix64(h1 ^ splitmix64(0) ^ 0)
    grown = splitmix64(h1 ^ GROW_SALT ^ 0)
    n = None
    return [
        ("COMM_INIT_RANK_SCALABLE", rank, nranks, h1, n, n, n, n, n, n, ret, False, n, n, n, n),
        ("ALL_TO_ALL", rank, nranks, h1, 0, 6, 24, "float32", n, n, ret, False, 10, n, n, n),
        ("GATHER", rank, nranks, h1, 1, 5, 40, "int64", n, 1, ret, False, 11, n, n, n),
        ("SCATTER", rank, nranks, h1, 2, 3, 6, "bfloat16", n, 2, ret, False, 12, n, n, n),
        ("GROUP_START", -1, -1, 0, n, n, n, n, n, n, 0, False, n, n, n, n),
        ("ALL_REDUCE", rank, nranks, h1, 3, 4, 16, "float32", "sum", n, 0, True, 13, n, n, n),
        ("GROUP_SIMULATE_END", -1, -1, 0, n, n, n, n, n, n, 0, False, n, n, n, n),
        # survivors of excluding ranks 0 and 3: rank 1 becomes rank 0 of 2
        ("COMM_SHRINK", 0, 2, shrunk, n, n, n, n, n, n, ret, False, n, h1, n, n),
        ("COMM_SPLIT", -1, -1, child, n, n, n, n, n, n, ret, False, n, h1, 0, rank),
        ("ALL_REDUCE", 0, 2, shrunk, 0, 7, 28, "float32", "sum", n, 0, False, 14, n, n, n),
        ("ALL_REDUCE", -1, -1, child, 0, 2, 8, "float32", "sum", n, 0, False, 15, n, n, n),
        # an existing rank without the grow id: (parent, its grow number 0 in `color`)
        ("COMM_GROW", rank, nranks + 1, grown, n, n, n, n, n, n, 0, False, n, h1, 0, n),
        ("COMM_GROW", nranks, nranks + 1, fold(id2), n, n, n, n, n, n, 0, False, n, n, n, n),
    ]



@pytest.mark.parametrize("nonblocking", [False, True], ids=["blocking", "nonblocking"])
def test_newer_entry_points_scalable_init_shrink_grow_alltoall_gather_scatter_keep_identity(
        fake_nccl, trace, tmp_path, nonblocking):
    """InitRankScalable hashes the first of its ids; AlltoAll/Gather/Scatter carry count,
    bytes, root and seq; GroupSimulateEnd closes the group; Shrink gives the survivor its
    new rank; with a non-blocking world (ncclInProgress, 7) the split/shrink children,
    whose handles are written only later, still get their identity at their first call."""
    go = tmp_path / "go"
    seed, rank, nranks = 9, 1, 4
    env = dict(os.environ, RANK="1", WORLD_SIZE="4")
    if nonblocking:
        env["NONBLOCKING"] = "1"
    drv = run_driver(fake_nccl, go, 1, seed, rank, nranks, mode="newer", env=env)
    t = trace("--pid", str(drv.pid), "--probes", "nccl")
    go.touch()
    assert drv.wait(30) == 0
    t.stop()
    rows = t.query(f"SELECT {COLS} FROM nccl_events WHERE pid = ? ORDER BY timestamp_ns", [drv.pid])
    want = expected_newer_rows(seed, rank, nranks, 7 if nonblocking else 0)
    assert rows[:len(want)] == want
    assert [r[0] for r in rows[len(want):]] == ["COMM_DESTROY"] * 5
    comms = t.query("SELECT op, comm_id_hash, rank, nranks FROM comms ORDER BY timestamp_ns")
    assert [c[0] for c in comms] == ["COMM_INIT_RANK_SCALABLE", "COMM_SHRINK", "COMM_SPLIT",
                                     "COMM_GROW", "COMM_GROW"]
    assert all(c[1] != 0 for c in comms)
    # the process's world identity comes from the scalable init
    assert t.query("SELECT rank, world_size FROM ranks WHERE pid = ?", [drv.pid]) == [(1, 4)]


@pytest.fixture(scope="module")
def two_copies(tmp_path_factory):
    """A program mapping libfakenccl.so and libtorchlike.so, which links the same fake
    NCCL in with every nccl* symbol local (.symtab only), as libtorch_cuda.so may."""
    import shutil
    import subprocess
    from tests.bpf.conftest import FIXTURES
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: cannot build the NCCL fixtures")
    d = tmp_path_factory.mktemp("twocopies")
    run = lambda *a: subprocess.run(list(a), check=True, cwd=d)  # noqa: E731
    run("gcc", "-O1", "-fPIC", "-c", str(FIXTURES / "fakenccl.c"), "-o", "fake.o")
    run("gcc", "-O1", "-fPIC", "-c", str(FIXTURES / "torchlike.c"), "-o", "tl.o")
    (d / "vs").write_text("{ global: torchlike_*; local: *; };\n")
    run("gcc", "-shared", "-o", "libtorchlike.so", "tl.o", "fake.o", "-Wl,--version-script=vs")
    run("gcc", "-O1", "-fPIC", "-shared", "-o", "libfakenccl.so", str(FIXTURES / "fakenccl.c"))
    run("gcc", "-o", "twocopies", str(FIXTURES / "twocopies.c"), f"-L{d}", "-lfakenccl",
        "-ltorchlike", f"-Wl,-rpath,{d}")
    return d


def test_nccl_hidden_in_another_library_is_found_in_symtab_and_both_mapped_copies_are_traced(
        two_copies, trace, tmp_path):
    from ingero_agent.elfsyms import nccl_symbols
    from tests.bpf.conftest import spawn
    hidden = nccl_symbols(two_copies / "libtorchlike.so")
    assert hidden.from_symtab and "ncclAllReduce" in hidden
    go = tmp_path / "go"
    proc = spawn([str(two_copies / "twocopies"), str(go)], None)
    t = trace("--pid", str(proc.pid), "--probes", "nccl")
    go.touch()
    assert proc.wait(30) == 0
    t.stop()
    rows = t.query("SELECT op, count, stream, nranks, rank FROM nccl_events WHERE pid = ? "
                   "AND op = 'ALL_REDUCE' ORDER BY timestamp_ns", [proc.pid])
    # 11 elements through the exported copy, 22 through the hidden one
    assert rows == [("ALL_REDUCE", 11, 0x11, 4, 2), ("ALL_REDUCE", 22, 0x77, 2, 1)]
