"""The operator's and the agents' /metrics follow Prometheus' naming guide: counters end in
`_total`, units are base units (seconds, ratios, bytes), no `_created` series, one
`ingero_build_info`; checked by promtool (Debian's `prometheus`, which `make setup`
installs) and by the rules promtool does not check, over registries and over the real
scrapes of a demo run (tests/unit/fixtures/dashboard-scrapes/)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

SCRAPES = Path(__file__).parent / "fixtures" / "dashboard-scrapes"
NOT_BASE_UNITS = re.compile(r"_(milliseconds|microseconds|nanoseconds|ms|us|ns|percent|pct|minutes|hours|kilobytes|"
                            r"megabytes|bits)(_|$)")


def naming_problems(text: str) -> list[str]:
    """What breaks the naming guide in one scrape (promtool's findings too, where it is installed)."""
    out = []
    for fam in text_string_to_metric_families(text):
        if NOT_BASE_UNITS.search(fam.name):
            out.append(f"{fam.name}: not in base units (seconds, ratios, bytes)")
        for s in fam.samples:
            if s.name.endswith("_created"):
                out.append(f"{s.name}: a _created series")
            if fam.type == "counter" and not s.name.endswith("_total"):
                out.append(f"{s.name}: a counter without _total")
            if fam.type == "gauge" and s.name.endswith("_total"):
                out.append(f"{s.name}: a gauge named like a counter")
    if shutil.which("promtool"):
        got = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        out += [ln for ln in (got.stdout + got.stderr).splitlines() if ln.strip()]
    return out


def test_the_checker_finds_each_kind_of_problem():
    bad = ("# TYPE x_latency_milliseconds gauge\nx_latency_milliseconds 1\n"
           "# TYPE x_hits counter\nx_hits_total 1\nx_hits_created 1\n"
           "# TYPE x_open_total gauge\nx_open_total 1\n")
    found = "\n".join(naming_problems(bad))
    for what in ("not in base units", "a _created series", "a gauge named like a counter"):
        assert what in found, found


def operator_scrape() -> str:
    from ingero_operator import metrics
    metrics.observe("u-naming", "ns", "job", {
        "phase": "Running", "verdict": {"kind": "straggler"}, "meanStepMs": 120.0,
        "straggler": {"kind": "stage", "who": "stage 1 (ranks 4-7)", "ranks": [4, 5, 6, 7], "rank": 7,
                      "pod": "job-rank-7", "cause": "compute", "savingPct": 12.5},
        "ranksTable": [{"rank": 7, "lateMs": 1.5, "retransmits": 3, "offcpuMs": {"runqueue": 12.0}}],
        "nodes": [{"name": "n1", "agentReached": True, "lostEvents": 4}]})
    metrics.DURATION.labels("gather").observe(0.3)
    try:
        return generate_latest(metrics.REGISTRY).decode()
    finally:
        metrics.forget("u-naming")


def test_the_operators_metrics_follow_the_naming_guide():
    text = operator_scrape()
    assert not naming_problems(text)
    for line in ('ingero_build_info{component="operator",version=',
                 'ingero_step_seconds{name="job",namespace="ns"} 0.12',
                 'ingero_session_phase{name="job",namespace="ns",phase="Running"} 1.0',
                 'ingero_session_phase{name="job",namespace="ns",phase="Completed"} 0.0',
                 'ingero_rank_lateness_seconds{name="job",namespace="ns",rank="7"} 0.0015',
                 'ingero_rank_offcpu_seconds_total{name="job",namespace="ns",rank="7",reason="runqueue"} 0.012',
                 'ingero_rank_retransmits_total{name="job",namespace="ns",rank="7"} 3.0',
                 'ingero_node_lost_events_total{name="job",namespace="ns",node="n1"} 4.0'):
        assert line in text, line


def test_the_agents_metrics_follow_the_naming_guide(tmp_path):
    from ingero_agent import metrics
    from ingero_agent.api import SessionManager

    reg, requests = metrics.registry(SessionManager(tmp_path, "n1", trace_cmd=["true"]))
    requests.labels("n1", "/v1/time", "200").inc()
    text = generate_latest(reg).decode()
    assert not naming_problems(text)
    assert 'ingero_build_info{component="agent",version=' in text


@pytest.mark.parametrize("scrape", sorted(p.name for p in SCRAPES.glob("*.prom")))
def test_the_demos_real_scrapes_follow_the_naming_guide(scrape):
    assert not naming_problems((SCRAPES / scrape).read_text())


def test_promtool_is_there_to_check():
    if not shutil.which("promtool"):
        pytest.skip("promtool is not installed: `make setup` installs Debian's prometheus")
    assert naming_problems("# TYPE x_ms gauge\nx_ms 1\n")
