"""Thirty hand-written mutations of ingero/analysis, the thresholds and rules a verdict turns
on, each applied in turn to a copy of the tree (``scripts/mutation.sh --listed`` makes it)
and run against the analysis's unit tests: killed (a test failed) or survived.

mutmut's operators change one token at a time; these change what a reader would suspect:
a threshold moved to another plausible figure, a rule or a filter dropped, a comparison
moved by one. Usage: ``python scripts/mutation_listed.py SRC TEST...`` with SRC the copy
(its ``ingero`` first on the path) and the test files relative to it; exit status 1 when
more than MAX_SURVIVORS survive.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

MAX_SURVIVORS = 2


class Mutation(NamedTuple):
    what: str
    path: str                 # under ingero/analysis
    old: str                  # found exactly once in the file
    new: str


MUTATIONS = [
    Mutation("OFFCPU_Z 3.5 -> 2.0", "verdict.py", "OFFCPU_Z = 3.5 ", "OFFCPU_Z = 2.0 "),
    Mutation("RETX_SHARE 0.67 -> 0.34", "verdict.py", "RETX_SHARE = 0.67 ", "RETX_SHARE = 0.34 "),
    Mutation("RETX_SHARE 0.67 -> 0.9", "verdict.py", "RETX_SHARE = 0.67 ", "RETX_SHARE = 0.9 "),
    Mutation("SPREAD_SHARE 0.5 -> 0.3", "verdict.py", "SPREAD_SHARE = 0.5 ", "SPREAD_SHARE = 0.3 "),
    Mutation("SPREAD_SHARE 0.5 -> 0.7", "verdict.py", "SPREAD_SHARE = 0.5 ", "SPREAD_SHARE = 0.7 "),
    Mutation("retransmits inside a node judged as link loss", "__init__.py",
             'wire = ~retx.local if timing != "host-enqueue"',
             'wire = np.ones(len(retx.ts), bool) if timing != "host-enqueue"'),
    Mutation("starved-rank candidate skipped", "verdict.py",
             "_starved_candidate(j), _stage_candidate(j)", "None, _stage_candidate(j)"),
    Mutation("send/recv rendezvous edges dropped", "calls.py",
             "rdv = (c.t + c.d)[sends[si]] >= a[r_ev]", "rdv = np.zeros(len(si), bool)"),
    Mutation("a plain group's calls not grouped (depth > 1)", "calls.py",
             "inside = (depth_before > 0) & (c.op > 0)", "inside = (depth_before > 1) & (c.op > 0)"),
    Mutation("a rank's peers taken from every role", "verdict.py",
             "for k, v in own.items() if role[k] == role[r]}", "for k, v in own.items()}"),
    Mutation("fixed own work the peers' median, not at most it", "verdict.py",
             "fixed_w=np.minimum(m.w, med).astype(np.int64)", "fixed_w=med.astype(np.int64)"),
    Mutation("retransmit window from arrival, not from ready", "verdict.py",
             'np.searchsorted(retx.ts, m.ready, side="left")\n    cand = np.flatnonzero((k > 0) & tl.inwin)\n'
             "    lo, hi = m.ready[cand], ev.e[cand]",
             'np.searchsorted(retx.ts, ev.a, side="left")\n    cand = np.flatnonzero((k > 0) & tl.inwin)\n'
             "    lo, hi = ev.a[cand], ev.e[cand]"),
    Mutation("slow node without NODE_ALIKE", "verdict.py",
             "if lo >= NODE_SLOW and lo - 1 >= NODE_ALIKE * (hi - 1):", "if lo >= NODE_SLOW:"),
    Mutation("step window one boundary longer (< for <=)", "steps.py",
             "inwin = (gb >= L + 1) & (gb <= H)", "inwin = (gb >= L + 1) & (gb <= H + 1)"),
    Mutation("a collective seen twice allowed as the marker", "steps.py",
             "steady = [f for f in families if count(f) >= MIN_INSTANCES] or families",
             "steady = families"),
    Mutation("any p2p-only communicator taken as a pipeline", "steps.py",
             "if np.mean((hop == 1) | ((hop == len(mem) - 1) & (len(mem) > 2))) >= 0.95:", "if True:"),
    Mutation("_starved_behind skipped", "verdict.py",
             "return _starved_behind(net, j.rows, j.tl, j.traced_ns, j.own, j.peers_own) or net", "return net"),
    Mutation("SAVING_FLOOR_PCT 5 -> 2", "verdict.py", "SAVING_FLOOR_PCT = 5.0 ", "SAVING_FLOOR_PCT = 2.0 "),
    Mutation("TIE_SHARE 0.9 -> 0.5", "verdict.py", "TIE_SHARE = 0.9 ", "TIE_SHARE = 0.5 "),
    Mutation("STARVED_SHARE 0.5 -> 0.1", "verdict.py", "STARVED_SHARE = 0.5 ", "STARVED_SHARE = 0.1 "),
    Mutation("STARVED_PER_WAIT 4 -> 1.5", "verdict.py", "STARVED_PER_WAIT = 4.0 ", "STARVED_PER_WAIT = 1.5 "),
    Mutation("OFFCPU_EXPLAINS 0.3 -> 0.6", "verdict.py", "OFFCPU_EXPLAINS = 0.3 ", "OFFCPU_EXPLAINS = 0.6 "),
    Mutation("OFFCPU_EXPLAINS_RUNQUEUE 0.5 -> 0.25", "verdict.py", "OFFCPU_EXPLAINS_RUNQUEUE = 0.5 ",
             "OFFCPU_EXPLAINS_RUNQUEUE = 0.25 "),
    Mutation("RETX_MIN_EVENT_SHARE 0.05 -> 0.5", "verdict.py", "RETX_MIN_EVENT_SHARE = 0.05 ",
             "RETX_MIN_EVENT_SHARE = 0.5 "),
    Mutation("NODE_SLOW 1.05 -> 1.5", "verdict.py", "NODE_SLOW = 1.05 ", "NODE_SLOW = 1.5 "),
    Mutation("robust z scaled by the MAD, not 1.4826 MAD", "stats.py",
             "scale = np.maximum(1.4826 * np.median(", "scale = np.maximum(1.0 * np.median("),
    Mutation("a collective's transfer from its own arrival, not the last member's", "replay.py",
             "ready[idx] = np.maximum(ready[idx], mx[inst])", "ready[idx] = ready[idx]"),
    Mutation("a network candidate not weighed against the ranks", "verdict.py",
             "best = _against_network(j, best, ranks)", "best = best"),
    Mutation("candidates ranked smallest saving first", "verdict.py",
             "key=lambda k: -k.saving_ns)", "key=lambda k: k.saving_ns)"),
    Mutation("a rank's peer median including itself", "verdict.py",
             "others = [v for k, v in vals.items() if k != r]", "others = list(vals.values())"),
]


def killed(src: Path, m: Mutation, tests: list[str]) -> bool:
    """Whether a test fails with `m` applied to `src` (restored afterwards)."""
    path = src / "ingero" / "analysis" / m.path
    text = path.read_text()
    if text.count(m.old) != 1:
        sys.exit(f"{m.what}: {m.old!r} occurs {text.count(m.old)} times in {path}, not once; "
                 "map the mutation to the code as it is now")
    path.write_text(text.replace(m.old, m.new))
    try:
        run = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                             cwd=src, env={**os.environ, "PYTHONPATH": str(src)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finally:
        path.write_text(text)
    return run.returncode != 0


def main() -> int:
    src, tests = Path(sys.argv[1]).resolve(), sys.argv[2:]
    clean = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=src,
                           env={**os.environ, "PYTHONPATH": str(src)})
    if clean.returncode != 0:
        sys.exit("the unmutated tests fail: fix them before judging mutations")
    survived = 0
    for i, m in enumerate(MUTATIONS, 1):
        t0 = time.monotonic()
        k = killed(src, m, tests)
        survived += not k
        print(f"{i:2d} {'killed  ' if k else 'SURVIVED'} {time.monotonic() - t0:5.1f} s  {m.what}", flush=True)
    print(f"{len(MUTATIONS) - survived} of {len(MUTATIONS)} killed")
    return 1 if survived > MAX_SURVIVORS else 0


if __name__ == "__main__":
    sys.exit(main())
