"""Compile the lab's C parts: ``libnccl.so.2`` (CPU NCCL) and ``ingero-lab-worker``.

Outputs go to ``$INGERO_CACHE/lab/<sha>/`` (default ``~/.cache/ingero``), where
<sha> covers the sources, the compiler flags and the gcc version, so a
previous build is reused and an edited source triggers a new one. A build
happens in a temporary directory that is renamed into place, so a crash or a
concurrent build never leaves a half-written result.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ingero.errors import IngeroError

CSRC = Path(__file__).resolve().parent / "csrc"
LIB_SOURCES = ("nccl_cpu.c", "nccl_coll.c", "nccl_net.c")
HEADERS = ("nccl.h", "nccl_cpu_internal.h")
WORKER_SOURCE = "worker.c"
CFLAGS = ("-O2", "-g", "-fPIC", "-pthread", "-Wall", "-Wextra")
LIB_NAME = "libnccl.so.2"
WORKER_NAME = "ingero-lab-worker"


@dataclass(frozen=True)
class LabBinaries:
    """Paths of one build: the directory, the library and the worker program."""

    dir: Path
    libnccl: Path
    worker: Path


def default_cache_dir() -> Path:
    """``$INGERO_CACHE`` or ``~/.cache/ingero``."""
    env = os.environ.get("INGERO_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "ingero"


def _gcc() -> str:
    gcc = shutil.which(os.environ.get("CC", "gcc"))
    if not gcc:
        raise IngeroError("gcc not found: the lab compiles its NCCL library and worker; "
                          "install it (apt-get install gcc libc6-dev) or set CC")
    return gcc


def _digest(gcc: str) -> str:
    h = hashlib.sha256()
    for name in HEADERS + LIB_SOURCES + (WORKER_SOURCE,):
        path = CSRC / name
        if not path.is_file():
            raise IngeroError(f"lab source {path} is missing: reinstall ingero (package data lab/csrc)")
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    version = subprocess.run([gcc, "--version"], capture_output=True, text=True).stdout
    h.update(" ".join(CFLAGS).encode() + version.encode())
    return h.hexdigest()[:16]


def _compile(gcc: str, argv: list[str]) -> None:
    proc = subprocess.run([gcc, *argv], capture_output=True, text=True)
    if proc.returncode != 0:
        raise IngeroError(f"compiling the lab failed ({' '.join(argv[-3:])}): "
                          + " | ".join(proc.stderr.strip().splitlines()[:5]))


def build_lab_binaries(cache_dir: Path | None = None) -> LabBinaries:
    """Build (or reuse) the lab binaries and return their paths."""
    gcc = _gcc()
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    final = root / "lab" / _digest(gcc)
    bins = LabBinaries(dir=final, libnccl=final / LIB_NAME, worker=final / WORKER_NAME)
    if bins.libnccl.is_file() and bins.worker.is_file():
        return bins
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=final.parent))
    try:
        _compile(gcc, [*CFLAGS, "-fvisibility=hidden", "-shared", f"-Wl,-soname,{LIB_NAME}",
                       "-o", str(tmp / LIB_NAME), *(str(CSRC / s) for s in LIB_SOURCES)])
        _compile(gcc, [*CFLAGS, "-o", str(tmp / WORKER_NAME), str(CSRC / WORKER_SOURCE),
                       f"-L{tmp}", f"-l:{LIB_NAME}", "-Wl,-rpath,$ORIGIN"])
        try:
            os.rename(tmp, final)
        except OSError:
            if not (bins.libnccl.is_file() and bins.worker.is_file()):
                raise  # not a concurrent build that won the race
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return bins
