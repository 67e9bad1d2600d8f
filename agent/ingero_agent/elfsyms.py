"""Which NCCL functions a shared object defines (.dynsym, else .symtab).

NCCL is not always a file called libnccl: PyTorch wheels can link it into
another library (libtorch_cuda.so). What counts is whether a mapped file
*defines* ncclAllReduce & co. in .dynsym; when NCCL is linked statically and
hidden (its functions in .symtab only, not exported), the full symbol table
is read instead and the result says so (`Symbols.from_symtab`): the loader
then attaches by address, as a name lookup of a local symbol is not
guaranteed. The reader memory-maps the file,
walks the section headers to .dynsym and its string table, and compares
names in bulk with numpy, so a 1 GB library costs a few milliseconds.
Only 64-bit little-endian ELF is read (the agent's probes are x86-64).
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from ingero.schema import NCCL_FUNCTIONS

NCCL_SYMBOLS = tuple(f for fs in NCCL_FUNCTIONS.values() for f in fs)
MARKER = "ncclAllReduce"   # a file that defines this one is an NCCL library
PROFILER_MARKER = "ingero_nccl_profiler_version"   # ... and this one Ingero's NCCL profiler plugin

_SHDR = np.dtype([("name", "<u4"), ("type", "<u4"), ("flags", "<u8"), ("addr", "<u8"),
                  ("offset", "<u8"), ("size", "<u8"), ("link", "<u4"), ("info", "<u4"),
                  ("addralign", "<u8"), ("entsize", "<u8")])
_SYM = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"),
                 ("value", "<u8"), ("size", "<u8")])
SHT_SYMTAB, SHT_DYNSYM = 2, 11
STT_FUNC, STT_GNU_IFUNC = 2, 10


class NotElf(ValueError):
    pass


class Symbols(dict):
    """name -> st_value; `from_symtab` when they came from .symtab (not exported); `sizes`:
    name -> st_size (the function's length in bytes)."""
    from_symtab: bool = False

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.sizes: dict[str, int] = {}


def defined_symbols(path: str | os.PathLike, wanted: tuple[str, ...] = NCCL_SYMBOLS) -> dict[str, int]:
    """name -> st_value for each of `wanted` that `path` defines as a function.

    Raises NotElf for files that are not 64-bit little-endian ELF, OSError
    when the file cannot be read.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 64:
            raise NotElf(f"{path}: too small for ELF")
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            return _scan(m, size, wanted, path)


def _scan(m: mmap.mmap, size: int, wanted: tuple[str, ...], path) -> Symbols:
    if m[:4] != b"\x7fELF" or m[4] != 2 or m[5] != 1:
        raise NotElf(f"{path}: not a 64-bit little-endian ELF file")
    buf = np.frombuffer(m, dtype=np.uint8)
    try:
        shoff = int(buf[0x28:0x30].view("<u8")[0])
        shentsize = int(buf[0x3A:0x3C].view("<u2")[0])
        shnum = int(buf[0x3C:0x3E].view("<u2")[0])
        if shentsize != _SHDR.itemsize or shoff + shnum * shentsize > size or not shnum:
            return Symbols()
        shdrs = buf[shoff:shoff + shnum * shentsize].view(_SHDR)
        found = _table(m, buf, size, shdrs, SHT_DYNSYM, wanted)
        if MARKER in wanted and MARKER not in found:
            local = _table(m, buf, size, shdrs, SHT_SYMTAB, wanted)
            if MARKER in local:
                local.from_symtab = True
                return local
        return found
    finally:
        del buf


def _table(m, buf, size: int, shdrs, kind_wanted: int, wanted: tuple[str, ...]) -> Symbols:
    found = Symbols()
    for dynsym in shdrs[shdrs["type"] == kind_wanted]:
        strtab = shdrs[int(dynsym["link"])]
        s0, sn = int(strtab["offset"]), int(strtab["size"])
        y0, yn = int(dynsym["offset"]), int(dynsym["size"])
        if s0 + sn > size or y0 + yn > size:
            continue
        syms = buf[y0:y0 + yn - yn % _SYM.itemsize].view(_SYM)
        strs = m[s0:s0 + sn]
        kind = syms["info"] & 0xF
        defined = (syms["shndx"] != 0) & ((kind == STT_FUNC) | (kind == STT_GNU_IFUNC))
        for name in wanted:
            offsets = _occurrences(strs, name.encode() + b"\0")
            if not offsets:
                continue
            hit = defined & np.isin(syms["name"], offsets)
            if hit.any():
                i = np.argmax(hit)
                found[name], found.sizes[name] = int(syms["value"][i]), int(syms["size"][i])
    return found


_PHDR = np.dtype([("type", "<u4"), ("flags", "<u4"), ("offset", "<u8"), ("vaddr", "<u8"),
                  ("paddr", "<u8"), ("filesz", "<u8"), ("memsz", "<u8"), ("align", "<u8")])
PT_LOAD = 1


def load_segments(path: str | os.PathLike) -> list[tuple[int, int, int]]:
    """(p_offset, p_vaddr, p_filesz) of each PT_LOAD segment: where the file's bytes land in
    its virtual addresses (a mapped address -> file offset -> symbol address). Raises NotElf."""
    with open(path, "rb") as f:
        head = f.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            raise NotElf(f"{path}: not a 64-bit little-endian ELF file")
        phoff = int.from_bytes(head[0x20:0x28], "little")
        phentsize = int.from_bytes(head[0x36:0x38], "little")
        phnum = int.from_bytes(head[0x38:0x3A], "little")
        if phentsize != _PHDR.itemsize:
            raise NotElf(f"{path}: unexpected program header size {phentsize}")
        f.seek(phoff)
        ph = np.frombuffer(f.read(phnum * phentsize), dtype=_PHDR)
    return [(int(h["offset"]), int(h["vaddr"]), int(h["filesz"])) for h in ph if h["type"] == PT_LOAD]


def file_offset(segments: list[tuple[int, int, int]], vaddr: int) -> int | None:
    """The file offset of virtual address `vaddr` (e.g. a symbol's st_value), from the
    load_segments of its file; None when no segment holds it."""
    for off, va, size in segments:
        if va <= vaddr < va + size:
            return vaddr - va + off
    return None


def _occurrences(haystack: bytes, needle: bytes) -> list[int]:
    out, i = [], haystack.find(needle)
    while i >= 0:
        out.append(i)
        i = haystack.find(needle, i + 1)
    return out


def nccl_symbols(path: str | os.PathLike) -> dict[str, int]:
    """The NCCL API functions `path` defines; {} for non-ELF or non-NCCL files."""
    try:
        syms = defined_symbols(path)
    except (OSError, NotElf):
        return {}
    return syms if MARKER in syms else {}


def is_profiler_plugin(path: str | os.PathLike) -> bool:
    """Whether `path` is Ingero's NCCL profiler plugin (exports PROFILER_MARKER)."""
    try:
        return PROFILER_MARKER in defined_symbols(path, (PROFILER_MARKER,))
    except (OSError, NotElf):
        return False

