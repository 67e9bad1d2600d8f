"""`ingero report`, `query` and `export` open every trace in the sandbox of ingero.readonly_sql,
and bad traces get one-line errors (finding 4 and 7 of the hardening issue)."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest

from bench.synthetic import session
from ingero import schema
from ingero.cli import main
from ingero.store import build_duckdb
from tests.unit.trace_fixture import write_crafted, write_job, write_node


def _one_line_error(capsys, argv) -> str:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc != 0, err
    assert err.startswith("ingero: ") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.fixture
def secret(tmp_path) -> Path:
    p = tmp_path / "outside" / "secret.txt"
    p.parent.mkdir()
    p.write_text("root:$6$not-for-you\n")
    return p


def _crafted(tmp_path: Path, secret: Path) -> Path:
    """An artifact folder whose trace.duckdb has views reading a file outside it."""
    art = tmp_path / "art"
    art.mkdir()
    con = duckdb.connect(str(art / "trace.duckdb"))
    cols = ", ".join(f"NULL::{ty} AS {c}" for c, ty in schema.TABLES["nccl_events"].columns)
    con.execute(f"CREATE VIEW nccl_events AS SELECT {cols}, content FROM read_text('{secret}')")
    con.execute(f"CREATE VIEW leak AS SELECT content FROM read_text('{secret}')")
    con.close()
    return art


def test_a_crafted_trace_cannot_read_a_file_outside_it_through_query_report_or_export(tmp_path, secret, capsys):
    art = _crafted(tmp_path, secret)
    for argv in (["query", str(art), "SELECT * FROM leak"],
                 ["query", str(art), "SELECT * FROM nccl_events"],
                 ["query", str(art), f"SELECT * FROM read_text('{secret}')"],
                 ["report", str(art)],
                 ["export", "perfetto", str(art), "-o", str(tmp_path / "t.json")]):
        err = _one_line_error(capsys, argv)
        assert "not-for-you" not in err and "Permission" in err, err


def test_an_artifact_listing_a_segment_outside_its_folder_is_refused_by_report(tmp_path, capsys):
    """The artifact's `segments` table names the files each window reads: a name leading
    out of the folder is refused in one line, whatever file it reaches."""
    import shutil

    from ingero_operator.gather import LocalSession, build_artifact

    write_job(tmp_path / "seg")
    local = LocalSession(tmp_path / "art")
    for node in ("node-a", "node-b"):
        shutil.copytree(tmp_path / "seg" / node, local.node_dir(node))
    build_artifact(local, {"node-a": 0, "node-b": 0})
    outside = tmp_path / "outside.parquet"
    shutil.copy(local.files("node-a", "nccl_events")[0], outside)
    with duckdb.connect(str(local.artifact)) as con:
        con.execute("UPDATE segments SET file = '../outside.parquet' WHERE rowid = 0")
    err = _one_line_error(capsys, ["report", str(local.root)])
    assert "names '../outside.parquet', outside the trace's folder" in err, err


def test_query_cannot_write_files_attach_databases_or_change_settings(tmp_path, capsys):
    session(tmp_path / "segs", steps=5)
    out = tmp_path / "written.csv"
    for sql in (f"COPY (SELECT 1) TO '{out}'", f"ATTACH '{tmp_path / 'x.duckdb'}' AS x",
                "SET enable_external_access = true", "INSTALL httpfs"):
        _one_line_error(capsys, ["query", str(tmp_path / "segs"), sql])
    assert not out.exists() and not (tmp_path / "x.duckdb").exists()


def test_a_truncated_segment_is_a_one_line_error_naming_the_file(tmp_path, capsys):
    session(tmp_path / "segs", steps=5)
    seg = next((tmp_path / "segs").rglob("nccl_events/*.parquet"))
    seg.write_bytes(seg.read_bytes()[:100])
    for argv in (["report", str(tmp_path / "segs")], ["query", str(tmp_path / "segs"), "SELECT 1"],
                 ["export", "perfetto", str(tmp_path / "segs"), "-o", str(tmp_path / "t.json")]):
        err = _one_line_error(capsys, argv)
        assert seg.name in err and "damaged" in err


def test_a_duckdb_lacking_tables_reads_them_as_empty_and_lacking_columns_is_a_one_line_error(tmp_path, capsys):
    db = tmp_path / "partial.duckdb"
    con = duckdb.connect(str(db))
    con.execute(schema.TABLES["nccl_events"].ddl())
    con.close()
    assert main(["query", "--format", "csv", str(db), "SELECT count(*) AS n FROM tcp_events"]) == 0
    assert capsys.readouterr().out.split() == ["n", "0"]
    db2 = tmp_path / "foreign.duckdb"
    con = duckdb.connect(str(db2))
    con.execute("CREATE TABLE nccl_events (op VARCHAR, rank INTEGER)")
    con.close()
    for argv in (["report", str(db2)], ["export", "perfetto", str(db2), "-o", str(tmp_path / "t.json")]):
        assert "lacks the columns" in _one_line_error(capsys, argv)


def test_a_folder_holding_several_sessions_is_refused_with_the_list_or_read_with_session(tmp_path, capsys):
    session(tmp_path / "segs", steps=5)
    write_node(tmp_path / "segs" / "node-c", "node-c", [0, 1], steps=5, session="another")   # ranks 0, 1 again
    err = _one_line_error(capsys, ["report", str(tmp_path / "segs")])
    assert "2 sessions (another, synthetic)" in err and "--session" in err
    assert main(["report", str(tmp_path / "segs"), "--session", "synthetic"]) == 0
    assert "straggler" in capsys.readouterr().out
    assert "no session 'nope'" in _one_line_error(capsys, ["query", "--session", "nope", str(tmp_path / "segs"),
                                                            "SELECT 1"])


def test_merge_reads_a_crafted_trace_in_the_sandbox_and_copies_nothing_from_outside(tmp_path, secret, capsys):
    session(tmp_path / "segs", steps=3)
    art = tmp_path / "art"
    art.mkdir()
    con = duckdb.connect(str(art / "trace.duckdb"))
    sel = ", ".join(("content" if c == "pod" else f"NULL::{ty}") + f" AS {c}"
                    for c, ty in schema.TABLES["nccl_events"].columns)
    con.execute(f"CREATE VIEW nccl_events AS SELECT {sel} FROM read_text('{secret}')")
    con.close()
    out = tmp_path / "merged.duckdb"
    assert main(["merge", str(art / "trace.duckdb"), str(tmp_path / "segs"), "-o", str(out)]) == 0
    text = capsys.readouterr()
    assert "Permission" in text.out + text.err           # the crafted table was refused, and said so
    con = duckdb.connect(str(out), read_only=True)
    pods = {r[0] for r in con.execute("SELECT DISTINCT pod FROM nccl_events").fetchall()}
    con.close()
    assert not any("not-for-you" in (p or "") for p in pods), pods


def test_ingero_query_in_a_folder_reads_neither_its_duckdb_temp_folder_nor_its_relative_names(
        tmp_path, monkeypatch, capsys):
    """Run where the reader's working directory holds `.tmp/secret.txt` (DuckDB's default temp
    folder, which it allows) and an `x.parquet` shadowing the trace's own relative `x.parquet`."""
    trace = write_crafted(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["query", "--format", "csv", str(trace), "SELECT * FROM rel"]) == 0
    assert capsys.readouterr().out.split() == ["who", "the", "trace"]
    for sql in ("SELECT * FROM leak_tmp", "SELECT * FROM read_text('.tmp/secret.txt')",
                "SELECT * FROM read_parquet('x.parquet')"):
        assert "Permission" in _one_line_error(capsys, ["query", str(trace), sql])


def test_merge_of_two_sessions_needs_session_and_an_unknown_session_of_a_file_is_an_error(tmp_path, capsys):
    session(tmp_path / "segs", steps=5)
    write_node(tmp_path / "segs" / "node-c", "node-c", [0, 1], steps=5, session="another")
    out = tmp_path / "m.duckdb"
    err = _one_line_error(capsys, ["merge", str(tmp_path / "segs"), "-o", str(out)])
    assert "2 sessions (another, synthetic)" in err and "--session" in err and not out.exists()
    assert "no session 'nope'" in _one_line_error(capsys, ["merge", str(tmp_path / "segs"), "-o", str(out),
                                                            "--session", "nope"])
    assert main(["merge", str(tmp_path / "segs"), "-o", str(out), "--session", "synthetic", "--quiet"]) == 0
    assert main(["report", str(tmp_path / "segs"), "--session", "synthetic"]) == 0
    apart = capsys.readouterr().out
    assert main(["report", str(out)]) == 0 and main(["report", str(out), "--session", "synthetic"]) == 0
    assert capsys.readouterr().out == apart * 2       # the other session's rows are not in it
    for argv in (["report", str(out), "--session", "nope"], ["query", "--session", "nope", str(out), "SELECT 1"]):
        assert "holds no session 'nope'; it holds synthetic" in _one_line_error(capsys, argv)
    build_duckdb([tmp_path / "segs"], tmp_path / "both.duckdb")    # a file of both, as merge wrote them
    for argv in (["report", str(tmp_path / "both.duckdb")],
                 ["report", str(tmp_path / "both.duckdb"), "--session", "synthetic"]):
        assert "holds 2 sessions (another, synthetic)" in _one_line_error(capsys, argv)


def test_terminal_control_characters_in_names_are_printed_escaped_by_report_and_query(tmp_path, capsys):
    """Pod names that would retitle (ESC ] 0; ... BEL) and clear (ESC [2J) the reader's terminal."""
    write_job(tmp_path / "seg")
    trace = tmp_path / "m.duckdb"
    assert main(["merge", str(tmp_path / "seg"), "-o", str(trace), "--quiet"]) == 0
    con = duckdb.connect(str(trace))
    for (table,) in con.execute("SELECT DISTINCT table_name FROM duckdb_columns() WHERE column_name = 'pod' "
                                "AND NOT internal").fetchall():
        con.execute(f"UPDATE {table} SET pod = '\x1b]0;pwned\x07\x1b[2J' || pod || '\u202e\n'")
    con.close()
    for argv in (["report", str(trace)], ["query", str(trace), "SELECT DISTINCT pod, rank FROM nccl_events"]):
        assert main(argv) == 0
        shown = "".join(capsys.readouterr())
        assert not any(c in shown for c in "\x1b\x07\u202e") and "\\x1b]0;pwned\\x07\\x1b[2J" in shown, shown
        assert "\\u202e\\x0a" in shown


def test_a_local_query_spills_into_a_private_folder_that_holds_nothing_else_to_read(tmp_path, secret):
    from ingero import readonly_sql

    write_job(tmp_path / "job")
    con = readonly_sql.open_sandbox(tmp_path / "job" / "node-a", memory_mb=16)
    scratch = con.execute("SELECT current_setting('temp_directory')").fetchone()[0]
    assert Path(scratch).is_dir() and Path(scratch).stat().st_mode & 0o077 == 0
    # sorting ~100 MB of rows under a 16 MiB limit needs the disk (without it: OutOfMemory)
    n, top = con.execute("SELECT count(*), max(x) FROM (SELECT (range * 7919) % 3000000 AS x, "
                         "repeat('y', 20) AS pad FROM range(3000000) ORDER BY x DESC)").fetchone()
    assert (n, top) == (3_000_000, 2_999_999)
    for path in (f"{scratch}/../outside/secret.txt", str(secret), f"{secret.parent}/../outside/secret.txt"):
        with pytest.raises(duckdb.PermissionException):
            con.execute("SELECT content FROM read_text(?)", [path]).fetchall()
    con.close()
    del con
    assert not Path(scratch).exists()
