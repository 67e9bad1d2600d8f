"""Printer columns and label selectors, as the API server applies them.

Used by the embedded API server (Table output for ``kubectl get``, list
filtering) and by the demo (``-o custom-columns=`` built from the CRD, which
kubectl evaluates with its own JSONPath engine).
"""

from __future__ import annotations

import datetime as dt
import re

_STEP = re.compile(r"\.([A-Za-z0-9_-]+)|\[(\d+)\]")


def jsonpath(obj, path: str):
    """Value at a simple JSONPath like `.status.straggler.pod` or `.status.nodes[0].name` (None if absent)."""
    path = path.strip()
    if path.startswith("{") and path.endswith("}"):
        path = path[1:-1]
    pos, cur = 0, obj
    for m in _STEP.finditer(path):
        if m.start() != pos:
            raise ValueError(f"unsupported JSONPath {path!r}: only .field and [index] steps")
        pos = m.end()
        if m.group(1) is not None:
            cur = cur.get(m.group(1)) if isinstance(cur, dict) else None
        else:
            i = int(m.group(2))
            cur = cur[i] if isinstance(cur, list) and i < len(cur) else None
    if pos != len(path):
        raise ValueError(f"unsupported JSONPath {path!r}: only .field and [index] steps")
    return cur


def human_age(since: str | None, now: dt.datetime | None = None) -> str:
    """'42s', '5m10s', '3h', '2d' like kubectl's AGE column."""
    if not since:
        return "<unknown>"
    try:
        t = dt.datetime.fromisoformat(since.replace("Z", "+00:00"))
    except ValueError:
        return "<invalid>"
    secs = int(((now or dt.datetime.now(dt.timezone.utc)) - t).total_seconds())
    if secs < 0:
        return "<future>"
    if secs < 120:
        return f"{secs}s"
    if secs < 600:
        return f"{secs // 60}m{secs % 60}s" if secs % 60 else f"{secs // 60}m"
    if secs < 3 * 3600:
        return f"{secs // 60}m"
    if secs < 48 * 3600:
        return f"{secs // 3600}h"
    return f"{secs // 86400}d"


def cell(obj: dict, col: dict):
    v = jsonpath(obj, col["jsonPath"])
    if col.get("type") == "date":
        return human_age(v) if v else None
    return v


def table(items: list[dict], columns: list[dict], wide: bool = False) -> dict:
    """A meta.k8s.io/v1 Table: NAME, then the printer columns (priority 0 unless wide)."""
    cols = [c for c in columns if wide or not c.get("priority")]
    defs = [{"name": "Name", "type": "string", "format": "name", "description": "object name", "priority": 0}]
    defs += [{"name": c["name"], "type": "string" if c.get("type") == "date" else c.get("type", "string"),
              "format": "", "description": c.get("description", ""), "priority": c.get("priority", 0)}
             for c in cols]
    rows = [{"cells": [i["metadata"]["name"], *[cell(i, c) for c in cols]],
             "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                        "metadata": i["metadata"]}} for i in items]
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {}, "columnDefinitions": defs,
            "rows": rows}


def custom_columns(columns: list[dict]) -> str:
    """The `kubectl get -o custom-columns=` argument for a CRD's printer columns."""
    heads = ["NAME:.metadata.name"] + [f"{c['name'].upper()}:{c['jsonPath']}" for c in columns]
    return "custom-columns=" + ",".join(heads)


def selector_matches(obj: dict, selector: str) -> bool:
    """Equality-based label selectors: k=v, k==v, k!=v, k, !k (comma = and)."""
    labels = ((obj.get("metadata") or {}).get("labels")) or {}
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        if "!=" in term:
            k, v = (s.strip() for s in term.split("!=", 1))
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = (s.strip() for s in term.replace("==", "=").split("=", 1))
            if labels.get(k) != v:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def fields_match(obj: dict, selector: str) -> bool:
    """A field selector of `path=value` / `path==value` / `path!=value` terms, comma-separated
    (what kubectl describe sends for an object's Events: involvedObject.name=x,...)."""
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        neg = "!=" in term
        path, _, want = term.partition("!=" if neg else "=")
        want = want.lstrip("=")
        cur: object = obj
        for part in path.split("."):
            cur = cur.get(part) if isinstance(cur, dict) else None
        got = "" if cur is None else str(cur)
        if (got == want) == neg:
            return False
    return True
