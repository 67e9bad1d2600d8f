"""``ingero lab``: run a multi-node training job with a fault on this machine, or clean up.

    ingero lab run --scenario lossy-link --seconds 20 --trace --out out/lab
    ingero lab cleanup
    ingero lab build
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
from pathlib import Path

from ingero.errors import IngeroError
from ingero.lab.job_args import add_job_shape_args, job_shape, ranks_per_node

EPILOG = """examples:
  ingero lab run --scenario clean --seconds 10
  ingero lab run --scenario lossy-link --loss-percent 5 --trace --out out/lab
  ingero lab run --scenario cpu-hog --nodes 2 --ranks-per-node 2 --victim-rank 1
  ingero lab run --layout tp=2,pp=2,dp=2 --nodes 2 --ranks-per-node 4 --scenario slow-stage --stage 1
  ingero lab run --layout tp=1,pp=4,dp=2 --schedule interleaved --virtual-stages 2 --microbatches 8
  ingero lab run --layout tp=2,dp=4 --sharding fsdp --layers 4 --scenario slow-rank --victim-rank 5
  ingero lab run --layout dp=8 --nodes 2 --sharding fsdp --replicas 2   # HSDP: 2 shard groups of 4
  ingero lab run --device gpu --profiler --trace --steps 40   # enqueue on device streams; device times
  ingero lab run --device gpu --profiler --trace --probes nccl --socket-sndbuf 65536 --scenario slow-link
  ingero lab run --device gpu --nonblocking --scenario slow-rank
  ingero lab run --scenario hang --fault-after 6 --timeout 20 --trace
  ingero lab run --scenario hang --timeout 40 --trace-after 10   # traced once the job already hangs
  ingero lab run --elastic --steps 10 --trace   # then shrink without rank 1 and grow back (NCCL 2.27/2.29)
  ingero lab cleanup        # remove namespaces/cgroups left by a crashed run

scenarios:
  clean       no fault
  lossy-link  drop a % of the victim node's outgoing TCP data segments (nftables)
  slow-link   the victim node's outgoing TCP data segments leave at --rate-mbit (tc htb, nftables)
  cpu-hog     busy loops share the victim rank's CPU
  slow-rank   the victim's compute takes twice as long
  io-stall    the victim writes and fsyncs a checkpoint every step
  slow-stage  every rank of one pipeline stage computes longer (needs --layout with pp > 1)
  imbalance   every rank, every step, computes a random factor longer: no single culprit
  hang        the victim (default: rank world/2) is stopped (SIGSTOP) at --fault-after, for good or
              for --hang-for seconds (--hang-mode sleep: it lives but calls NCCL no more); the
              others wait in their next collective until --timeout
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    from ingero.lab.faults import HANG_MODES, SCENARIOS

    p = subparsers.add_parser("lab", help="run a multi-node training job with a fault, on this machine",
                              description=__doc__, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="lab_command", metavar="ACTION")
    r = sub.add_parser("run", help="run one scenario", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--scenario", choices=SCENARIOS, default="clean")
    r.add_argument("--nodes", type=int, default=2, help="lab nodes (network namespaces); default 2")
    r.add_argument("--ranks-per-node", type=int, default=None, help="default 2, or what --layout needs")
    r.add_argument("--seconds", type=float, default=20.0, help="training time; default 20")
    r.add_argument("--steps", type=int, default=0, help="stop after this many steps instead of --seconds")
    r.add_argument("--loss-percent", type=float, default=5.0, help="lossy-link drop rate; default 5")
    r.add_argument("--rate-mbit", type=float, default=100.0, help="slow-link rate, Mbit/s; default 100")
    r.add_argument("--socket-sndbuf", type=int, default=None, metavar="BYTES",
                   help="NCCL_SOCKET_SNDBUF of every rank (as NCCL: SO_SNDBUF, which the kernel doubles, on "
                        "connections between nodes): a buffer smaller than a step makes a send's proxy step "
                        "end near when its data is acknowledged, as on NET/IB; default: the kernel's autotuning")
    r.add_argument("--victim-rank", type=int, default=None,
                   help="default: the last rank (hang: the middle one, world/2)")
    r.add_argument("--fault-after", type=float, default=None, metavar="SECONDS",
                   help="start the fault this long after the ranks start (time in lab.json: fault_injected_ns); "
                        "default: before they start (hang: 6 s after)")
    r.add_argument("--timeout", type=int, default=None, metavar="SECONDS",
                   help="a rank whose peers stop answering fails its NCCL call after this; default 60 "
                        "(hang: 20)")
    r.add_argument("--hang-for", type=float, default=None, metavar="SECONDS",
                   help="hang: continue the stopped rank after this long; default: stopped for good")
    r.add_argument("--hang-mode", choices=HANG_MODES, default="stop",
                   help="hang: stop the victim's process (SIGSTOP; default), or let it live and sleep in "
                        "its compute for good, calling NCCL no more")
    r.add_argument("--compute-ms", type=float, default=40.0, help="compute kernel per step; default 40")
    r.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                   help="cpu: every NCCL call and kernel runs when it is called (default); gpu: they are "
                   "enqueued on device streams (compute on one, each communicator on its own, side by side) and "
                   "each step synchronises with the device, as on a GPU")
    r.add_argument("--nonblocking", action="store_true",
                   help="non-blocking communicators (ncclConfig_t.blocking = 0, as PyTorch's "
                   "TORCH_NCCL_USE_COMM_NONBLOCKING): calls return ncclInProgress and are polled")
    r.add_argument("--elastic", action="store_true",
                   help="after the steps, ncclCommShrink the world without rank 1 (the last of 2), run "
                   "checked steps on it, then ncclCommGrow it back to every rank with a grow id from "
                   "ncclCommGetUniqueId and run on that; each such step also ends a group with "
                   "ncclGroupSimulateEnd")
    r.add_argument("--profiler", action="store_true",
                   help="every rank loads Ingero's NCCL profiler plugin (built like `ingero profiler build`); "
                   "with --trace its device times land in nccl_profiler_events")
    r.add_argument("--background-load", type=int, default=0, metavar="N",
                   help="N busy processes (CPU spin and system-call churn, unpinned) keep the whole "
                   "machine busy, as on a shared node or in CI; default 0")
    add_job_shape_args(r)
    r.add_argument("--ipv6", action="store_true", help="rendezvous and move data over IPv6")
    r.add_argument("--trace", action="store_true", help="run `ingero trace` on every lab node")
    r.add_argument("--probes", default=None, metavar="FAMILIES",
                   help="the tracers' probe families (`ingero trace --probes`, e.g. nccl: no TCP or "
                        "scheduler probes); default: the tracer's")
    r.add_argument("--trace-after", type=float, default=None, metavar="SECONDS",
                   help="start the tracers this long after the ranks (implies --trace): a trace attached to "
                        "a running job, which finds NCCL in the ranks' maps; past --fault-after with "
                        "--scenario hang, a job that hung before the trace began")
    r.add_argument("--out", type=Path, default=Path("out/lab"), help="output directory; default out/lab")
    sub.add_parser("cleanup", help="remove namespaces and cgroups left by crashed runs")
    sub.add_parser("build", help="compile libnccl.so.2 (CPU NCCL) and the worker; print their paths")
    p.set_defaults(_lab_parser=p)
    return p


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def run(args) -> int:
    if args.lab_command == "run":
        return _run(args)
    if args.lab_command == "cleanup":
        return _cleanup()
    if args.lab_command == "build":
        from ingero.lab.build import build_lab_binaries

        b = build_lab_binaries()
        print(f"libnccl: {b.libnccl}\nworker:  {b.worker}")
        return 0
    args._lab_parser.print_help()
    return 2


def _log(msg: str) -> None:
    print(msg, flush=True)


def profiler_plugin() -> Path:
    """Ingero's NCCL profiler plugin, built (or reused from the cache) by `ingero profiler build`,
    which prints its path."""
    proc = subprocess.run([sys.executable, "-m", "ingero", "profiler", "build"], capture_output=True, text=True)
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        raise IngeroError(f"building the NCCL profiler plugin failed ({why}); run `ingero profiler build` to see why")
    return Path(proc.stdout.strip().splitlines()[-1])


def _run(args) -> int:
    from ingero.lab import tracers as tr
    from ingero.lab.runner import LabConfig, LabRun

    cfg = LabConfig(scenario=args.scenario, nodes=args.nodes, ranks_per_node=ranks_per_node(args),
                    seconds=args.seconds, steps=args.steps, loss_percent=args.loss_percent, rate_mbit=args.rate_mbit,
                    victim_rank=args.victim_rank, ipv6=args.ipv6, out_dir=args.out,
                    compute_ms=args.compute_ms, fault_after_s=args.fault_after,
                    background_load=args.background_load, device=args.device, nonblocking=args.nonblocking,
                    elastic=args.elastic, hang_s=args.hang_for, hang_mode=args.hang_mode,
                    timeout_s=args.timeout, probes=args.probes, socket_sndbuf=args.socket_sndbuf,
                    profiler_plugin=profiler_plugin() if args.profiler else None, **job_shape(args))
    if cfg.fault_after_s is not None and cfg.fault_after_s < 0:
        raise IngeroError("--fault-after must be >= 0")
    if cfg.seconds <= 0 and cfg.steps <= 0:
        raise IngeroError("--seconds must be > 0 (or give --steps)")
    if args.trace_after is not None and (args.trace_after < 0 or (
            cfg.scenario != "hang" and cfg.steps <= 0 and args.trace_after >= cfg.seconds)):
        raise IngeroError(f"--trace-after must be >= 0 and less than --seconds ({cfg.seconds:g}): the job would "
                          "end before the tracers start")
    old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
    tracers: list = []
    try:
        with LabRun(cfg, log=_log) as lab:
            if args.trace and args.trace_after is None:
                _log(f"lab {lab.run_id}: waiting for {len(lab.nodes)} tracers")
                tracers = tr.start_lab_tracers(lab)
            lab.start_ranks()
            if args.trace_after is not None:
                _log(f"lab {lab.run_id}: starting {len(lab.nodes)} tracers {args.trace_after:g} s after the ranks")
                tracers = tr.start_lab_tracers(lab, after_s=args.trace_after)
                _log(f"lab {lab.run_id}: tracers ready "
                     f"{(lab.notes['trace_ready_ns'] - lab.ranks_started_ns) / 1e9:.1f} s after the ranks started")
            codes = lab.wait()
            if tracers:
                lab.notes["tracer_exit_codes"] = tr.stop_tracers(tracers)
        trace_db = None
        if tracers:
            trace_db = tr.merge(tracers, lab.out / "trace.duckdb")
    finally:
        signal.signal(signal.SIGTERM, old_term)
    return _summary(lab, codes, trace_db)


def _summary(lab, codes: dict[int, int], trace_db) -> int:
    c = lab.cfg
    how = f"schedule {c.schedule}"
    if c.sharding == "fsdp":
        how = f"HSDP, {c.replicas} replicas" if c.replicas > 1 else "FSDP"
        how += f", {c.layers} layers"
    lay = f", layout tp={lab.layout[0]},pp={lab.layout[1]},dp={lab.layout[2]}, {how}" if lab.layout else ""
    lay += f", device {lab.cfg.device}" + (", non-blocking" if lab.cfg.nonblocking else "")
    lay += ", elastic" if lab.cfg.elastic else ""
    if lab.cfg.scenario == "slow-stage":
        who = f"stage {lab.cfg.stage}"
    elif lab.cfg.scenario in ("clean", "imbalance"):
        who = "no single victim"
    else:
        who = f"victim rank {lab.victim} ({lab.victim_node.name})"
    print(f"lab {lab.run_id}: scenario {lab.cfg.scenario}{lay}, {who}")
    means = []
    for rp in lab.ranks:
        s = rp.stats
        mean = s.get("mean_step_ms")
        if mean is not None:
            means.append(mean)
        print(f"  rank {rp.rank} {rp.node.name} exit {codes[rp.rank]} steps {s.get('steps', '?')} "
              f"mean step {mean if mean is not None else '?'} ms")
    if means:
        print(f"  job mean step {statistics.mean(means):.1f} ms")
    print(f"  report {lab.out / 'lab.json'}")
    if trace_db:
        print(f"  trace  {trace_db}")
    bad = {r: c for r, c in codes.items() if c != 0}
    if lab.cfg.scenario == "hang" and lab.cfg.hang_s is None:
        # the others fail their call at the timeout (exit 3), the stopped (or sleeping) rank is killed
        bad = {r: c for r, c in bad.items() if c not in (3, -9) or (r == lab.victim) != (c == -9)}
        if not bad:
            print(f"  the hang ended as it should: rank {lab.victim} hung ({lab.cfg.hang_mode}) and was killed, the others "
                  f"timed out after {lab.cfg.timeout_s} s")
    if bad:
        print(f"ingero: ranks failed: {bad}; logs in {lab.out / 'logs'}", file=sys.stderr)
        return 1
    return 0


def _cleanup() -> int:
    from ingero.lab import cgroups
    from ingero.lab.netns import ip, leftover_netns
    from ingero.lab.runner import require_root

    require_root()
    errors = []
    for run in cgroups.leftover_runs():
        if run.parent == cgroups.CPU_V1_ROOT:
            errors += cgroups.remove_cpu_group(run.name[len(cgroups.RUN_PREFIX):])
        else:
            errors += cgroups.remove_tree(run)
        print(f"removed cgroup {run}")
    for ns in leftover_netns():
        proc = ip("netns", "del", ns, check=False)
        if proc.returncode:
            errors.append(f"netns {ns}: {proc.stderr.strip()}")
        else:
            print(f"removed netns {ns}")
    for e in errors:
        print(f"ingero: {e}", file=sys.stderr)
    return 1 if errors else 0

