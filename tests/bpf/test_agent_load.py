"""The agent under load (bench/agent_load.py, shorter): while 20 clients hammer its API and a
real tracer records a known workload on the same machine, /healthz keeps answering, the agent
stays within its memory bound, and the tracer records every call (none lost)."""

from __future__ import annotations

from bench.agent_load import run


def test_under_20_concurrent_clients_healthz_answers_memory_is_bounded_and_no_call_is_lost():
    res = run(seconds=10, clients=20, max_memory_mb=768)
    assert res["agent_alive"] and res["healthz_probes"]["failed"] == 0, res
    assert res["healthz_probes"]["ok"] > 0 and res["answered_200"] > 0, res
    assert set(res["status"]) <= {"200", "429"}, res["status"]     # 429: query slots busy, by design
    assert res["agent_peak_rss_mb"] < 768, res
    assert res["workload_failures"] == 0 and res["events_lost"] == 0, res
    assert res["calls_traced"] == res["calls_made"] > 0, res
