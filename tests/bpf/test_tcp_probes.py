"""TCP tracepoints: retransmits over a lossy veth pair between two network
namespaces this test creates (nftables drops 15% of data packets arriving at
the server), attributed to the connection's owner, not to the CPU's task.

Traffic stays between the two namespaces made here (198.18.0.0/24, the
benchmarking range, and fd00:18::/64).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.bpf.conftest import spawn

PORT = 5001
ADDRS = {4: ("198.18.0.1", "198.18.0.2"), 6: ("fd00:18::1", "fd00:18::2")}

SERVER = """
import socket, sys
fam = socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET
s = socket.socket(fam, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(8)
print("listening", flush=True)
while True:
    c, _ = s.accept()
    while c.recv(1 << 16):
        pass
    c.close()
"""

# On the lossy port (argv[3] "lossy") the client sends until its own socket has retransmitted
# (tcp_info's tcpi_total_retrans, at byte 100 of linux/tcp.h's struct tcp_info): veth segments
# are up to 64 KiB, so a fixed amount can cross the 15% loss untouched. Exit 3 when 64 MiB went
# through without one.
CLIENT = """
import socket, struct, sys
fam = socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
print(c.getsockname()[1], flush=True)
data = b"x" * 8192
def retransmitted():
    return struct.unpack_from("I", c.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104), 100)[0]
sent = 0
lossy = sys.argv[3:] == ["lossy"]
while sent < 48 or (lossy and not retransmitted() and sent < 8192):
    c.sendall(data)
    sent += 1
c.shutdown(socket.SHUT_WR)
c.recv(1)
ok = retransmitted() or not lossy
c.close()
sys.exit(0 if ok else 3)
"""


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


@pytest.fixture
def lossy_link(tmp_path):
    """Namespaces A (client) and B (server, drops 15% of incoming data packets)."""
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed: cannot build the lossy veth pair")
    tag = uuid.uuid4().hex[:6]
    a, b = f"ingA{tag}", f"ingB{tag}"
    try:
        _run("ip", "netns", "add", a)
        _run("ip", "netns", "add", b)
        _run("ip", "link", "add", f"va{tag}", "netns", a, "type", "veth", "peer", "name", f"vb{tag}",
             "netns", b)
        for ns, dev, i in ((a, f"va{tag}", 0), (b, f"vb{tag}", 1)):
            _run("ip", "-n", ns, "addr", "add", f"{ADDRS[4][i]}/24", "dev", dev)
            _run("ip", "-n", ns, "addr", "add", f"{ADDRS[6][i]}/64", "dev", dev, "nodad")
            _run("ip", "-n", ns, "link", "set", dev, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        rules = tmp_path / "drop.nft"
        rules.write_text(
            "table inet ingero_test {\n chain input {\n  type filter hook input priority 0;\n"
            f"  tcp dport {PORT} meta length > 200 numgen random mod 100 < 15 drop\n }}\n}}\n")
        _run("ip", "netns", "exec", b, "nft", "-f", str(rules))
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create network namespaces / nftables rules here: {e.stderr.strip()}")
    procs = []
    for fam in (4, 6):
        srv = subprocess.Popen(["ip", "netns", "exec", b, sys.executable, "-c", SERVER, ADDRS[fam][1],
                                str(PORT)], stdout=subprocess.PIPE, text=True)
        assert srv.stdout.readline().strip() == "listening"
        procs.append(srv)
    yield a
    for p in procs:
        p.kill()
        p.wait()
    for ns in (a, b):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def client(ns: str, fam: int, cgroup: Path | None = None, to: str | None = None) -> tuple[subprocess.Popen, int]:
    p = spawn(["ip", "netns", "exec", ns, sys.executable, "-c", CLIENT, to or ADDRS[fam][1], str(PORT), "lossy"],
              cgroup)
    sport = int(p.stdout.readline())
    return p, sport


@pytest.mark.parametrize("fam", [4, 6])
def test_retransmits_are_recorded_for_the_target_connection_with_its_owner_pid(
        lossy_link, trace, make_cgroup, fam):
    cg = make_cgroup()
    t = trace("--cgroup", str(cg), "--probes", "tcp")
    target, target_port = client(lossy_link, fam, cg)
    other, other_port = client(lossy_link, fam)              # same link, not a target
    assert target.wait(60) == 0 and other.wait(60) == 0
    t.stop()
    rows = t.query("SELECT pid, owner_source, saddr, daddr, sport, dport, family FROM tcp_events "
                   "WHERE event = 'tcp_retransmit_skb'")
    assert rows, "no retransmit recorded:\n" + "\n".join(t.lines)
    family = "AF_INET" if fam == 4 else "AF_INET6"
    assert set(rows) == {(target.pid, "socket", ADDRS[fam][0], ADDRS[fam][1], target_port, PORT, family)}
    assert t.query("SELECT COUNT(*) FROM tcp_events WHERE sport = ?", [other_port]) == [(0,)]
    states = [s for (s,) in t.query("SELECT state FROM tcp_events WHERE event = 'inet_sock_set_state' "
                                    "AND pid = ? ORDER BY timestamp_ns", [target.pid])]
    assert states[:2] == ["SYN_SENT", "ESTABLISHED"]
    assert t.query("SELECT COUNT(*) FROM tcp_events") == t.query("SELECT events_tcp FROM nodes")


@pytest.mark.parametrize("mapped", [False, True], ids=["ipv4", "ipv4-mapped-ipv6"])
def test_connections_of_unknown_owners_are_kept_when_they_use_a_target_pod_address(
        lossy_link, trace, make_cgroup, tmp_path, mapped):
    """With `mapped`, the client is a dual-stack AF_INET6 socket talking to the IPv4
    server through ::ffff:198.18.0.2: its local end ::ffff:198.18.0.1 must match the
    pod's IPv4 address, in the kernel filter and in the user-side attribution."""
    pod_uid = uuid.uuid4().hex
    pod_cg = make_cgroup()
    pod_dir = pod_cg / f"pod{pod_uid}"
    pod_dir.mkdir()
    pods = tmp_path / "pods.json"
    pods.write_text(json.dumps({"node": "test-node", "cgroup_root": str(pod_cg), "pods": [
        {"name": "w-0", "namespace": "ml", "uid": pod_uid, "ips": [ADDRS[4][0]]}]}))
    t = trace("--pods", str(pods), "--probes", "tcp")
    to = f"::ffff:{ADDRS[4][1]}" if mapped else None
    outside, port = client(lossy_link, 4, to=to)   # not in the pod's cgroup, but uses its address
    assert outside.wait(60) == 0
    t.stop()
    pod_dir.rmdir()
    rows = t.query("SELECT pid, owner_source, pod, namespace, sport FROM tcp_events "
                   "WHERE event = 'tcp_retransmit_skb'")
    assert rows and set(rows) == {(None, "address", "w-0", "ml", port)}


PASSIVE_PORT = 5002


@pytest.mark.parametrize("hide_length_tracepoints", [False, True], ids=["sock_length", "rcv_space_adjust"])
def test_an_accepted_connection_gets_its_owner_from_the_reading_task(
        lossy_link, trace, make_cgroup, monkeypatch, hide_length_tracepoints):
    """The server (in the target cgroup) only accepts and reads; the client is outside.
    Its connection's later state changes (softirq) carry the server as owner: from
    sock_recv_length, or on kernels without it (hidden here) from tcp_rcv_space_adjust."""
    from ingero_agent.probes import tracepoint_format
    if tracepoint_format("tcp/tcp_rcv_space_adjust") is None:
        pytest.skip("this kernel has no tcp:tcp_rcv_space_adjust")
    if hide_length_tracepoints:
        monkeypatch.setenv("INGERO_HIDE_TRACEPOINTS", "sock/sock_send_length,sock/sock_recv_length")
    server_ns = lossy_link.replace("ingA", "ingB")
    cg = make_cgroup()
    t = trace("--cgroup", str(cg), "--probes", "tcp")
    srv = spawn(["ip", "netns", "exec", server_ns, sys.executable, "-c", SERVER, ADDRS[4][1],
                 str(PASSIVE_PORT)], cg)
    try:
        assert srv.stdout.readline().strip() == "listening"
        cli = subprocess.Popen(["ip", "netns", "exec", lossy_link, sys.executable, "-c", CLIENT,
                                ADDRS[4][1], str(PASSIVE_PORT)], stdout=subprocess.PIPE, text=True)
        assert cli.wait(60) == 0
        import time
        time.sleep(0.5)
    finally:
        srv.kill()
        srv.wait()
    t.stop()
    rows = t.query("SELECT DISTINCT pid, owner_source FROM tcp_events WHERE sport = ?", [PASSIVE_PORT])
    assert (srv.pid, "socket") in rows, rows
