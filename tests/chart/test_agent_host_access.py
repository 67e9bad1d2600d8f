"""The agent DaemonSet gives the agent exactly the host access its code uses.

The host paths are taken from the agent's source (every absolute path literal
in ingero_agent/*.py) and from the path flags the chart passes; each one must
be served by the pod (a read-only hostPath mount at the same path, hostPID for
/proc), or be listed below with the reason the agent does not need it in a
pod. Conversely every mount of the container must serve one of them. A new
path in the agent's code fails this test until the chart or this table says
how it is served.
"""

from __future__ import annotations

import ast
from pathlib import Path, PurePosixPath

from tests.chart.chartlib import ROOT, args_of, container, find, render

AGENT_SRC = ROOT / "agent" / "ingero_agent"
# Paths in the agent's code that a pod does not need from the host, and why.
NOT_FROM_HOST = {
    "/sys/kernel/debug": "legacy location of tracefs (debugfs/tracing), used only when "
                         "/sys/kernel/tracing has no events/, and for uprobe_events (as bcc) only "
                         "when it exists; the chart mounts tracefs",
    "/etc/ingero/agent.yaml": "optional config file naming the node; the chart passes --node=$(NODE_NAME)",
    "/sys/class": "the RDMA ports' counters (class/infiniband, class/infiniband_verbs) are read from the "
                  "container's own read-only sysfs: it shows the pod network namespace's RDMA devices, "
                  "which in RDMA's default shared mode are all of the node's (docs/tracing.md)",
    "/sys/kernel/btf/vmlinux": "only checked to exist (task-local frames need kernel BTF): the "
                               "container's own read-only sysfs shows the host kernel's BTF; "
                               "without it the probes keep per-thread frames in a hash",
    "/var/cache/ingero/bpf": "the compiled probes' cache outside a pod; in the chart's container (a "
                             "read-only root) the agent's tracers keep it in the data folder "
                             "(--data-dir, a host folder: it outlives the pod)",
}
# Host paths the agent writes, and why.
WRITABLE = {
    "/sys/kernel/tracing": "bcc creates NCCL uprobes in uprobe_events: the perf uprobe PMU needs "
                           "CAP_SYS_ADMIN since Linux 6.16 (tests/bpf/test_capabilities.py)",
}
# The agent API's own URL paths (server.py's routes): literals that name no file.
URL_PATHS = ("/healthz", "/v1/")
# Flags of `ingero agent serve` that name files or folders, and what must back them.
PATH_FLAGS = {"--data-dir": "hostPath-rw", "--cgroup-root": "hostPath", "--token-file": "secret",
              "--tls-cert": "secret", "--tls-key": "secret"}


def code_paths() -> dict[str, list[str]]:
    """Absolute path literals in the agent's code -> where they appear."""
    out: dict[str, list[str]] = {}
    for f in sorted(AGENT_SRC.glob("*.py")):
        tree = ast.parse(f.read_text())
        # inside an f-string only its first part can begin a path (f"{root}/maps" does not)
        inner = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values[1:]}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in inner:
                v = node.value
                if (v.startswith("/") and len(v) > 1 and " " not in v and "\n" not in v
                        and not v.startswith(URL_PATHS)):
                    out.setdefault(v, []).append(f"{f.name}:{node.lineno}")
    return out


def within(path: str, root: str) -> bool:
    return PurePosixPath(path) == PurePosixPath(root) or PurePosixPath(root) in PurePosixPath(path).parents


def agent_pod(values=None):
    docs = render(values)
    pod = find(docs, "DaemonSet")["spec"]["template"]["spec"]
    c = container(docs, "DaemonSet", "agent")
    vols = {v["name"]: v for v in pod["volumes"]}
    return pod, c, vols


def mount_for(c: dict, path: str) -> dict | None:
    """The container's mount that serves `path` (the deepest one)."""
    got = [m for m in c["volumeMounts"] if within(path, m["mountPath"])]
    return max(got, key=lambda m: len(m["mountPath"])) if got else None


def test_the_agent_code_names_the_host_paths_this_test_expects():
    # If this fails, the agent reads a new host path: serve it in the chart (or add it to
    # NOT_FROM_HOST with the reason) and update this list.
    roots = sorted({p for p in code_paths() if not within(p, "/proc")})
    assert roots == ["/etc/ingero/agent.yaml", "/lib/modules", "/sys/class", "/sys/kernel/btf/vmlinux", "/sys/kernel/debug",
                     "/sys/kernel/debug/tracing", "/sys/kernel/debug/tracing/events", "/sys/kernel/tracing", "/sys/kernel/tracing/events",
                     "/usr/src", "/var/cache/ingero/bpf"]


def test_every_host_path_in_the_agent_code_is_served_by_the_pod():
    pod, c, vols = agent_pod()
    served = {}
    for path, where in code_paths().items():
        if any(within(path, k) for k in NOT_FROM_HOST):
            continue
        if within(path, "/proc"):
            # /proc/<pid>/... of the training processes, and /proc/self: the host's process
            # table, through hostPID (no /proc mount).
            assert pod["hostPID"] is True, f"{path} ({where}) needs hostPID"
            served[path] = "hostPID"
            continue
        m = mount_for(c, path)
        assert m is not None, f"{path} (read at {where}) is not mounted into the agent container"
        hp = vols[m["name"]].get("hostPath")
        assert hp is not None, f"{path} ({where}) is mounted from {vols[m['name']]}, not from the host"
        assert hp["path"] == m["mountPath"], f"{path}: host {hp['path']} is mounted at {m['mountPath']}"
        if m["mountPath"] in WRITABLE:
            assert m.get("readOnly") is False, f"{path}: {WRITABLE[m['mountPath']]}"
        else:
            assert m.get("readOnly") is True, f"{path}: the agent only reads it; mount it read-only"
        served[path] = m["name"]
    assert served["/lib/modules"] == "modules" and served["/usr/src"] == "usr-src"
    assert served["/sys/kernel/tracing"] == "tracefs"


def test_every_path_flag_of_the_agent_is_backed_by_the_right_volume():
    pod, c, vols = agent_pod({"tls": {"enabled": True, "secretName": "agent-tls"}})
    args = args_of(c)
    assert set(PATH_FLAGS) <= set(args)
    for flag, kind in PATH_FLAGS.items():
        path = args[flag][0]
        m = mount_for(c, path)
        assert m is not None, f"{flag}={path} is not mounted"
        vol = vols[m["name"]]
        if kind.startswith("hostPath"):
            assert "hostPath" in vol, f"{flag}={path} must come from the host"
            writable = kind == "hostPath-rw"
            assert bool(m.get("readOnly")) is not writable, f"{flag}={path}: readOnly should be {not writable}"
        else:
            assert "secret" in vol and m.get("readOnly") is True
            item = PurePosixPath(path).relative_to(m["mountPath"]).as_posix()
            assert item in [i["path"] for i in vol["secret"]["items"]], f"{flag}={path}: no such key mounted"
    # The cgroup root is the host's cgroup v2 mount, under /host in the pod.
    assert vols[mount_for(c, args["--cgroup-root"][0])["name"]]["hostPath"]["path"] == "/sys/fs/cgroup"
    assert args["--cgroup-root"] == ["/host/sys/fs/cgroup"]
    assert args["--data-dir"] == ["/var/lib/ingero"]
    assert vols["data"]["hostPath"] == {"path": "/var/lib/ingero", "type": "DirectoryOrCreate"}


def test_the_container_has_no_mount_the_agent_does_not_use():
    pod, c, vols = agent_pod({"tls": {"enabled": True, "secretName": "agent-tls"}})
    used = {mount_for(c, p)["name"] for p in code_paths()
            if not within(p, "/proc") and not any(within(p, k) for k in NOT_FROM_HOST)}
    used |= {mount_for(c, v[0])["name"] for f, v in args_of(c).items() if f in PATH_FLAGS}
    env = {e["name"]: e.get("value") for e in c["env"]}
    used.add(mount_for(c, env["HOME"])["name"])   # HOME=/tmp: bcc, DuckDB and Python scratch
    assert {m["name"] for m in c["volumeMounts"]} == used
    # The pod's only other volume: the profiler plugin's host folder, which the
    # profiler-plugin init container alone mounts (tests/chart/test_profiler_plugin.py).
    assert {v["name"] for v in pod["volumes"]} == used | {"profiler-plugin"}
    # Writable: the data folder, /tmp and tracefs (WRITABLE) only (the root filesystem is read-only).
    assert {m["name"] for m in c["volumeMounts"] if not m.get("readOnly")} == {"data", "tmp", "tracefs"}
    assert "emptyDir" in vols["tmp"] and c["securityContext"]["readOnlyRootFilesystem"] is True


def test_linking_headers_on_the_host_is_the_only_way_to_make_lib_modules_writable():
    _, c, vols = agent_pod({"agent": {"kernelHeaders": {"linkOnHost": True}}})
    assert mount_for(c, "/lib/modules")["readOnly"] is False
    # headers.py links build/source into /lib/modules/<release> when exact headers are missing.
    src = (AGENT_SRC / "headers.py").read_text()
    assert "symlink_to" in src and 'MODULES_DIR = Path("/lib/modules")' in src


def test_custom_host_paths_are_mounted_where_the_code_looks():
    values = {"agent": {"hostPaths": {"cgroup": "/sys/fs/cgroup/unified", "modules": "/opt/modules",
                                      "src": "/opt/src", "tracefs": "/sys/kernel/debug/tracing"},
                        "dataDir": "/data/ingero"}}
    _, c, vols = agent_pod(values)
    args = args_of(c)
    assert args["--cgroup-root"] == ["/host/sys/fs/cgroup/unified"]
    assert vols[mount_for(c, "/lib/modules/6.1.0/build")["name"]]["hostPath"]["path"] == "/opt/modules"
    assert vols[mount_for(c, "/usr/src/linux-headers-6.1.0-amd64")["name"]]["hostPath"]["path"] == "/opt/src"
    assert vols[mount_for(c, "/sys/kernel/tracing/events")["name"]]["hostPath"]["path"] == \
        "/sys/kernel/debug/tracing"
    assert args["--data-dir"] == ["/data/ingero"] and mount_for(c, "/data/ingero/sessions")["name"] == "data"


def test_node_name_comes_from_the_downward_api_and_bpf_sources_from_the_image():
    _, c, _ = agent_pod()
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert args_of(c)["--node"] == ["$(NODE_NAME)"]
    bpf = env["INGERO_BPF_DIR"]["value"]
    assert mount_for(c, bpf) is None, "the BPF sources come from the image, not from a mount"
    # The image puts bpf/ there (Dockerfile.agent), with every file the tracer compiles.
    docker = (ROOT / "Dockerfile.agent").read_text()
    assert f"COPY bpf/ {bpf}/" in docker
    assert {p.name for p in (ROOT / "bpf").iterdir()} >= {"ingero.h", "nccl.c", "tcp.c", "sched.c"}
    assert Path(ROOT / "bpf" / "ingero.h").is_file()


def test_the_preflight_traces_with_the_agents_privileges_and_a_subset_of_its_mounts():
    pod, c, vols = agent_pod()
    pre = pod["initContainers"][0]
    assert pre["name"] == "preflight" and pre["image"] == c["image"]
    assert pre["securityContext"] == c["securityContext"]
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    for m in pre["volumeMounts"]:
        if m["name"] == "tracefs":   # tracepoints only (tcp, sched), no uprobes: read-only
            assert m == {**mounts["tracefs"], "readOnly": True}, m
        else:
            assert m == mounts[m["name"]], m
    # What bcc needs to compile and attach (headers, tracefs) and scratch space; no data, no token.
    assert {m["name"] for m in pre["volumeMounts"]} == {"tracefs", "modules", "usr-src", "tmp"}
    assert {e["name"]: e.get("value") for e in pre["env"]}["INGERO_BPF_DIR"] == \
        {e["name"]: e.get("value") for e in c["env"]}["INGERO_BPF_DIR"]
    pod, _, _ = agent_pod({"agent": {"preflight": {"enabled": False}}})
    assert [i["name"] for i in pod["initContainers"]] == ["profiler-plugin"]
    pod, _, _ = agent_pod({"agent": {"preflight": {"enabled": False}}, "profilerPlugin": {"enabled": False}})
    assert "initContainers" not in pod


def test_the_optional_check_runs_ingero_check_first_with_the_agents_privileges_and_mounts_read_only():
    pod, _, _ = agent_pod()
    assert "check" not in [i["name"] for i in pod["initContainers"]]      # off by default
    pod, c, _ = agent_pod({"agent": {"preflight": {"check": True}}})
    assert [i["name"] for i in pod["initContainers"]] == ["check", "preflight", "profiler-plugin"]
    check = pod["initContainers"][0]
    assert check["image"] == c["image"] and check["args"] == ["check"]
    assert check["securityContext"] == c["securityContext"]
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert {m["name"] for m in check["volumeMounts"]} == {"tracefs", "cgroup", "modules", "usr-src", "tmp"}
    for m in check["volumeMounts"]:       # where the agent has them; it only reads
        assert m["mountPath"] == mounts[m["name"]]["mountPath"], m
        assert m.get("readOnly", False) is (m["name"] != "tmp"), m
