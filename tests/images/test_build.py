"""The images `make images` builds (the `images` fixture, tests/conftest.py): their version, size
and user, and the chart's optional `check` init container run in the agent image on this node.
The lab group of `make test` begins here (tests/conftest.py, IMAGES_FIRST): these wait for the
images' build that `make test` started. A lab job with both images: tests/cluster/test_whole_flow.py
(lossy-link)."""

from __future__ import annotations

import json
import subprocess

import pytest

pytestmark = pytest.mark.bpf
SIZE_MB = {"agent": 800, "operator": 550}   # bounds; they are ~730 and ~495 MB (bcc and LLVM, pyarrow, DuckDB)


def inspect(image: str) -> dict:
    return json.loads(subprocess.run(["docker", "image", "inspect", image], capture_output=True, text=True,
                                     check=True).stdout)[0]


def test_both_images_carry_the_package_version_and_stay_small(images):
    from scripts.release import version

    for component, image in images.items():
        assert image.endswith(f"ingero-{component}:{version()}")
        got = subprocess.run(["docker", "run", "--rm", "--network", "none", image, "--version"],
                             capture_output=True, text=True, timeout=120)
        assert got.stdout.strip() == f"ingero {version()}", got.stdout + got.stderr
        size_mb = inspect(image)["Size"] / 1e6
        print(f"{image}: {size_mb:.0f} MB")
        assert size_mb < SIZE_MB[component], (image, size_mb)
    assert inspect(images["operator"])["Config"]["User"] == "65532:65532"


def test_the_charts_optional_check_finds_this_node_ready_in_the_agent_image(images):
    """The chart's `check` init container (agent.preflight.check) as Helm renders it for this
    node, cgroup v2 at /sys/fs/cgroup/unified (agent.hostPaths.cgroup, as docs/install.md says
    for hybrid hosts): its args and host mounts, run in the agent image with the agent's
    capabilities."""
    from ingero_operator.demo import AGENT_CAPS
    from tests.chart.chartlib import find, render

    values = {"agent": {"preflight": {"check": True}, "hostPaths": {"cgroup": "/sys/fs/cgroup/unified"}}}
    pod = find(render(values), "DaemonSet")["spec"]["template"]["spec"]
    check = next(c for c in pod["initContainers"] if c["name"] == "check")
    volumes = {v["name"]: v for v in pod["volumes"]}
    argv = ["docker", "run", "--rm", "--network", "none", "--read-only", "--user", "0", "--cap-drop", "ALL",
            *[a for cap in AGENT_CAPS for a in ("--cap-add", cap)]]
    for m in check["volumeMounts"]:
        host = volumes[m["name"]].get("hostPath", {}).get("path")
        argv += ["-v", f"{host}:{m['mountPath']}{':ro' if m.get('readOnly') else ''}"] if host else \
            ["--tmpfs", m["mountPath"]]
    got = subprocess.run([*argv, images["agent"], *check["args"]], capture_output=True, text=True, timeout=120)
    print(got.stdout)
    assert got.returncode == 0 and "ready: the agent can trace on this node" in got.stdout, got.stdout + got.stderr
