"""The per-machine table of where each probed NCCL argument is at entry
(agent/ingero_agent/abi.py), checked against the calling conventions' rules
for EVERY probed function.

On x86-64 the x86-64 entries are also exercised by the real-eBPF tests
(tests/bpf/test_nccl_probes.py). The aarch64 entries can only be checked as a
table here: no aarch64 machine runs these tests, so they are verified against
AAPCS64's rules, not against a running aarch64 process.
"""

from __future__ import annotations

import pytest

from ingero.errors import IngeroError
from ingero_agent import abi
from ingero_agent.elfsyms import NCCL_SYMBOLS


def test_every_probed_symbol_has_a_signature_in_the_table():
    assert set(NCCL_SYMBOLS) == set(abi.SIGNATURES)


def _aapcs64_expected(params):
    """AAPCS64 6.8.2 stage C, integer part: NGRN counts x0..x7; a composite > 16 bytes
    (rule B.4) becomes a pointer to a caller-made copy and is then allocated like a
    pointer; once x0..x7 are used up, 8-byte stack slots from SP in order (C.12..C.16)."""
    ngrn, nsaa, out = 0, 0, {}
    for name, kind in params:
        size = abi.UID_BYTES if kind == abi.UID else 8
        by_ref = kind == abi.UID and size > 16
        if ngrn < 8:
            out[name] = ("x", ngrn, by_ref)
            ngrn += 1
        else:
            out[name] = ("sp", nsaa, by_ref)
            nsaa += 8
    return out


def _sysv_expected(params):
    """x86-64 psABI 3.2.3: INTEGER class takes rdi..r9; a struct > 16 bytes is MEMORY
    (copied onto the stack in argument order, no register); stack from SP+8 at entry."""
    gp, stack, out = 0, 8, {}
    for name, kind in params:
        if kind == abi.UID:                    # 128 bytes > 16: MEMORY
            out[name] = ("copy", stack)
            stack += abi.UID_BYTES
        elif gp < 6:
            out[name] = ("reg", gp)
            gp += 1
        else:
            out[name] = ("sp", stack)
            stack += 8
    return out


@pytest.mark.parametrize("fn", sorted(abi.SIGNATURES))
def test_aarch64_locations_follow_aapcs64_for(fn):
    m = abi.machine("aarch64")
    got = abi.locations(m, abi.SIGNATURES[fn])
    for name, (where, n, by_ref) in _aapcs64_expected(abi.SIGNATURES[fn]).items():
        loc = got[name]
        if where == "x":
            assert loc == abi.Loc("reg_ref" if by_ref else "reg", n)
            assert abi.c_expr(m, loc) == f"((ctx)->regs[{n}])"
        else:
            assert abi.c_expr(m, loc) == f"nccl_stack_word(ctx,{n})"


@pytest.mark.parametrize("fn", sorted(abi.SIGNATURES))
def test_x86_64_locations_follow_the_sysv_psabi_for(fn):
    m = abi.machine("x86_64")
    got = abi.locations(m, abi.SIGNATURES[fn])
    for name, (where, n) in _sysv_expected(abi.SIGNATURES[fn]).items():
        expr = abi.c_expr(m, got[name])
        assert expr == {"reg": f"PT_REGS_PARM{n + 1}(ctx)", "copy": f"(PT_REGS_SP(ctx)+{n})",
                        "sp": f"nccl_stack_word(ctx,{n})"}[where]


def test_the_unique_id_is_a_pointer_in_x2_on_aarch64_and_a_stack_copy_at_sp8_on_x86_64():
    arm = dict(f.split("=", 1) for f in abi.cflags("aarch64"))
    x86 = dict(f.split("=", 1) for f in abi.cflags("x86_64"))
    assert arm["-DARG_ncclCommInitRank_commId"] == "((ctx)->regs[2])"
    assert arm["-DARG_ncclCommInitRank_rank"] == "((ctx)->regs[3])"
    assert arm["-DARG_ncclCommInitRankConfig_config"] == "((ctx)->regs[4])"
    assert x86["-DARG_ncclCommInitRank_commId"] == "(PT_REGS_SP(ctx)+8)"
    assert x86["-DARG_ncclCommInitRank_rank"] == "PT_REGS_PARM3(ctx)"
    # ncclReduce's 7th and 8th arguments: registers on aarch64, stack on x86-64
    assert arm["-DARG_ncclReduce_stream"] == "((ctx)->regs[7])"
    assert x86["-DARG_ncclReduce_stream"] == "nccl_stack_word(ctx,16)"
    assert (arm["-DINGERO_RET_SP_DELTA"], x86["-DINGERO_RET_SP_DELTA"]) == ("0", "8")


def test_a_machine_without_a_table_is_refused_with_the_fix():
    with pytest.raises(IngeroError, match="use --probes tcp,sched"):
        abi.machine("riscv64")
