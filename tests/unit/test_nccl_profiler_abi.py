"""Our C copy of NCCL's profiler ABI (ingero/csrc/nccl_profiler_abi.h)
against NVIDIA's own headers.

NVIDIA_LAYOUT was measured by compiling NVIDIA's C++ headers
(src/include/plugin/nccl_profiler.h, profiler/profiler_v{4,5,6}.h and profiler/net_{ib,socket}_v1.h at
NVIDIA/nccl 5067397c2676d5aed50042fc39e5c8ee96eb0027, NCCL 2.30.7) with g++ on
x86-64 and printing offsetof/sizeof of every field below. Here the C copy is
compiled with gcc and must give the same numbers: a field moved, resized or
dropped in the copy (or a union member missing, which changes the size) fails.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

HEADER = Path(__file__).resolve().parents[2] / "ingero" / "csrc" / "nccl_profiler_abi.h"

# (struct, member) -> (offset, size); member "SIZE" is sizeof(struct).
_DESCR = {
    "SIZE": None, "type": None, "parentObj": (8, 8), "rank": (16, 4),
    "coll.seqNumber": (24, 8), "coll.func": (32, 8), "coll.count": (56, 8), "coll.root": (64, 4),
    "coll.datatype": (72, 8), "coll.nChannels": (80, 1), "coll.nWarps": (81, 1), "coll.algo": (88, 8),
    "coll.proto": (96, 8), "p2p.func": (24, 8), "p2p.buff": (32, 8), "p2p.datatype": (40, 8),
    "p2p.count": (48, 8), "p2p.peer": (56, 4), "p2p.nChannels": (60, 1),
    "kernelCh.channelId": (24, 1), "kernelCh.pTimer": (32, 8),
    "proxyOp.pid": (24, 4), "proxyOp.channelId": (28, 1), "proxyOp.peer": (32, 4), "proxyOp.nSteps": (36, 4),
    "proxyOp.chunkSize": (40, 4), "proxyOp.isSend": (44, 4), "proxyStep.step": (24, 4),
    "netPlugin.id": (24, 8), "netPlugin.data": (32, 8),
}
NVIDIA_LAYOUT: dict[tuple[str, str], tuple[int, int]] = {}
for _v, _size, _type in (("v4", 104, (0, 1)), ("v5", 112, (0, 8)), ("v6", 112, (0, 8))):
    for _m, _at in _DESCR.items():
        NVIDIA_LAYOUT[(f"ncclProfilerEventDescr_{_v}_t", _m)] = {"SIZE": (_size, 0), "type": _type}.get(_m, _at)
    NVIDIA_LAYOUT[(f"ncclProfilerEventStateArgs_{_v}_t", "SIZE")] = (8, 0)
    NVIDIA_LAYOUT[(f"ncclProfilerEventStateArgs_{_v}_t", "kernelCh.pTimer")] = (0, 8)
    NVIDIA_LAYOUT[(f"ncclProfilerEventStateArgs_{_v}_t", "proxyStep.transSize")] = (0, 8)
    NVIDIA_LAYOUT[(f"ncclProfilerEventStateArgs_{_v}_t", "netPlugin.data")] = (0, 8)
    NVIDIA_LAYOUT[(f"ncclProfiler_{_v}_t", "SIZE")] = (48, 0)
    for _i, _f in enumerate(("init", "startEvent", "stopEvent", "recordEventState", "finalize")):
        NVIDIA_LAYOUT[(f"ncclProfiler_{_v}_t", _f)] = (8 + 8 * _i, 8)
for _v in ("v5", "v6"):
    NVIDIA_LAYOUT[(f"ncclProfilerEventDescr_{_v}_t", "coll.parentGroup")] = (104, 8)
    NVIDIA_LAYOUT[(f"ncclProfilerEventDescr_{_v}_t", "p2p.parentGroup")] = (64, 8)
    NVIDIA_LAYOUT[(f"ncclProfilerEventDescr_{_v}_t", "collApi.stream")] = (56, 8)
    NVIDIA_LAYOUT[(f"ncclProfilerEventDescr_{_v}_t", "p2pApi.stream")] = (48, 8)
NVIDIA_LAYOUT.update({
    ("ncclProfilerNetIbDescr_v1_t", "SIZE"): (40, 0), ("ncclProfilerNetIbDescr_v1_t", "type"): (0, 1),
    ("ncclProfilerNetIbDescr_v1_t", "qp.device"): (8, 4), ("ncclProfilerNetIbDescr_v1_t", "qp.wr_id"): (16, 8),
    ("ncclProfilerNetIbDescr_v1_t", "qp.opcode"): (24, 4), ("ncclProfilerNetIbDescr_v1_t", "qp.qpNum"): (28, 4),
    ("ncclProfilerNetIbDescr_v1_t", "qp.length"): (32, 8),
    ("ncclProfilerNetSockDescr_v1_t", "SIZE"): (24, 0), ("ncclProfilerNetSockDescr_v1_t", "type"): (0, 1),
    ("ncclProfilerNetSockDescr_v1_t", "sock.fd"): (8, 4), ("ncclProfilerNetSockDescr_v1_t", "sock.op"): (12, 4),
    ("ncclProfilerNetSockDescr_v1_t", "sock.length"): (16, 8),
})
NVIDIA_ENUMS = {"ncclProfileGroup": 1, "ncclProfileColl": 2, "ncclProfileP2p": 4, "ncclProfileKernelCh": 64,
                "ncclProfileCollApi": 512, "ncclProfileP2pApi": 1024, "ncclProfilerKernelChStop": 22,
                "ncclProfileProxyOp": 8, "ncclProfileProxyStep": 16, "ncclProfileNetPlugin": 128,
                "ncclProfilerProxyStepSendGPUWait": 8, "ncclProfilerProxyStepSendPeerWait_v4": 20,
                "ncclProfilerProxyStepSendWait": 9, "ncclProfilerProxyStepRecvWait": 10,
                "ncclProfilerProxyStepRecvFlushWait": 11, "ncclProfilerProxyStepRecvGPUWait": 12,
                "ncclProfileSocket": 1, "ncclProfileQp": 1, "NCCL_PROFILER_NET_TYPE_IB": 65536,
                "NCCL_PROFILER_NET_TYPE_SOCK": 131072}


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory) -> dict:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: cannot compile the profiler ABI header")
    lines = []
    for (struct, member) in NVIDIA_LAYOUT:
        if member == "SIZE":
            lines.append(f'printf("{struct} SIZE %zu 0\\n", sizeof({struct}));')
        else:
            lines.append(f'printf("{struct} {member} %zu %zu\\n", offsetof({struct}, {member}), '
                         f'sizeof((({struct} *)0)->{member}));')
    for name in NVIDIA_ENUMS:
        lines.append(f'printf("enum {name} %d 0\\n", (int){name});')
    src = tmp_path_factory.mktemp("abi") / "abi.c"
    src.write_text(f'#include <stdio.h>\n#include "{HEADER}"\nint main(void) {{\n' + "\n".join(lines)
                   + "\nreturn 0;\n}\n")
    exe = src.with_suffix("")
    subprocess.run(["gcc", "-std=c11", "-Wall", "-Werror", "-o", str(exe), str(src)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    got = {}
    for line in out.splitlines():
        struct, member, a, b = line.split()
        got[(struct, member)] = (int(a), int(b))
    return got


@pytest.mark.parametrize("struct,member", sorted(NVIDIA_LAYOUT))
def test_the_c_copy_puts_each_field_where_nvidia_does(c_layout, struct, member):
    assert c_layout[(struct, member)] == NVIDIA_LAYOUT[(struct, member)]


def test_event_kinds_states_and_network_plugin_ids_have_nvidias_values(c_layout):
    assert {n: c_layout[("enum", n)][0] for n in NVIDIA_ENUMS} == NVIDIA_ENUMS
