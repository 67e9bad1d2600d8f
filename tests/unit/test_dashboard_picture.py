"""The dashboard picture of the docs: the chart's dashboard.json read against real scrapes.

tests/unit/fixtures/dashboard-scrapes/ holds scrapes of a real `ingero demo --metrics-out`
run (lossy-link, 2 nodes): the operator and one agent while the job ran, and after the verdict.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from ingero.errors import IngeroError

_spec = importlib.util.spec_from_file_location(
    "dashboard_picture", Path(__file__).resolve().parents[2] / "scripts" / "dashboard_picture.py")
dashboard_picture = sys.modules["dashboard_picture"] = importlib.util.module_from_spec(_spec)   # dataclasses need it
_spec.loader.exec_module(dashboard_picture)
DASHBOARD, load_dashboard, load_scrapes, main, panel_series, parse_expr = (
    dashboard_picture.DASHBOARD, dashboard_picture.load_dashboard, dashboard_picture.load_scrapes,
    dashboard_picture.main, dashboard_picture.panel_series, dashboard_picture.parse_expr)

SCRAPES = Path(__file__).parent / "fixtures" / "dashboard-scrapes"


def test_every_panel_reads_series_the_demo_exports():
    panels = load_dashboard(DASHBOARD)
    samples = load_scrapes(SCRAPES)
    names = {name for _, name, _ in samples}
    assert len(panels) >= 10
    for panel in panels:
        missing = [n for n in panel.metric_names() if n not in names]
        assert not missing, f"panel {panel.title!r} reads {missing}, not in the demo's scrapes"
        assert panel_series(panel, samples), f"panel {panel.title!r}: no series"


def test_the_straggler_panels_carry_the_verdict():
    panels = {p.title: p for p in load_dashboard(DASHBOARD)}
    samples = load_scrapes(SCRAPES)
    named = panel_series(panels["Named straggler (while the session runs)"], samples)
    assert len(named) == 1, named                                 # `ingero_straggler_saving_ratio{…} > 0`
    (legend, points), = named.items()
    assert all(0 < v < 1 for _, v in points) and "ranks 3; network, rank" in legend, legend
    saving = panel_series(panels["Straggler saving (share of the step, while the session runs)"], samples)
    assert any(v > 0 for pts in saving.values() for _, v in pts)
    lateness = panel_series(panels["Rank lateness (s)"], samples)
    assert len(lateness) >= 2                                     # one series per rank


def test_expressions_names_matchers_and_functions():
    q = parse_expr('histogram_quantile(0.9, sum by (le, step) (rate(ingero_operator_step_seconds_bucket[10m])))')
    assert [s.name for s in q.selectors] == ["ingero_operator_step_seconds_bucket"]
    assert q.functions == ["histogram_quantile", "sum", "rate"] and q.comparison is None
    q = parse_expr('ingero_agent_lost_events_total{ring!="events", node=~"lab-n.*"} > 0')
    (sel,) = q.selectors
    assert sel.name == "ingero_agent_lost_events_total" and q.comparison == (">", 0.0)
    assert sel.matches({"ring": "records", "node": "lab-n1"})
    assert not sel.matches({"ring": "events", "node": "lab-n1"})
    assert not sel.matches({"ring": "records", "node": "other"})
    with pytest.raises(IngeroError, match="no series name"):
        parse_expr("sum(1)")


def test_one_line_errors(tmp_path, capsys):
    assert main([str(tmp_path / "none"), "-o", str(tmp_path / "x.svg")]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert main([str(tmp_path), "-o", str(tmp_path / "x.svg")]) == 2
    assert "no t<seconds>-<what>.prom scrapes" in capsys.readouterr().err


def test_draws_every_panel(tmp_path):
    # matplotlib is the docs extra, which `make setup` installs (ingero[test] includes it)
    pytest.importorskip("matplotlib", reason="the docs extra: pip install 'ingero[docs]'")
    out = tmp_path / "dash.svg"
    assert main([str(SCRAPES), "-o", str(out)]) == 0
    svg = out.read_text()
    assert svg.startswith("<?xml") and len(svg) > 20_000
    for panel in load_dashboard(DASHBOARD):
        assert panel.title.replace("&", "&amp;") in svg or panel.title in svg


def test_without_matplotlib_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)        # import matplotlib raises ImportError
    assert main([str(SCRAPES), "-o", str(tmp_path / "x.svg")]) == 2
    assert capsys.readouterr().err == "error: drawing needs matplotlib: pip install 'ingero[docs]'\n"
    assert not (tmp_path / "x.svg").exists()


def test_demo_metrics_out_that_cannot_be_written_is_one_line(tmp_path, capsys):
    from ingero.cli import main as ingero_main
    (tmp_path / "file").write_text("")
    assert ingero_main(["demo", "--metrics-out", str(tmp_path / "file" / "metrics")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ingero: --metrics-out {tmp_path / 'file' / 'metrics'}: cannot write there")
    assert err.count("\n") == 1
