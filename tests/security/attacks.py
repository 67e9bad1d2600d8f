"""What the attacks of tests/security share: a crowd of half-open connections and the memory
figures of a process under attack."""

from __future__ import annotations

import socket
from pathlib import Path


def half_open(port: int, n: int, first_line: bytes = b"GET /metrics HTTP/1.1\r\n") -> list[socket.socket]:
    """`n` connections that start a request and never finish it (`first_line` b"": that never
    send a byte, e.g. a TLS client that never says hello)."""
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        if first_line:
            s.sendall(first_line)
        out.append(s)
    return out


def vm(pid: int | str, field: str) -> float:
    """A /proc/PID/status field in MiB (VmRSS, VmHWM, VmData)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field}")
