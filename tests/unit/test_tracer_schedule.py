"""The tracer's quick-scan period: fast while something is new, backing off while nothing is."""

from __future__ import annotations

from pathlib import Path

from ingero_agent.probes import ProbeConfig
from ingero_agent.tracer import TraceOptions, Tracer


def _tracer() -> Tracer:
    opts = TraceOptions(segments=Path("/nonexistent"), node="n", session_id="s",
                        probe_config=ProbeConfig(), quick_scan_s=0.1, scan_s=1.0)
    t = Tracer(opts, targets=None, log=lambda _m: None)
    t.quick_every = opts.quick_scan_s
    return t


def test_quick_scans_back_off_to_the_full_scan_period_while_nothing_is_new():
    t = _tracer()
    periods = [round(t._next_quick_period(), 3) for _ in range(6)]
    assert periods == [0.2, 0.4, 0.8, 1.0, 1.0, 1.0]


def test_something_new_brings_quick_scans_back_to_their_shortest_period_once():
    t = _tracer()
    for _ in range(5):
        t._next_quick_period()
    t._news = True                        # e.g. a new process, or one still without its library
    assert t._next_quick_period() == 0.1
    assert t._next_quick_period() == 0.2  # the news was used up
