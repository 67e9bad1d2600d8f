"""`ingero trace`: record NCCL calls, TCP events and off-CPU time of target processes.

Importing this module does not import bcc (the CLI lists every subcommand,
also on machines without it); ``run`` does.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import re
import secrets
import shutil
import signal
import time
from pathlib import Path

from ingero import schema
from ingero.errors import IngeroError
from ingero.families import NAMES

EPILOG = """\
targets (combine freely; at least one):
  --pid 4242 4243            these processes
  --cgroup kubepods.slice/x  every process in these cgroup v2 folders and below
  --pods pods.json           pods by UID / container id (format below)
  --all                      every process on the machine

examples:
  ingero trace --duration 30s --pid $(pgrep -f train.py) --out t.duckdb
  ingero trace --cgroup /sys/fs/cgroup/unified/job --probes nccl,tcp --out t.duckdb
  ingero trace --pods pods.json --segments /var/lib/ingero/seg --node n1 --quiet

pods file:
  {"node": "n1", "cgroup_root": "/sys/fs/cgroup/unified/kubepods.slice",
   "pods": [{"name": "w-0", "namespace": "default", "uid": "<pod uid>", "node": "n1",
             "containers": [{"name": "trainer", "id": "containerd://<id>"}],
             "ips": ["10.0.0.1", "fd00::1"]}],
   "nccl_libs": ["/path/to/libnccl.so.2"]}          (optional, like --nccl-lib)
"""

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNITS = {None: 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """'30s', '2m', '1h', '500ms' or plain seconds -> seconds."""
    m = _DURATION.match(str(text))
    if not m or float(m.group(1)) <= 0:
        raise IngeroError(f"--duration {text!r} is not a duration: use e.g. 30s, 2m, 1h or "
                          "plain seconds")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_probes(text: str) -> tuple[str, ...]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in NAMES]
    if unknown or not names:
        raise IngeroError(f"unknown probe {','.join(unknown) or repr(text)}: --probes takes a "
                          f"comma-separated list of {','.join(NAMES)}")
    return tuple(f for f in NAMES if f in names)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "trace", help="record NCCL calls, TCP retransmits and scheduler stalls with eBPF",
        description="Attach eBPF probes (NCCL uprobes, TCP and scheduler tracepoints) filtered "
        "in the kernel to the target processes, and write the events as Parquet segments "
        "and one DuckDB file. Needs root.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", help="stop after this long (30s, 2m, 1h, seconds); "
                   "default: until Ctrl-C / SIGTERM")
    p.add_argument("--out", type=Path, help="DuckDB file to write at the end "
                   "(default trace.duckdb unless --segments is given)")
    p.add_argument("--segments", type=Path, help="segment folder (default <out>.segments, "
                   "replaced on each run; an explicit folder is kept and resumed)")
    p.add_argument("--pid", nargs="+", action="extend", default=[], metavar="PID",
                   help="trace these processes")
    p.add_argument("--cgroup", nargs="+", action="extend", default=[], metavar="PATH",
                   help="trace every process in these cgroup v2 folders (and below)")
    p.add_argument("--pods", type=Path, metavar="FILE.json",
                   help="trace these pods; SIGHUP re-reads the file (new pods join, traced ones keep going)")
    p.add_argument("--all", action="store_true", help="trace every process")
    p.add_argument("--probes", default="nccl,tcp,sched", help="families to attach "
                   "(default nccl,tcp,sched)")
    p.add_argument("--nccl-lib", type=Path, action="append", default=[], metavar="PATH",
                   help="attach to this NCCL library now, before target processes load it; with "
                   "--pods, also the file at this path in each target's own file system "
                   "(/proc/<pid>/root), as soon as the process appears")
    p.add_argument("--profiler-lib", type=Path, action="append", default=[], metavar="PATH",
                   help="attach to this copy of Ingero's NCCL profiler plugin now (libnccl-profiler-ingero.so, "
                   "see `ingero profiler build`); copies that target processes map are found anyway")
    p.add_argument("--node", help="node name (default: the pods file's node, the config file's "
                   "`node` (/etc/ingero/agent.yaml or $INGERO_CONFIG), NODE_NAME, hostname)")
    p.add_argument("--sched-min-us", type=float, default=1000.0, metavar="US",
                   help="record off-CPU intervals at least this long (default 1000); "
                   "shorter ones are only summed")
    p.add_argument("--ringbuf-pages", type=int, default=2048, metavar="N",
                   help="ring buffer size per probe family in pages, a power of 2 (default 2048)")
    p.add_argument("--segment-seconds", type=float, default=2.0, metavar="S",
                   help="write a segment (and drain the rings, if no burst woke the tracer "
                        "earlier) this often (default 2; live views see data this late)")
    p.add_argument("--rdma-seconds", type=float, default=1.0, metavar="S",
                   help="read the RDMA ports' counters (/sys/class/infiniband) this often "
                        "(default 1; 0: not at all)")
    p.add_argument("--done-file", type=Path, metavar="PATH",
                   help="touch this file once the last segments are on disk (detaching the "
                        "probes afterwards can take seconds; a supervisor need not wait for it)")
    p.add_argument("--ready-file", type=Path, metavar="PATH",
                   help="touch this file once the probes are attached")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--session-id", help="session id (default: time and random suffix)")
    p.add_argument("--ebpf", action="store_true", help=argparse.SUPPRESS)
    return p


def _check_nccl_lib(path: Path, where: str = "--nccl-lib"):
    from ingero_agent.procinfo import LibraryFinder
    if not path.is_file():
        raise IngeroError(f"{where} {path} does not exist; pass the libnccl.so.2 the job loads")
    got = LibraryFinder().check(path.resolve())
    if not got or not got[1]:
        raise IngeroError(f"{where} {path} defines no NCCL functions (ncclAllReduce); pass the "
                          "libnccl.so.2 (or the library NCCL is linked into) the job loads")
    return path.resolve(), got[0], got[1]


def _check_profiler_lib(path: Path):
    from ingero_agent.elfsyms import is_profiler_plugin
    if not path.is_file():
        raise IngeroError(f"--profiler-lib {path} does not exist; pass the libnccl-profiler-ingero.so "
                          "the job loads (NCCL_PROFILER_PLUGIN)")
    if not is_profiler_plugin(path):
        raise IngeroError(f"--profiler-lib {path} is not Ingero's NCCL profiler plugin; build it with "
                          "`ingero profiler build`")
    st = path.resolve().stat()
    return path.resolve(), (st.st_dev, st.st_ino)


def _segments_dir(args) -> tuple[Path | None, Path]:
    if args.segments is not None:
        return args.out, args.segments
    out = args.out or Path("trace.duckdb")
    seg = out.with_name(out.name + ".segments")
    if seg.exists():
        extra = [e.name for e in seg.iterdir() if e.name not in schema.TABLES]
        if extra:
            raise IngeroError(f"{seg} exists and holds more than Ingero segments ({extra[0]}); "
                              "move it away or pass --segments")
        shutil.rmtree(seg)
    return out, seg


def run(args) -> int:
    from ingero_agent import headers
    from ingero_agent.probes import ProbeConfig, build_program
    from ingero_agent.procinfo import node_identity
    from ingero_agent.targets import TargetSet, load_pods
    from ingero_agent.tracer import TraceOptions, Tracer, require_privileges

    families = parse_probes(args.probes)
    duration = parse_duration(args.duration) if args.duration is not None else None
    if args.sched_min_us < 0:
        raise IngeroError(f"--sched-min-us {args.sched_min_us} is negative; pass 0 or more")
    if not 0.1 <= args.segment_seconds <= 3600:
        raise IngeroError(f"--segment-seconds {args.segment_seconds} is out of range; "
                          "pass 0.1 to 3600")
    if args.rdma_seconds != 0 and not 0.1 <= args.rdma_seconds <= 3600:
        raise IngeroError(f"--rdma-seconds {args.rdma_seconds} is out of range; pass 0 (off) or 0.1 to 3600")
    cfg = ProbeConfig(families=families, trace_all=args.all,
                      sched_min_ns=int(args.sched_min_us * 1000),
                      ringbuf_pages=args.ringbuf_pages, self_tgid=os.getpid())
    if args.ebpf:
        text, cflags, _ = build_program(cfg)
        print(f"// cflags: {' '.join(cflags)}\n{text}")
        return 0
    pods = load_pods(args.pods) if args.pods else None
    node = node_identity(args.node or (pods.node if pods else None))
    targets = TargetSet(pids=args.pid, cgroup_paths=args.cgroup, pods=pods,
                        trace_all=args.all, node=node)
    if not (args.pid or args.cgroup or pods or args.all):
        raise IngeroError("nothing to trace: pass --pid, --cgroup, --pods or --all")
    libs = []
    for p in args.nccl_lib:
        if pods is not None:
            # with pods, the path is the one their containers see (a TraceSession's
            # ncclLibPath): looked up through each target's /proc/<pid>/root as it appears
            targets.libs_in_pods.append(str(p))
            if not p.is_file():
                continue          # not in the agent's own file system: only in the pods'
        libs.append(_check_nccl_lib(p))
    if pods:
        libs += [_check_nccl_lib(p, f"nccl_libs in {args.pods}:") for p in pods.nccl_libs]
    plugins = [_check_profiler_lib(p) for p in args.profiler_lib]
    require_privileges()
    headers.ensure_kernel_build_dir()
    headers.ensure_tracefs()
    out, seg = _segments_dir(args)
    session = args.session_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    opts = TraceOptions(segments=seg, node=node, session_id=session, probe_config=cfg, out=out,
                        duration_s=duration, nccl_libs=libs, ready_file=args.ready_file, done_file=args.done_file,
                        profiler_libs=plugins,
                        pods_file=args.pods, roll_s=args.segment_seconds, rdma_s=args.rdma_seconds,
                        quiet=args.quiet)
    # a tracer that does not stop can be asked where it is: SIGUSR1 prints every thread's stack
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    return Tracer(opts, targets).run()
