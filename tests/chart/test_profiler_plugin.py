"""The agent DaemonSet's profiler-plugin init container: it copies the plugin from where
Dockerfile.agent installs it into the host folder training pods load it from.

The init container's own command line, taken from the rendered chart, is run here with
only its two paths moved: the image's plugin becomes a locally built one, the pod's
mount a temporary folder.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import PurePosixPath

import pytest

from tests.chart.chartlib import ROOT, args_of, find, render

LIB_NAME = "libnccl-profiler-ingero.so"


def pod_spec(values=None) -> dict:
    return find(render(values), "DaemonSet")["spec"]["template"]["spec"]


def init(pod: dict, name: str) -> dict:
    return next(c for c in pod["initContainers"] if c["name"] == name)


def image_plugin_path() -> str:
    """Where Dockerfile.agent puts the plugin: built into a folder of the build stage and
    copied to the same folder of the final image."""
    docker = (ROOT / "Dockerfile.agent").read_text()
    built = re.search(r"ingero profiler build --out (\S+)", docker)
    assert built, "Dockerfile.agent no longer builds the plugin with `ingero profiler build --out DIR`"
    out = built.group(1)
    assert re.search(rf"^COPY --from=build {re.escape(out)} {re.escape(out)}\s*$", docker, re.M), \
        f"the final image does not copy {out} from the build stage"
    return f"{out}/{LIB_NAME}"


def test_the_init_container_copies_the_images_plugin_into_the_host_folder():
    pod = pod_spec()
    c, agent = init(pod, "profiler-plugin"), next(x for x in pod["containers"] if x["name"] == "agent")
    assert c["image"] == agent["image"]
    args = args_of(c)
    assert c["args"][:2] == ["profiler", "install"]
    assert args["--lib"] == [image_plugin_path()] == ["/opt/ingero/lib/" + LIB_NAME]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    out = mounts[args["--out"][0]]
    assert not out.get("readOnly"), "the init container writes the plugin"
    vol = {v["name"]: v for v in pod["volumes"]}[out["name"]]
    assert vol["hostPath"] == {"path": "/var/lib/ingero/plugin", "type": "DirectoryOrCreate"}
    # Written by this container alone: no other container of the agent pod mounts it.
    for other in pod["containers"] + [i for i in pod["initContainers"] if i is not c]:
        assert out["name"] not in {m["name"] for m in other.get("volumeMounts", [])}, other["name"]
    sc = c["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False and "privileged" not in sc


def test_the_host_folder_follows_the_value_and_the_init_container_goes_with_enabled():
    pod = pod_spec({"profilerPlugin": {"hostPath": "/opt/ingero-plugin"}})
    name = init(pod, "profiler-plugin")["volumeMounts"][0]["name"]
    assert {v["name"]: v for v in pod["volumes"]}[name]["hostPath"]["path"] == "/opt/ingero-plugin"
    pod = pod_spec({"profilerPlugin": {"enabled": False}})
    assert [c["name"] for c in pod["initContainers"]] == ["preflight"]
    assert "profiler-plugin" not in {v["name"] for v in pod["volumes"]}


@pytest.mark.parametrize("bad", ["/", "relative/path", "/var/lib/../etc", "/var/lib/ingero/plugin/"])
def test_a_host_folder_that_is_not_a_plain_absolute_path_is_refused(bad):
    with pytest.raises(Exception, match="profilerPlugin/hostPath"):
        render({"profilerPlugin": {"hostPath": bad}})


@pytest.fixture(scope="module")
def built_plugin():
    if not shutil.which(os.environ.get("CC", "gcc")):
        pytest.skip("gcc is not installed: cannot compile the plugin")
    from ingero.errors import IngeroError
    from ingero_agent.profiler_build import build_profiler
    try:
        return build_profiler()
    except IngeroError as e:
        if "sys/sdt.h" in str(e):
            pytest.skip("sys/sdt.h is missing: apt-get install systemtap-sdt-dev")
        raise


def run_init(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ingero", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def moved_args(c: dict, lib: str, out: str) -> list[str]:
    args = args_of(c)
    moves = {f"--lib={args['--lib'][0]}": f"--lib={lib}", f"--out={args['--out'][0]}": f"--out={out}"}
    return [moves.get(a, a) for a in c["args"]]


def test_the_init_containers_command_installs_the_plugin_by_rename(built_plugin, tmp_path):
    c = init(pod_spec(), "profiler-plugin")
    host = tmp_path / "host-folder"
    p = run_init(moved_args(c, str(built_plugin), str(host)))
    assert p.returncode == 0, p.stderr
    dest = host / LIB_NAME
    assert p.stdout.strip() == str(dest)
    assert dest.read_bytes() == built_plugin.read_bytes()
    assert dest.stat().st_mode & 0o444 == 0o444, "training pods run as any user: readable by all"
    # A second install (an agent upgrade) while a job has the plugin open: the job's file is
    # left as it was (a new inode replaces it), and no temporary file stays behind.
    with open(dest, "rb") as running:
        before = os.fstat(running.fileno())
        p = run_init(moved_args(c, str(built_plugin), str(host)))
        assert p.returncode == 0, p.stderr
        assert os.stat(dest).st_ino != before.st_ino
        assert os.fstat(running.fileno()).st_size == before.st_size and running.read() == built_plugin.read_bytes()
    assert sorted(x.name for x in host.iterdir()) == [LIB_NAME]


def test_the_init_container_refuses_a_file_that_is_not_the_plugin_in_one_line(tmp_path):
    c = init(pod_spec(), "profiler-plugin")
    not_plugin = shutil.which("true") or "/bin/true"
    for lib, words in ((not_plugin, "is not Ingero's NCCL profiler plugin"),
                       (str(tmp_path / "missing.so"), "does not exist")):
        p = run_init(moved_args(c, lib, str(tmp_path / "out")))
        assert p.returncode != 0
        err = p.stderr.strip()
        assert "\n" not in err and words in err and "Traceback" not in err, err
        assert not (tmp_path / "out" / LIB_NAME).exists()
    assert PurePosixPath(args_of(c)["--out"][0]).is_absolute()
