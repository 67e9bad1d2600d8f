"""A small multi-node trace written through the real segment store (for fleet/merge/perfetto/mcp tests).

Two nodes x two ranks, `steps` steps of ALL_REDUCE + ALL_GATHER on one
communicator plus a SEND/RECV pair, rank 3 arriving `late_ms` late at every
ALL_REDUCE, retransmits on rank 3's connections (and one owned by nobody),
off-CPU intervals nested in each collective, and the state tables. Every
timestamp is on one true clock; `skew_ns` moves a node's recorded clock.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from ingero.store import SegmentWriter

T0 = 1_760_000_000_000_000_000
STEP_NS = 50_000_000
COMM = 0x0123_4567_89AB_CDEF
CHILD = 0x0FED_CBA9_8765_4321    # split of COMM (color 0); split_key 3 - rank: NCCL numbers it 3 - rank
SESSION = "default.job.abc"
TOKEN = "fleet-token-0123456789abcdef"


def write_node(seg_dir: Path, node: str, ranks: list[int], steps: int = 20, late_ms: float = 6.0,
               skew_ns: int = 0, session: str = SESSION, world: int = 4, split: bool = False) -> dict:
    w = SegmentWriter(seg_dir, node, session)
    counts = {"collectives": 0, "p2p": 0, "retx": 0, "offcpu": 0}
    sched = {k: [] for k in ("timestamp_ns", "duration_ns", "runq_ns", "reason", "pid", "tid", "rank")}
    tcp = {k: [] for k in ("timestamp_ns", "event", "pid", "rank", "saddr", "daddr", "sport", "dport",
                           "owner_source")}
    for r in ranks:
        pid = 1000 + r
        cols = {k: [] for k in ("timestamp_ns", "duration_ns", "op", "rank", "nranks", "comm_id_hash", "seq",
                                "count", "bytes", "datatype", "peer", "pid", "tid", "global_rank", "ret",
                                "pod", "namespace")}

        def call(ts, dur, op, seq, peer=-1):
            cols["timestamp_ns"].append(ts + skew_ns)
            cols["duration_ns"].append(dur)
            cols["op"].append(op)
            cols["rank"].append(r)
            cols["nranks"].append(world)
            cols["comm_id_hash"].append(COMM)
            cols["seq"].append(seq)
            cols["count"].append(262144)
            cols["bytes"].append(1 << 20)
            cols["datatype"].append("float32")
            cols["peer"].append(peer)
            for k, v in (("pid", pid), ("tid", pid), ("global_rank", r), ("ret", 0),
                         ("pod", f"job-rank-{r}"), ("namespace", "default")):
                cols[k].append(v)

        for s in range(steps):
            base = T0 + s * STEP_NS
            late = int(late_ms * 1e6) if r == 3 else 0
            ends = base + 20_000_000 + int(late_ms * 1e6)
            arrive = base + 20_000_000 + late + 1000 * r
            call(arrive, ends - arrive + 500_000, "ALL_REDUCE", 3 * s)
            sched["timestamp_ns"].append(arrive + 100_000 + skew_ns)
            sched["duration_ns"].append(200_000)
            sched["runq_ns"].append(10_000)
            sched["reason"].append("sleep")
            for k, v in (("pid", pid), ("tid", pid), ("rank", r)):
                sched[k].append(v)
            g = ends + 2_000_000 + 1000 * r
            call(g, 1_000_000, "ALL_GATHER", 3 * s + 1)
            call(g + 2_000_000, 300_000, "SEND" if r % 2 == 0 else "RECV", 3 * s + 2, peer=r ^ 1)
            counts["collectives"] += 2
            counts["p2p"] += 1
            counts["offcpu"] += 1
            if r == 3 and s % 2 == 0:
                tcp["timestamp_ns"].append(arrive + 50_000 + skew_ns)
                for k, v in (("event", "tcp_retransmit_skb"), ("pid", pid), ("rank", r), ("saddr", "10.0.0.2"),
                             ("daddr", "10.0.0.1"), ("sport", 40000), ("dport", 29500), ("owner_source", "socket")):
                    tcp[k].append(v)
                counts["retx"] += 1
        if split:   # one ALL_REDUCE on the split child, whose rank the kernel cannot know
            call(T0 + steps * STEP_NS + 1000 * r, 400_000, "ALL_REDUCE", 0)
            cols["comm_id_hash"][-1], cols["rank"][-1] = CHILD, -1
        w.append("nccl_events", cols)
        w.put_rows("ranks", [{"pid": 1000 + x, "rank": x, "local_rank": x % 2, "world_size": world,
                              "pod": f"job-rank-{x}", "namespace": "default",
                              "first_seen_ns": T0 + skew_ns} for x in ranks])
    if 3 in ranks:   # one retransmit nobody owns (softirq on a socket of no target)
        tcp["timestamp_ns"].append(T0 + 5_000_000 + skew_ns)
        for k, v in (("event", "tcp_retransmit_skb"), ("pid", 0), ("rank", None), ("saddr", "10.0.0.2"),
                     ("daddr", "10.0.0.9"), ("sport", 1), ("dport", 2), ("owner_source", "none")):
            tcp[k].append(v)
        counts["retx"] += 1
    w.append("sched_events", sched)
    if tcp["timestamp_ns"]:
        w.append("tcp_events", tcp)
    w.put_rows("comms", [{"pid": 1000 + x, "comm": 0x5000 + x, "comm_id_hash": COMM, "rank": x, "nranks": world,
                          "op": "COMM_INIT_RANK", "timestamp_ns": T0 - 1_000_000 + skew_ns} for x in ranks]
               + [{"pid": 1000 + x, "comm": 0x6000 + x, "comm_id_hash": CHILD, "rank": -1, "nranks": -1,
                   "parent_hash": COMM, "color": 0, "split_key": 3 - x, "op": "COMM_SPLIT",
                   "timestamp_ns": T0 - 500_000 + skew_ns} for x in ranks if split])
    w.put_rows("sched_totals", [{"pid": 1000 + x, "rank": x, "reason": "sleep", "total_ns": steps * 200_000,
                                 "intervals": steps} for x in ranks])
    w.put_rows("nodes", [{"hostname": node, "lost_nccl": 0, "lost_tcp": 0, "lost_sched": 0,
                          "events_nccl": 3 * steps * len(ranks), "started_ns": T0, "ended_ns": T0 + steps * STEP_NS}])
    w.put_rows("sessions", [{"started_ns": T0, "ended_ns": T0 + steps * STEP_NS, "probes": "nccl,tcp,sched",
                             "status": "finished"}])
    w.close()
    return counts


def write_job(root: Path, steps: int = 20, skew_b_ns: int = 0, split: bool = False) -> dict:
    """node-a (ranks 0, 1) and node-b (ranks 2, 3) under root/<node>/; returns the counts per node."""
    return {"node-a": write_node(root / "node-a", "node-a", [0, 1], steps, split=split),
            "node-b": write_node(root / "node-b", "node-b", [2, 3], steps, skew_ns=skew_b_ns, split=split)}


def agent_data(root: Path, node: str, ranks: list[int], sessions=(SESSION,), skew_ns: int = 0, steps: int = 10):
    """An agent data dir holding finished sessions (segments written through the real store)."""
    for sid in sessions:
        d = root / "sessions" / sid
        write_node(d / "segments", node, ranks, steps=steps, skew_ns=skew_ns, session=sid)
        (d / "plan.json").write_text(json.dumps({"session_id": sid, "pods": []}))
        (d / "stopped").touch()
    return root


def serve_agent(root: Path, node: str, limits=None, slots: int = 2, trace_cmd=None, **kw):
    """The real agent HTTP server in a thread (no tracer needed when the sessions are
    finished; else `trace_cmd`, e.g. tests/unit/fake_tracer.py)."""
    from ingero_agent.api import SessionManager
    from ingero_agent.queries import QueryService
    from ingero_agent.server import make_server

    mgr = SessionManager(root, node, trace_cmd=trace_cmd or ["true"])
    srv = make_server(mgr, ("127.0.0.1", 0), TOKEN.encode(), quiet=True,
                      queries=QueryService(mgr, limits, slots), **kw)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, mgr


def write_crafted(d: Path) -> Path:
    """d/crafted/trace.duckdb, whose views read outside it when a reader runs in `d`: `d` holds
    `.tmp/` (DuckDB's default temp folder) and an `x.parquet` of its own beside the trace's."""
    import duckdb

    from ingero import schema

    (d / ".tmp").mkdir()
    (d / ".tmp" / "secret.txt").write_text("in the working directory")
    art = d / "crafted"
    art.mkdir()
    duckdb.execute(f"COPY (SELECT 'the trace' AS who) TO '{art / 'x.parquet'}'")
    duckdb.execute(f"COPY (SELECT 'the working directory' AS who) TO '{d / 'x.parquet'}'")
    con = duckdb.connect(str(art / "trace.duckdb"))
    con.execute("SET file_search_path = ?", [str(art)])
    con.execute("CREATE VIEW rel AS SELECT who FROM read_parquet('x.parquet')")
    con.execute(f"CREATE VIEW leak AS SELECT content FROM read_text('{d / '.tmp' / 'secret.txt'}')")
    con.execute("CREATE VIEW leak_tmp AS SELECT content FROM read_text('.tmp/secret.txt')")
    cols = ", ".join(f"NULL::{ty} AS {c}" for c, ty in schema.TABLES["nccl_events"].columns)
    con.execute(f"CREATE VIEW nccl_events AS SELECT {cols} FROM leak")
    con.close()
    return art / "trace.duckdb"


def spawn_agent(tmp_path: Path, *args: str):
    """`ingero agent serve` as a process (node n1, data in tmp_path/data, the test token),
    once it listens: (process, API port). `args`: more flags."""
    import subprocess
    import sys
    import time

    from ingero_operator.cluster_objects import free_port

    port = free_port()
    (tmp_path / "token").write_text(TOKEN)
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-m", "ingero", "agent", "serve", "--node", "n1",
                             "--listen", f"127.0.0.1:{port}", "--data-dir", str(tmp_path / "data"),
                             "--token-file", str(tmp_path / "token"), "--ready-file", str(ready), "--quiet", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
        time.sleep(0.05)
    return proc, port


def spawn_mcp_http(root: Path, token_file: Path, *args: str, cwd: Path | None = None):
    """`ingero mcp --http` over `root` as a process, once it accepts: (process, port)."""
    import socket
    import subprocess
    import sys
    import time

    from ingero_operator.cluster_objects import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ingero", "mcp", "--root", str(root), "--http",
                             f"127.0.0.1:{port}", "--token-file", str(token_file), *args], cwd=cwd,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180         # its imports alone take half a minute on a busy 2-core machine
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc, port
        except OSError:
            assert proc.poll() is None, proc.stderr.read()
            if time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"ingero mcp --http did not accept on port {port} within 180 s")
            time.sleep(0.1)
