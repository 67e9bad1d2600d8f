"""Property-based fuzzing (hypothesis) of what crosses a trust boundary: the agent API's plan
and query bodies, the read-only SQL gate and sandbox, and the segment readers. Whatever the
input, the answer is a clean refusal (ApiError, QueryRefused, IngeroError), never another
exception, and never a file read outside the trace. Example counts are modest so the suite
stays fast; `HYPOTHESIS_PROFILE=deep` runs 20x more (docs/benchmarks.md, Fuzzing)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from bench.synthetic import session
from ingero import readonly_sql
from ingero.errors import IngeroError
from ingero.readonly_sql import open_source
from ingero_agent.api import ApiError, Plan, parse_plan

settings.register_profile("ci", max_examples=150, deadline=None,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
settings.register_profile("deep", max_examples=3000, deadline=None,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
                    max_leaves=20)
PLAN_KEYS = st.sampled_from(["session_id", "pods", "probes", "nccl_lib", "sched_min_us", "duration_s"])
POD = st.fixed_dictionaries({}, optional={"name": JSON | st.text(max_size=10), "uid": JSON | st.text(max_size=10),
                                          "namespace": JSON, "ips": JSON | st.lists(st.text(max_size=40), max_size=3),
                                          "containers": JSON, "node": JSON})


@given(st.dictionaries(PLAN_KEYS, JSON | st.lists(POD, max_size=3), max_size=6) | JSON)
def test_any_plan_body_is_a_plan_or_a_400(body):
    try:
        plan = parse_plan(body)
    except ApiError as e:
        assert e.status == 400 and "\n" not in str(e)
    else:
        assert isinstance(plan, Plan) and plan.session_id


SQL_WORDS = st.sampled_from(["SELECT", "*", "FROM", "nccl_events", "ranks", "read_text", "read_csv", "(", ")",
                             "'/etc/passwd'", "COPY", "TO", "'/tmp/x'", "ATTACH", "INSTALL", "LOAD", "SET",
                             "PRAGMA", ";", ",", "1", "glob", "'*'", "UNION", "WITH", "AS", "x", "--", "/*",
                             "read_parquet", "'../../x.parquet'", "getenv", "'HOME'", "EXPLAIN", "CALL"])


@pytest.fixture(scope="module")
def segs(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz-segs")
    session(d, steps=5)
    return d


@settings(max_examples=max(40, settings().max_examples // 3))
@given(st.lists(SQL_WORDS, min_size=1, max_size=12).map(" ".join) | st.text(max_size=80))
def test_any_sql_through_the_gate_is_a_result_or_a_refusal_and_never_reads_outside(segs, sql):
    try:
        res = readonly_sql.query(segs, sql, readonly_sql.Limits(timeout_s=2.0, max_rows=50))
    except readonly_sql.QueryRefused as e:
        assert "\n" not in str(e)
    else:
        assert "root:" not in repr(res.rows)    # nothing of /etc/passwd


def test_the_gate_refuses_the_classic_escapes(segs):
    for sql in ("SELECT * FROM read_text('/etc/passwd')", "COPY (SELECT 1) TO '/tmp/ingero-fuzz-x.csv'",
                "ATTACH '/tmp/ingero-fuzz.duckdb' AS x", "SELECT getenv('HOME')", "SET threads = 64"):
        with pytest.raises(readonly_sql.QueryRefused):
            readonly_sql.query(segs, sql)
    assert not Path("/tmp/ingero-fuzz-x.csv").exists()


@settings(max_examples=max(20, settings().max_examples // 4))
@given(st.data())
def test_a_damaged_segment_is_read_or_refused_with_one_line_never_a_traceback(tmp_path_factory, data):
    d = tmp_path_factory.mktemp("fuzz-damaged")
    session(d, steps=3)
    seg = sorted(d.rglob("nccl_events/*.parquet"))[0]
    raw = bytearray(seg.read_bytes())
    how = data.draw(st.sampled_from(["truncate", "flip", "zero-tail"]))
    rnd = random.Random(data.draw(st.integers(0, 2 ** 32)))
    if how == "truncate":
        raw = raw[:rnd.randrange(0, len(raw))]
    elif how == "flip":
        for _ in range(rnd.randrange(1, 16)):
            raw[rnd.randrange(len(raw))] ^= 1 << rnd.randrange(8)
    else:
        cut = rnd.randrange(len(raw))
        raw[cut:] = bytes(len(raw) - cut)
    seg.write_bytes(bytes(raw))
    try:
        con = open_source(d)
        try:
            con.execute("SELECT count(*), sum(duration_ns) FROM nccl_events").fetchall()
        except Exception as e:   # a damaged page can pass the footer check: then DuckDB says so
            assert type(e).__module__.split(".")[0] in ("duckdb", "_duckdb"), type(e)
        finally:
            con.close()
    except IngeroError as e:
        assert "\n" not in str(e)
