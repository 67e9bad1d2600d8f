"""Shared test setup: the repo root on sys.path (for bench.synthetic) and skip helpers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def root_reason() -> str | None:
    """Why root-only tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root (eBPF, network namespaces, cgroups); run `make test` as root"
    return None
