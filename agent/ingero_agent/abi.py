"""Where each probed NCCL argument is at function entry, per machine: a table.

The parameter lists are NVIDIA's (src/nccl.h.in, NCCL 2.30.7); every
parameter is INTEGER-class (int, enum, size_t, pointer) except the 128-byte
`ncclUniqueId` that ncclCommInitRank/ncclCommInitRankConfig take BY VALUE.
From the lists and each machine's calling convention this module computes
the C expression that reads each argument in a uprobe, and hands them to
bpf/nccl.c as -D flags (`ARG_<function>_<parameter>`), so the C has no
per-machine code of its own.

x86-64 (System V psABI 3.2.3): INTEGER arguments take rdi, rsi, rdx, rcx,
r8, r9, then 8-byte stack slots. A struct larger than 16 bytes is class
MEMORY: the caller copies it onto the stack among the stack arguments and it
takes no register. At entry SP holds the return address, so stack slot n
(1-based) is at SP + 8n; at return SP is the entry SP + 8.

aarch64 (AAPCS64 6.8.2, parameter passing rules): INTEGER arguments take
x0..x7 (NGRN), then 8-byte stack slots from SP at entry (the return address
is in the link register, not on the stack, so slot n is at SP + 8(n-1) and
the return SP equals the entry SP). Rule B.4: a composite type larger than
16 bytes (not an HFA/HVA) is copied by the caller to memory and the argument
is replaced by a pointer to the copy, which then takes the next register:
ncclCommInitRank's id is a pointer in x2 and its rank moves to x3.

The aarch64 entries are checked against these rules in
tests/unit/test_agent_abi.py; they have not run on aarch64 hardware here.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

from ingero.errors import IngeroError

UID = "uid"      # ncclUniqueId by value (128 bytes)
INT = "int"      # INTEGER class, one 8-byte register or slot
UID_BYTES = 128

# Parameter lists of every probed function (names as in nccl.h.in).
SIGNATURES: dict[str, tuple[tuple[str, str], ...]] = {
    "ncclAllReduce": (("sendbuff", INT), ("recvbuff", INT), ("count", INT), ("datatype", INT),
                      ("op", INT), ("comm", INT), ("stream", INT)),
    "ncclAllGather": (("sendbuff", INT), ("recvbuff", INT), ("sendcount", INT), ("datatype", INT),
                      ("comm", INT), ("stream", INT)),
    "ncclReduceScatter": (("sendbuff", INT), ("recvbuff", INT), ("recvcount", INT), ("datatype", INT),
                          ("op", INT), ("comm", INT), ("stream", INT)),
    "ncclBroadcast": (("sendbuff", INT), ("recvbuff", INT), ("count", INT), ("datatype", INT),
                      ("root", INT), ("comm", INT), ("stream", INT)),
    "ncclBcast": (("buff", INT), ("count", INT), ("datatype", INT), ("root", INT), ("comm", INT),
                  ("stream", INT)),
    "ncclReduce": (("sendbuff", INT), ("recvbuff", INT), ("count", INT), ("datatype", INT), ("op", INT),
                   ("root", INT), ("comm", INT), ("stream", INT)),
    "ncclSend": (("sendbuff", INT), ("count", INT), ("datatype", INT), ("peer", INT), ("comm", INT),
                 ("stream", INT)),
    "ncclRecv": (("recvbuff", INT), ("count", INT), ("datatype", INT), ("peer", INT), ("comm", INT),
                 ("stream", INT)),
    "ncclAlltoAll": (("sendbuff", INT), ("recvbuff", INT), ("count", INT), ("datatype", INT),
                     ("comm", INT), ("stream", INT)),
    "ncclGather": (("sendbuff", INT), ("recvbuff", INT), ("count", INT), ("datatype", INT),
                   ("root", INT), ("comm", INT), ("stream", INT)),
    "ncclScatter": (("sendbuff", INT), ("recvbuff", INT), ("count", INT), ("datatype", INT),
                    ("root", INT), ("comm", INT), ("stream", INT)),
    "ncclGroupStart": (),
    "ncclGroupEnd": (),
    "ncclGroupSimulateEnd": (("simInfo", INT),),
    "ncclCommInitRank": (("comm", INT), ("nranks", INT), ("commId", UID), ("rank", INT)),
    "ncclCommInitRankConfig": (("comm", INT), ("nranks", INT), ("commId", UID), ("rank", INT),
                               ("config", INT)),
    "ncclCommInitRankScalable": (("newcomm", INT), ("nranks", INT), ("myrank", INT), ("nId", INT),
                                 ("commIds", INT), ("config", INT)),
    "ncclCommInitAll": (("comm", INT), ("ndev", INT), ("devlist", INT)),
    "ncclCommSplit": (("comm", INT), ("color", INT), ("key", INT), ("newcomm", INT), ("config", INT)),
    "ncclCommShrink": (("comm", INT), ("excludeRanksList", INT), ("excludeRanksCount", INT),
                       ("newcomm", INT), ("config", INT), ("shrinkFlags", INT)),
    "ncclCommGrow": (("comm", INT), ("nRanks", INT), ("uniqueId", INT), ("rank", INT), ("newcomm", INT),
                     ("config", INT)),
    "ncclCommDestroy": (("comm", INT),),
    "ncclCommAbort": (("comm", INT),),
}


@dataclass(frozen=True)
class Loc:
    """Where an argument is at entry. kind: 'reg' (register index), 'stack'
    (value in stack slot `index`, 1-based), 'stack_copy' (a by-value struct
    copied at stack slot `index`: the argument's ADDRESS is SP-relative) or
    'reg_ref' (a by-value struct passed as a pointer in register `index`)."""
    kind: str
    index: int


@dataclass(frozen=True)
class Machine:
    name: str
    int_regs: int              # general registers for arguments
    big_struct: str            # how a struct > 16 bytes travels: 'stack_copy' or 'reg_ref'
    first_slot_offset: int     # SP offset of stack slot 1 at entry
    return_sp_delta: int       # SP at return minus SP at entry
    reg_expr: str              # C expression for register i (format with i)


MACHINES = {
    "x86_64": Machine("x86_64", 6, "stack_copy", 8, 8,
                      "PT_REGS_PARM{n}(ctx)"),
    "aarch64": Machine("aarch64", 8, "reg_ref", 0, 0, "((ctx)->regs[{i}])"),
}
ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}


def machine(name: str | None = None) -> Machine:
    m = ALIASES.get(name or platform.machine(), name or platform.machine())
    if m not in MACHINES:
        raise IngeroError(f"the nccl probes know the argument layout of {', '.join(MACHINES)}; this "
                          f"machine is {m}: use --probes tcp,sched")
    return MACHINES[m]


def locations(m: Machine, params: tuple[tuple[str, str], ...]) -> dict[str, Loc]:
    out, reg, slot = {}, 0, 1
    for name, kind in params:
        if kind == UID and m.big_struct == "stack_copy":
            out[name] = Loc("stack_copy", slot)
            slot += UID_BYTES // 8
            continue
        as_reg = "reg_ref" if kind == UID else "reg"
        if reg < m.int_regs:
            out[name] = Loc(as_reg, reg)
            reg += 1
        else:                      # out of registers (a pointer to a copy, too, goes on the stack)
            out[name] = Loc("stack" if kind == INT else "stack_ref", slot)
            slot += 1
    return out


def c_expr(m: Machine, loc: Loc) -> str:
    if loc.kind in ("reg", "reg_ref"):
        return m.reg_expr.format(i=loc.index, n=loc.index + 1)
    off = m.first_slot_offset + 8 * (loc.index - 1)
    if loc.kind == "stack_copy":
        return f"(PT_REGS_SP(ctx)+{off})"
    return f"nccl_stack_word(ctx,{off})"


def cflags(name: str | None = None) -> list[str]:
    """-D flags: ARG_<fn>_<param> for every probed parameter, and the return SP delta.
    For a by-value ncclUniqueId the expression is the id's ADDRESS."""
    m = machine(name)
    flags = [f"-DINGERO_RET_SP_DELTA={m.return_sp_delta}"]
    for fn, params in SIGNATURES.items():
        for p, loc in locations(m, params).items():
            flags.append(f"-DARG_{fn}_{p}={c_expr(m, loc)}")
    return flags
