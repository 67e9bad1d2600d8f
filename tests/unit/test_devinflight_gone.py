"""A process that exits while its proxy ring is read: the read ends, nothing is made up."""

from __future__ import annotations

import numpy as np

from ingero_agent.devinflight import VERSION, Reader
from ingero_agent.records import (NCCL_PROF_OP, NCCL_PROF_PROXY, NCCL_PROF_TABLE, NCCL_PROF_TABLE_MAGIC,
                                  NCCL_PROF_TABLE_NAME)

PID, START = 4242, 0x10000000     # a sparse file stands in for the memory


def test_a_proxy_ring_that_reads_empty_ends_the_read(tmp_path):
    """/proc/PID/mem of a process that has exited reads 0 bytes: here, a table whose head
    says 3 summaries were written, and a memory that ends before its ring."""
    h = np.zeros(1, NCCL_PROF_TABLE)
    h["magic"], h["size"], h["version"], h["pid"] = NCCL_PROF_TABLE_MAGIC, NCCL_PROF_TABLE.itemsize, VERSION, PID
    h["comm_hash"], h["rank"], h["nranks"] = 0xabc, 0, 2
    h["slots"], h["nslots"], h["off_rec"] = NCCL_PROF_TABLE.itemsize, 0, 0
    h["stride"] = NCCL_PROF_OP.itemsize
    h["proxy"], h["nproxy"], h["proxy_stride"], h["proxy_head"] = NCCL_PROF_TABLE.itemsize, 4, NCCL_PROF_PROXY.itemsize, 3
    d = tmp_path / str(PID)
    d.mkdir()
    length = NCCL_PROF_TABLE.itemsize + 4 * NCCL_PROF_PROXY.itemsize
    (d / "maps").write_text(f"{START:x}-{START + length:x} rw-s 00000000 00:01 1234 "
                            f"/memfd:{NCCL_PROF_TABLE_NAME} (deleted)\n")
    with open(d / "mem", "wb") as f:          # only the head is there
        f.seek(START)
        f.write(h.tobytes())
    tables = Reader(tmp_path).read(PID)
    assert [(t["comm_hash"], t["proxies"]) for t in tables] == [(0xabc, [])]
