"""`ingero report SOURCE`: the per-rank table and the straggler verdict of a trace.

A trace holding more NCCL calls than a window (``ingero.analysis.windows``) is judged window
after window, so memory stays bounded by a window whatever the session's length; each window
of an operator's artifact reads only the segment files in its range."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ingero.readonly_sql import open_source
from ingero.report_text import render
from ingero.segment_views import analyse_trace


def add_parser(sub):
    p = sub.add_parser("report", help="per-rank table and straggler verdict of a trace",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="example:\n  ingero report out/demo/trace.duckdb")
    p.add_argument("source", type=Path, help="trace .duckdb file, a folder holding one (the operator's "
                   "artifact folder, a lab --out folder), or a segment directory")
    p.add_argument("--session", metavar="ID", help="the session to read when a segment folder "
                   "holds several (the error lists them)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def run(args) -> int:
    con = open_source(args.source, session=args.session)
    try:
        rep = analyse_trace(con)
    finally:
        con.close()
    if args.json:
        json.dump(rep.to_dict(), sys.stdout, indent=2, default=str)
        print()
    else:
        render(rep)
    return 0
