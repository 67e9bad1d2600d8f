"""Build Ingero's NCCL profiler plugin, ``libnccl-profiler-ingero.so``.

    ingero profiler build --out DIR
    ingero profiler install --lib /opt/ingero/lib/libnccl-profiler-ingero.so --out DIR

The plugin (agent/nccl_profiler/) is C loaded by NCCL inside the training
process; it includes the record layout from bpf/ingero.h, shared with the
probe that reads it, and <sys/sdt.h> (Debian: systemtap-sdt-dev). The build is
cached like the lab's (``ingero.cbuild``). With ``--out`` the library is copied
into DIR (replaced atomically), where a job points NCCL at it:
``NCCL_PROFILER_PLUGIN=DIR/libnccl-profiler-ingero.so``, or
``NCCL_PROFILER_PLUGIN=ingero`` with DIR on the loader path. ``install`` copies an
already built plugin (the agent image's) into DIR the same way: the chart's agent
init container puts it into a host folder that training pods mount read-only.
The copy replaces the file by rename, never in place: a training process that
has the old plugin mapped keeps its inode, and never reads a half-written file.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from ingero.cbuild import CFLAGS, INCLUDE_DIR, cached_build, compile_c, digest, find_gcc
from ingero.errors import IngeroError
from ingero_agent.probes import bpf_dir

LIB_NAME = "libnccl-profiler-ingero.so"
SOURCE = "ingero_profiler.c"
HEADER = "nccl_profiler_abi.h"   # in INCLUDE_DIR, shipped with the ingero package
FLAGS = CFLAGS + ("-fvisibility=hidden", "-shared")
HINTS = {"sys/sdt.h": "install the USDT header: apt-get install systemtap-sdt-dev"}


def source_dir() -> Path:
    """The plugin's C sources: $INGERO_PROFILER_SRC or the repository's agent/nccl_profiler."""
    env = os.environ.get("INGERO_PROFILER_SRC")
    d = Path(env) if env else Path(__file__).resolve().parents[1] / "nccl_profiler"
    if not (d / SOURCE).is_file():
        raise IngeroError(f"cannot find the profiler plugin's source {d / SOURCE}: set INGERO_PROFILER_SRC "
                          "to the repository's agent/nccl_profiler folder")
    return d.resolve()


def build_profiler(out_dir: Path | None = None, cache_dir: Path | None = None) -> Path:
    """Build (or reuse) the plugin; returns its path (in `out_dir` when given)."""
    gcc = find_gcc("the NCCL profiler plugin is C")
    src, bpf = source_dir(), bpf_dir()
    key = digest(gcc, [src / SOURCE, INCLUDE_DIR / HEADER, bpf / "ingero.h"], FLAGS,
                 "point INGERO_PROFILER_SRC and INGERO_BPF_DIR at the repository's folders")

    def build(tmp: Path) -> None:
        compile_c(gcc, [*FLAGS, f"-I{bpf}", f"-I{INCLUDE_DIR}", "-o", str(tmp / LIB_NAME), str(src / SOURCE), "-lm"],
                  "the NCCL profiler plugin", HINTS)

    lib = cached_build("nccl-profiler", key, (LIB_NAME,), build, cache_dir) / LIB_NAME
    if out_dir is None:
        return lib
    return replace_into(lib, Path(out_dir), "--out")


def replace_into(lib: Path, out_dir: Path, flag: str) -> Path:
    """Copy `lib` to out_dir/LIB_NAME by rename (readable by every user, as training pods run)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{LIB_NAME}.", dir=out_dir)
        os.close(fd)
        try:
            shutil.copyfile(lib, tmp)
            os.chmod(tmp, 0o755)
            os.replace(tmp, out_dir / LIB_NAME)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        raise IngeroError(f"cannot write {out_dir / LIB_NAME}: {e.strerror}; pass a writable {flag}") from e
    return out_dir / LIB_NAME


def install_profiler(lib: Path, out_dir: Path) -> Path:
    """Copy an already built plugin into `out_dir` (the agent image's, by the chart's init container)."""
    from ingero_agent.elfsyms import is_profiler_plugin

    if not lib.is_file():
        raise IngeroError(f"--lib {lib} does not exist; pass the built {LIB_NAME} "
                          "(the agent image has it in /opt/ingero/lib)")
    if not is_profiler_plugin(lib):
        raise IngeroError(f"--lib {lib} is not Ingero's NCCL profiler plugin; build it with `ingero profiler build`")
    return replace_into(lib, out_dir, "--out")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "profiler", help="build the NCCL profiler plugin (device times of NCCL operations)",
        description="Ingero's NCCL profiler plugin records, for every collective and point-to-point "
        "operation, when the GPU ran it, and hands it to `ingero trace` through a USDT probe.",
        epilog="example:\n  ingero profiler build --out /opt/ingero/lib\n"
        "  NCCL_PROFILER_PLUGIN=/opt/ingero/lib/libnccl-profiler-ingero.so torchrun ...",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    b = sub.add_parser("build", help=f"compile {LIB_NAME}")
    b.add_argument("--out", type=Path, help="copy the library into this folder (default: print the "
                   "cached build's path)")
    i = sub.add_parser("install", help=f"copy a built {LIB_NAME} into a folder (replaced by rename)")
    i.add_argument("--lib", type=Path, required=True, help=f"the built plugin, e.g. /opt/ingero/lib/{LIB_NAME}")
    i.add_argument("--out", type=Path, required=True, help="the folder training pods load it from")
    return p


def run(args) -> int:
    if args.action == "install":
        print(install_profiler(args.lib, args.out))
        return 0
    print(build_profiler(args.out))
    return 0
