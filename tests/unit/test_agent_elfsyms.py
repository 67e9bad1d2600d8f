"""The ELF dynamic-symbol check that decides what counts as an NCCL library."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from ingero_agent.elfsyms import NotElf, defined_symbols, nccl_symbols


def _build(tmp: Path, name: str, body: str, extra=()) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: cannot build fixture ELF files")
    src = tmp / (name + ".c")
    src.write_text(body)
    out = tmp / name
    subprocess.run(["gcc", "-fPIC", "-o", str(out), str(src), *extra], check=True)
    return out


def test_defined_functions_are_found_with_their_addresses(tmp_path):
    lib = _build(tmp_path, "libnccl.so.2",
                 "int ncclAllReduce(void){return 0;}\nint ncclGroupStart(void){return 1;}\n",
                 ["-shared"])
    syms = defined_symbols(lib)
    assert set(syms) == {"ncclAllReduce", "ncclGroupStart"}
    assert syms["ncclAllReduce"] != syms["ncclGroupStart"] and all(syms.values())


def test_a_program_that_only_calls_nccl_does_not_count(tmp_path):
    lib = _build(tmp_path, "libnccl.so", "int ncclAllReduce(void){return 0;}\n", ["-shared"])
    exe = _build(tmp_path, "caller", "int ncclAllReduce(void);\nint main(void){return ncclAllReduce();}\n",
                 [f"-L{tmp_path}", "-l:libnccl.so"])
    assert nccl_symbols(lib) and nccl_symbols(exe) == {}


def test_a_name_that_only_ends_in_ncclAllReduce_does_not_count(tmp_path):
    # The string table may share "ncclAllReduce" as the tail of "pncclAllReduce".
    lib = _build(tmp_path, "libp.so", "int pncclAllReduce(void){return 0;}\n", ["-shared"])
    assert nccl_symbols(lib) == {}


def test_aliases_report_the_same_address(tmp_path):
    lib = _build(tmp_path, "liba.so",
                 "int pncclSend(void){return 0;}\n"
                 "int ncclSend(void) __attribute__((alias(\"pncclSend\")));\n"
                 "int ncclAllReduce(void){return 1;}\n", ["-shared"])
    syms = defined_symbols(lib)
    assert "ncclSend" in syms and nccl_symbols(lib)["ncclSend"] == syms["ncclSend"]


def test_non_elf_files_are_rejected(tmp_path):
    f = tmp_path / "libnccl.so"
    f.write_text("not an ELF file at all, just text that is long enough" * 3)
    with pytest.raises(NotElf):
        defined_symbols(f)
    assert nccl_symbols(f) == {}
    assert nccl_symbols(tmp_path / "missing.so") == {}
