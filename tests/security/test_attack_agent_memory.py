"""The agent's own process is bounded in memory: a query that would allocate gigabytes fails
with a one-line 400 and the agent keeps serving (it was OOM-killed by such a query)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.security.attacks import vm
from tests.unit.trace_fixture import TOKEN, spawn_agent


@pytest.fixture
def agent(tmp_path):
    proc, port = spawn_agent(tmp_path, "--max-memory-mb", "768", "--query-memory-mb", "192")
    yield proc, f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


def _call(url: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.mark.parametrize("sql", ["SELECT repeat('x', 1073741000) AS s", "SELECT length(repeat('x', 1073741000))"])
def test_a_query_allocating_gigabytes_fails_with_a_400_naming_the_flags_and_the_agent_keeps_serving(agent, sql):
    proc, base = agent
    code, doc = _call(f"{base}/v1/query", {"sql": sql})
    assert code == 400 and "--query-memory-mb 192" in doc["error"] and "--max-memory-mb 768" in doc["error"], \
        (code, doc)
    assert "\n" not in doc["error"]
    print(f"agent {sql}: {code}, VmHWM {vm(proc.pid, 'VmHWM'):.0f} MiB")
    assert vm(proc.pid, "VmHWM") < 768, vm(proc.pid, "VmHWM")
    assert proc.poll() is None
    assert _call(f"{base}/healthz")[0] == 200
    code, doc = _call(f"{base}/v1/query", {"sql": "SELECT 41 + 1 AS answer"})
    assert code == 200 and doc["rows"] == [[42]], doc


def test_a_value_larger_than_the_byte_budget_is_cut_without_being_copied_into_json(agent):
    proc, base = agent
    code, doc = _call(f"{base}/v1/query", {"sql": "SELECT repeat('x', 50000000) AS s"})
    assert code == 200 and doc.get("truncated") == "bytes" and doc.get("rows") == [], (code, str(doc)[:300])
    assert vm(proc.pid, "VmHWM") < 768


def test_ingero_query_is_bounded_too_and_names_the_flag(tmp_path):
    from tests.unit.trace_fixture import write_job

    write_job(tmp_path / "job")
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "ingero", "query", "--max-memory-mb", "768", str(tmp_path / "job"),
                          "SELECT length(repeat('x', 1073741000)) AS s"], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "--max-memory-mb 768" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and time.monotonic() - t0 < 30
