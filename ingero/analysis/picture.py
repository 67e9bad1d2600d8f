"""One step of the job as a picture: what the verdict sees, measured and replayed.

Two panels on one time scale, a row per rank: each rank's time split into own
work (between its blocking calls), waiting (for the last of its dependencies:
the members of a collective, the sender of a recv) and transfer (from then to
the call's return). The top panel is the step as measured (replayed from the
measured own work and transfers, which gives back the measured timeline); the
bottom one the same step replayed with the named straggler's excess removed,
which is where the saving in the report comes from. Written as a plain SVG, no
plotting library needed.
"""

from __future__ import annotations

from html import escape

import numpy as np

from ingero.analysis.coverage import ranks_text
from ingero.analysis.verdict import Decision

OWN, WAIT, XFER = "#4c72b0", "#e3e3e3", "#55a868"
ROW, GAP, LEFT, WIDTH = 14, 2, 118, 980


def _segments(tl, a: np.ndarray, e: np.ndarray, x: np.ndarray, lo: int, hi: int) -> dict:
    """rank -> [(start, end, colour)] of its own work, waits and transfers inside [lo, hi]."""
    ev = tl.ev
    out: dict = {}
    for k, r in enumerate(ev.ranks.tolist()):
        s, t = int(ev.off[k]), int(ev.off[k + 1])
        segs = []
        prev = None
        # a rank's events end in order: start at the last one that ended before the window
        first = max(s, s + int(np.searchsorted(e[s:t], lo, side="right")) - 1)
        for i in range(first, t):
            ready = e[i] - x[i]
            if prev is not None and e[i] > lo and prev < hi:
                segs += [(prev, a[i], OWN), (a[i], ready, WAIT), (ready, e[i], XFER)]
            prev = e[i]
            if prev >= hi:
                break
        out[r] = [(max(p, lo), min(q, hi), c) for p, q, c in segs if q > p and q > lo and p < hi]
    return out


def _panel(title: str, segs: dict, lo: int, span: int, y0: int, named: set, stage_of: dict) -> list[str]:
    scale = (WIDTH - LEFT - 10) / max(span, 1)
    out = [f'<text x="4" y="{y0 + 12}" font-weight="bold">{escape(title, quote=False)}</text>']
    y = y0 + 20
    for r in sorted(segs):
        label = f"rank {r}" + (f" (stage {stage_of[r]})" if r in stage_of else "")
        colour = ' fill="#c0392b" font-weight="bold"' if r in named else ""
        out.append(f'<text x="4" y="{y + ROW - 3}"{colour}>{escape(label, quote=False)}</text>')
        for p, q, c in segs[r]:
            out.append(f'<rect x="{LEFT + (p - lo) * scale:.1f}" y="{y}" width="{max((q - p) * scale, 0.5):.1f}" '
                       f'height="{ROW}" fill="{c}"/>')
        y += ROW + GAP
    return out


def step_svg(report, d: Decision | None, step: int | None = None) -> tuple[str, str]:
    """(SVG text, one-line summary) of `step` (default: the middle whole step); `d`: what the
    verdict worked on (`analyse_with_replays`)."""
    if d is None:
        raise ValueError(f"no step to draw: {report.cannot_judge or 'the trace holds no step'}")
    tl, base, named = d.timeline, d.base, d.shown
    steps = tl.steps
    k = steps // 2 if step is None else step
    if not 0 <= k < steps:
        raise ValueError(f"step {step} is out of range: the trace has {steps} whole steps (0 to {steps - 1})")
    m = tl.m
    lo, hi = tl.step_bounds(base.e, k)
    panels = [("measured", _segments(tl, base.a, base.e, m.x, lo, hi), lo, hi)]
    who = set(named.ranks) if named is not None and named.kind != "spread" else set()
    if named is not None and named.whatif is not None:
        fixed, x = named.whatif
        flo, fhi = tl.step_bounds(fixed.e, k)
        panels.append((f"replayed without {named.label}'s excess", _segments(tl, fixed.a, fixed.e, x, flo, fhi),
                       flo, fhi))
    span = max(h - l for _, _, l, h in panels)
    rows = len(tl.ev.ranks)
    ph = 24 + rows * (ROW + GAP)
    height = 40 + len(panels) * (ph + 10) + 20
    body = []
    y = 34
    for title, segs, l, h in panels:
        body += _panel(f"{title}: step {k} takes {(h - l) / 1e6:.1f} ms", segs, l, span, y, who, tl.stage_of)
        y += ph + 10
    legend_y = y + 4
    legend = []
    for i, (c, name) in enumerate(((OWN, "own work"), (WAIT, "waiting on a dependency"), (XFER, "transfer"))):
        legend.append(f'<rect x="{LEFT + i * 190}" y="{legend_y}" width="12" height="12" fill="{c}"/>'
                      f'<text x="{LEFT + i * 190 + 16}" y="{legend_y + 10}">{name}</text>')
    s = report.straggler
    head = (f"straggler: {s.group or f'rank {s.rank}'}, cause {s.cause}, saves {s.saving_ms_per_step:.1f} ms/step "
            f"({s.saving_pct:.1f}%)" if s is not None else
            f"no straggler (best single fix: {report.best_candidate or 'none'}, {report.best_saving_pct:.1f}%)")
    if report.covered_ranks:
        head += f"; covers {ranks_text(report.covered_ranks)} only"
    svg = "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'font-family="sans-serif" font-size="11">',
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
        f'<text x="4" y="16" font-size="13" font-weight="bold">{escape(head, quote=False)}</text>',
        *body, *legend, "</svg>", ""])
    summary = f"step {k} of {steps}: {head}"
    return svg, summary
