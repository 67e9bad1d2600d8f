"""The agent under load: many concurrent API clients while the node is being traced.

    python -m bench.agent_load [--seconds 60] [--clients 50]

A real agent (`ingero agent serve` on 127.0.0.1, a finished synthetic session of 4 ranks x
200 steps in its data folder) answers `--clients` concurrent clients for `--seconds`, each
looping over GET /healthz, GET /v1/sessions/<id>, the segment listing and a small
POST /v1/query (loopback only; the loop ends at the deadline). Meanwhile a real tracer
(`ingero trace --cgroup`, eBPF) records a workload on the same machine: every 0.5 s a new
process in the traced cgroup makes 2,000 calls of the test suite's fake NCCL library, so
the count of calls is known. A prober asks /healthz every 100 ms.

Reported: requests answered per second, p50/p99 latency by kind, answers by status (429 is
the query slots turning work away, by design), /healthz probes failed, the agent's peak RSS,
and the calls the tracer recorded against the calls made (and events lost). Needs root.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp

from bench.common import need_root
from bench.synthetic import session
from ingero.http_client import new_session

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "bpf" / "fixtures"
TOKEN = "agent-load-token-0123456789abcdef"
SID = "load.synthetic.0001"
CALLS_PER_PROC = 2_000     # per process, a process every 0.5 s: ~4,000 NCCL calls/s, far above a real rank's rate


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _build(tmp: Path) -> tuple[Path, Path]:
    lib = tmp / "libfakenccl.so"
    subprocess.run(["gcc", "-O1", "-fPIC", "-shared", "-o", str(lib), str(FIXTURES / "fakenccl.c")], check=True)
    exe = tmp / "burst"
    subprocess.run(["gcc", "-O1", "-o", str(exe), str(FIXTURES / "burst.c"), f"-L{tmp}", "-lfakenccl",
                    f"-Wl,-rpath,{tmp}"], check=True)
    return lib, exe


def _wait_file(p: Path, proc: subprocess.Popen, what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not p.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start (exit {proc.poll()})")
        time.sleep(0.05)


async def _clients(base: str, n: int, seconds: float, agent_pid: int) -> dict:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    kinds = [("healthz", "GET", "/healthz", None),
             ("session", "GET", f"/v1/sessions/{SID}", None),
             ("segments", "GET", f"/v1/sessions/{SID}/segments", None),
             ("query", "POST", "/v1/query",
              {"sql": "SELECT op, count(*) AS n FROM nccl_events GROUP BY op", "session_id": SID})]
    lat: dict[str, list[float]] = {k[0]: [] for k in kinds}
    status: dict[str, int] = {}
    probe = {"ok": 0, "failed": 0, "worst_ms": 0.0}
    peak = [0.0]
    deadline = time.monotonic() + seconds
    async with new_session(timeout_s=30, limit=n + 4) as http:
        async def client(i: int):
            k = i
            while time.monotonic() < deadline:
                name, method, path, body = kinds[k % len(kinds)]
                k += 1
                t0 = time.perf_counter()
                try:
                    async with http.request(method, base + path, headers=auth, json=body) as r:
                        await r.read()
                        code = str(r.status)
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    code = type(e).__name__
                status[code] = status.get(code, 0) + 1
                if code == "200":
                    lat[name].append((time.perf_counter() - t0) * 1e3)

        async def prober():
            while time.monotonic() < deadline:
                t0 = time.perf_counter()
                try:
                    async with new_session(timeout_s=5) as own:     # a new connection each time
                        async with own.get(base + "/healthz") as r:
                            ok = r.status == 200
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    ok = False
                probe["ok" if ok else "failed"] += 1
                probe["worst_ms"] = max(probe["worst_ms"], (time.perf_counter() - t0) * 1e3)
                peak[0] = max(peak[0], _rss_mb(agent_pid))
                await asyncio.sleep(0.1)

        t0 = time.monotonic()
        await asyncio.gather(prober(), *(client(i) for i in range(n)))
        elapsed = time.monotonic() - t0

    def q(xs, p):
        xs = sorted(xs)
        return round(xs[min(len(xs) - 1, int(p * len(xs)))], 2) if xs else None

    answered = sum(len(v) for v in lat.values())
    return {"elapsed_s": round(elapsed, 1), "answered_200": answered,
            "requests_per_s": round(sum(status.values()) / elapsed, 1),
            "answered_200_per_s": round(answered / elapsed, 1),
            "status": dict(sorted(status.items())),
            "latency_ms": {k: {"p50": q(v, 0.5), "p99": q(v, 0.99), "n": len(v)} for k, v in lat.items()},
            "healthz_probes": probe, "agent_peak_rss_mb": round(peak[0], 1)}


def run(seconds: float = 60.0, clients: int = 50, max_memory_mb: int = 1536) -> dict:
    """One load run; returns its figures (see the module doc)."""
    need_root("agent_load")
    tmp = Path(tempfile.mkdtemp(prefix="ingero-agent-load-"))
    cg = None
    procs: list[subprocess.Popen] = []
    try:
        lib, burst = _build(tmp)
        data = tmp / "data"
        seg = data / "sessions" / SID / "segments"
        session(seg, steps=200)
        (seg.parent / "plan.json").write_text(json.dumps({"session_id": SID, "pods": []}))
        (seg.parent / "stopped").touch()
        (tmp / "token").write_text(TOKEN)
        port = _free_port()
        agent = subprocess.Popen([sys.executable, "-m", "ingero", "agent", "serve", "--node", "load",
                                  "--listen", f"127.0.0.1:{port}", "--data-dir", str(data),
                                  "--token-file", str(tmp / "token"), "--max-memory-mb", str(max_memory_mb),
                                  "--ready-file", str(tmp / "agent.ready"), "--quiet"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(agent)
        _wait_file(tmp / "agent.ready", agent, "the agent")
        cg = Path("/sys/fs/cgroup/unified") / f"ingero-load-{uuid.uuid4().hex[:8]}"
        cg.mkdir()
        tracer = subprocess.Popen([sys.executable, "-m", "ingero", "trace", "--cgroup", str(cg), "--probes", "nccl",
                                   "--nccl-lib", str(lib), "--out", str(tmp / "t.duckdb"), "--node", "load",
                                   "--ready-file", str(tmp / "t.ready"), "--quiet"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        procs.append(tracer)
        _wait_file(tmp / "t.ready", tracer, "the tracer")
        go = tmp / "go"
        go.touch()
        made = []

        async def workload():
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                made.append(subprocess.Popen(["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cg),
                                              str(burst), str(CALLS_PER_PROC), str(go)]))
                await asyncio.sleep(0.5)

        async def both():
            res, _ = await asyncio.gather(_clients(f"http://127.0.0.1:{port}", clients, seconds, agent.pid),
                                          workload())
            return res

        res = asyncio.run(both())
        codes = [p.wait(60) for p in made]
        tracer.send_signal(2)
        tracer.wait(120)
        import duckdb
        con = duckdb.connect(str(tmp / "t.duckdb"), read_only=True)
        events, lost = con.execute("SELECT sum(events_nccl), sum(lost_nccl) FROM nodes").fetchone()
        con.close()
        res.update({"clients": clients, "seconds": seconds, "calls_made": CALLS_PER_PROC * codes.count(0),
                    "workload_failures": len(codes) - codes.count(0), "calls_traced": int(events or 0),
                    "events_lost": int(lost or 0), "agent_alive": agent.poll() is None})
        return res
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
        if cg is not None and cg.exists():
            for pid in (cg / "cgroup.procs").read_text().split():
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass
            for _ in range(100):
                try:
                    cg.rmdir()
                    break
                except OSError:
                    time.sleep(0.05)
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--clients", type=int, default=50)
    a = ap.parse_args(argv)
    if not (1 <= a.seconds <= 600 and 1 <= a.clients <= 500):
        sys.exit("agent_load: --seconds 1-600 and --clients 1-500")
    res = run(a.seconds, a.clients)
    print(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
