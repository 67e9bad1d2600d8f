"""Records to columns: names, bytes = count x datatype size, NULLs where a
field does not apply, wall-clock times, and rank/pod enrichment (TCP by
socket owner, else by target pod address)."""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

from ingero.store import to_arrow
from ingero.store import dict_column
from ingero_agent.decode import (Identity, Registry, mono_to_wall, nccl_columns, nccl_profiler_columns,
                                 sched_columns, tcp_columns)
from ingero_agent.records import NCCL_EVENT, NCCL_PROF_EVENT, SCHED_EVENT, TCP_EVENT


def _col(table: str, cols: dict, name: str) -> list:
    return to_arrow(table, cols).column(name).to_pylist()


def test_dict_column_maps_codes_and_turns_unknown_codes_into_null():
    col = dict_column(np.array([1, 0, 7, -1, 2]), {1: "a", 2: "b", 5: None})
    assert col.to_pylist() == ["a", None, None, None, "b"]
    assert None not in col.dictionary.to_pylist()


def test_nccl_columns_compute_bytes_and_null_out_fields_that_do_not_apply():
    a = np.zeros(3, dtype=NCCL_EVENT)
    a["op"] = [1, 6, 10]                 # ALL_REDUCE, SEND, COMM_INIT_RANK
    a["count"] = [1000, 10, 0]
    a["datatype"] = [7, 6, 0]            # float32, float16
    a["redop"] = [0, 0, 0]
    a["peer"] = [-1, 3, -1]
    a["rank"] = [2, 2, 2]
    a["flags"] = [0, 1, 0]
    a["ts_ns"] = 1000
    a["pid"] = 50
    reg = Registry()
    reg.by_pid[50] = Identity(rank=9, pod="w-2", namespace="ml")
    cols = nccl_columns(a, offset_ns=5_000, reg=reg)
    t = "nccl_events"
    assert _col(t, cols, "op") == ["ALL_REDUCE", "SEND", "COMM_INIT_RANK"]
    assert _col(t, cols, "bytes") == [4000, 20, None]
    assert _col(t, cols, "datatype") == ["float32", "float16", None]
    assert _col(t, cols, "reduce_op") == ["sum", None, None]
    assert _col(t, cols, "peer") == [None, 3, None]
    assert _col(t, cols, "in_group") == [False, True, False]
    assert _col(t, cols, "timestamp_ns") == [6000] * 3 and _col(t, cols, "ts_mono_ns") == [1000] * 3
    assert _col(t, cols, "rank") == [2, 2, 2]            # the communicator rank from the kernel
    assert _col(t, cols, "global_rank") == [9, 9, 9]     # the process's torchrun RANK
    assert _col(t, cols, "pod") == ["w-2"] * 3


def test_profiler_columns_name_ops_and_types_like_nccl_events_and_null_what_the_device_did_not_say():
    a = np.zeros(4, dtype=NCCL_PROF_EVENT)
    a["func"] = [b"AllReduce", b"Recv", b"Broadcast", b"PutSignal"]
    a["datatype"] = [b"ncclFloat32", b"ncclBfloat16", b"ncclInt8", b"Unknown"]
    a["comm_name"] = [b"dp", b"dp", b"", b"dp"]
    a["algo"] = [b"RING", b"", b"TREE", b""]
    a["pid"] = 50
    o = a["op"]
    o["kind"] = [1, 2, 1, 1]
    o["count"] = [1000, 10, 33, 5]
    o["peer"] = [0, 3, 2, 0]                       # AllReduce's root means nothing
    o["seq"] = [7, 2, 8, 2**64 - 1]
    o["host_start_ns"] = 1000
    o["host_stop_ns"] = [1500, 1200, 0, 1100]
    o["dev_start_ns"] = [4000, 3000, 0, 2000]
    o["dev_stop_ns"] = [9000, 3500, 0, 0]
    o["dev_start_raw"] = [10**18, 10**18 + 7, 0, 5]
    o["dev_stop_raw"] = [10**18 + 5000, 10**18 + 507, 0, 0]
    o["flags"] = [0, 0, 0, 1]
    cols = nccl_profiler_columns(a, offset_ns=100, reg=Registry())
    t = "nccl_profiler_events"
    assert _col(t, cols, "op") == ["ALL_REDUCE", "RECV", "BROADCAST", "PUT_SIGNAL"]
    assert _col(t, cols, "datatype") == ["float32", "bfloat16", "int8", "unknown"]
    assert _col(t, cols, "bytes") == [4000, 20, 33, None]
    assert _col(t, cols, "peer") == [None, 3, 2, None]
    assert _col(t, cols, "seq") == [7, 2, 8, None]
    assert _col(t, cols, "comm_name") == ["dp", "dp", None, "dp"]
    assert _col(t, cols, "algo") == ["RING", None, "TREE", None]
    assert _col(t, cols, "timestamp_ns") == [1100] * 4 and _col(t, cols, "ts_mono_ns") == [1000] * 4
    assert _col(t, cols, "host_duration_ns") == [500, 200, None, 100]
    assert _col(t, cols, "device_start_ns") == [4100, 3100, None, 2100]
    assert _col(t, cols, "device_end_ns") == [9100, 3600, None, None]
    assert _col(t, cols, "device_duration_ns") == [5000, 500, None, None]   # in GPU ns, from the raw stamps
    assert _col(t, cols, "unfinished") == [False, False, False, True]


def _tcp(n: int) -> np.ndarray:
    a = np.zeros(n, dtype=TCP_EVENT)
    a["kind"] = 1
    a["state"] = 1
    return a


def test_tcp_rows_are_attributed_to_the_socket_owner_or_the_local_pod_address():
    a = _tcp(4)
    a["family"] = [2, 2, 2, 10]
    v6 = lambda last: [0xFD] + [0] * 14 + [last]            # noqa: E731
    a["saddr"][0, :4], a["daddr"][0, :4] = [10, 0, 0, 1], [10, 0, 0, 2]
    a["saddr"][1, :4], a["daddr"][1, :4] = [10, 0, 0, 2], [192, 0, 2, 1]   # local end is the pod
    a["saddr"][2, :4], a["daddr"][2, :4] = [192, 0, 2, 7], [10, 0, 0, 2]   # only the remote end is
    a["saddr"][3], a["daddr"][3] = v6(1), v6(9)
    a["pid"] = [77, 0, 0, 0]
    a["owner_src"] = [1, 0, 0, 0]
    reg = Registry()
    reg.by_pid[77] = Identity(rank=3, pod="w-3", namespace="ml")
    reg.by_ip["10.0.0.2"] = Identity(rank=4, pod="w-4", namespace="ml")
    reg.by_ip["fd00::1"] = Identity(rank=5, pod="w-5", namespace="ml")
    cols = tcp_columns(a, 0, reg)
    t = "tcp_events"
    assert _col(t, cols, "saddr") == ["10.0.0.1", "10.0.0.2", "192.0.2.7", "fd00::1"]
    assert _col(t, cols, "daddr") == ["10.0.0.2", "192.0.2.1", "10.0.0.2", "fd00::9"]
    assert _col(t, cols, "family") == ["AF_INET", "AF_INET", "AF_INET", "AF_INET6"]
    assert _col(t, cols, "rank") == [3, 4, None, 5]
    assert _col(t, cols, "pod") == ["w-3", "w-4", None, "w-5"]
    assert _col(t, cols, "owner_source") == ["socket", "address", "none", "address"]
    assert _col(t, cols, "pid") == [77, None, None, None]
    assert _col(t, cols, "event") == ["tcp_retransmit_skb"] * 4


def test_sched_columns_name_the_reason_and_keep_runqueue_time():
    a = np.zeros(2, dtype=SCHED_EVENT)
    a["reason"] = [0, 1]
    a["off_ns"] = [5_000_000, 9_000_000]
    a["runq_ns"] = [5_000_000, 100]
    a["pid"] = 8
    cols = sched_columns(a, 0, Registry())
    t = "sched_events"
    assert _col(t, cols, "reason") == ["runqueue", "io"]
    assert _col(t, cols, "duration_ns") == [5_000_000, 9_000_000]
    assert _col(t, cols, "runq_ns") == [5_000_000, 100]
    assert _col(t, cols, "rank") == [None, None]


def test_mono_to_wall_offset_converts_monotonic_to_current_wall_time():
    off, rtt = mono_to_wall()
    assert 0 <= rtt < 50_000_000
    now_wall = time.clock_gettime_ns(time.CLOCK_MONOTONIC) + off
    assert abs(now_wall - time.time_ns()) < 50_000_000
    assert isinstance(dict_column(np.array([0]), ["x"]), pa.DictionaryArray)


def test_an_ipv4_mapped_ipv6_socket_is_attributed_to_the_pod_with_that_ipv4_address():
    a = _tcp(2)
    a["family"] = [10, 10]
    mapped = lambda b: [0] * 10 + [0xFF, 0xFF] + b                # noqa: E731
    a["saddr"][0], a["daddr"][0] = mapped([10, 0, 0, 2]), mapped([10, 0, 0, 3])
    a["saddr"][1], a["daddr"][1] = mapped([10, 0, 0, 9]), mapped([10, 0, 0, 2])   # only remote end
    reg = Registry()
    reg.by_ip["10.0.0.2"] = Identity(rank=4, pod="w-4", namespace="ml")
    cols = tcp_columns(a, 0, reg)
    assert _col("tcp_events", cols, "saddr") == ["::ffff:a00:2", "::ffff:a00:9"]   # as Python formats them
    assert _col("tcp_events", cols, "rank") == [4, None]
    assert _col("tcp_events", cols, "owner_source") == ["address", "none"]
