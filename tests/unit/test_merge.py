"""Offline merge: dedupe, clock offsets applied once, idempotence, split ranks, bad input skipped."""

from __future__ import annotations

import shutil
from pathlib import Path

import duckdb
import pytest

from ingero import schema
from ingero.cli import main
from ingero.errors import IngeroError
from ingero.merge import merge
from ingero.readonly_sql import open_source
from tests.unit.trace_fixture import CHILD, SESSION, T0, write_job, write_node

SKEW = 3_000_000_000   # node-b's clock runs 3 s ahead


@pytest.fixture
def job(tmp_path) -> Path:
    write_job(tmp_path / "copied", split=True)
    return tmp_path


def tables(path: Path) -> dict[str, list]:
    con = open_source(path)
    try:
        return {t: sorted(con.execute(f"SELECT * FROM {t}").fetchall(), key=repr) for t in schema.TABLES}
    finally:
        con.close()


def q(path: Path, sql: str, params=()):
    con = open_source(path)
    try:
        return con.execute(sql, params).fetchall()
    finally:
        con.close()


def test_two_nodes_merge_into_one_file_with_every_row_and_no_id_collision(job):
    res = merge([job / "copied" / "node-a", job / "copied" / "node-b"], job / "m.duckdb")
    assert res.rows["nccl_events"] == 2 * (20 * 3 * 2 + 2) and res.rows["nodes"] == 2 and not res.skipped
    n, distinct = q(job / "m.duckdb", "SELECT count(*), count(DISTINCT (node, event_id)) FROM nccl_events")[0]
    assert n == distinct == res.rows["nccl_events"]
    assert q(job / "m.duckdb", "SELECT count(DISTINCT event_id >> 48) FROM nccl_events")[0][0] == 2


def test_the_same_segments_copied_twice_count_once(job):
    shutil.copytree(job / "copied", job / "again")
    once = merge([job / "copied"], job / "once.duckdb")
    twice = merge([job / "copied", job / "again"], job / "twice.duckdb")
    assert twice.rows == once.rows
    assert tables(job / "twice.duckdb") == tables(job / "once.duckdb")


def test_a_duckdb_file_and_its_own_segments_merge_once_and_merging_again_changes_nothing(job):
    merge([job / "copied"], job / "m.duckdb")
    merge([job / "m.duckdb", job / "copied" / "node-b"], job / "m2.duckdb")
    merge([job / "m2.duckdb", job / "m.duckdb", job / "copied"], job / "m3.duckdb")
    assert tables(job / "m2.duckdb") == tables(job / "m.duckdb") == tables(job / "m3.duckdb")


def test_split_communicator_ranks_are_resolved_across_nodes(job):
    merge([job / "copied"], job / "m.duckdb")
    got = q(job / "m.duckdb", "SELECT global_rank, rank, nranks FROM nccl_events WHERE comm_id_hash = ? "
                              "ORDER BY global_rank", [CHILD])
    assert got == [(0, 3, 4), (1, 2, 4), (2, 1, 4), (3, 0, 4)]


def test_a_clock_offset_given_on_the_command_line_is_applied_and_recorded(tmp_path):
    write_job(tmp_path / "seg", skew_b_ns=SKEW)
    merge([tmp_path / "seg"], tmp_path / "m.duckdb", offsets={"node-b": SKEW})
    first = dict(q(tmp_path / "m.duckdb", "SELECT node, min(timestamp_ns) FROM nccl_events GROUP BY node"))
    assert abs(first["node-b"] - first["node-a"]) < 10_000_000     # same instants, same clock now
    assert dict(q(tmp_path / "m.duckdb", "SELECT node, clock_offset_ns FROM nodes")) == {"node-a": None,
                                                                                         "node-b": SKEW}
    # merged again without the flag: the offset is known from the merge itself and not applied twice
    merge([tmp_path / "m.duckdb", tmp_path / "seg"], tmp_path / "m2.duckdb")
    assert tables(tmp_path / "m2.duckdb") == tables(tmp_path / "m.duckdb")


def operator_artifact(tmp_path: Path, skew_b_ns: int = 0, split: bool = False):
    """Two nodes' segments (node-b's clock `skew_b_ns` ahead) in tmp/seg, and the
    operator's artifact built from copies of them in tmp/art (offsets applied)."""
    from ingero_operator.gather import LocalSession, build_artifact

    write_job(tmp_path / "seg", skew_b_ns=skew_b_ns, split=split)
    local = LocalSession(tmp_path / "art")
    for node in ("node-a", "node-b"):
        shutil.copytree(tmp_path / "seg" / node, local.node_dir(node))
    build_artifact(local, {"node-a": 0, "node-b": skew_b_ns})
    return local


def test_the_artifacts_view_resolves_split_ranks_as_the_merge_does_in_a_table(tmp_path):
    local = operator_artifact(tmp_path, split=True)
    assert q(local.artifact, "SELECT count(*) FROM duckdb_views() WHERE view_name = 'nccl_events' "
             "AND database_name = 'trace'") == [(1,)]
    assert q(local.artifact, "SELECT count(*) FROM nccl_events WHERE rank < 0 AND comm_id_hash = ?",
             [CHILD]) == [(0,)]
    merge([tmp_path / "seg"], tmp_path / "m.duckdb")          # raw segments: resolved by UPDATE
    merged, art = tables(tmp_path / "m.duckdb"), tables(local.artifact)
    assert merged["nccl_events"] == art["nccl_events"] and merged["comms"] == art["comms"]


def test_an_offset_known_to_one_input_is_applied_once_to_raw_rows_of_that_node(tmp_path):
    local = operator_artifact(tmp_path, SKEW)
    # the operator's artifact (shifted) plus node-b's raw segments (not shifted) again
    merge([local.artifact, tmp_path / "seg" / "node-b"], tmp_path / "m.duckdb")
    assert tables(tmp_path / "m.duckdb") == tables(local.artifact)
    # raw segments alone with the artifact's knowledge: the same answer
    merge([tmp_path / "seg", local.artifact], tmp_path / "m2.duckdb")
    assert tables(tmp_path / "m2.duckdb") == tables(local.artifact)


def test_an_artifact_whose_view_lost_its_files_loses_only_that_table(tmp_path):
    local = operator_artifact(tmp_path)
    whole = tables(local.artifact)
    views = [v for (v,) in q(local.artifact, "SELECT view_name FROM duckdb_views() WHERE NOT internal "
                                             "AND database_name = 'trace'")]
    if not views:
        pytest.skip("the operator's artifact holds no view over its segments (every table is copied)")
    shutil.copy(local.artifact, tmp_path / "copied.duckdb")     # copied without the folder beside it
    shutil.rmtree(local.work)
    res = merge([tmp_path / "copied.duckdb", tmp_path / "seg"], tmp_path / "m.duckdb")
    assert [s.split(" unreadable")[0] for s in res.skipped] == [f"{tmp_path / 'copied.duckdb'}: table {v}"
                                                                for v in views]
    assert tables(tmp_path / "m.duckdb") == whole


def test_the_artifact_folder_moved_whole_still_opens_with_every_row(tmp_path):
    local = operator_artifact(tmp_path, SKEW)
    whole = tables(local.artifact)
    assert whole["nccl_events"]
    shutil.move(local.root, tmp_path / "elsewhere")
    assert tables(tmp_path / "elsewhere" / "trace.duckdb") == whole
    assert tables(tmp_path / "elsewhere") == whole     # the folder itself names the artifact
    merge([tmp_path / "elsewhere" / "trace.duckdb"], tmp_path / "m.duckdb")
    assert tables(tmp_path / "m.duckdb") == whole
    merge([tmp_path / "elsewhere"], tmp_path / "m2.duckdb")       # the folder: the same
    assert tables(tmp_path / "m2.duckdb") == whole


def test_truncated_and_foreign_inputs_are_named_and_skipped_and_everything_else_is_merged(job, tmp_path):
    good = merge([job / "copied"], job / "good.duckdb")
    bad = job / "bad"
    shutil.copytree(job / "copied", bad)
    seg = next((bad / "node-a" / "nccl_events").glob("*.parquet"))
    trunc = bad / "node-b" / "nccl_events" / "node-b__x__000009.parquet"
    trunc.write_bytes(seg.read_bytes()[:500])                      # a copy cut short
    foreign_pq = bad / "node-b" / "tcp_events" / "other.parquet"
    duckdb.sql(f"COPY (SELECT 1 AS x) TO '{foreign_pq}' (FORMAT parquet)")
    foreign_db = tmp_path / "other.duckdb"
    duckdb.connect(str(foreign_db)).execute("CREATE TABLE t AS SELECT 1 AS x").close()
    garbage = tmp_path / "garbage.duckdb"
    garbage.write_bytes(b"not a database at all" * 100)
    res = merge([bad, foreign_db, garbage, tmp_path / "missing"], job / "m.duckdb")
    named = "\n".join(res.skipped)
    for p in (trunc, foreign_pq, foreign_db, garbage, tmp_path / "missing"):
        assert str(p) in named
    assert tables(job / "m.duckdb") == tables(job / "good.duckdb") and res.rows == good.rows


def test_nothing_usable_fails_with_one_line_and_writes_no_output(tmp_path, capsys):
    (tmp_path / "junk.duckdb").write_text("junk")
    with pytest.raises(IngeroError, match="nothing usable"):
        merge([tmp_path / "junk.duckdb"], tmp_path / "m.duckdb")
    assert main(["merge", str(tmp_path / "junk.duckdb"), "-o", str(tmp_path / "m.duckdb")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "junk.duckdb" in err[0] and not (tmp_path / "m.duckdb").exists()
    assert not list(tmp_path.glob(".m.duckdb*"))


def test_merge_cli_names_skipped_files_and_the_offsets_it_applied(job, capsys):
    (job / "copied" / "node-a" / "nccl_events" / "cut__x__000001.parquet").write_bytes(b"PAR1")
    rc = main(["merge", str(job / "copied"), "-o", str(job / "m.duckdb"), "--clock-offset", "node-b=1500"])
    out = capsys.readouterr()
    assert rc == 0 and "cut__x__000001.parquet" in out.err and "node-b 1500 ns" in out.out
    assert main(["merge", str(job / "copied"), "-o", str(job / "m.duckdb"), "--clock-offset", "b"]) == 2
    assert "NODE=NANOSECONDS" in capsys.readouterr().err


def test_two_sessions_of_one_node_are_merged_one_at_a_time_each_with_its_own_rows(tmp_path):
    write_node(tmp_path / "s1", "node-a", [0, 1], steps=3, session=SESSION)
    write_node(tmp_path / "s2", "node-a", [0, 1], steps=3, session="default.job.other")
    with pytest.raises(IngeroError, match=r"2 sessions \(default.job.abc, default.job.other\) that recorded one node or rank twice: pick one"):
        merge([tmp_path / "s1", tmp_path / "s2"], tmp_path / "m.duckdb")
    assert not (tmp_path / "m.duckdb").exists()
    for sid in (SESSION, "default.job.other"):
        res = merge([tmp_path / "s1", tmp_path / "s2"], tmp_path / "m.duckdb", session=sid)
        assert res.rows["nccl_events"] == 3 * 3 * 2 and res.rows["nodes"] == 1
        assert q(tmp_path / "m.duckdb", "SELECT DISTINCT session_id FROM nccl_events") == [(sid,)]
        assert q(tmp_path / "m.duckdb", "SELECT min(timestamp_ns) FROM nccl_events")[0][0] >= T0


def test_device_times_of_profiler_rows_are_shifted_by_the_node_offset_like_timestamps(tmp_path):
    from ingero.store import SegmentWriter
    from ingero_operator.gather import LocalSession, build_artifact

    seg = tmp_path / "seg" / "node-b"
    w = SegmentWriter(seg, "node-b", SESSION)
    w.append("nccl_profiler_events", {"timestamp_ns": [T0], "device_start_ns": [T0 + 500],
                                      "device_end_ns": [T0 + 900], "op": ["ALL_REDUCE"], "pid": [7]})
    w.put_rows("nodes", [{"hostname": "node-b"}])
    w.close()
    cols = "timestamp_ns, device_start_ns, device_end_ns"
    merge([seg], tmp_path / "m.duckdb", offsets={"node-b": SKEW})
    want = [(T0 - SKEW, T0 + 500 - SKEW, T0 + 900 - SKEW)]
    assert q(tmp_path / "m.duckdb", f"SELECT {cols} FROM nccl_profiler_events") == want
    local = LocalSession(tmp_path / "art")
    shutil.copytree(seg, local.node_dir("node-b"))
    build_artifact(local, {"node-b": SKEW})
    assert q(local.artifact, f"SELECT {cols} FROM nccl_profiler_events") == want


def test_nodes_traced_apart_are_one_job_read_together(tmp_path):
    # an `ingero trace` per node (the lab's tracers, a late attach by --pid): a session id
    # each, but no node or rank recorded twice: merged and read as one job
    write_node(tmp_path / "a", "node-a", [0, 1], steps=3, session="node-a-run")
    write_node(tmp_path / "b", "node-b", [2, 3], steps=3, session="node-b-run")
    merge([tmp_path / "a", tmp_path / "b"], tmp_path / "m.duckdb")
    assert q(tmp_path / "m.duckdb", "SELECT list_sort(list(DISTINCT rank)) FROM ranks") == [([0, 1, 2, 3],)]
    con = open_source(tmp_path / "m.duckdb")
    con.close()
