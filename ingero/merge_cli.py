"""`ingero merge INPUT... -o merged.duckdb`: one trace from DuckDB files and segment folders.

For air-gapped clusters: copy each node's segment folder (the agent's
DATA/sessions/<id>/segments, or `ingero trace --segments`), `ingero trace`
outputs, or operator artifacts, and merge them. Rows copied twice count once,
each node's clock offset is applied when an input knows it (or when given
with --clock-offset), split communicators' ranks are resolved, and merging
the result with an input again changes nothing. A truncated or foreign file
is named and skipped; the merge fails only when nothing usable is left, or
when the inputs hold several sessions that recorded one node or rank twice and
--session names none of them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ingero.errors import IngeroError


def add_parser(sub):
    p = sub.add_parser("merge", help="merge traces and segment folders copied from nodes into one DuckDB file",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="examples:\n"
                       "  ingero merge node-a/segments node-b/segments -o job.duckdb\n"
                       "  ingero merge trace.duckdb late-node/segments -o job.duckdb\n"
                       "  ingero merge node-*/ -o job.duckdb --clock-offset node-b=-2500000")
    p.add_argument("inputs", nargs="+", type=Path, help="DuckDB files, segment folders or segment files")
    p.add_argument("-o", "--out", type=Path, required=True, help="the merged DuckDB file (replaced atomically)")
    p.add_argument("--clock-offset", action="append", default=[], metavar="NODE=NS",
                   help="node's clock minus the reference clock, in ns (repeatable); "
                   "overrides what the inputs say")
    p.add_argument("--session", metavar="ID", help="the session to merge when the inputs hold several "
                   "(the error lists them)")
    p.add_argument("--quiet", action="store_true", help="print only warnings")
    return p


def parse_offsets(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        node, sep, value = item.partition("=")
        try:
            out[node.strip()] = int(value)
        except ValueError:
            raise IngeroError(f"--clock-offset {item!r} is not NODE=NANOSECONDS (e.g. node-b=-2500000)") from None
        if not sep or not node.strip():
            raise IngeroError(f"--clock-offset {item!r} is not NODE=NANOSECONDS (e.g. node-b=-2500000)")
    return out


def run(args) -> int:
    from ingero.merge import merge

    res = merge(args.inputs, args.out, parse_offsets(args.clock_offset), session=args.session)
    for s in res.skipped:
        print(f"ingero: warning: skipped {s}", file=sys.stderr)
    for w in res.warnings:
        print(f"ingero: warning: {w}", file=sys.stderr)
    if not args.quiet:
        offs = ", ".join(f"{n} {'unknown' if o is None else f'{o} ns'}" for n, o in sorted(res.offsets.items()))
        print(f"merged {len(res.loaded)} input files into {res.out}: "
              + ", ".join(f"{t} {n}" for t, n in res.rows.items() if n) + f"; clock offsets: {offs or '-'}")
    return 0
