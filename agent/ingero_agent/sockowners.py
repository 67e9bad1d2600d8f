"""Which target process holds a TCP connection, from /proc, for events the kernel gave no owner.

A retransmit runs in softirq context and, on kernels without the
``sock_send_length``/``sock_recv_length`` tracepoints, an accepted connection
may never be seen in its owner's process context: such a row has the
connection's four addresses and no pid. ``SocketOwners.resolve`` finds the
owner the way ``ss -p`` does:

1. group the target processes by network namespace (``/proc/<pid>/ns/net``);
2. read that namespace's ``net/tcp`` and ``net/tcp6`` through one of its
   members (``/proc/<pid>/net/tcp*`` is the table of the namespace ``pid``
   is in) and keep the entries whose local and remote address:port are a
   wanted connection: their socket inode;
3. list the ``/proc/<pid>/fd`` links of the namespace's target processes
   for ``socket:[inode]``.

Only the target processes are read, and only when a batch holds connections
that are not cached: one pass per batch for all its connections together,
never one per row. Addresses are compared with IPv4-mapped IPv6 addresses
(``::ffff:a.b.c.d``, a dual-stack socket talking IPv4, listed in ``tcp6``)
folded to IPv4, so either form finds the other.

A connection that is closed by the time of the scan (its rows drained after
its close), an accepted one that no ``accept()`` has taken yet (inode 0) and
one held by no target process are not found: the caller falls back to the
address. Results are cached per connection and kernel socket (``skaddr``, so
a later connection reusing the same four addresses is looked up again);
found owners are kept up to a bound (least recently used dropped first),
misses for ``miss_ttl_s`` so a socket the targets do not hold costs one scan
per that period, not one per drain.
"""

from __future__ import annotations

import os
import sys
import time
from collections import OrderedDict
from pathlib import Path

PROC = Path("/proc")
AF_INET, AF_INET6 = 2, 10
_MAPPED_PREFIX = bytes(10) + b"\xff\xff"

# (local address, local port, remote address, remote port); addresses as 4 or 16 bytes,
# IPv4-mapped IPv6 folded to 4
Conn = tuple[bytes, int, bytes, int]


def fold_address(raw: bytes, family: int) -> bytes:
    """An address of a record's 16 bytes as 4 bytes (IPv4, also IPv4-mapped IPv6) or 16."""
    if family == AF_INET:
        return bytes(raw[:4])
    raw = bytes(raw[:16])
    return raw[12:] if raw.startswith(_MAPPED_PREFIX) else raw


def parse_proc_address(text: str) -> tuple[bytes, int]:
    """(folded address, port) of a /proc/net/tcp{,6} field such as ``0100007F:C660``.

    The kernel prints the address as 32-bit words in host byte order
    (``%08X`` of each ``__be32``), the port as a number.
    """
    addr, _, port = text.partition(":")
    raw = bytes.fromhex(addr)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
    return fold_address(raw, AF_INET if len(raw) == 4 else AF_INET6), int(port, 16)


def read_tcp_table(proc: Path, pid: int, wanted: set[Conn]) -> dict[Conn, int] | None:
    """{connection: socket inode} of the wanted connections in the TCP tables of `pid`'s
    network namespace (inode 0: not attached to a file, e.g. accepted but not yet taken
    by accept(), or orphaned while closing); None when the tables cannot be read."""
    found: dict[Conn, int] = {}
    ports = {"%04X" % c[1] for c in wanted}   # a node's table may be long: parse only likely lines
    ok = False
    for name in ("tcp", "tcp6"):
        try:
            with open(proc / str(pid) / "net" / name, encoding="ascii", errors="replace") as f:
                next(f, None)   # header
                for line in f:
                    fields = line.split()
                    if len(fields) < 10 or fields[1][-4:] not in ports:
                        continue
                    local, lport = parse_proc_address(fields[1])
                    remote, rport = parse_proc_address(fields[2])
                    conn = (local, lport, remote, rport)
                    if conn in wanted:
                        inode = int(fields[9])
                        if inode or conn not in found:   # a live socket beats a lingering one
                            found[conn] = inode
            ok = True
        except (OSError, ValueError):
            continue
    return found if ok else None


def socket_inodes(proc: Path, pid: int) -> set[int] | None:
    """The socket inodes among `pid`'s open files (none when it is gone); None when its
    fds may not be read: /proc/<pid>/fd is mode 0500, so another user's process needs
    CAP_DAC_READ_SEARCH, which the agent is not given."""
    fd_dir = proc / str(pid) / "fd"
    try:
        names = os.listdir(fd_dir)
    except PermissionError:
        return None
    except OSError:
        return set()
    out = set()
    for n in names:
        try:
            link = os.readlink(fd_dir / n)
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(int(link[8:-1]))
    return out


def netns_of(proc: Path, pid: int) -> int | None:
    try:
        return os.stat(proc / str(pid) / "ns" / "net").st_ino
    except OSError:
        return None


class SocketOwners:
    """Connection -> pids of the target processes that hold it, cached (see the module doc)."""

    def __init__(self, proc: Path = PROC, max_entries: int = 4096, miss_ttl_s: float = 10.0,
                 clock=time.monotonic):
        self.proc = Path(proc)
        self.max_entries = max_entries   # found owners kept; a drain batch names far fewer
        self.miss_ttl_s = miss_ttl_s     # a connection not found is looked up again after this
        self.clock = clock
        self._found: OrderedDict[tuple, tuple[int, ...]] = OrderedDict()
        self._missed: OrderedDict[tuple, float] = OrderedDict()
        self.scans = 0        # passes over /proc (one per batch with uncached connections)
        self.looked_up = 0    # connections looked for in those passes
        self.denied: set[int] = set()   # target pids whose fds could not be read
        self.notes: list[str] = []      # for the log, once per such pid (take_notes)

    def take_notes(self) -> list[str]:
        notes, self.notes = self.notes, []
        return notes

    def resolve(self, keys: list[tuple[int, Conn]], pids) -> dict[tuple[int, Conn], tuple[int, ...]]:
        """{(skaddr, connection): holder pids, sorted} of the `keys` some target in `pids`
        holds; a key not found is absent."""
        out: dict[tuple[int, Conn], tuple[int, ...]] = {}
        todo: list[tuple[int, Conn]] = []
        now = self.clock()
        for key in keys:
            got = self._found.get(key)
            if got is not None:
                self._found.move_to_end(key)
                out[key] = got
            elif key in self._missed and now - self._missed[key] < self.miss_ttl_s:
                continue
            else:
                todo.append(key)
        if not todo:
            return out
        holders = self._scan({conn for _, conn in todo}, pids)
        for key in todo:
            got = holders.get(key[1])
            if got:
                out[key] = got
                self._found[key] = got
                self._missed.pop(key, None)
            else:
                self._missed[key] = now
                self._missed.move_to_end(key)
        while len(self._found) > self.max_entries:
            self._found.popitem(last=False)
        while len(self._missed) > self.max_entries:
            self._missed.popitem(last=False)
        return out

    def _scan(self, wanted: set[Conn], pids) -> dict[Conn, tuple[int, ...]]:
        self.scans += 1
        self.looked_up += len(wanted)
        by_ns: dict[int, list[int]] = {}
        for pid in sorted(set(pids)):
            ns = netns_of(self.proc, pid)
            if ns is not None:
                by_ns.setdefault(ns, []).append(pid)
        holders: dict[Conn, list[int]] = {}
        for members in by_ns.values():
            table = None
            for pid in members:   # the table through any member that can still be read
                table = read_tcp_table(self.proc, pid, wanted)
                if table is not None:
                    break
            inode_conn = {ino: conn for conn, ino in (table or {}).items() if ino}
            if not inode_conn:
                continue
            for pid in members:
                inodes = socket_inodes(self.proc, pid)
                if inodes is None:
                    if pid not in self.denied:
                        self.denied.add(pid)
                        self.notes.append(
                            f"cannot read /proc/{pid}/fd (another user's process; the agent has no "
                            f"CAP_DAC_READ_SEARCH): its TCP rows without a kernel owner are matched "
                            f"by address only")
                    continue
                for ino in inodes & inode_conn.keys():
                    holders.setdefault(inode_conn[ino], []).append(pid)
        return {conn: tuple(sorted(p)) for conn, p in holders.items()}
