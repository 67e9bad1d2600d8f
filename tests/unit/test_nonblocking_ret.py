"""ncclInProgress (7) is the normal return of every call on a non-blocking NCCL
communicator (PyTorch: TORCH_NCCL_USE_COMM_NONBLOCKING). The merged tables must
be analysed the same whether a job's calls returned 0 or 7.

The agent keeps them (bpf/nccl.c, ingero_agent/tracer.py; see
tests/bpf/test_nccl_probes.py's non-blocking case) and so does the analysis
(`ret IN schema.NCCL_OK_RETS` in ingero/analysis/calls.py and the
MCP server's slow-collective query).
"""

from __future__ import annotations

import duckdb

from bench.synthetic import session
from ingero import schema
from ingero.analysis import analyse
from ingero.comms import resolve_split_ranks
from ingero_operator import gather


def _merged(tmp_path, ret: int):
    local = gather.LocalSession(tmp_path)
    lay = session(local.work / "nodes", fault="slow-rank", nodes=2, ranks_per_node=2, steps=120)
    con = duckdb.connect()
    schema.create_all(con)
    for table in schema.EVENT_TABLES:
        gather._insert(con, table, gather._sources(local, table, {}))
    gather._load_state(con, local, {})
    resolve_split_ranks(con)
    con.execute("UPDATE nccl_events SET ret = ?", [ret])
    return con, lay


def test_in_progress_is_counted_as_success_by_the_schema():
    assert schema.NCCL_OK_RETS == (0, 7)


def test_a_job_returning_success_names_its_slow_rank(tmp_path):
    con, lay = _merged(tmp_path, 0)
    rep = analyse(con)
    assert rep.straggler is not None and rep.straggler.rank == lay["victim"]


def test_a_non_blocking_job_returning_in_progress_names_the_same_slow_rank(tmp_path):
    con, lay = _merged(tmp_path, 7)
    rep = analyse(con)
    assert rep.straggler is not None and rep.straggler.rank == lay["victim"]
