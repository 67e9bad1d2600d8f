"""Segments on the operator's disk: fetch what is new, ingest it, merge the artifact.

Per session (``<artifacts>/<namespace>/<name>/``)::

    work/<node>/<table>/*.parquet   copies of each node's segments (mtime = the agent's)
    work/live.duckdb                event rows ingested so far (each segment once) for the live status
    trace.duckdb, report.json       the artifact, written when the session completes

Clock offsets are applied on the way in: a node's clock columns
(``schema.CLOCK_COLUMNS``) are shifted by ``-offset`` so that every node's events
share the operator's clock, by the read the artifact's views make
(``ingero.segment_views.scan``: one ``read_parquet`` of a table over every node's
files). The live database uses the offset measured when tracing started; the
artifact is rebuilt from all segments with the offsets measured at the end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
from pathlib import Path

import duckdb

from ingero import schema
from ingero.comms import resolve_split_ranks
from ingero.analysis import Report, analyse_part
from ingero.analysis.hang import SAME_ENTRY_NS, find_hang
from ingero.analysis.windows import WINDOW_CALLS, events_where
from ingero.segment_views import VIEWS, Segment, SegmentViews, analyse_trace, describe, scan
from ingero_operator.agents import AgentBroke, AgentClient, AgentUnreachable
from ingero_operator.settings import GatherSettings

log = logging.getLogger("ingero.operator.gather")

LIST_OVERLAP_NS = 2_000_000_000   # file mtimes tick coarsely: re-list this far back, skip known files


# What this operator process knows of each session folder: the segment bytes per node folder
# (scanned once, then kept up to date by the downloads) and the folders whose live database
# it has scanned once for segments (after that, a refresh ingests what the gather announced).
_NODE_BYTES: dict[Path, int] = {}
_SCANNED: set[Path] = set()


class LocalSession:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.work = self.root / "work"
        self.live_db = self.work / "live.duckdb"
        self.artifact = self.root / "trace.duckdb"
        self.report = self.root / "report.json"
        self.announced = self.work / "announced.tsv"

    def announce(self, node: str, table: str, name: str) -> None:
        """Note a segment the gather has just written, for the next live refresh to ingest
        (a refresh never lists the session's folder again: it holds every segment so far)."""
        self.announced.parent.mkdir(parents=True, exist_ok=True)
        with open(self.announced, "a") as f:
            f.write(f"{node}\t{table}\t{name}\n")

    def files(self, node: str, table: str) -> list[Path]:
        """The node's segment files of `table` (its folder holds no other: `fetch_new`)."""
        d = self.node_dir(node) / table
        return sorted(f for f in d.glob("*.parquet") if not f.name.startswith(".")) if d.is_dir() else []

    def node_bytes(self, node: str) -> int:
        """Bytes of the node's segments, downloads in progress included; a folder is scanned
        the first time this process asks, then kept by `add_bytes`."""
        key = self.node_dir(node).resolve()
        if key not in _NODE_BYTES:
            _NODE_BYTES[key] = disk_bytes(key)
        return _NODE_BYTES[key]

    def add_bytes(self, node: str, n: int | None) -> None:
        """Count `n` more bytes in the node's folder; None: not known (scanned again next time)."""
        key = self.node_dir(node).resolve()
        if n is None:
            _NODE_BYTES.pop(key, None)
        elif key in _NODE_BYTES:
            _NODE_BYTES[key] += n

    def node_dir(self, node: str) -> Path:
        return self.work / "nodes" / node

    def nodes(self) -> list[str]:
        d = self.work / "nodes"
        return sorted(p.name for p in d.iterdir() if p.is_dir()) if d.is_dir() else []

    def needs(self, node: str, entry: dict) -> bool:
        try:
            st = (self.node_dir(node) / entry["table"] / entry["name"]).stat()
        except FileNotFoundError:
            return True
        return st.st_size != entry["size"] or st.st_mtime_ns < entry["mtime_ns"]


# What an agent's segment listing may name. The listing crosses a trust boundary (an agent,
# or whatever answers at its address): names become paths under the session folder, so
# anything but a plain segment file name is refused and reported, never written.
SEGMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,200}\.parquet")
NODE_NAME = re.compile(r"[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?")


def check_entry(node: str, entry) -> str | None:
    """Why a segment listing entry of `node` is refused, or None when it is sound."""
    if not isinstance(entry, dict):
        return f"node {node}: refused a segment listing entry that is not an object"
    name, table = entry.get("name"), entry.get("table")
    if table not in schema.TABLES:
        return f"node {node}: refused segment of unknown table {str(table)[:60]!r}"
    if not isinstance(name, str) or not SEGMENT_NAME.fullmatch(name) or ".." in name:
        return f"node {node}: refused segment name {str(name)[:80]!r} (not a segment file name)"
    for k in ("size", "mtime_ns"):
        v = entry.get(k)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 63:
            return f"node {node}: refused segment {name}: {k} {str(v)[:40]!r} is not a count"
    return None


def disk_bytes(folder: Path) -> int:
    """Bytes of the files below `folder` (downloads in progress included)."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0


async def fetch_new(client: AgentClient, sid: str, local: LocalSession, since_ns: int,
                    sem: asyncio.Semaphore, limits: GatherSettings | None = None) -> tuple[int, int, list[str]]:
    """Download the node's segments that are new or changed, within `limits`: a listing of
    more entries than allowed, segments that would take the node's or the session's folder
    past its cap, or a segment larger than listed raise AgentBroke (the node counts as
    failed; what it sent before stays).

    Returns (new cursor, files fetched, warnings naming the entries refused)."""
    g = limits or GatherSettings()
    if not NODE_NAME.fullmatch(client.node):
        return since_ns, 0, [f"node {client.node[:80]!r}: not a node name; nothing fetched from it"]
    listing = await client.segments(sid, max(0, since_ns - LIST_OVERLAP_NS))
    if listing is None:
        return since_ns, 0, []
    entries = listing.get("segments") if isinstance(listing, dict) else None
    if not isinstance(entries, list):
        return since_ns, 0, [f"node {client.node}: refused a segment listing without a segments list"]
    if len(entries) > g.listing_max_entries:
        raise AgentBroke(f"{client}: listed {len(entries)} segments; at most {g.listing_max_entries} are taken")
    refused, todo = [], []
    root = local.node_dir(client.node).resolve()
    for e in entries:
        why = check_entry(client.node, e)
        if why is None and not (root / e["table"] / e["name"]).resolve().is_relative_to(root):
            why = f"node {client.node}: refused segment name {e['name']!r} (outside the session folder)"
        if why:
            refused.append(why)
        elif local.needs(client.node, e):
            todo.append(e)
    for w in refused:
        log.warning("%s", w)
    want = sum(e["size"] for e in todo)
    node_bytes = local.node_bytes(client.node)
    session_bytes = sum(local.node_bytes(n) for n in local.nodes())
    for cap, used, what, flag in ((g.node_max_bytes, node_bytes, "node's", "--node-max-bytes"),
                                  (g.session_max_bytes, session_bytes, "session's", "--session-max-bytes")):
        if want and used + want > cap:
            raise AgentBroke(f"{client}: its {len(todo)} new segments ({want:,} bytes) would take the {what} "
                             f"segments past {flag} {cap:,}")
    local.add_bytes(client.node, want)       # reserved while they download: other nodes see them

    async def one(e):
        async with sem:
            dest = local.node_dir(client.node) / e["table"] / e["name"]
            old = dest.stat().st_size if dest.exists() else 0
            got = await client.download(sid, e["table"], e["name"], dest, int(e["mtime_ns"]),
                                        e["size"] + g.size_slack_bytes)
            local.add_bytes(client.node, got - old - e["size"])
            local.announce(client.node, e["table"], e["name"])

    results = await asyncio.gather(*(one(e) for e in todo), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        local.add_bytes(client.node, None)   # partial downloads: count the folder again
        errors.sort(key=lambda e: not isinstance(e, AgentBroke))     # a broken bound first: it is final
        raise errors[0] if isinstance(errors[0], AgentUnreachable) else AgentUnreachable(
            f"{client}: {errors[0]}")
    cursor = listing.get("cursor")
    return (cursor if isinstance(cursor, int) and cursor >= 0 else since_ns), len(todo), refused


def _insert(con, table: str, segs: list[Segment], since: int | None = None) -> None:
    """Insert the rows of segments `segs` (`since`: those from then on, ns)."""
    rows = scan(table, segs, lo=since)
    if rows is not None:
        con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM ({rows})"
                    + ("" if since is None else f" WHERE timestamp_ns >= {int(since)}"))


def _new_segments(local: LocalSession) -> list[tuple[str, str, str]]:
    """(node, table, name) of the event segments a refresh may not have ingested yet: those
    announced since the last refresh, or, the first time this process refreshes the session
    (an operator restarted, a live database begun), every segment in its folder."""
    key = local.root.resolve()
    if key not in _SCANNED:
        _SCANNED.add(key)
        return [(node, table, f.name) for node in local.nodes() for table in schema.EVENT_TABLES
                for f in local.files(node, table)]
    if not local.announced.exists():
        return []
    rows = [tuple(line.split("\t")) for line in local.announced.read_text().splitlines()]
    return [r for r in rows if len(r) == 3 and r[1] in schema.EVENT_TABLES]


def _ingest_new(con, local: LocalSession, offsets: dict[str, int], recent_s: float | None) -> None:
    """Insert the event segments not yet in the live database, each once: their NCCL calls
    into the per-node extent, and their rows from the time ``_keep_since`` gives on (older
    ones, in the database already, are deleted). The announcements are dropped once they are
    in (a failed refresh leaves them for the next)."""
    cand = _new_segments(local)
    todo: dict[str, list[tuple[str, Path]]] = {}      # table -> (node, file)
    if cand:
        con.execute("CREATE OR REPLACE TEMP TABLE _cand (node VARCHAR, tbl VARCHAR, name VARCHAR)")
        con.executemany("INSERT INTO _cand VALUES (?, ?, ?)", [list(r) for r in cand])
        new = con.execute("SELECT DISTINCT node, tbl, name FROM _cand ANTI JOIN _ingested USING (node, tbl, name) "
                          "ORDER BY node, tbl, name").fetchall()
        con.execute("DROP TABLE _cand")
        for node, tbl, name in new:
            f = (local.node_dir(node) / tbl / name).resolve()
            if f.exists():
                todo.setdefault(tbl, []).append((node, f))
    segs = {table: [describe(f, str(f), offsets.get(node, 0)) for node, f in files] for table, files in todo.items()}
    calls = scan("nccl_events", segs.get("nccl_events", []))
    if calls is not None:
        _add_extent(con, f"({calls})")
    since = _keep_since(con, recent_s)
    if since is not None:
        for table in schema.EVENT_TABLES:
            con.execute(f"DELETE FROM {table} WHERE timestamp_ns < ?", [since])
    for table, files in todo.items():
        _insert(con, table, segs[table], since)
        con.executemany("INSERT INTO _ingested VALUES (?, ?, ?)", [[node, table, f.name] for node, f in files])
    local.announced.unlink(missing_ok=True)


def _keep_since(con, recent_s: float | None) -> int | None:
    """The oldest event time the live database keeps: KEEP_WINDOWS live windows (of the step
    the refresh before measured) before the newest call judged, or the entry of a call a
    thread was last seen inside, if earlier (``find_hang`` pairs it with its returned row by
    that time). None: every event is kept (the whole session is judged, or no step is known
    yet)."""
    known = con.execute("SELECT max(step_ms) FROM _live_step").fetchone()[0]
    if not recent_s or known is None:
        return None
    until, _ = _horizon(con)
    end = until if until is not None else con.execute("SELECT max(last_ns) FROM _extent").fetchone()[0]
    if end is None:
        return None
    since = int(end - KEEP_WINDOWS * _window_s(recent_s, known) * 1e9)
    entered = con.execute("SELECT min(since_ns) FROM nccl_inflight WHERE op IS NOT NULL").fetchone()[0]
    return since if entered is None else min(since, int(entered) - SAME_ENTRY_NS)


def _add_extent(con, rows: str) -> None:
    """Add the NCCL calls of table `rows` to `_extent` (per node: calls, first and newest start),
    which a live refresh reads instead of scanning every call ingested so far."""
    con.execute("""CREATE OR REPLACE TABLE _extent AS
        SELECT node, sum(calls)::BIGINT AS calls, min(first_ns) AS first_ns, max(last_ns) AS last_ns
        FROM (SELECT * FROM _extent UNION ALL
              SELECT node, count(*), min(timestamp_ns), max(timestamp_ns) FROM """ + rows + """ GROUP BY node)
        GROUP BY node""")


def _sources(local: LocalSession, table: str, offsets: dict[str, int], root: Path | None = None) -> list[Segment]:
    """Every node's segments of `table` (footers read), each with its node's clock offset,
    named by absolute path, or relative to `root`."""
    return [describe(f, str(f.relative_to(root) if root else f), offsets.get(node, 0))
            for node in local.nodes() for f in map(Path.resolve, local.files(node, table))]


def _load_state(con, local: LocalSession, offsets: dict[str, int]) -> None:
    """Small state tables are replaced as a whole (agents rewrite them in place)."""
    for table in schema.TABLES:
        if table in schema.EVENT_TABLES:
            continue
        con.execute(f"DELETE FROM {table}")
        _insert(con, table, _sources(local, table, offsets))
    if offsets:
        con.execute("UPDATE nodes SET clock_offset_ns = o.off FROM (SELECT unnest(?::VARCHAR[]) AS node, "
                    "unnest(?::BIGINT[]) AS off) o WHERE nodes.node = o.node",
                    [list(offsets), [int(v) for v in offsets.values()]])


def unheard(local: LocalSession, rows: list[dict], rep: Report) -> None:
    """A verdict without the nodes whose pods the session selected but that sent no segment
    (their agent unreachable or absent, their tracer failing) is no verdict on the job: their
    ranks may be the ones the others wait for. `rows`: status.nodes."""
    have = set(local.nodes())
    quiet = sorted({r["name"] for r in rows if r.get("pods") and r["name"] not in have})
    if quiet and rep.verdict in ("straggler", "none"):
        rep.straggler = None
        rep.cannot_judge = (f"{len(quiet)} of {len({r['name'] for r in rows})} nodes with selected pods sent no "
                            f"data ({', '.join(quiet[:8])}{', ...' if len(quiet) > 8 else ''}): their ranks may "
                            "be the ones the others wait for")


def world_size(con) -> int | None:
    row = con.execute("SELECT max(world_size), count(DISTINCT rank) FROM ranks").fetchone()
    return int(row[0] or row[1] or 0) or None


# The live window covers at least this many steps, so jobs with long steps are judged on
# enough of them (at the lab's ~55 ms steps the seconds dominate); and the live status
# names no straggler before the session holds this many.
RECENT_MIN_STEPS = 40
# The live database keeps this many windows of events before the newest call judged (older
# rows are deleted): the next refresh's window and the hang search's reads fit in them, and
# a refresh costs the same an hour into a session as a minute in.
KEEP_WINDOWS = 2


def ingest_and_analyse(local: LocalSession, offsets: dict[str, int],
                       slow_collective_ms: float | None = None,
                       recent_s: float | None = None) -> tuple[Report, int | None]:
    """Add event segments not yet in the live database, refresh state tables, analyse.

    With `recent_s`, the live status judges the most recent part of the session only
    (`recent_s` seconds, and at least RECENT_MIN_STEPS steps of the step the refresh
    before measured; the whole session while it is not longer), once per refresh, and a
    warning says so when the session is longer: a fault that starts mid-session shows up
    once it fills about half of that window, instead of half of the whole session (where
    the medians over every earlier, healthy step hide it), and a refresh costs the same
    at any session length. The live database then keeps only KEEP_WINDOWS windows of
    events. The whole session is judged when it ends (``build_artifact``). Without
    `recent_s`, every refresh judges the whole session again (its cost grows with it)."""
    local.work.mkdir(parents=True, exist_ok=True)
    con = duckdb.connect(str(local.live_db))
    try:
        schema.create_all(con)
        con.execute("CREATE TABLE IF NOT EXISTS _ingested (node VARCHAR, tbl VARCHAR, name VARCHAR)")
        con.execute("CREATE TABLE IF NOT EXISTS _live_step (step_ms DOUBLE)")
        if not con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = '_extent'").fetchone()[0]:
            con.execute("CREATE TABLE _extent (node VARCHAR, calls BIGINT, first_ns BIGINT, last_ns BIGINT)")
            _add_extent(con, "nccl_events")      # a live database from before the extent was kept
        _load_state(con, local, offsets)
        _ingest_new(con, local, offsets, recent_s)
        resolve_split_ranks(con)
        calls, first, last = con.execute(
            "SELECT coalesce(sum(calls), 0), min(first_ns), max(last_ns) FROM _extent").fetchone()
        _keep_sched_totals(con, last)
        until, behind = _horizon(con)
        if until is not None:
            last = until
        span_ns = (last - first) if first is not None else 0
        if recent_s:
            rep, window_s = _judge_recent(con, slow_collective_ms, recent_s, span_ns, until)
        else:
            rep, window_s = _analyse_until(con, slow_collective_ms, until), None
        steps = span_ns / (rep.step_ms * 1e6) if rep.step_ms else 0.0
        if rep.verdict in ("straggler", "none") and steps < RECENT_MIN_STEPS:
            # the first steps of a job (connections, the probes attaching) are not evidence:
            # a live verdict on them named a healthy rank in 1 of 12 lab runs
            rep.straggler = None
            rep.cannot_judge = (f"{steps:.0f} steps traced so far; the live verdict waits for "
                                f"{RECENT_MIN_STEPS}")
        if window_s is not None:
            rep.warnings.insert(0, f"live figures cover the last {window_s:.3g} s of {calls:,} NCCL "
                                   "calls so far; the whole session is judged when it ends")
        _warn_behind(rep, behind)
        rep.hang = find_hang(con, LIVE_HANG_MIN_S)
        return rep, world_size(con)
    finally:
        con.close()


# The live status names a hang once ranks wait this long in a call (the final verdict: 10 s,
# ingero.analysis.hang.HANG_MIN_S): the status should say so within 10 s of the hang.
LIVE_HANG_MIN_S = 5.0
# A node this far behind the newest call is named in the live status's warnings.
BEHIND_WARN_S = 5.0


def _horizon(con) -> tuple[int | None, list[tuple[str, float]]]:
    """The newest time every node's calls have reached, when the nodes differ (None when
    they agree, or with one node), and the nodes behind the newest call by more than
    BEHIND_WARN_S, with how far (s).

    The live database holds each node's segments as they are flushed, one node's later
    than another's: a refresh may see node a's calls up to now and node b's up to a
    second ago. Judged as they are, node b's ranks look absent from the last collectives
    and node a's ranks look slow (replayed on a clean lab trace, a lag of 0.6 s names a
    node at 5.5%, 1 s at 8-12%). So the live verdict judges the calls up to the slowest
    node's newest one."""
    rows = con.execute("SELECT node, last_ns FROM _extent").fetchall()
    ends = {n: t for n, t in rows if t is not None}
    if len(ends) < 2:
        return None, []
    lo, hi = min(ends.values()), max(ends.values())
    behind = sorted(((n, (hi - t) / 1e9) for n, t in ends.items() if hi - t > BEHIND_WARN_S * 1e9),
                    key=lambda x: -x[1])
    return (lo if lo < hi else None), behind


def _warn_behind(rep: Report, behind: list[tuple[str, float]]) -> None:
    for node, lag in behind:
        rep.warnings.insert(0, f"node {node}'s newest call is {lag:.1f} s older than the newest of the "
                               "others' (its agent slow to flush, or gone): the live verdict judges up to it")


def _analyse_until(con, slow_collective_ms: float | None, until: int | None) -> Report:
    """The analysis of the events up to `until` (None: all), without the hang search (the
    live status runs its own, ``find_hang`` with LIVE_HANG_MIN_S)."""
    if until is None:
        return analyse_part(con, slow_collective_ms, hang=False).report
    with events_where(con, f"timestamp_ns <= {int(until)}"):
        return analyse_part(con, slow_collective_ms, hang=False).report


def _window_s(recent_s: float, step_ms: float | None) -> float:
    return max(recent_s, RECENT_MIN_STEPS * step_ms / 1e3) if step_ms else recent_s


def _judge_recent(con, slow_collective_ms: float | None, recent_s: float, span_ns: int,
                  until: int | None) -> tuple[Report, float | None]:
    """The report of the recent window and its length (None: the session is not longer, and
    is judged whole): `recent_s`, stretched to RECENT_MIN_STEPS steps of the step the refresh
    before measured (kept in ``_live_step``), or, when this window's own steps say it is too
    short (the first refresh of a job with long steps), of those. A straggler's evidence and
    a verdict's impossibility say which window they come from. `until`: the window ends
    there (`_horizon`), not at the newest call."""
    known = con.execute("SELECT max(step_ms) FROM _live_step").fetchone()[0]
    window_s = _window_s(recent_s, known)
    rep = _analyse_recent(con, slow_collective_ms, window_s, span_ns, until)
    if rep is not None and _window_s(recent_s, rep.step_ms) > window_s * 1.01:
        window_s = _window_s(recent_s, rep.step_ms)
        rep = _analyse_recent(con, slow_collective_ms, window_s, span_ns, until)
    if rep is None:
        rep, window_s = _analyse_until(con, slow_collective_ms, until), None
    if rep.step_ms:
        con.execute("DELETE FROM _live_step")
        con.execute("INSERT INTO _live_step VALUES (?)", [rep.step_ms])
    if window_s is None:
        return rep, None
    if rep.straggler is not None:
        rep.straggler = dataclasses.replace(rep.straggler,
                                            evidence=f"in the last {window_s:.3g} s: {rep.straggler.evidence}")
    if rep.cannot_judge:   # e.g. a rank silent of late
        rep.cannot_judge = f"in the last {window_s:.3g} s: {rep.cannot_judge}"
    return rep, window_s


def _keep_sched_totals(con, newest_call_ns: int | None) -> None:
    """Keep this refresh's off-CPU totals (cumulative, from the kernel) with the time of the
    newest call, so the recent window can use the increase since its start."""
    con.execute("CREATE TABLE IF NOT EXISTS _sched_totals_at AS "
                "SELECT 0::BIGINT AS at_ns, * FROM sched_totals WHERE false")
    if newest_call_ns is not None:
        con.execute("INSERT INTO _sched_totals_at SELECT ?, * FROM sched_totals", [int(newest_call_ns)])


def _analyse_recent(con, slow_collective_ms: float | None, recent_s: float, span_ns: int,
                    until: int | None = None) -> Report | None:
    """The analysis of the events of the last `recent_s` seconds (None if the session,
    `span_ns` long, is not longer than that). Temporary views shadow the event tables for
    the while, and the off-CPU totals by their increase since the window's start (the
    snapshot kept at or before it; older snapshots are dropped)."""
    if span_ns <= recent_s * 1e9:
        return None        # the whole session is recent: already judged
    newest = until if until is not None else con.execute("SELECT max(last_ns) FROM _extent").fetchone()[0]
    since = int(newest - recent_s * 1e9)
    upto = f" AND timestamp_ns <= {int(until)}" if until is not None else ""
    base = con.execute("SELECT max(at_ns) FROM _sched_totals_at WHERE at_ns <= ?", [since]).fetchone()[0]
    with events_where(con, f"timestamp_ns >= {since}{upto}") as (db, shadowed):
        if base is not None:
            con.execute("DELETE FROM _sched_totals_at WHERE at_ns < ?", [base])
            # a restarted agent counts from 0 again: then the whole new total is recent
            con.execute(f"""CREATE OR REPLACE TEMP VIEW sched_totals AS
                SELECT c.* REPLACE (CASE WHEN c.total_ns >= b.total_ns THEN c.total_ns - b.total_ns
                                         ELSE c.total_ns END AS total_ns,
                                    CASE WHEN c.intervals >= b.intervals THEN c.intervals - b.intervals
                                         ELSE c.intervals END AS intervals)
                FROM "{db}".main.sched_totals c
                LEFT JOIN (SELECT * FROM _sched_totals_at WHERE at_ns = {int(base)}) b
                  ON b.node IS NOT DISTINCT FROM c.node AND b.session_id IS NOT DISTINCT FROM c.session_id
                 AND b.pid = c.pid AND b.reason = c.reason""")
            shadowed.append("sched_totals")
        return analyse_part(con, slow_collective_ms, hang=False).report


def segment_views(local: LocalSession, offsets: dict[str, int]) -> SegmentViews:
    """Every node's event segments, with its clock offset, for the artifact's views."""
    root = local.root.resolve()
    return SegmentViews(root, {table: _sources(local, table, offsets, root) for table in VIEWS})


def build_artifact(local: LocalSession, offsets: dict[str, int],
                   slow_collective_ms: float | None = None,
                   window_calls: int = WINDOW_CALLS) -> tuple[Report, int | None]:
    """Merge every node's segments (clock offsets applied) into trace.duckdb and analyse it.

    NCCL calls and operations and scheduler events (nearly all rows) are not copied: in
    trace.duckdb ``nccl_events``, ``nccl_profiler_events`` and ``sched_events`` are views
    over the node segments kept beside it in ``work/nodes/``, by paths relative to the
    session folder, so the folder is the artifact and can be moved or copied whole
    (``ingero.segment_views``; ``ingero.readonly_sql.open_source`` resolves them against the
    folder, the duckdb shell does when started inside it). The analysis reads the calls in
    windows of whole steps holding about `window_calls` NCCL calls each
    (``ingero.analysis.windows``), each from the segments in its range. Copying 100 M rows
    into a DuckDB file took 137 s on 2 cores; the other tables are small and are copied.
    See docs/benchmarks.md, "Gather, merge and analysis at scale".
    """
    local.root.mkdir(parents=True, exist_ok=True)    # no node gave a segment: an empty artifact, not an error
    tmp = local.artifact.with_name(f".{local.artifact.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    con = duckdb.connect(str(tmp))
    try:
        con.execute("SET parquet_metadata_cache = true")   # the views and the analysis read the same footers
        con.execute("SET file_search_path = ?", [str(local.root.resolve())])
        schema.create_all(con)
        # few rows: copied (nccl_proxy: one per proxy op, its peers' ranks filled below)
        for table in ("tcp_events", "rdma_counters", "nccl_proxy"):
            _insert(con, table, _sources(local, table, offsets))
        _load_state(con, local, offsets)
        resolve_split_ranks(con)           # comms (nccl_events is still an empty table here)
        views = segment_views(local, offsets)
        views.create(con)
        result = analyse_trace(con, slow_collective_ms, window_calls, views), world_size(con)
    finally:
        con.close()
    os.replace(tmp, local.artifact)
    return result
