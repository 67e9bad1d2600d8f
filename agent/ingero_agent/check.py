"""`ingero check`: is this node ready for the agent? One line per requirement, with the fix.

    ingero check                      # this node
    ingero check --root /host         # a node whose root is mounted at /host (a container)
    ingero check --nccl-lib /opt/venv/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2

Required (exit 1 when one is missing): kernel >= 5.8 (BPF ring buffers), kernel BTF
(/sys/kernel/btf/vmlinux: the sched probes place task_struct fields by it), kernel
headers (bcc compiles the probes on the node), tracefs, uprobes (the NCCL probes),
cgroup v2 (the per-pod filter). Optional: an NCCL library with the API the probes
attach to (the agent finds each job's own copy in its process maps; finding one on the
node only shows the probes' symbols are there). Reads only: links and mounts that the
agent makes itself at start (headers, tracefs) are reported as such.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ingero_agent.cgroups import cgroup2_mount
from ingero_agent.elfsyms import nccl_symbols
from ingero_agent.headers import DEBUGFS, MODULES_DIR, SRC_DIR, TRACEFS, find_header_dirs
from ingero_agent.kbtf import KERNEL_BTF

MIN_KERNEL = (5, 8)          # BPF_MAP_TYPE_RINGBUF
NCCL_GLOBS = ("usr/lib/x86_64-linux-gnu/libnccl.so*", "usr/lib64/libnccl.so*", "usr/local/cuda*/lib*/libnccl.so*",
              "usr/local/lib/python3*/dist-packages/nvidia/nccl/lib/libnccl.so*",
              "usr/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so*", "opt/*/lib/libnccl.so*")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True

    def line(self) -> str:
        status = "ok" if self.ok else ("missing" if self.required else "optional")
        return f"{status:<9}{self.name:<16}{self.detail}" + ("" if self.ok or not self.fix else f"; fix: {self.fix}")


def _under(root: Path, path: Path | str) -> Path:
    """`path` (an absolute path on the node) under the node's root folder `root`."""
    return root / Path(path).relative_to("/")


def kernel(release: str) -> Check:
    try:
        version = tuple(int(x) for x in release.split("-")[0].split(".")[:2])
    except ValueError:
        return Check("kernel", False, f"cannot read the version of {release!r}", "run a Linux kernel >= 5.8")
    ok = version >= MIN_KERNEL
    return Check("kernel", ok, f"{release} ({'>=' if ok else '<'} 5.8: BPF ring buffers)",
                 "upgrade the node's kernel to 5.8 or newer")


def btf(root: Path) -> Check:
    p = _under(root, KERNEL_BTF)
    return Check("kernel BTF", p.is_file(), str(p) if p.is_file() else f"no {p}",
                 "a kernel built with CONFIG_DEBUG_INFO_BTF=y (most distributions' kernels are)")


def headers(root: Path, release: str) -> Check:
    build = _under(root, MODULES_DIR / release / "build")
    if (build / "include").is_dir():
        return Check("kernel headers", True, str(build))
    found = find_header_dirs(release, _under(root, SRC_DIR))
    if found is not None:
        return Check("kernel headers", True, f"{found[0]} (the agent links it at {build} at start)")
    return Check("kernel headers", False, f"none at {build} or under {_under(root, SRC_DIR)}",
                 "install the kernel's headers (Debian: linux-headers-amd64; RHEL: kernel-devel), "
                 "and mount /lib/modules and /usr/src into the agent")


def tracefs(root: Path) -> Path | None:
    for d in (TRACEFS, DEBUGFS / "tracing"):
        if (_under(root, d) / "events").is_dir():
            return _under(root, d)
    return None


def tracefs_check(root: Path) -> Check:
    t = tracefs(root)
    if t is not None:
        return Check("tracefs", True, str(t))
    return Check("tracefs", False, f"not mounted at {_under(root, TRACEFS)}",
                 f"mount -t tracefs tracefs {TRACEFS} (the agent tries at start, with CAP_SYS_ADMIN)")


def uprobes(root: Path) -> Check:
    t = tracefs(root)
    if t is None:
        return Check("uprobes", False, "cannot tell without tracefs", "mount tracefs first")
    p = t / "uprobe_events"
    return Check("uprobes", p.exists(), str(p) if p.exists() else f"no {p}",
                 "a kernel built with CONFIG_UPROBE_EVENTS=y (the NCCL probes are uprobes)")


def cgroup_v2(root: Path) -> Check:
    mount = cgroup2_mount(_under(root, "/proc/self/mounts"))
    return Check("cgroup v2", mount is not None, f"mounted at {mount}" if mount else "no cgroup2 mount",
                 "boot with systemd.unified_cgroup_hierarchy=1 or mount cgroup2 (the per-pod filter needs it)")


def nccl(root: Path, lib: Path | None) -> Check:
    if lib is not None:
        if not lib.is_file():
            return Check("NCCL library", False, f"{lib} does not exist", "pass the libnccl.so.2 the job loads")
        syms = nccl_symbols(lib)
        return Check("NCCL library", bool(syms), f"{lib}: {len(syms)} NCCL API functions" if syms
                     else f"{lib} is not an NCCL library (no NCCL API symbols)",
                     "pass the libnccl.so.2 the job loads", required=True)
    candidates = sorted({p for g in NCCL_GLOBS for p in glob.glob(str(root / g))})
    if root == Path("/"):
        try:
            out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
            candidates += [ln.rsplit("=> ", 1)[-1].strip() for ln in out.splitlines() if "libnccl.so" in ln]
        except (OSError, subprocess.SubprocessError):
            pass
    for c in candidates:
        if syms := nccl_symbols(c):
            return Check("NCCL library", True, f"{c}: {len(syms)} NCCL API functions", required=False)
    return Check("NCCL library", False, "none on the node's library paths (the agent finds each job's copy in "
                 "its process maps)", "--nccl-lib PATH checks the one your jobs load", required=False)


def checks(root: Path = Path("/"), release: str | None = None, nccl_lib: Path | None = None) -> list[Check]:
    release = release or os.uname().release
    return [kernel(release), btf(root), headers(root, release), tracefs_check(root), uprobes(root),
            cgroup_v2(root), nccl(root, nccl_lib)]


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("check", help="is this node ready for the agent? (kernel, BTF, headers, tracefs, "
                                     "uprobes, cgroup v2, NCCL)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=Path("/"), help="the node's root folder (default /; in a "
                                                                "container the host's root mount)")
    p.add_argument("--kernel-release", default=None, metavar="RELEASE", help=argparse.SUPPRESS)
    p.add_argument("--nccl-lib", type=Path, default=None, metavar="PATH",
                   help="check this NCCL library (the one your jobs load) instead of searching")
    return p


def run(args) -> int:
    results = checks(args.root, args.kernel_release, args.nccl_lib)
    for c in results:
        print(c.line())
    missing = [c.name for c in results if c.required and not c.ok]
    if missing:
        print(f"not ready: {', '.join(missing)} missing", file=sys.stderr)
        return 1
    print("ready: the agent can trace on this node")
    return 0
