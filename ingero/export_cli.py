"""`ingero export perfetto SOURCE -o trace.json`: the trace as a timeline for ui.perfetto.dev.
`ingero export step SOURCE -o step.svg`: one step as the verdict sees it (own work, waits,
transfers per rank), measured and replayed without the straggler.

One process per node, one thread track per rank (ordered by rank): NCCL
calls as slices (op, bytes, comm, seq, lateness in args), off-CPU intervals
nested in them, TCP retransmits and resets as instants on the rank that owns
the connection, and flow arrows from every rank's slice of a collective to
the rank that arrived last. Open the file at https://ui.perfetto.dev (Open
trace file) or in chrome://tracing.

Large traces: --start/--end keep a window (offsets from the first event,
e.g. --start 30s --end 35s) and --max-events samples whole collectives
(every k-th, all ranks kept, so arrows stay complete) down to about N events.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ingero.errors import IngeroError
from ingero.perfetto import export


def add_parser(sub):
    p = sub.add_parser("export", help="export a trace for other tools (Perfetto timeline)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_subparsers(dest="export_format", metavar="FORMAT")
    e = s.add_parser("perfetto", help="Chrome Trace Event JSON for ui.perfetto.dev",
                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                     epilog="examples:\n"
                     "  ingero export perfetto out/demo/artifacts/default/lab-job-<uid>/ -o lab.json\n"
                     "  ingero export perfetto job.duckdb -o window.json --start 10s --end 12.5s\n"
                     "  ingero export perfetto job.duckdb -o small.json --max-events 200000")
    e.add_argument("source", type=Path, help="trace .duckdb file, a folder holding one (the operator's "
                   "artifact folder), or a segment directory")
    e.add_argument("--session", metavar="ID", help="the session to read when a segment folder "
                   "holds several (the error lists them)")
    e.add_argument("-o", "--out", type=Path, required=True, help="the JSON file to write")
    e.add_argument("--start", help="keep events from this long after the first event (e.g. 30s, 250ms)")
    e.add_argument("--end", help="... until this long after the first event")
    e.add_argument("--max-events", type=int, help="sample whole collectives down to about N events")
    st = s.add_parser("step", help="one step as an SVG picture: own work, waits and transfers per rank, "
                      "measured and replayed without the straggler",
                      epilog="example:\n  ingero export step out/demo/artifacts/default/lab-job-<uid>/ -o step.svg",
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    st.add_argument("source", type=Path, help="trace .duckdb file, artifact folder or segment directory")
    st.add_argument("--session", metavar="ID", help="the session to read when a segment folder holds several")
    st.add_argument("-o", "--out", type=Path, required=True, help="the SVG file to write")
    st.add_argument("--step", type=int, help="which whole step (0 = the first); default: the middle one")
    p.set_defaults(_export_parser=p)
    return p


def run(args) -> int:
    fmt = getattr(args, "export_format", None)
    if fmt == "step":
        return _step(args)
    if fmt != "perfetto":
        args._export_parser.print_help()
        return 2
    export(args.source, args.out, args.start, args.end, args.max_events, args.session)
    return 0


def _step(args) -> int:
    from ingero.analysis import analyse_with_replays
    from ingero.analysis.picture import step_svg
    from ingero.readonly_sql import open_source

    if not args.out.parent.is_dir():
        raise IngeroError(f"-o {args.out}: folder {args.out.parent} does not exist")
    con = open_source(args.source, session=args.session)
    try:
        report, ctx = analyse_with_replays(con)
    finally:
        con.close()
    try:
        svg, summary = step_svg(report, ctx, args.step)
    except ValueError as e:
        raise IngeroError(f"{args.source}: {e}") from None
    args.out.write_text(svg)
    print(f"wrote {args.out}: {summary}", file=sys.stderr)
    return 0
