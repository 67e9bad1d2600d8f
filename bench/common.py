"""Helpers shared by the benchmarks: compiling small C programs, root checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"


def need_root(what: str) -> None:
    if os.geteuid() != 0:
        sys.exit(f"{what}: needs root (eBPF); run as root")


def compile_c(out: Path, sources: list[str], shared: bool = False, libs: tuple[str, ...] = (),
              includes: tuple[Path, ...] = ()) -> Path:
    """gcc -O2 the given files of bench/csrc into `out`."""
    cmd = ["gcc", "-O2", "-g", *(f"-I{d}" for d in includes), "-o", str(out)] + [str(CSRC / s) for s in sources]
    if shared:
        cmd[1:1] = ["-shared", "-fPIC"]
    subprocess.run(cmd + list(libs), check=True)
    return out
