"""The agent and operator images, as `make images` (scripts/images.sh) builds them: on a Debian
base made from the mirror, with no image registry pull, after starting a docker daemon when
none runs (scripts/docker-daemon.sh). The first build on a machine bootstraps the base (~15 s
with a fast mirror; its tarball is kept under $INGERO_CACHE/images) and builds both images
(~110 s of CPU in all, most of it dpkg and pip: Debian's bcc and LLVM, the Python
dependencies; the wall time grows with the machine's load); docker's layer cache keeps the
base, the Debian packages and the dependencies (a layer per image, rebuilt when
pyproject.toml changes), so a later build redoes only the project's own layers.

test_build.py checks what was built, test_lab.py runs a traced lab job with both."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.conftest import ROOT, bpf_reason


def skip_reason() -> str | None:
    reason = bpf_reason()
    if reason:
        return reason
    for tool in ("docker", "kubectl"):
        if not shutil.which(tool):
            return f"{tool} is not installed: `make setup` installs it"
    return None


@pytest.fixture(scope="session")
def images() -> dict[str, str]:
    """component -> the image `make images` built."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    daemon = subprocess.run(["bash", "scripts/docker-daemon.sh"], cwd=ROOT, capture_output=True, text=True)
    if daemon.returncode:
        pytest.skip(daemon.stderr.strip())
    proc = subprocess.run(["bash", "scripts/images.sh"], cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    names = proc.stdout.split()
    return {"agent": names[0], "operator": names[1]}
