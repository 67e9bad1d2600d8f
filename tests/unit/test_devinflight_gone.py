"""A process that exits while its tables are read: the read ends, nothing is made up or dropped."""

from __future__ import annotations

import numpy as np

from ingero_agent.devinflight import VERSION, Reader, read_all
from ingero_agent.records import (NCCL_PROF_OP, NCCL_PROF_PROXY, NCCL_PROF_TABLE, NCCL_PROF_TABLE_MAGIC,
                                  NCCL_PROF_TABLE_NAME)

PID, START = 4242, 0x10000000     # a sparse file stands in for the memory


def _head(comm_hash: int) -> np.ndarray:
    h = np.zeros(1, NCCL_PROF_TABLE)
    h["magic"], h["size"], h["version"], h["pid"] = NCCL_PROF_TABLE_MAGIC, NCCL_PROF_TABLE.itemsize, VERSION, PID
    h["comm_hash"], h["rank"], h["nranks"] = comm_hash, 0, 2
    h["slots"], h["nslots"], h["off_rec"] = NCCL_PROF_TABLE.itemsize, 0, 0
    h["stride"] = NCCL_PROF_OP.itemsize
    h["proxy"], h["nproxy"], h["proxy_stride"], h["proxy_head"] = NCCL_PROF_TABLE.itemsize, 4, NCCL_PROF_PROXY.itemsize, 3
    return h


LENGTH = NCCL_PROF_TABLE.itemsize + 4 * NCCL_PROF_PROXY.itemsize


def _process(tmp_path, starts: list[int], written: list[int], ring: bool = False):
    """A process with a table mapped at each of `starts`; only the heads at `written` in its
    memory (with `ring`, each followed by its 3 proxy summaries)."""
    d = tmp_path / str(PID)
    d.mkdir()
    (d / "maps").write_text("".join(f"{s:x}-{s + LENGTH:x} rw-s 00000000 00:01 1234 "
                                    f"/memfd:{NCCL_PROF_TABLE_NAME} (deleted)\n" for s in starts))
    entries = np.zeros(3, NCCL_PROF_PROXY)
    entries["seq"] = [1, 2, 3]
    with open(d / "mem", "wb") as f:
        for i, s in enumerate(written):
            f.seek(s)
            f.write(_head(0xabc + i).tobytes() + (entries.tobytes() if ring else b""))


def test_a_proxy_ring_that_reads_empty_ends_the_read(tmp_path):
    """/proc/PID/mem of a process that has exited reads 0 bytes: here, a table whose head
    says 3 summaries were written, and a memory that ends before its ring."""
    _process(tmp_path, [START], [START])
    tables = Reader(tmp_path).read(PID)
    assert [(t["comm_hash"], t["proxies"]) for t in tables] == [(0xabc, [])]


def test_a_process_that_exits_between_its_tables_keeps_its_last_open_rows_and_gives_its_summaries(tmp_path):
    """Its maps list two tables and its memory ends before the second: the first alone as its
    open operations would drop those open in the second (the caller keeps the last whole
    read); the first's proxy summaries, drained by the read, are still written."""
    second = START + 0x100000
    _process(tmp_path, [START, second], [START], ring=True)
    tables = Reader(tmp_path).read(PID)
    assert [(t["comm_hash"], t["partial"], len(t["proxies"])) for t in tables] == [(0xabc, True, 3)]
    opens, proxy = read_all(Reader(tmp_path), [PID], 0, 1, lambda pid: 0)
    assert opens == {} and len(proxy) == 3
