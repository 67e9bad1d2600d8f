"""The chart's Grafana dashboard redrawn from saved /metrics scrapes, for the docs.

    ingero demo --metrics-out out/demo-metrics
    python scripts/dashboard_picture.py out/demo-metrics -o docs/img/dashboard-demo.svg

Grafana cannot run everywhere (it cannot on the machine the docs are made on), so this
draws each panel of charts/ingero/files/dashboard.json from Prometheus text files as
`ingero demo --metrics-out` saves them (t<seconds>-<operator|agent-NODE>.prom): every
series a panel's query reads, its label matchers and a comparison with a number applied,
over the scrapes' times. It is not a PromQL engine: rate(), sum by (), histogram_quantile()
are not applied, the panel shows the raw series they would read (its caption says so).
Each scrape's file name becomes the series' `instance` label, as Prometheus adds one.
The dashboard's variables ($namespace, $session) are read as "All" (`.*`).

Drawing needs matplotlib (`pip install 'ingero[docs]'`); reading the queries and the
scrapes does not.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from ingero.errors import IngeroError

DASHBOARD = Path(__file__).resolve().parents[1] / "charts" / "ingero" / "files" / "dashboard.json"
SCRAPE_NAME = re.compile(r"^t(\d+(?:\.\d+)?)-(.+)\.prom$")
# words of PromQL that are not series names
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
            "offset", "inf", "nan"}
SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^}]*\})?")
MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*,?')
COMPARISON = re.compile(r"(==|!=|>=|<=|>|<)\s*(-?\d+(?:\.\d+)?)\s*$")
VARIABLE = re.compile(r"\$\{?\w+\}?")          # Grafana's $var and ${var}, drawn as "All"
UNITS = {"percent": "%", "percentunit": "share (1 = 100%)", "ms": "ms", "s": "s", "bytes": "bytes", "short": "count", "reqps": "requests"}


@dataclass
class Selector:
    name: str
    matchers: list[tuple[str, str, str]] = field(default_factory=list)   # (label, op, value)

    def matches(self, labels: dict[str, str]) -> bool:
        for label, op, value in self.matchers:
            have = labels.get(label, "")
            if ((op == "=" and have != value) or (op == "!=" and have == value)
                    or (op == "=~" and not re.fullmatch(value, have)) or (op == "!~" and re.fullmatch(value, have))):
                return False
        return True


@dataclass
class Query:
    expr: str
    legend: str
    selectors: list[Selector]
    comparison: tuple[str, float] | None   # a trailing `== 1` and the like, applied to the values
    functions: list[str]                   # PromQL functions and aggregations not applied here


@dataclass
class Panel:
    title: str
    kind: str                              # Grafana's panel type: timeseries, stat, table
    unit: str
    queries: list[Query]

    def metric_names(self) -> list[str]:
        return [s.name for q in self.queries for s in q.selectors]


def parse_expr(expr: str, legend: str = "") -> Query:
    """The series selectors of a PromQL expression (names and label matchers), the functions
    and aggregations it applies (not evaluated here), and a trailing comparison with a number."""
    rest, comparison = expr, None
    if m := COMPARISON.search(rest):
        comparison, rest = (m.group(1), float(m.group(2))), rest[:m.start()]
    rest = re.sub(r"\[[^\]]*\]", " ", rest)                                 # range selectors [10m]
    rest = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", r"\1", rest)  # grouping labels
    selectors, functions = [], []
    for m in SELECTOR.finditer(rest):
        word, braces = m.group(1), m.group(2)
        after = rest[m.end():].lstrip()
        if word.lower() in KEYWORDS:
            continue
        if not braces and (after.startswith("(") or re.match(r"(by|without)\b", after)):   # sum by (x) (...)
            functions.append(word)
            continue
        matchers = []
        if braces:
            inner = braces[1:-1]
            for mm in MATCHER.finditer(inner):
                matchers.append((mm.group(1), mm.group(2), bytes(mm.group(3), "utf-8").decode("unicode_escape")))
        selectors.append(Selector(word, matchers))
    if not selectors:
        raise IngeroError(f"dashboard query {expr!r}: no series name found in it")
    return Query(expr, legend, selectors, comparison, functions)


def load_dashboard(path: Path = DASHBOARD) -> list[Panel]:
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise IngeroError(f"{path}: {e.strerror or e}") from None
    except ValueError as e:
        raise IngeroError(f"{path}: not JSON ({e})") from None
    panels = []
    for p in doc.get("panels", []):
        targets = [t for t in p.get("targets", []) if t.get("expr")]
        if not targets:
            continue
        panels.append(Panel(p.get("title", "?"), p.get("type", "timeseries"),
                            p.get("fieldConfig", {}).get("defaults", {}).get("unit", ""),
                            [parse_expr(VARIABLE.sub(".*", t["expr"]), t.get("legendFormat", ""))
                             for t in targets]))
    if not panels:
        raise IngeroError(f"{path}: no panels with a query")
    return panels


# ---- scrapes ---------------------------------------------------------------------------
# (seconds, sample name, labels as a sorted tuple) -> value
Samples = dict[tuple[float, str, tuple[tuple[str, str], ...]], float]


def parse_scrape(text: str, instance: str, t: float = 0.0) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = dict(s.labels, instance=instance)
            out[(t, s.name, tuple(sorted(labels.items())))] = float(s.value)
    return out


def load_scrapes(folder: Path) -> Samples:
    """Every t<seconds>-<what>.prom in folder (as `ingero demo --metrics-out` writes them)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise IngeroError(f"{folder}: no such folder (make one with `ingero demo --metrics-out {folder}`)")
    out: Samples = {}
    for f in sorted(folder.iterdir()):
        if m := SCRAPE_NAME.match(f.name):
            try:
                out |= parse_scrape(f.read_text(), m.group(2), float(m.group(1)))
            except ValueError as e:
                raise IngeroError(f"{f}: not Prometheus text ({e})") from None
    if not out:
        raise IngeroError(f"{folder}: no t<seconds>-<what>.prom scrapes in it "
                          "(`ingero demo --metrics-out DIR` saves them)")
    return out


def panel_series(panel: Panel, samples: Samples) -> dict[str, list[tuple[float, float]]]:
    """legend -> [(seconds, value)] of every series the panel's queries read."""
    out: dict[str, list[tuple[float, float]]] = {}
    for q in panel.queries:
        for sel in q.selectors:
            for (t, name, labels), v in sorted(samples.items()):
                if name != sel.name or not sel.matches(dict(labels)):
                    continue
                if q.comparison and not _compare(v, *q.comparison):
                    continue
                out.setdefault(_legend(q, sel, dict(labels)), []).append((t, v))
    return out


def _compare(v: float, op: str, x: float) -> bool:
    return {"==": v == x, "!=": v != x, ">": v > x, "<": v < x, ">=": v >= x, "<=": v <= x}[op]


def _legend(q: Query, sel: Selector, labels: dict[str, str]) -> str:
    shown = {k: v for k, v in labels.items() if k != "instance"}
    if q.legend and not q.functions:
        text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), q.legend)
    else:          # the raw series: the legend of an aggregation would merge them
        text = ",".join(f"{k}={v}" for k, v in shown.items())
    if labels.get("instance", "operator") != "operator" and "node" not in labels:
        text = f"{labels['instance']} {text}".strip()
    return text or sel.name


# ---- drawing ---------------------------------------------------------------------------
def draw(panels: list[Panel], samples: Samples, out: Path, caption: str = "") -> None:
    try:
        import matplotlib
    except ImportError:
        raise IngeroError("drawing needs matplotlib: pip install 'ingero[docs]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # text stays text in an SVG (smaller, searchable); the same scrapes give the same file
    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "ingero"})

    cols = 3
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 5.6, rows * 3.6), squeeze=False)
    times = sorted({t for t, _, _ in samples})
    for ax, panel in zip(axes.flat, panels):
        series = panel_series(panel, samples)
        raw = sorted({f for q in panel.queries for f in q.functions})
        exprs = "; ".join(q.expr for q in panel.queries)
        note = exprs + (f"\nraw series shown: {', '.join(raw)} not applied" if raw else "")
        ax.set_title(panel.title, fontsize=10, fontweight="bold", loc="left", pad=6 + 9 * (1 + note.count("\n")))
        ax.text(0, 1.015, note, transform=ax.transAxes, fontsize=6.5, color="#555", va="bottom")
        if not series:
            ax.text(0.5, 0.5, "no series in the scrapes", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
            continue
        if panel.kind == "table":
            last = max(t for pts in series.values() for t, _ in pts)
            rowsx = [k for k, pts in series.items() if any(t == last for t, _ in pts)]
            ax.set_axis_off()
            ax.text(0, 0.9, f"at t={last:.0f} s (the last scrape):\n" + "\n".join(f"• {r}" for r in rowsx),
                    transform=ax.transAxes, fontsize=8, va="top", family="monospace", wrap=True)
            continue
        if panel.kind == "stat":
            last = {k: pts[-1][1] for k, pts in series.items()}
            ax.barh(list(last), list(last.values()), color="#3274d9")
            for i, v in enumerate(last.values()):
                ax.text(v, i, f" {v:g}", va="center", fontsize=8)
            ax.set_xlabel(f"value at the last scrape (t={times[-1]:.0f} s)", fontsize=8)
            ax.tick_params(labelsize=7)
            continue
        if all(n.endswith("_bucket") for n in panel.metric_names()):
            _draw_buckets(ax, panel, samples, times[-1])
            continue
        for i, (legend, pts) in enumerate(sorted(series.items())):
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", markersize=2.5, linewidth=1.2, label=legend if i < 8 else None)
        if len(series) > 8:
            ax.plot([], [], " ", label=f"… and {len(series) - 8} more series")
        ax.set_xlabel("seconds since the ranks started", fontsize=8)
        ax.set_ylabel(UNITS.get(panel.unit, panel.unit) or "value", fontsize=8)
        ax.set_xlim(times[0] - 1, times[-1] + 1)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="best", framealpha=0.7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_axis_off()
    if caption:
        fig.text(0.01, 0.003, caption, fontsize=8, va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.03 if caption else 0, 1, 1), h_pad=2.5)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, metadata={"Date": None} if out.suffix.lower() == ".svg" else None)
    plt.close(fig)


def _draw_buckets(ax, panel: Panel, samples: Samples, last: float) -> None:
    """A histogram's raw buckets at the last scrape: cumulative count by upper bound `le`,
    one line per other label set (histogram_quantile over rate() is not computed)."""
    lines: dict[str, dict[float, float]] = {}
    for q in panel.queries:
        for sel in q.selectors:
            for (t, name, labels), v in samples.items():
                labels = dict(labels)
                if t != last or name != sel.name or not sel.matches(labels) or "le" not in labels:
                    continue
                key = ",".join(f"{k}={x}" for k, x in sorted(labels.items()) if k not in ("le", "instance"))
                lines.setdefault(key or sel.name, {})[float(labels["le"])] = v
    finite = sorted({le for pts in lines.values() for le in pts if le != math.inf})
    inf_x = finite[-1] * 3 if finite else 1.0
    for key, pts in sorted(lines.items()):
        xs = sorted(pts)
        ax.step([inf_x if x == math.inf else x for x in xs], [pts[x] for x in xs], where="post", marker="o",
                markersize=2.5, label=key)
    ax.set_xscale("log")
    ax.set_xlabel(f"bucket upper bound le (s; +Inf drawn at {inf_x:g}), last scrape t={last:.0f} s", fontsize=8)
    ax.set_ylabel("observations ≤ le (cumulative)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="best", framealpha=0.7)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/dashboard_picture.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scrapes", type=Path, help="the folder `ingero demo --metrics-out` wrote")
    p.add_argument("-o", "--out", type=Path, default=Path("docs/img/dashboard-demo.svg"),
                   help="an .svg or .png; default docs/img/dashboard-demo.svg")
    p.add_argument("--dashboard", type=Path, default=DASHBOARD, help="default: the chart's dashboard.json")
    p.add_argument("--caption", default=None, help="the line under the panels (default: how they were made)")
    args = p.parse_args(argv)
    try:
        panels = load_dashboard(args.dashboard)
        samples = load_scrapes(args.scrapes)
        n = len({t for t, _, _ in samples})
        caption = args.caption if args.caption is not None else (
            f"The panels of {args.dashboard.name} redrawn from {n} scrapes of the operator's and agents' /metrics "
            "(`ingero demo --metrics-out`); not Grafana: queries with PromQL functions show the raw series they read.")
        draw(panels, samples, args.out, caption)
    except IngeroError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {len(panels)} panels from {n} scrapes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
