"""How often the verdict is right on real lab jobs: every fault, quiet and under load.

    python -m bench.verdict_lab [--runs 3] [--background-load 0,2] [--cases all|dp|3d|gpu|3d-gpu|fsdp] [--steps 40]
                                [--only cpu-hog,clean] [--set hog_weight=16]
                                [--keep-wrong DIR | --keep DIR]
    python -m bench.verdict_lab --rejudge DIR

Each case is one real lab run traced with real eBPF (``ingero lab run --trace``,
the merged trace analysed by ``ingero.analysis``): the data-parallel job (2
nodes x 2 ranks) with clean, lossy-link, slow-rank, cpu-hog (and a mild one) and io-stall, and
the tensor x pipeline x data parallel job (tp=2, pp=2, dp=2; 8 ranks; the
lab's default shape: 1F1B with grouped exchanges, the distributed optimizer's
reduce-scatter and all-gather, an embedding group, no collective spanning
every rank) with clean, slow-rank at stage 0, slow-stage, imbalance, a slow
rank in a middle stage (tp=1, pp=4, dp=2), a lossy link between two stages (4
nodes x 2 ranks, each stage on its own node), cpu-hog and io-stall; the
data-parallel faults and the 3D ones (``--cases 3d-gpu``) again on the lab's
GPU-like device with Ingero's profiler plugin in every rank (``--device gpu
--profiler``: judged on device times), victims placed off the last rank, and a slow link
(the victim node's data out at 100 Mbit/s) and the clean job traced with NCCL probes
only (``--probes nccl``: no TCP probe, as on InfiniBand, so NCCL's proxy send waits are
the only network evidence); and
an FSDP job (``--cases fsdp``: tp=2, dp=4, 4 layers, each gathered and
reduce-scattered in coalesced groups; HSDP with dp=8 as 2 replicas) with
clean, slow-rank, lossy-link, imbalance, cpu-hog and io-stall, and slow-rank, clean
and imbalance on the GPU-like device.
``--keep`` keeps every run's lab folder, ``--rejudge DIR`` judges the kept runs of DIR again
with the current analysis (no lab run, no root). A trace that cannot be judged is never right. ``--only`` keeps the cases whose name contains one of
the given words (``--cases all --only cpu-hog``: the four cpu-hog cases); ``--set``
overrides a LabConfig field in every case (a number or a word). A verdict is right when
it names what was planted (rank / stage / spread / nobody) with the planted
cause (a clean job: nobody, or a rank the busy machine starved, by the kernel's
own counts, named cpu-contention: ingero.lab.truth); each run prints the verdict, the saving and the job's mean step.
Needs root (eBPF, network namespaces, cgroups).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# (name, LabConfig keyword arguments, check(straggler, lab report) -> bool)
DP = dict(nodes=2, ranks_per_node=2)
L3 = dict(nodes=2, ranks_per_node=4, layout="tp=2,pp=2,dp=2")
GPU = dict(DP, device="gpu", profiler=True)       # profiler: built in one() (needs a compiler)
PROXY_IB = dict(probes="nccl", socket_sndbuf=65536)   # no TCP probe; sends complete when (nearly) acknowledged
FSDP = dict(nodes=2, ranks_per_node=4, layout="tp=2,dp=4", sharding="fsdp", layers=4)


def _clean(s, lab):
    """Nobody, or a rank the busy machine starved, named cpu-contention (ingero.lab.truth)."""
    from ingero.lab.truth import clean_verdict_problem
    return not clean_verdict_problem(s, {r["rank"]: r["stats"] for r in lab["ranks"]})


def _rank(cause):
    return lambda s, lab: s is not None and s.kind == "rank" and s.rank == lab["victim_rank"] and s.cause == cause


def _rank_or_nobody(cause):
    return lambda s, lab: s is None or _rank(cause)(s, lab)


CASES = {
    "dp": [
        ("clean", dict(DP, scenario="clean"), _clean),
        ("lossy-link", dict(DP, scenario="lossy-link"),
         lambda s, lab: s is not None and s.node == lab["victim_node"] and s.cause == "network"),
        ("slow-rank", dict(DP, scenario="slow-rank"), _rank("compute/unknown")),
        ("cpu-hog", dict(DP, scenario="cpu-hog", hogs=8), _rank("cpu-contention")),
        # a neighbour that weighs what a rank does: the victim waits 1.5-3.8x its peers per
        # off-CPU interval, in its own work; when it costs the job 5% it is cpu-contention
        ("cpu-hog mild", dict(DP, scenario="cpu-hog", hogs=2, hog_weight=2.0), _rank_or_nobody("cpu-contention")),
        ("io-stall", dict(DP, scenario="io-stall"), _rank("io")),
    ],
    "3d": [
        ("3d clean", dict(L3, scenario="clean"), _clean),
        ("3d slow-rank stage 0", dict(L3, scenario="slow-rank", victim_rank=1), _rank("compute/unknown")),
        ("3d slow-stage 1", dict(L3, scenario="slow-stage", stage=1, slow_factor=1.5),
         lambda s, lab: s is not None and s.kind == "stage" and s.ranks == lab["stage_ranks"]),
        ("3d imbalance", dict(L3, scenario="imbalance", imbalance=1.0),
         lambda s, lab: s is not None and s.kind == "spread"),
        ("3d slow-rank mid stage", dict(L3, scenario="slow-rank", layout="tp=1,pp=4,dp=2", victim_rank=2),
         _rank("compute/unknown")),
        ("3d lossy stage link", dict(L3, scenario="lossy-link", nodes=4, ranks_per_node=2, victim_rank=2),
         lambda s, lab: s is not None and s.node == lab["victim_node"] and s.cause == "network"),
        ("3d cpu-hog", dict(L3, scenario="cpu-hog", hogs=8, victim_rank=1), _rank("cpu-contention")),
        ("3d io-stall", dict(L3, scenario="io-stall", io_mb=16, victim_rank=6), _rank("io")),
    ],
    "gpu": [
        ("gpu clean", dict(GPU, scenario="clean"), _clean),
        ("gpu lossy-link", dict(GPU, scenario="lossy-link", victim_rank=1),
         lambda s, lab: s is not None and s.node == lab["victim_node"] and s.cause == "network"),
        # no TCP probe (as on NET/IB): NCCL's proxy send waits are the only network evidence, with
        # a send buffer smaller than a step so that a send completes near when its data is
        # acknowledged, as an RC QP's does (PROXY_IB)
        ("gpu slow-link proxy only", dict(GPU, **PROXY_IB, scenario="slow-link", victim_rank=1),
         lambda s, lab: s is not None and s.node == lab["victim_node"] and s.cause == "network"
         and s.evidence.startswith("NCCL's proxy:")),
        ("gpu clean proxy only", dict(GPU, **PROXY_IB, scenario="clean"), _clean),
        ("gpu slow-rank", dict(GPU, scenario="slow-rank", victim_rank=1), _rank("compute/unknown")),
        ("gpu cpu-hog", dict(GPU, scenario="cpu-hog", hogs=8, victim_rank=1), _rank("cpu-contention")),
        ("gpu io-stall", dict(GPU, scenario="io-stall", victim_rank=2), _rank("io")),
    ],
}
CASES["fsdp"] = [
    ("fsdp clean", dict(FSDP, scenario="clean"), _clean),
    ("fsdp slow-rank", dict(FSDP, scenario="slow-rank", victim_rank=5), _rank("compute/unknown")),
    ("fsdp lossy-link", dict(FSDP, scenario="lossy-link"),
     lambda s, lab: s is not None and s.node == lab["victim_node"] and s.cause == "network"),
    ("fsdp imbalance", dict(FSDP, scenario="imbalance", imbalance=1.0),
     lambda s, lab: s is not None and s.kind == "spread"),
    ("fsdp cpu-hog", dict(FSDP, scenario="cpu-hog", hogs=8, victim_rank=2), _rank("cpu-contention")),
    ("fsdp io-stall", dict(FSDP, scenario="io-stall", io_mb=16, victim_rank=6), _rank("io")),
    ("hsdp slow-rank", dict(FSDP, layout="dp=8", replicas=2, scenario="slow-rank", victim_rank=2),
     _rank("compute/unknown")),
    ("fsdp-gpu slow-rank", dict(FSDP, scenario="slow-rank", victim_rank=5, device="gpu", profiler=True),
     _rank("compute/unknown")),
    # about 20 sync events per rank and step: each one's jitter adds to "fix everyone"
    ("fsdp-gpu clean", dict(FSDP, scenario="clean", device="gpu", profiler=True), _clean),
    ("fsdp-gpu imbalance", dict(FSDP, scenario="imbalance", imbalance=1.0, device="gpu", profiler=True),
     lambda s, lab: s is not None and s.kind == "spread"),
]
# the 3D faults again on the GPU-like device, judged on the plugin's device times
CASES["3d-gpu"] = [(name.replace("3d", "3d-gpu", 1), dict(kw, device="gpu", profiler=True), check)
                   for name, kw, check in CASES["3d"]]
GROUPS = tuple(CASES)


def one(kw: dict, steps: int, load: int, out: Path):
    from ingero.analysis import analyse
    from ingero.lab.runner import LabConfig
    from ingero.lab.tracers import run_traced
    from ingero.readonly_sql import open_source

    if kw.pop("profiler", False):
        from ingero_agent.profiler_build import build_profiler
        kw["profiler_plugin"] = build_profiler()
    run = run_traced(LabConfig(steps=steps, compute_ms=40.0, out_dir=out, background_load=load, **kw))
    if set(run.codes.values()) != {0}:
        raise RuntimeError(f"rank exit codes {run.codes}")
    con = open_source(run.db)
    try:
        return analyse(con), run.report
    finally:
        con.close()


def judge(rep, lab, cfg: dict, check) -> tuple[bool, str]:
    """Whether the report names what was planted, and what it says."""
    s = rep.straggler
    # a trace that cannot be judged is never right, not even for a clean job
    ok = (check(s, lab) and rep.verdict != "cannot-judge"
          and (rep.timing == "device") == (cfg.get("device") == "gpu"))
    what = rep.verdict if s is None else f"{s.kind} {s.group or s.rank} {s.cause} {s.saving_pct:.1f}%"
    return ok, (f"{'RIGHT' if ok else 'WRONG'}  {what}; {rep.timing} times, mean step {rep.mean_step_ms:.1f} ms, "
                f"best fix {rep.best_saving_pct:.1f}%")


def _folder(name: str, load: int, i: int) -> str:
    return f"{name.replace(' ', '-')}-load{load}-run{i + 1}"


def rejudge(kept: Path, cases: list) -> list:
    """Each kept run of `cases` in `kept` analysed again: (load, name, ok) rows, one line each."""
    import json
    import re

    from ingero.analysis import analyse
    from ingero.readonly_sql import open_source

    rows = []
    by_folder = {name.replace(" ", "-"): (name, kw, check) for name, kw, check in cases}
    for d in sorted(kept.iterdir()):
        m = re.fullmatch(r"(.+)-load(\d+)-run(\d+)", d.name)
        if m is None or m[1] not in by_folder or not (d / "trace.duckdb").exists():
            continue
        name, kw, check = by_folder[m[1]]
        con = open_source(d / "trace.duckdb")
        try:
            rep = analyse(con)
        finally:
            con.close()
        lab = json.loads((d / "lab.json").read_text())
        ok, what = judge(rep, lab, kw, check)
        print(f"load {m[2]} {name:22s} run {m[3]}: {what}" + _victim_detail(rep, lab), flush=True)
        rows.append((int(m[2]), name, ok))
    return rows


def _victim_detail(rep, lab) -> str:
    """For cpu-hog: the victim's runqueue wait and own work per step against its peers' medians;
    for lossy-link, each rank's sends' network wait (NCCL's proxy), when the plugin gave it."""
    if lab.get("scenario") in ("lossy-link", "slow-link") and any(r.net_wait_ms is not None for r in rep.ranks):
        return "; sends' network wait (ms, proxy): " + ", ".join(
            f"{r.rank}{'*' if r.node == lab['victim_node'] else ''} {r.net_wait_ms or 0:.0f}" for r in rep.ranks)
    if lab.get("scenario") != "cpu-hog":
        return ""
    from statistics import median
    v = next((r for r in rep.ranks if r.rank == lab["victim_rank"]), None)
    peers = [r for r in rep.ranks if r.rank != lab["victim_rank"]]
    if v is None or not peers:
        return ""
    rq = median(r.offcpu_ms.get("runqueue", 0.0) for r in peers)
    own = median(r.own_ms for r in peers)
    return (f"; victim runqueue {v.offcpu_ms.get('runqueue', 0.0):.0f} ms vs peers {rq:.0f}, "
            f"own work {v.own_ms:.1f} vs {own:.1f} ms/step, retransmits {rep.retransmits} "
            f"(victim's node {sum(r.retransmits for r in rep.ranks if r.node == lab['victim_node'])})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--background-load", default="0,2", help="comma-separated loads; default 0,2")
    ap.add_argument("--cases", choices=("all",) + GROUPS, default="all")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--only", default="", help="comma-separated words; keep the cases whose name contains one")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a LabConfig field in every case (repeatable)")
    ap.add_argument("--keep-wrong", type=Path, metavar="DIR",
                    help="move the lab folder (trace.duckdb, lab.json, logs) of each wrong run into DIR")
    ap.add_argument("--keep", type=Path, metavar="DIR", help="move every run's lab folder into DIR")
    ap.add_argument("--rejudge", type=Path, metavar="DIR",
                    help="no lab run: analyse the runs kept in DIR again and judge them")
    a = ap.parse_args(argv)
    loads = [int(x) for x in a.background_load.split(",")]
    cases = [c for k in GROUPS if a.cases in ("all", k) for c in CASES[k]]
    words = [w.strip() for w in a.only.split(",") if w.strip()]
    if words:
        cases = [c for c in cases if any(w in c[0] for w in words)]
        if not cases:
            ap.error(f"--only {a.only!r} matches no case of --cases {a.cases}")
    overrides = {}
    for item in a.set:
        k, eq, v = item.partition("=")
        if not eq:
            ap.error(f"--set {item!r}: write FIELD=VALUE")
        try:
            overrides[k] = int(v)
        except ValueError:
            try:
                overrides[k] = float(v)
            except ValueError:
                overrides[k] = v
    rows = rejudge(a.rejudge, cases) if a.rejudge is not None else _run(a, cases, loads, overrides)
    right, total = sum(ok for *_, ok in rows), len(rows)
    loads = sorted({ld for ld, *_ in rows}) if a.rejudge is not None else loads
    print(f"\nverdict_lab: {right} of {total} right")
    for load in loads:
        sub = [ok for ld, _, ok in rows if ld == load]
        print(f"  background load {load}: {sum(sub)} of {len(sub)}")
    return 0 if right == total else 1


def _run(a, cases: list, loads: list, overrides: dict) -> list:
    """Each case `a.runs` times at each load: (load, name, ok) rows, one line each."""
    rows = []
    keep = a.keep if a.keep is not None else a.keep_wrong
    for load in loads:
        for name, kw, check in cases:
            for i in range(a.runs):
                out = Path(tempfile.mkdtemp(prefix="verdict-lab-"))
                t = time.monotonic()
                cfg = dict(kw, **overrides)
                try:
                    rep, lab = one(cfg, a.steps, load, out)
                    ok, what = judge(rep, lab, cfg, check)
                    line = (f"load {load} {name:22s} run {i + 1}: {what} ({time.monotonic() - t:.0f} s)"
                            + _victim_detail(rep, lab))
                except Exception as e:          # a failed run counts as wrong, with its reason
                    ok, line = False, f"load {load} {name:22s} run {i + 1}: ERROR {type(e).__name__}: {e}"
                if keep is not None and (not ok or a.keep is not None):
                    kept = keep / _folder(name, load, i)
                    keep.mkdir(parents=True, exist_ok=True)
                    shutil.rmtree(kept, ignore_errors=True)
                    shutil.move(str(out), kept)
                    line += f" [kept in {kept}]"
                shutil.rmtree(out, ignore_errors=True)
                print(line, flush=True)
                rows.append((load, name, ok))
    return rows


if __name__ == "__main__":
    sys.exit(main())
