"""Compile the lab's C parts: ``libnccl.so.2`` (CPU NCCL) and ``ingero-lab-worker``.

The library calls NCCL profiler plugins through NVIDIA's profiler ABI as mirrored
for Ingero's plugin: ``nccl_profiler_abi.h`` in ``ingero.cbuild.INCLUDE_DIR``, one
header for both.

Outputs go to ``$INGERO_CACHE/lab/<sha>/`` (default ``~/.cache/ingero``), built
and reused by ``ingero.cbuild`` (keyed by sources, flags and gcc version;
built in a temporary folder renamed into place).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ingero.cbuild import CFLAGS, INCLUDE_DIR, cached_build, compile_c, digest, find_gcc

CSRC = Path(__file__).resolve().parent / "csrc"
LIB_SOURCES = ("nccl_cpu.c", "nccl_coll.c", "nccl_net.c", "nccl_dev.c", "nccl_prof.c")
HEADERS = ("nccl.h", "nccl_cpu_internal.h", "nccl_prof.h", "lab_device.h")
PROFILER_ABI = "nccl_profiler_abi.h"
WORKER_SOURCE = "worker.c"
LIB_NAME = "libnccl.so.2"
WORKER_NAME = "ingero-lab-worker"


@dataclass(frozen=True)
class LabBinaries:
    """Paths of one build: the directory, the library and the worker program."""

    dir: Path
    libnccl: Path
    worker: Path


def build_lab_binaries(cache_dir: Path | None = None) -> LabBinaries:
    """Build (or reuse) the lab binaries and return their paths."""
    gcc = find_gcc("the lab compiles its NCCL library and worker")
    inputs = [CSRC / n for n in HEADERS + LIB_SOURCES + (WORKER_SOURCE,)] + [INCLUDE_DIR / PROFILER_ABI]
    key = digest(gcc, inputs, CFLAGS, "reinstall ingero (package data lab/csrc, csrc)")

    def build(tmp: Path) -> None:
        compile_c(gcc, [*CFLAGS, "-fvisibility=hidden", "-shared", f"-Wl,-soname,{LIB_NAME}", f"-I{INCLUDE_DIR}",
                        "-o", str(tmp / LIB_NAME), *(str(CSRC / s) for s in LIB_SOURCES), "-ldl"], "the lab")
        compile_c(gcc, [*CFLAGS, "-o", str(tmp / WORKER_NAME), str(CSRC / WORKER_SOURCE),
                        f"-L{tmp}", f"-l:{LIB_NAME}", "-Wl,-rpath,$ORIGIN"], "the lab")

    d = cached_build("lab", key, (LIB_NAME, WORKER_NAME), build, cache_dir)
    return LabBinaries(dir=d, libnccl=d / LIB_NAME, worker=d / WORKER_NAME)
