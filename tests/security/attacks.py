"""What the attacks of tests/security share: a crowd of half-open connections and the memory
figures of a process under attack."""

from __future__ import annotations

import socket
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable


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


def self_signed(d: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key, made in the new folder `d`."""
    d.mkdir()
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(d / "k.pem"), "-out", str(d / "c.pem")], check=True, capture_output=True)
    return d / "c.pem", d / "k.pem"


def throughout(request: Callable[[], int], seconds: float = 3.0, every_s: float = 0.2) -> tuple[set, list[float]]:
    """`request()` (-> an HTTP status) again and again for `seconds`, a pause of `every_s`
    between: (the statuses, each call's milliseconds, sorted); printed as p50 and max."""
    statuses, ms, end = set(), [], time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        statuses.add(request())
        ms.append((time.monotonic() - t0) * 1e3)
        time.sleep(every_s)
    ms.sort()
    print(f"{len(ms)} requests: p50 {statistics.median(ms):.0f} ms, max {ms[-1]:.0f} ms", end="; ")
    return statuses, ms
