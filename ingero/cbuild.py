"""Compile Ingero's C parts with gcc into a cache folder keyed by their inputs.

Used by the lab (``ingero.lab.build``: a CPU NCCL library and its worker) and
by the NCCL profiler plugin (``ingero_agent.profiler_build``). A build goes to
``$INGERO_CACHE/<kind>/<sha>/`` (default ``~/.cache/ingero``), where <sha>
covers the input files, the compiler flags and the gcc version, so a previous
build is reused and an edited source triggers a new one. It happens in a
temporary folder renamed into place, so a crash or a concurrent build never
leaves a half-written result.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from ingero.errors import IngeroError

CFLAGS = ("-O2", "-g", "-fPIC", "-pthread", "-Wall", "-Wextra")
# C headers shipped with the package (package data): nccl_profiler_abi.h, NVIDIA's NCCL profiler
# plugin ABI in C, which both the lab's NCCL library and Ingero's profiler plugin include.
INCLUDE_DIR = Path(__file__).resolve().parent / "csrc"


def default_cache_dir() -> Path:
    """``$INGERO_CACHE`` or ``~/.cache/ingero``."""
    env = os.environ.get("INGERO_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "ingero"


def find_gcc(purpose: str) -> str:
    gcc = shutil.which(os.environ.get("CC", "gcc"))
    if not gcc:
        raise IngeroError(f"gcc not found: {purpose}; install it (apt-get install gcc libc6-dev) or set CC")
    return gcc


def digest(gcc: str, inputs: list[Path], flags: tuple[str, ...], missing_hint: str) -> str:
    h = hashlib.sha256()
    for path in inputs:
        if not path.is_file():
            raise IngeroError(f"source {path} is missing: {missing_hint}")
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    version = subprocess.run([gcc, "--version"], capture_output=True, text=True).stdout
    h.update(" ".join(flags).encode() + version.encode())
    return h.hexdigest()[:16]


def compile_c(gcc: str, argv: list[str], what: str, hints: dict[str, str] | None = None) -> None:
    """Run gcc; a failure raises with the first compiler lines and, when the output
    mentions a key of `hints` (e.g. a missing header), its advice."""
    proc = subprocess.run([gcc, *argv], capture_output=True, text=True)
    if proc.returncode != 0:
        advice = next((v for k, v in (hints or {}).items() if k in proc.stderr), None)
        raise IngeroError(f"compiling {what} failed ({' '.join(argv[-3:])}): "
                          + " | ".join(proc.stderr.strip().splitlines()[:5])
                          + (f"; {advice}" if advice else ""))


def cached_build(kind: str, key: str, outputs: tuple[str, ...], build: Callable[[Path], None],
                 cache_dir: Path | None = None) -> Path:
    """The folder holding `outputs`, built by `build(tmp_folder)` unless already there."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    final = root / kind / key
    if all((final / o).is_file() for o in outputs):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=final.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not all((final / o).is_file() for o in outputs):
                raise  # not a concurrent build that won the race
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
