"""Byte offsets of kernel struct fields, read from the running kernel's BTF.

bcc compiles the probes against the kernel headers it finds, which need not
be those of the running kernel (a distribution's headers package of another
version, a container image's). The tracepoints' arguments do not depend on
them, but a field of `struct task_struct` read by the sched probes does: its
offset is taken here from /sys/kernel/btf/vmlinux (the running kernel's own
type information) and handed to the C as a -D flag.

Only what that needs is read: type records are walked once, in order (their
ids are their positions), and a dotted path is resolved through named and
anonymous struct/union members. Format: Documentation/bpf/btf.rst.
"""

from __future__ import annotations

import struct
from pathlib import Path

KERNEL_BTF = Path("/sys/kernel/btf/vmlinux")

_MAGIC = 0xEB9F
_STRUCT, _UNION = 4, 5
_TYPEDEF, _VOLATILE, _CONST, _RESTRICT, _TYPE_TAG = 8, 9, 10, 11, 18
# bytes after the 12-byte common record, by kind: fixed, and per vlen entry
_EXTRA = {1: (4, 0), 3: (12, 0), 4: (0, 12), 5: (0, 12), 6: (0, 8), 13: (0, 8),
          14: (4, 0), 15: (0, 12), 17: (4, 0), 19: (0, 12)}


class BtfError(Exception):
    pass


class Btf:
    def __init__(self, data: bytes):
        if len(data) < 24:
            raise BtfError("too short for a BTF header")
        magic, _ver, _flags, hdr_len = struct.unpack_from("<HBBI", data, 0)
        if magic != _MAGIC:
            raise BtfError("not BTF (or not little-endian)")
        type_off, type_len, str_off, str_len = struct.unpack_from("<IIII", data, 8)
        self.data = data
        self.types_at = hdr_len + type_off
        self.strs_at = hdr_len + str_off
        self.strs_end = self.strs_at + str_len
        self.offsets = [0]          # type id -> where its record starts (id 0: void)
        pos, end = self.types_at, self.types_at + type_len
        unpack = struct.unpack_from
        while pos < end:
            self.offsets.append(pos)
            info = unpack("<I", data, pos + 4)[0]
            fixed, per = _EXTRA.get((info >> 24) & 0x1F, (0, 0))
            pos += 12 + fixed + per * (info & 0xFFFF)

    def name(self, name_off: int) -> str:
        start = self.strs_at + name_off
        return self.data[start:self.data.index(b"\0", start, self.strs_end)].decode()

    def _record(self, tid: int) -> tuple[int, int, int, int]:
        """(name_off, kind, vlen, size_or_type) and the members follow at offsets[tid] + 12."""
        name_off, info, size = struct.unpack_from("<III", self.data, self.offsets[tid])
        return name_off, (info >> 24) & 0x1F, info & 0xFFFF, size

    def find_struct(self, name: str) -> int:
        key = name.encode() + b"\0"
        for tid in range(1, len(self.offsets)):
            name_off, kind, vlen, _ = self._record(tid)
            if kind == _STRUCT and vlen:
                start = self.strs_at + name_off
                if self.data[start:start + len(key)] == key:
                    return tid
        raise BtfError(f"no struct {name}")

    def _strip(self, tid: int) -> int:
        while True:
            _, kind, _, ref = self._record(tid)
            if kind not in (_TYPEDEF, _VOLATILE, _CONST, _RESTRICT, _TYPE_TAG):
                return tid
            tid = ref

    def _member(self, tid: int, name: str) -> tuple[int, int] | None:
        """(bit offset, type id) of member `name` of struct/union tid, looking into
        anonymous members."""
        _, kind, vlen, _ = self._record(tid)
        if kind not in (_STRUCT, _UNION):
            return None
        kflag = struct.unpack_from("<I", self.data, self.offsets[tid] + 4)[0] >> 31
        at = self.offsets[tid] + 12
        for i in range(vlen):
            name_off, mtype, off = struct.unpack_from("<III", self.data, at + 12 * i)
            bits = off & 0xFFFFFF if kflag else off
            if name_off and self.name(name_off) == name:
                return bits, mtype
            if not name_off:
                inner = self._member(self._strip(mtype), name)
                if inner is not None:
                    return bits + inner[0], inner[1]
        return None

    def offset(self, struct_name: str, path: str) -> int:
        """Byte offset of the dotted member path in struct struct_name."""
        tid, bits = self.find_struct(struct_name), 0
        for part in path.split("."):
            m = self._member(self._strip(tid), part)
            if m is None:
                raise BtfError(f"struct {struct_name} has no member {path}")
            bits += m[0]
            tid = m[1]
        if bits % 8:
            raise BtfError(f"{struct_name}.{path} is a bit field")
        return bits // 8


def kernel_offsets(struct_name: str, paths: tuple[str, ...],
                   src: Path = KERNEL_BTF) -> dict[str, int] | None:
    """{path: byte offset} in the running kernel, None without kernel BTF. Raises BtfError
    for a member the kernel does not have."""
    try:
        data = src.read_bytes()
    except OSError:
        return None
    btf = Btf(data)
    return {p: btf.offset(struct_name, p) for p in paths}
