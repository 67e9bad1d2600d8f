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


def bpf_reason() -> str | None:
    """Why real-eBPF tests cannot run here, or None when they can."""
    reason = root_reason()
    if reason:
        return reason
    try:
        import bcc  # noqa: F401
    except ImportError:
        return "bcc is not importable: install Debian's python3-bpfcc and use a venv with --system-site-packages"
    try:
        from ingero_agent.headers import ensure_kernel_build_dir, ensure_tracefs
        ensure_kernel_build_dir()
        ensure_tracefs()
    except Exception as e:  # the message names what is missing
        return f"eBPF prerequisites missing: {e}"
    return None
