"""TCP rows the kernel gave no owner (pid 0): the target process holding the connection, found in
/proc with real sockets and processes, else the local address only when one pod and rank have it."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ingero.store import to_arrow
from ingero_agent import sockowners
from ingero_agent.decode import Identity, Registry, tcp_columns
from ingero_agent.probes import ProbeConfig
from ingero_agent.records import TCP_EVENT
from ingero_agent.targets import Pod
from ingero_agent.tracer import TraceOptions, Tracer

# A "rank": connects one TCP socket, says its local port, holds the socket until stdin closes.
RANK = r"""
import socket, sys
s = socket.socket(socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET)
s.connect((sys.argv[1], int(sys.argv[2])))
print(s.getsockname()[1], flush=True)
sys.stdin.read()
"""

# A "rank" that listens: says its port, accepts one connection (the passive end), holds both.
SERVING_RANK = r"""
import socket, sys
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
print("accepted", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def listener():
    """A dual-stack loopback listener (IPv4 clients appear to it as ::ffff:127.0.0.1)."""
    try:
        s = socket.socket(socket.AF_INET6)
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind(("::", 0))
    except OSError as e:
        pytest.skip(f"no dual-stack IPv6 socket here: {e}")
    s.listen(16)
    yield s
    s.close()


@pytest.fixture
def ranks():
    """Start rank processes; each returns (process, its local port). All stopped at the end."""
    procs = []

    def start(host: str = "", port: int = 0, script: str = RANK):
        p = subprocess.Popen([sys.executable, "-c", script, host, str(port)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(p)
        return p, int(p.stdout.readline())
    yield start
    for p in procs:
        if not p.stdin.closed:
            p.stdin.close()
        p.wait(timeout=10)


def _v4(a: str) -> list[int]:
    return list(socket.inet_aton(a))


def _mapped(a: str) -> list[int]:
    return [0] * 10 + [0xFF, 0xFF] + _v4(a)


def _rows(conns: list[tuple[int, list[int], int, list[int], int]], family: int) -> np.ndarray:
    """Owner-less retransmit records (pid 0) of (skaddr, saddr, sport, daddr, dport)."""
    a = np.zeros(len(conns), dtype=TCP_EVENT)
    a["kind"], a["state"], a["family"] = 1, 1, family
    for i, (sk, sa, sp, da, dp) in enumerate(conns):
        a["skaddr"][i], a["sport"][i], a["dport"][i] = sk, sp, dp
        a["saddr"][i, :len(sa)], a["daddr"][i, :len(da)] = sa, da
    return a


def _col(cols: dict, name: str) -> list:
    return to_arrow("tcp_events", cols).column(name).to_pylist()


def test_each_rank_of_a_multi_rank_pod_gets_its_own_owner_less_rows_from_proc(listener, ranks):
    port = listener.getsockname()[1]
    (p0, sp0), (p1, sp1) = ranks("127.0.0.1", port), ranks("127.0.0.1", port)
    accepted = [listener.accept()[0] for _ in range(2)]   # held by this test: not a target
    reg = Registry()
    reg.by_pid[p0.pid] = Identity(0, "w-0", "ml")
    reg.by_pid[p1.pid] = Identity(1, "w-0", "ml")
    reg.by_ip["127.0.0.1"] = Identity(None, "w-0", "ml")   # two ranks: the address names no rank
    lo = _v4("127.0.0.1")
    a = _rows([(0xA0, lo, sp0, lo, port), (0xA1, lo, sp1, lo, port), (0xA0, lo, sp0, lo, port),
               (0xB0, lo, port, lo, sp0)], family=2)   # the listener's end of rank 0's connection
    cols = tcp_columns(a, 0, reg)
    assert _col(cols, "rank") == [0, 1, 0, None]
    assert _col(cols, "pod") == ["w-0"] * 4
    assert _col(cols, "owner_source") == ["proc", "proc", "proc", "address"]
    assert _col(cols, "pid") == [p0.pid, p1.pid, p0.pid, None]   # the holder, from /proc
    assert _col(cols, "tid") == [None] * 4                       # which thread is not known
    for s in accepted:
        s.close()


def test_an_accepted_connection_is_told_from_its_listener_and_its_peer_by_both_ends(ranks):
    server, port = ranks(script=SERVING_RANK)              # rank 0: the passive end
    client, cport = ranks("127.0.0.1", port)               # rank 1 of the same pod: the active end
    assert server.stdout.readline().strip() == "accepted"
    reg = Registry()
    reg.by_pid[server.pid] = Identity(0, "w-0", "ml")
    reg.by_pid[client.pid] = Identity(1, "w-0", "ml")
    reg.by_ip["127.0.0.1"] = Identity(None, "w-0", "ml")
    lo = _v4("127.0.0.1")
    cols = tcp_columns(_rows([(0xA0, lo, port, lo, cport), (0xA1, lo, cport, lo, port)], 2), 0, reg)
    assert _col(cols, "rank") == [0, 1]
    assert _col(cols, "pid") == [server.pid, client.pid]
    assert _col(cols, "owner_source") == ["proc", "proc"]


def test_a_connection_keeps_the_holder_found_while_open_and_one_first_seen_closed_has_its_address(
        listener, ranks):
    port = listener.getsockname()[1]
    (p0, sp0), (p1, sp1) = ranks("127.0.0.1", port), ranks("127.0.0.1", port)
    for _ in range(2):
        listener.accept()[0].close()
    reg = Registry()
    reg.by_pid[p0.pid] = Identity(0, "w-0", "ml")
    reg.by_pid[p1.pid] = Identity(1, "w-0", "ml")
    reg.by_ip["127.0.0.1"] = Identity(None, "w-0", "ml")
    lo = _v4("127.0.0.1")
    assert _col(tcp_columns(_rows([(0xA0, lo, sp0, lo, port)], 2), 0, reg), "rank") == [0]
    for p in (p0, p1):   # both ranks close their connections before the next drain
        p.stdin.close()
        p.wait(timeout=10)
    cols = tcp_columns(_rows([(0xA0, lo, sp0, lo, port), (0xA1, lo, sp1, lo, port)], 2), 0, reg)
    assert _col(cols, "owner_source") == ["proc", "address"]
    assert _col(cols, "rank") == [0, None] and _col(cols, "pod") == ["w-0", "w-0"]
    assert _col(cols, "pid") == [p0.pid, None]


def test_ipv4_mapped_and_plain_ipv4_forms_of_one_connection_find_each_other_in_proc(listener, ranks):
    port = listener.getsockname()[1]
    p4, sp4 = ranks("127.0.0.1", port)          # AF_INET socket: listed in /proc/net/tcp
    p6, sp6 = ranks("::ffff:127.0.0.1", port)   # dual-stack socket talking IPv4: in tcp6, mapped
    accepted = [listener.accept()[0] for _ in range(2)]
    reg = Registry()
    reg.by_pid[p4.pid] = Identity(4, "w-4", "ml")
    reg.by_pid[p6.pid] = Identity(6, "w-6", "ml")
    lo, mlo = _v4("127.0.0.1"), _mapped("127.0.0.1")
    as_v6 = tcp_columns(_rows([(1, mlo, sp4, mlo, port), (2, mlo, sp6, mlo, port)], 10), 0, reg)
    as_v4 = tcp_columns(_rows([(3, lo, sp4, lo, port), (4, lo, sp6, lo, port)], 2), 0, reg)
    for cols in (as_v6, as_v4):
        assert _col(cols, "rank") == [4, 6]
        assert _col(cols, "owner_source") == ["proc", "proc"]
    assert _col(as_v6, "saddr") == ["::ffff:7f00:1"] * 2   # rows keep the kernel's form
    for s in accepted:
        s.close()


def test_proc_is_scanned_once_per_batch_and_connection_not_per_row(listener, ranks):
    port = listener.getsockname()[1]
    (p0, sp0), (p1, sp1) = ranks("127.0.0.1", port), ranks("127.0.0.1", port)
    accepted = [listener.accept()[0] for _ in range(2)]
    reg = Registry()
    reg.by_pid[p0.pid] = Identity(0, "w-0", "ml")
    reg.by_pid[p1.pid] = Identity(1, "w-0", "ml")
    lo = _v4("127.0.0.1")
    a = _rows([(0xA0, lo, sp0, lo, port), (0xA1, lo, sp1, lo, port)] * 500, 2)
    cols = tcp_columns(a, 0, reg)
    assert _col(cols, "rank") == [0, 1] * 500
    assert (reg.sockets.scans, reg.sockets.looked_up) == (1, 2)
    tcp_columns(a, 0, reg)                        # the next drain: both connections are cached
    assert (reg.sockets.scans, reg.sockets.looked_up) == (1, 2)
    gone = _rows([(0xC0, lo, 1, lo, 2)] * 100, 2)  # not held by anyone: looked for once
    tcp_columns(gone, 0, reg)
    tcp_columns(gone, 0, reg)
    assert (reg.sockets.scans, reg.sockets.looked_up) == (2, 3)
    for s in accepted:
        s.close()


def _tracer_with(pods: list[Pod], procs: list[tuple[int, int | None, Pod]]) -> Tracer:
    opts = TraceOptions(segments=Path("/nonexistent"), node="n", session_id="s", probe_config=ProbeConfig())
    t = Tracer(opts, targets=None, log=lambda _m: None)
    t.targets = SimpleNamespace(pods=pods, processes={
        pid: SimpleNamespace(pid=pid, rank=rank, pod=pod) for pid, rank, pod in procs})
    t._update_registry()
    return t


def test_an_address_of_several_pods_or_ranks_names_only_what_they_agree_on():
    node = "10.9.0.1"
    host_a = Pod("host-a", "ml", "ua", ips=(node,))          # two hostNetwork pods: the node's address
    host_b = Pod("host-b", "ml", "ub", ips=(node,))
    multi = Pod("multi", "ml", "um", ips=("10.1.0.5",))       # one pod, two ranks
    single = Pod("single", "ml", "us", ips=("10.1.0.6",))     # one pod, one rank
    t = _tracer_with([host_a, host_b, multi, single],
                     [(900001, 0, host_a), (900002, 1, host_b), (900003, 2, multi),
                      (900004, 3, multi), (900005, 4, single)])
    a = _rows([(1, _v4(node), 5000, _v4("10.9.0.2"), 29500),
               (2, _v4("10.1.0.5"), 5001, _v4("10.9.0.2"), 29500),
               (3, _v4("10.1.0.6"), 5002, _v4("10.9.0.2"), 29500),
               (4, _mapped(node), 5003, _mapped("10.9.0.2"), 29500)], 2)
    a["family"][3] = 10
    cols = tcp_columns(a, 0, t.registry)   # no target process holds these: addresses only
    assert _col(cols, "pod") == [None, "multi", "single", None]   # not the last pod written
    assert _col(cols, "rank") == [None, None, 4, None]
    assert _col(cols, "namespace") == ["ml"] * 4
    assert _col(cols, "owner_source") == ["address-ambiguous", "address-ambiguous", "address",
                                          "address-ambiguous"]


def test_a_target_whose_fds_may_not_be_read_is_noted_once_and_matched_by_address(listener, ranks,
                                                                                  monkeypatch):
    port = listener.getsockname()[1]
    p0, sp0 = ranks("127.0.0.1", port)
    accepted = listener.accept()[0]
    listdir = sockowners.os.listdir

    def denied(path):   # another user's process, the agent without CAP_DAC_READ_SEARCH
        if str(path) == f"/proc/{p0.pid}/fd":
            raise PermissionError(13, "Permission denied", str(path))
        return listdir(path)
    monkeypatch.setattr(sockowners.os, "listdir", denied)
    reg = Registry()
    reg.by_pid[p0.pid] = Identity(0, "w-0", "ml")
    reg.by_ip["127.0.0.1"] = Identity(0, "w-0", "ml")
    lo = _v4("127.0.0.1")
    for sk in (0xA0, 0xA1):   # two batches, two connections: one note
        cols = tcp_columns(_rows([(sk, lo, sp0, lo, port)], 2), 0, reg)
        assert _col(cols, "owner_source") == ["address"] and _col(cols, "rank") == [0]
    notes = reg.sockets.take_notes()
    assert len(notes) == 1 and f"/proc/{p0.pid}/fd" in notes[0] and "by address only" in notes[0]
    accepted.close()
