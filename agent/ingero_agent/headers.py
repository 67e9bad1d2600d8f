"""Host facts bcc needs before it can compile a probe: kernel headers and tracefs.

bcc compiles the BPF C on the node against the headers under
``/lib/modules/$(uname -r)/build`` (and ``source``). Distribution kernels
ship them as a package; a VM or a container image often has headers of a
nearby version only (Debian's ``linux-headers-amd64``), which is enough for
tracepoints and uprobes. ``ensure_kernel_build_dir`` finds such headers and
links them where bcc looks. TRACEPOINT_PROBE reads each tracepoint's format
from tracefs, so ``ensure_tracefs`` mounts it when it is missing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
from pathlib import Path

from ingero.errors import IngeroError

MODULES_DIR = Path("/lib/modules")
SRC_DIR = Path("/usr/src")
TRACEFS = Path("/sys/kernel/tracing")
DEBUGFS = Path("/sys/kernel/debug")


def _version_key(name: str) -> tuple:
    """Sort key for header folder names like linux-headers-6.1.0-56-amd64."""
    return tuple(int(n) for n in re.findall(r"\d+", name))


def find_header_dirs(release: str, src_dir: Path = SRC_DIR) -> tuple[Path, Path | None] | None:
    """The best (build, source) header folders under `src_dir` for kernel `release`.

    Prefers headers of exactly this release, then the newest ``-amd64``
    (Debian) flavour; ``source`` is the matching ``-common`` folder, if any.
    """
    if not src_dir.is_dir():
        return None
    exact = src_dir / f"linux-headers-{release}"
    if (exact / "include").is_dir():
        return exact, None
    flavour = release.rsplit("-", 1)[-1] if "-" in release else "amd64"
    candidates = []
    for d in src_dir.glob("linux-headers-*"):
        if not (d / "include").is_dir() or d.name.endswith("-common"):
            continue
        if d.name.endswith(f"-{flavour}") or d.name.endswith("-amd64"):
            candidates.append(d)
    if not candidates:
        return None
    build = max(candidates, key=lambda d: _version_key(d.name))
    common = build.with_name(build.name.rsplit("-", 1)[0] + "-common")
    return build, (common if common.is_dir() else None)


def ensure_kernel_build_dir(release: str | None = None, modules_dir: Path = MODULES_DIR,
                            src_dir: Path = SRC_DIR) -> Path:
    """Return a kernel build dir with headers for bcc, linking one in if needed."""
    release = release or os.uname().release
    build = modules_dir / release / "build"
    if (build / "include").is_dir():
        return build
    found = find_header_dirs(release, src_dir)
    if found is None:
        raise IngeroError(
            f"kernel headers not found for {release}: install linux-headers-amd64 (Debian) "
            "or mount /usr/src and /lib/modules from the host")
    hdr, common = found
    try:
        (modules_dir / release).mkdir(parents=True, exist_ok=True)
        for link, target in (("build", hdr), ("source", common)):
            if target is None:
                continue
            p = modules_dir / release / link
            if p.is_symlink() or p.exists():
                if p.resolve() == target.resolve():
                    continue
                if p.is_symlink():
                    p.unlink()
                else:
                    continue  # a real folder someone put there: leave it
            p.symlink_to(target)
    except OSError as e:
        raise IngeroError(
            f"cannot link kernel headers {hdr} into {modules_dir / release}: {e.strerror}; "
            "run as root or mount /lib/modules writable") from e
    if not (build / "include").is_dir():
        raise IngeroError(f"kernel headers at {build} have no include/ folder: reinstall "
                          "linux-headers-amd64 (Debian) or mount /usr/src from the host")
    return build


def _is_mountpoint(path: Path, fstype: str) -> bool:
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and parts[1] == str(path) and parts[2] == fstype:
                    return True
    except OSError:
        pass
    return False


def _mount(source: str, target: Path, fstype: str) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.mount(source.encode(), str(target).encode(), fstype.encode(), 0, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def ensure_tracefs() -> Path:
    """Make sure tracefs is mounted (bcc reads tracepoint formats from it)."""
    if _is_mountpoint(TRACEFS, "tracefs") or (TRACEFS / "events").is_dir():
        return TRACEFS
    legacy = DEBUGFS / "tracing"
    if (legacy / "events").is_dir():
        return legacy
    try:
        _mount("tracefs", TRACEFS, "tracefs")
    except OSError as e:
        raise IngeroError(
            f"tracefs is not mounted at {TRACEFS} and mounting it failed ({e.strerror}): "
            f"run 'mount -t tracefs tracefs {TRACEFS}' as root, or mount /sys/kernel/tracing "
            "from the host into the agent container") from e
    # Older bcc builds look under debugfs; mount it too when that is cheap.
    if not (legacy / "events").is_dir() and not _is_mountpoint(DEBUGFS, "debugfs"):
        try:
            _mount("debugfs", DEBUGFS, "debugfs")
        except OSError:
            pass  # tracefs alone is enough for the bcc we ship with
    return TRACEFS
