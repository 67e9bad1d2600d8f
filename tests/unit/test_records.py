"""records.py dtypes must match the structs in bpf/ingero.h field by field.

The header is compiled with the system C compiler, which prints every field's
offset and size; any drift (a field added, moved or resized on one side only)
fails here.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ingero.families import RINGS
from ingero_agent.records import RECORDS, ringbuf_dtype

HEADER = Path(__file__).resolve().parents[2] / "bpf" / "ingero.h"


def struct_fields(struct: str) -> list[str]:
    """Field names of `struct <name> { ... };` in the header."""
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)
    body = re.search(r"struct\s+" + struct + r"\s*\{(.*?)\};", text, re.S).group(1)
    return re.findall(r"(\w+)\s*(?:\[\s*\w+\s*\])?\s*;", body)


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory):
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: cannot compile bpf/ingero.h to read its layout")
    lines = []
    for struct in RECORDS:
        lines.append(f'printf("{struct} SIZE %zu 0\\n", sizeof(struct {struct}));')
        for f in struct_fields(struct):
            lines.append(f'printf("{struct} {f} %zu %zu\\n", offsetof(struct {struct}, {f}), '
                         f'sizeof(((struct {struct} *)0)->{f}));')
    src = tmp_path_factory.mktemp("layout") / "layout.c"
    src.write_text("#include <linux/types.h>\n#include <stddef.h>\n#include <stdio.h>\n"
                   f'#include "{HEADER}"\nint main(void) {{\n' + "\n".join(lines) + "\nreturn 0;\n}\n")
    exe = src.with_suffix("")
    subprocess.run(["gcc", "-Wall", "-Werror", "-o", str(exe), str(src)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    layout: dict[str, dict[str, tuple[int, int]]] = {}
    for line in out.splitlines():
        struct, field, off, size = line.split()
        layout.setdefault(struct, {})[field] = (int(off), int(size))
    return layout


@pytest.mark.parametrize("struct,dtype", list(RECORDS.items()))
def test_dtype_has_every_header_field_at_the_same_offset_and_size(c_layout, struct, dtype):
    c = c_layout[struct]
    assert dtype.itemsize == c["SIZE"][0]
    c_fields = {k: v for k, v in c.items() if k != "SIZE"}
    assert set(dtype.names) == set(c_fields)
    for name, (off, size) in c_fields.items():
        ftype, foff = dtype.fields[name][:2]
        assert (foff, ftype.itemsize) == (off, size), name


@pytest.mark.parametrize("ring", list(RINGS))
def test_records_are_multiples_of_8_so_ring_records_pack_without_gaps(ring):
    dtype = RECORDS[RINGS[ring].struct]
    assert dtype.itemsize % 8 == 0
    assert ringbuf_dtype(dtype).itemsize == dtype.itemsize + 8


def test_nccl_record_round_trips_through_bytes():
    dtype = RECORDS["ingero_nccl_event"]
    rec = np.zeros(1, dtype=dtype)
    rec["comm_hash"] = 0xDEADBEEFCAFEF00D
    rec["rank"] = -1
    rec["op"] = 5
    back = np.frombuffer(rec.tobytes(), dtype=dtype)
    assert int(back["comm_hash"][0]) == 0xDEADBEEFCAFEF00D
    assert int(back["rank"][0]) == -1 and int(back["op"][0]) == 5
