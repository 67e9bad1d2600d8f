"""The one-source tables agree with what they describe: bpf/ingero.h's codes, the BPF files of
each probe family, the CRD's probes, and NCCL's nccl.h."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from ingero import families, schema
from ingero.families import FAMILIES, RINGS
from ingero_agent import decode, records

ROOT = Path(__file__).resolve().parents[2]
BPF = ROOT / "bpf"


def defines(path: Path) -> dict[str, int]:
    """name -> value of each `#define NAME <integer>` in a C file."""
    text = re.sub(r"/\*.*?\*/", "", path.read_text(), flags=re.S)
    return {m[1]: int(m[2], 0) for m in re.finditer(r"^#define\s+(\w+)\s+(0x[0-9a-fA-F]+|\d+)(?:ULL|U)?\s*$",
                                                    text, re.M)}


HEADER = defines(BPF / "ingero.h")


def prefixed(prefix: str) -> dict[str, int]:
    return {k.removeprefix(prefix): v for k, v in HEADER.items() if k.startswith(prefix)}


def test_op_codes_are_the_headers():
    assert prefixed("OP_") == {o.name: o.value for o in schema.Op}


def test_flags_and_small_enums_are_the_headers():
    assert {k: v for k, v in prefixed("NCCL_F_").items()} == {
        "IN_GROUP": records.NCCL_F_IN_GROUP, "COMM_UNKNOWN": records.NCCL_F_COMM_UNKNOWN,
        "BCAST_ALIAS": records.NCCL_F_BCAST_ALIAS, "PENDING": records.NCCL_F_PENDING}
    assert prefixed("NCCL_PROF_F_") == {"UNFINISHED": records.NCCL_PROF_F_UNFINISHED,
                                        "STREAM": records.NCCL_PROF_F_STREAM}
    assert (HEADER["NCCL_PROF_COLL"], HEADER["NCCL_PROF_P2P"]) == (records.NCCL_PROF_COLL, records.NCCL_PROF_P2P)
    assert (HEADER["NCCL_SUCCESS"], HEADER["NCCL_IN_PROGRESS"]) == schema.NCCL_OK_RETS
    assert {v: k.lower() for k, v in prefixed("OWNER_").items()} == {
        c: n for c, n in records.OWNER_SOURCES.items() if c < records.OWNER_ADDRESS}
    assert {v: k.lower() for k, v in prefixed("OFFCPU_").items()} == schema.OFFCPU_REASONS
    assert set(prefixed("TCP_EV_").values()) == set(schema.TCP_EVENTS)
    assert {v: k.lower() for k, v in prefixed("NCCL_PROXY_NET_").items()} == records.PROXY_NETS
    assert HEADER["NCCL_PROXY_WAITS"] == len(records.PROXY_WAITS)
    assert HEADER["INGERO_NCCL_PROF_TABLE_MAGIC"] == records.NCCL_PROF_TABLE_MAGIC


def test_lost_slots_are_the_headers():
    assert prefixed("LOST_") == {**{r.upper(): ring.lost_slot for r, ring in RINGS.items()},
                                 "SLOTS": len(RINGS)}


@pytest.mark.parametrize("ring", list(RINGS))
def test_every_ring_has_its_bpf_file_record_decoder_and_table(ring):
    r = RINGS[ring]
    src = (BPF / r.source).read_text()
    assert re.search(rf"BPF_RINGBUF_OUTPUT\({r.table},", src), f"bpf/{r.source} declares no ring {r.table}"
    assert f"struct {r.struct}" in (BPF / "ingero.h").read_text()
    assert r.struct in records.RECORDS
    assert decode.DECODERS[ring].__module__ == decode.__name__
    assert r.table in schema.TABLES and r.table in schema.EVENT_TABLES
    assert {f"events_{ring}", f"lost_{ring}"} <= set(schema.NODES.column_names)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_tracepoint_of_a_family_is_hooked_in_its_bpf_files(family):
    f = FAMILIES[family]
    src = "".join((BPF / r.source).read_text() for r in f.rings)
    for tp in f.required_tracepoints + tuple(tp for tp, _ in f.optional_tracepoints):
        category, event = tp.split("/")
        # one hook for both kinds, or a raw and a perf-event tracepoint
        assert (f"INGERO_TRACEPOINT({category}, {event})" in src
                or f"RAW_TRACEPOINT_PROBE({event})" in src and f"TRACEPOINT_PROBE({category}, {event})" in src), tp
    for _, flag in f.optional_tracepoints:
        assert re.search(rf"^#(el)?if .*\b{flag}\b", src, re.M), flag
    for flag, _, _ in f.raw_tp_fields:
        assert flag in src, flag


def test_no_decoder_without_a_ring():
    assert set(decode.DECODERS) == set(RINGS)
    assert families.rings_of(("tcp", "nccl")) == FAMILIES["nccl"].rings + FAMILIES["tcp"].rings


@pytest.mark.parametrize("crd", [ROOT / "crds" / "tracesession.yaml",
                                 ROOT / "charts" / "ingero" / "crds" / "tracesession.yaml"])
def test_the_crds_probes_are_the_families(crd):
    doc = yaml.safe_load(crd.read_text())
    probes = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["probes"]
    assert probes["items"]["enum"] == list(families.NAMES)
    assert probes["default"] == list(families.NAMES)


# What Ingero relies on in NCCL's nccl.h: NVIDIA/nccl, src/nccl.h.in, tag v2.30.7-1.
NCCL_H_FUNCTIONS = {
    "ncclAllGather", "ncclAllReduce", "ncclAlltoAll", "ncclBcast", "ncclBroadcast", "ncclCommAbort",
    "ncclCommDestroy", "ncclCommGrow", "ncclCommInitAll", "ncclCommInitRank", "ncclCommInitRankConfig",
    "ncclCommInitRankScalable", "ncclCommShrink", "ncclCommSplit", "ncclGather", "ncclGroupEnd",
    "ncclGroupSimulateEnd", "ncclGroupStart", "ncclRecv", "ncclReduce", "ncclReduceScatter", "ncclScatter",
    "ncclSend",
}
NCCL_H_DATATYPES = {   # ncclDataType_t, without its aliases (ncclChar, ncclInt, ncclHalf, ncclFloat, ncclDouble)
    "ncclInt8": 0, "ncclUint8": 1, "ncclInt32": 2, "ncclUint32": 3, "ncclInt64": 4, "ncclUint64": 5,
    "ncclFloat16": 6, "ncclFloat32": 7, "ncclFloat64": 8, "ncclBfloat16": 9, "ncclFloat8e4m3": 10,
    "ncclFloat8e5m2": 11,
}
NCCL_H_REDOPS = {"ncclSum": 0, "ncclProd": 1, "ncclMax": 2, "ncclMin": 3, "ncclAvg": 4}   # ncclRedOp_t
NCCL_H_RESULTS = {"ncclSuccess": 0, "ncclInProgress": 7}   # ncclResult_t


def test_every_recorded_function_is_ncclhs_and_hooked():
    recorded = {fn for fns in schema.NCCL_FUNCTIONS.values() for fn in fns}
    assert set(schema.NCCL_FUNCTIONS) == set(schema.Op)
    assert recorded == NCCL_H_FUNCTIONS
    nccl_c = (BPF / "nccl.c").read_text()
    for fn in recorded:
        assert re.search(rf"\bnccl_enter_{fn}\(", nccl_c), fn


def test_datatypes_redops_and_results_are_ncclhs():
    assert {f"nccl{n[0].upper()}{n[1:]}": c for c, (n, _) in schema.NCCL_DATATYPES.items()} == NCCL_H_DATATYPES
    assert {f"nccl{n.title()}": c for c, n in schema.NCCL_REDOPS.items()} == NCCL_H_REDOPS
    assert schema.NCCL_OK_RETS == (NCCL_H_RESULTS["ncclSuccess"], NCCL_H_RESULTS["ncclInProgress"])
