"""The bulk ring reader on real BPF ring buffers: a one-page ring that the
probes overflow must account for every call as either an event or a lost
one, and the mmap reader and bcc's callback reader must decode alike."""

from __future__ import annotations

from ingero_agent.ringbuf import CallbackRing, MappedRing, open_ring

from tests.bpf.conftest import drive, nccl_probes


def test_an_overflowing_ring_counts_every_call_as_event_or_lost(fake_nccl, tmp_path):
    p = nccl_probes(fake_nccl, pages=1)          # 4 KiB: 36 NCCL records
    try:
        assert isinstance(p.rings["nccl"], MappedRing)
        drive(p, fake_nccl, tmp_path, 500)
        got = p.rings["nccl"].read()
        lost = p.lost()["nccl"]
        assert 0 < len(got) < 500 and lost > 0
        assert len(got) + lost == 500 + 19
        # what was kept is the start of the run, in order
        assert got["op"][0] == 10 and (got["ts_ns"][1:] >= got["ts_ns"][:-1]).all()
        # the ring accepts events again once drained
        drive(p, fake_nccl, tmp_path, 3)
        assert len(p.rings["nccl"].read()) == 3 + 19
    finally:
        p.close()


def test_mmap_reader_and_callback_reader_decode_the_same_records(fake_nccl, tmp_path):
    decoded = []
    for force_callback in (False, True):
        p = nccl_probes(fake_nccl, pages=64)
        try:
            ring = open_ring(p.bpf, "nccl_events", 64 * 4096, p.rings["nccl"].record,
                             force_callback=force_callback)
            assert isinstance(ring, CallbackRing if force_callback else MappedRing)
            drv = drive(p, fake_nccl, tmp_path, 20)
            got = ring.read()          # the driver has exited: every record is committed
            assert len(got) == 20 + 19 and (got["pid"] == drv.pid).all()
            decoded.append(got)
        finally:
            p.close()
    fields = ["op", "count", "datatype", "redop", "seq", "rank", "nranks", "comm_hash", "stream", "ret"]
    a, b = decoded
    for f in fields:
        if f != "comm_hash":
            assert a[f].tolist() == b[f].tolist(), f
    # hashes of ids are equal; InitAll's depend on pointer and entry time
    init_all = a["op"] == 11
    assert a["comm_hash"][~init_all].tolist()[:2] == b["comm_hash"][~init_all].tolist()[:2]
