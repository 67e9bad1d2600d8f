"""Compile, load and attach the BPF probes; fill the filter maps; read counters.

The BPF program is bpf/ingero.h plus one file per ring of the selected
families (bpf/nccl.c and nccl_profiler.c for `nccl`, tcp.c, sched.c),
compiled together by bcc so the families share the filter maps and the lost
counters. bcc only rewrites map calls in the text it compiles as its main
file, so the files are inlined (with #line markers, so compiler messages name
the real file and line) rather than #included. Every setting reaches the C as
a -D flag; what differs between the tracers of a node (targets, the tracer's
own tgid) is in maps, so that they all run the same compiled program: it is
compiled once per node and kept (ingero_agent/probecache.py); later tracers
compile only its maps and load its programs from there.

Uprobes attach per library *file* (dev, inode), for every process that maps
it; the in-kernel filter decides whose calls are recorded. They are
uprobe_multi links, one per program and file, where the kernel makes them
(ingero_agent/uprobe_multi.py: stopping then takes ~0.1 s, not ~0.1 s per
probe), else one perf event per probe. The TCP and scheduler tracepoints are
raw tracepoints where the kernel has them (raw_tp_cflags), for the same reason.
Libraries found in new target processes attach when the tracer's next scan
sees them. So does the USDT probe of Ingero's NCCL profiler plugin: bcc's USDT support
reads the plugin's .note.stapsdt (probe address, argument register) and the
probe is a uprobe at that address running the program for that register.
"""

from __future__ import annotations

import ctypes as ct
import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ingero.errors import IngeroError
from ingero.families import FAMILIES, NAMES, RINGS, rings_of
from ingero_agent import abi, kbtf, probecache, uprobe_multi, uprobe_names
from ingero_agent.elfsyms import NCCL_SYMBOLS, file_offset, load_segments
from ingero_agent.records import RECORDS, ringbuf_dtype
from ingero_agent.ringbuf import PAGE_SIZE, MappedRing, RingWaiter, open_ring

PROFILER_PROBE = "nccl_op_v2"   # ingero:nccl_op_v<INGERO_NCCL_PROF_VERSION> (bpf/ingero.h)
PROFILER_REGS = ("ax", "bx", "cx", "dx", "si", "di", "bp", "r8", "r9", "r10", "r11", "r12", "r13", "r14",
                 "r15")     # the ncclprof_<reg> programs of bpf/nccl_profiler.c
EXEC_TRACEPOINT = "sched/sched_process_exec"   # exec notes (ingero.h); optional
WAKE_FRACTION = 4   # a ring wakes the agent once a 1/WAKE_FRACTION of it is unread
TRACEFS_EVENTS = (Path("/sys/kernel/tracing/events"), Path("/sys/kernel/debug/tracing/events"))


FRAME_STORAGES = ("auto", "task", "hash")
KERNEL_BTF = Path("/sys/kernel/btf/vmlinux")


def task_storage_available() -> bool:
    """Can the probes keep per-thread state in task-local storage?

    (The NCCL probes' frames, and every family's cached target verdict.)
    BPF_MAP_TYPE_TASK_STORAGE and bpf_get_current_task_btf in kprobe/uprobe
    and tracepoint programs need kernel >= 5.11 built with BTF
    (/sys/kernel/btf/vmlinux).
    INGERO_FRAME_STORAGE=hash behaves as on a kernel without them (to test the
    fallback)."""
    if os.environ.get("INGERO_FRAME_STORAGE") == "hash":
        return False
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (5, 11) and KERNEL_BTF.is_file()


def frame_storage(cfg: "ProbeConfig") -> str:
    """task or hash: where bpf/nccl.c keeps the per-thread frames and bpf/ingero.h the
    per-thread target verdicts (INGERO_TASK_STORAGE; hash: frames in a hash, verdicts not cached)."""
    if cfg.frame_storage == "auto":
        return "task" if task_storage_available() else "hash"
    return cfg.frame_storage


def bpf_dir() -> Path:
    """The folder holding ingero.h and the family files."""
    env = os.environ.get("INGERO_BPF_DIR")
    if env:
        d = Path(env)
        if not (d / "ingero.h").is_file():
            raise IngeroError(f"INGERO_BPF_DIR={env} has no ingero.h; point it at the repository's "
                              "bpf/ folder")
        return d.resolve()
    d = Path(__file__).resolve().parents[2] / "bpf"
    if (d / "ingero.h").is_file():
        return d
    raise IngeroError("cannot find the BPF sources (bpf/ingero.h): set INGERO_BPF_DIR to the "
                      "repository's bpf/ folder")


@dataclass(frozen=True)
class ProbeConfig:
    families: tuple[str, ...] = NAMES
    trace_all: bool = False            # INGERO_TARGET_ALL
    cgroup_levels: int = 8             # ancestor levels the cgroup filter checks
    sched_min_ns: int = 1_000_000      # off-CPU intervals shorter than this are only summed
    ringbuf_pages: int = 2048          # per family; 8 MiB with 4 KiB pages (power of 2)
    self_tgid: int = 0                 # the agent itself is never traced
    max_targets: int = 4096            # capacity of each filter map
    frame_storage: str = "auto"        # per-thread NCCL frames and target verdicts: task, hash, auto

    def __post_init__(self):
        unknown = [f for f in self.families if f not in NAMES]
        if unknown or not self.families:
            raise IngeroError(f"unknown probe family {','.join(unknown) or '(none)'}: choose from "
                              f"{','.join(NAMES)}")
        if self.frame_storage not in FRAME_STORAGES:
            raise IngeroError(f"frame storage {self.frame_storage!r}: choose from "
                              f"{', '.join(FRAME_STORAGES)}")
        p = self.ringbuf_pages
        if p <= 0 or p & (p - 1):
            raise IngeroError(f"ring buffer pages {p} is not a power of 2; use e.g. 1024 or 2048")


def tracepoint_format(name: str) -> str | None:
    # INGERO_HIDE_TRACEPOINTS=a/b,c/d: behave as on a kernel without them (to test fallbacks)
    if name in os.environ.get("INGERO_HIDE_TRACEPOINTS", "").split(","):
        return None
    for base in TRACEFS_EVENTS:
        try:
            return (base / name / "format").read_text()
        except OSError:
            continue
    return None


def feature_flags(cfg: ProbeConfig) -> tuple[list[str], list[str]]:
    """(-D flags for the kernel's tracepoints, notes on what is missing)."""
    flags, notes = [], []
    for fam in cfg.families:
        for tp in FAMILIES[fam].required_tracepoints:
            if tracepoint_format(tp) is None:
                raise IngeroError(f"the kernel has no tracepoint {tp.replace('/', ':')} (needed by "
                                  f"the {fam} probes); drop '{fam}' from --probes or use a newer kernel")
        for tp, flag in FAMILIES[fam].optional_tracepoints:
            have = tracepoint_format(tp) is not None
            flags.append(f"-D{flag}={int(have)}")
            if not have:
                notes.append(f"{tp.replace('/', ':')} is missing: its events are not recorded")
    have_exec = tracepoint_format(EXEC_TRACEPOINT) is not None
    flags.append(f"-DINGERO_EXEC_NOTIFY={int(have_exec)}")
    if not have_exec:
        notes.append("sched:sched_process_exec is missing: new target processes are found by "
                     "the periodic scans only")
    if "tcp" in cfg.families:
        fmt = tracepoint_format("tcp/tcp_send_reset") or ""
        flags.append(f"-DINGERO_TCP_RESET_SOCKADDR={int('field:__u16 family' not in fmt)}")
        if "enum sk_rst_reason" in fmt:
            flags.append("-DINGERO_DECLARE_SK_RST_REASON=1")
    return flags, notes


SCHEDSTAT = Path("/proc/self/schedstat")
SCHED_TASK_FIELDS = {"INGERO_TASK_SUM_EXEC_OFF": "se.sum_exec_runtime",
                     "INGERO_TASK_RUN_DELAY_OFF": "sched_info.run_delay"}


def sched_cflags() -> list[str]:
    """-D flags placing the task_struct fields bpf/sched.c reads, from the running kernel's
    BTF (none without kernel BTF: then the headers bcc compiles against must be the kernel's)."""
    # run_delay exists only with CONFIG_SCHED_INFO, which also makes /proc/<pid>/schedstat
    if not SCHEDSTAT.exists():
        raise IngeroError("the sched probes need a kernel built with CONFIG_SCHED_INFO (it has no "
                          "/proc/self/schedstat); drop 'sched' from --probes on this kernel")
    try:
        offs = kbtf.kernel_offsets("task_struct", tuple(SCHED_TASK_FIELDS.values()), KERNEL_BTF)
    except kbtf.BtfError as e:
        raise IngeroError(f"reading the kernel's BTF ({KERNEL_BTF}) for the sched probes failed: {e}") from e
    if offs is None:
        return []
    return [f"-D{flag}={offs[field]}" for flag, field in SCHED_TASK_FIELDS.items()]


RAW_TP_OFF = "INGERO_RAW_TRACEPOINTS"   # =0: the tracepoints' perf events, as without kernel BTF


def raw_tp_cflags(cfg: ProbeConfig) -> tuple[list[str], str | None]:
    """(-D flags, None) to hook the tracepoints as raw tracepoints: no perf event, so a
    tracer's stop waits on no global lock (perf-event tracepoints are released under the
    kernel's event_mutex with a grace period inside, each queued behind every other release
    on the machine). Else ([-DINGERO_RAW_TP=0], why not). They need Linux 6.1 (the
    prev_state argument of sched_switch and the task states bpf/sched.c reports from it)
    and kernel BTF (the offsets of the fields they read)."""
    off = ["-DINGERO_RAW_TP=0"]
    if os.environ.get(RAW_TP_OFF) == "0":
        return off, f"{RAW_TP_OFF}=0"
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except ValueError:
        return off, f"kernel release {os.uname().release} not understood"
    if (major, minor) < (6, 1):
        return off, "Linux 6.1 has them"
    try:
        btf = kbtf.Btf(KERNEL_BTF.read_bytes())
        return ["-DINGERO_RAW_TP=1"] + [f"-D{flag}={btf.offset(struct, path)}" for fam in cfg.families
                                        for flag, struct, path in FAMILIES[fam].raw_tp_fields], None
    except OSError:
        return off, f"no kernel BTF ({KERNEL_BTF})"
    except kbtf.BtfError as e:
        return off, f"kernel BTF: {e}"


def build_program(cfg: ProbeConfig, src: Path | None = None) -> tuple[str, list[str], list[str]]:
    """(C text, cflags, notes) for the selected families."""
    src = src or bpf_dir()
    parts = []
    for name in ("ingero.h",) + tuple(r.source for r in rings_of(cfg.families)):
        path = src / name
        parts.append(f'#line 1 "{path}"\n{path.read_text()}\n')
    flags, notes = feature_flags(cfg)
    raw, why = raw_tp_cflags(cfg)
    flags += raw
    if why and {"tcp", "sched"} & set(cfg.families):
        notes.append(f"the TCP and scheduler tracepoints are perf events ({why}): stopping waits "
                     "on the kernel's event_mutex for each")
    cflags = [
        f"-I{src}",
        "-DINGERO_BPF_PROGRAM=1",
        f"-DINGERO_TARGET_ALL={int(cfg.trace_all)}",
        f"-DINGERO_CGROUP_LEVELS={int(cfg.cgroup_levels)}",
        f"-DINGERO_SCHED_MIN_NS={int(cfg.sched_min_ns)}ULL",
        f"-DINGERO_RINGBUF_PAGES={int(cfg.ringbuf_pages)}",
        f"-DINGERO_MAX_TARGETS={int(cfg.max_targets)}",
        f"-DINGERO_TASK_STORAGE={int(frame_storage(cfg) == 'task')}",
    ] + flags
    if "sched" in cfg.families:
        cflags += sched_cflags()
    if "nccl" in cfg.families:
        cflags += abi.cflags()     # where each NCCL argument is on this machine
        cflags.append(f"-DINGERO_NCCLPROF_REGS={int(abi.machine().name == 'x86_64')}")
    return "".join(parts), cflags, notes


def check_machine(cfg: ProbeConfig) -> None:
    if "nccl" in cfg.families:
        abi.machine()   # raises, naming the fix, on a machine without an argument table


# bpf_map_type BPF_MAP_TYPE_ARRAY, bpf_prog_type BPF_PROG_TYPE_KPROBE (linux/bpf.h); a
# program of two instructions: r0 = 0 (BPF_ALU64 | BPF_MOV | BPF_K), exit (BPF_JMP | BPF_EXIT)
_MAP_ARRAY, _PROG_KPROBE = 2, 2
_RETURN_0 = bytes([0xB7, 0, 0, 0, 0, 0, 0, 0, 0x95, 0, 0, 0, 0, 0, 0, 0])


def bpf_refusal() -> str | None:
    """Why the kernel will not let this process trace with BPF, or None: one map and one
    tracing program made and closed, through bcc's library. A refusal here is a missing
    capability, and no fallback compile can get past it: said at once, not after several
    compiles (minutes on a busy node)."""
    from bcc.libbcc import lib
    lib.bcc_create_map.restype = ct.c_int
    lib.bcc_create_map.argtypes = [ct.c_int, ct.c_char_p, ct.c_int, ct.c_int, ct.c_int, ct.c_int]
    lib.bcc_prog_load.restype = ct.c_int
    lib.bcc_prog_load.argtypes = [ct.c_int, ct.c_char_p, ct.c_char_p, ct.c_int, ct.c_char_p,
                                  ct.c_uint, ct.c_int, ct.c_char_p, ct.c_uint]
    fd = lib.bcc_create_map(_MAP_ARRAY, b"ingero_check", 4, 4, 1, 0)
    if fd < 0 and ct.get_errno() == errno.EPERM:
        return "the kernel refused to create a BPF map (Operation not permitted): the tracer needs CAP_BPF"
    if fd >= 0:
        os.close(fd)
    fd = lib.bcc_prog_load(_PROG_KPROBE, b"ingero_check", _RETURN_0, len(_RETURN_0), b"GPL", 0, 0, None, 0)
    if fd < 0 and ct.get_errno() == errno.EPERM:
        return ("the kernel refused to load a BPF tracing program (Operation not permitted): the "
                "tracer needs CAP_PERFMON beside CAP_BPF")
    if fd >= 0:
        os.close(fd)
    return None


# Functions that close a group: their entries are attached before the rest, so that a group
# whose start is seen has its end seen too. Probes reach a running job one function after
# the other; a start seen without its end (a 3D lab job probed late on a busy machine) put
# every later call of that thread into one group, one event holding hundreds of collectives.
GROUP_CLOSERS = ("ncclGroupEnd", "ncclGroupSimulateEnd")


def entry_order(names) -> list[str]:
    """`names`, the functions that close a group first, the rest in their order."""
    return sorted(names, key=lambda n: n not in GROUP_CLOSERS)


class Probes:
    """A loaded BPF program and what is attached to it."""

    def __init__(self, cfg: ProbeConfig):
        check_machine(cfg)
        self.cfg = cfg
        self.text, self.cflags, self.notes = build_program(cfg)
        try:
            from bcc import BPF
        except ImportError as e:
            raise IngeroError("the bcc Python module is missing: install python3-bpfcc (Debian) and "
                              "create the venv with --system-site-packages") from e
        self._BPF = BPF
        refusal = bpf_refusal()
        if refusal:
            raise IngeroError(f"{refusal} (docs/install.md lists the agent's capabilities)")
        try:
            try:
                self._load()
            except Exception:
                # Task-local storage chosen by kernel version, yet the kernel refused it
                # (e.g. a backport without the helper for uprobes or tracepoints): NCCL
                # frames in a hash, target verdicts not cached.
                if cfg.frame_storage != "auto" or "-DINGERO_TASK_STORAGE=1" not in self.cflags:
                    raise
                self.cflags = [("-DINGERO_TASK_STORAGE=0" if f == "-DINGERO_TASK_STORAGE=1" else f)
                               for f in self.cflags]
                self._load()
                self.notes.append("the kernel refused task-local storage for the probes' per-thread "
                                  "state: NCCL frames are kept in a hash and the target filter runs "
                                  "uncached (slower per call and per event)")
        except Exception as e:  # bcc raises bare Exception with the compiler output on stderr
            raise IngeroError(f"loading the BPF program failed ({e}); the compiler/verifier "
                              "output above says why") from e
        self.attached: dict[tuple[int, int], tuple[Path, list[str]]] = {}
        self.links: list[int] = []     # uprobe_multi link fds
        if self.multi_off:
            self.notes.append(f"this kernel makes no BPF uprobe_multi links ({self.multi_off}; Linux "
                              "6.6 has them): each NCCL uprobe is a perf event of its own, and "
                              "stopping waits ~0.1 s for each")
        uprobe_names.install(self.bpf)   # uprobes in tracefs without CAP_SYS_ADMIN: see there
        self.rings = {}
        size = cfg.ringbuf_pages * PAGE_SIZE
        self.wake_records: dict[str, int] = {}
        for ring in rings_of(cfg.families):
            dtype = RECORDS[ring.struct]
            self.rings[ring.name] = open_ring(self.bpf, ring.table, size, dtype)
            self.wake_records[ring.name] = max(1, size // ringbuf_dtype(dtype).itemsize // WAKE_FRACTION)
        # Exec notes of target processes (8-byte tgids), when the kernel has the tracepoint.
        self.exec_notes = None
        if "-DINGERO_EXEC_NOTIFY=1" in self.cflags:
            try:
                self.exec_notes = MappedRing(self.bpf[b"exec_notes"].map_fd, PAGE_SIZE,
                                             np.dtype("<u8"))
            except (OSError, ValueError, KeyError):
                self.exec_notes = None
        # Sleep in epoll on the rings when every ring is mapped; else the
        # caller polls (bcc's callback reader cannot be waited on here).
        self.waiter = None
        if all(isinstance(r, MappedRing) for r in self.rings.values()):
            self.waiter = RingWaiter(list(self.rings.values())
                                     + ([self.exec_notes] if self.exec_notes else []))
        self._current: dict[str, set] = {"target_cgroups": set(), "target_tgids": set(),
                                         "target_ips": set()}

    def _load(self) -> None:
        """Compile, load and attach the program; where the kernel refuses its raw tracepoints,
        again with the tracepoints' perf events."""
        try:
            self._compile()
        except Exception as e:     # bcc: bare Exception
            if "-DINGERO_RAW_TP=1" not in self.cflags:
                raise
            self.cflags = [f for f in self.cflags if not f.startswith("-DINGERO_RAW_TP=")] + ["-DINGERO_RAW_TP=0"]
            self._compile()
            self.notes.append(f"the kernel refused raw tracepoints ({e}): the TCP and scheduler "
                              "tracepoints are perf events, and stopping waits on the kernel's "
                              "event_mutex for each")
        self._load_nccl()

    def _compile(self) -> None:
        """self.bpf: the program compiled by bcc, or its maps compiled and its programs
        from the node's cache (ingero_agent/probecache.py); self.compiled says which, and
        self.compile_cpu_s what it cost."""
        cpu0 = time.thread_time()
        self.bpf, self.compiled = probecache.compile_or_load(self._BPF, self.text, self.cflags,
                                                             self._set_self)
        self.compile_cpu_s = time.thread_time() - cpu0

    def _set_self(self, bpf) -> None:
        """Before any probe is attached: the tracer's own tgid, never a target."""
        try:
            t = bpf[b"self_tgid"]
        except KeyError:   # BPF sources of an older version (bench.uprobe_cost --baseline)
            return
        t[t.Key(0)] = t.Leaf(self.cfg.self_tgid)

    # ---- uprobes -----------------------------------------------------------
    def _load_nccl(self) -> None:
        """Load the NCCL programs' first pair now (bcc verifies a program when it is first
        loaded, and a refusal must reach the task-storage fallback), for uprobe_multi links
        where the kernel makes them (`multi_off`: None, or why each uprobe is a perf event)."""
        self.multi_off: str | None = None
        if "nccl" not in self.cfg.families:
            return
        first = b"nccl_enter_ncclAllReduce"
        try:
            fn = self.bpf.load_func(first, self._BPF.KPROBE, attach_type=uprobe_multi.BPF_TRACE_UPROBE_MULTI)
            self.multi_off = uprobe_multi.unsupported(fn.fd)
        except Exception as e:     # bcc: bare Exception; the plain load below says what is wrong
            self.multi_off = f"loading a program for it failed: {e}"
        if self.multi_off:         # a program made for links cannot go on a perf event
            fn = self.bpf.funcs.pop(first, None)
            if fn is not None:
                os.close(fn.fd)
        for name in (first, b"nccl_return"):
            self._program(name.decode())

    def _program(self, name: str) -> int:
        """The fd of program `name`, loaded for uprobe_multi links or for perf events."""
        kind = uprobe_multi.BPF_TRACE_UPROBE_MULTI if not self.multi_off else -1
        return self.bpf.load_func(name.encode(), self._BPF.KPROBE, attach_type=kind).fd

    def _attach_uprobes(self, path: Path, groups: list[tuple[str, list[int], bool]]) -> None:
        """Run each (program, virtual addresses in `path`, on return) of `groups`: a
        uprobe_multi link per program, or a perf-event uprobe per address. Raises OSError,
        NotElf, or bcc's Exception."""
        if self.multi_off:
            for prog, addrs, ret in groups:
                attach = self.bpf.attach_uretprobe if ret else self.bpf.attach_uprobe
                for addr in addrs:     # bcc turns the virtual address into the file offset
                    attach(name=os.fsencode(path), addr=addr, fn_name=prog.encode())
            return
        segments = load_segments(path)
        made = []
        try:
            for prog, addrs, ret in groups:
                offsets = [file_offset(segments, a) for a in addrs]
                found = [o for o in offsets if o is not None]
                if len(found) < len(offsets):
                    raise OSError(errno.EINVAL, f"address 0x{addrs[offsets.index(None)]:x} is in no "
                                  "loaded segment")
                made.append(uprobe_multi.link_create(self._program(prog), os.fsencode(path), found, ret))
        except BaseException:
            close_side_by_side([lambda fd=fd: os.close(fd) for fd in made])
            raise
        self.links += made

    def attach_library(self, path: Path, key: tuple[int, int], symbols: dict[str, int]) -> list[str]:
        """Attach entry/return probes to the NCCL functions `path` defines.

        Symbols sharing an address (aliases) are attached once. Returns the
        names attached; names missing from the library are skipped.
        """
        if "nccl" not in self.cfg.families or key in self.attached:
            return []
        addr: dict[str, int] = {}
        for name in NCCL_SYMBOLS:
            a = symbols.get(name)
            if a is not None and a not in addr.values():
                addr[name] = a
        # Returns first: a call whose entry is seen has its return seen too.
        groups = [("nccl_return", [a for n, a in addr.items() if n != "ncclCommInitAll"], True),
                  ("nccl_return_init_all", [a for n, a in addr.items() if n == "ncclCommInitAll"], True)]
        groups = [g for g in groups if g[1]] + [(f"nccl_enter_{n}", [addr[n]], False) for n in entry_order(addr)]
        try:
            self._attach_uprobes(path, groups)
        except Exception as e:
            raise IngeroError(f"attaching the uprobes of {len(addr)} NCCL functions in {path} failed "
                              f"({e}); check that uprobes are enabled (CONFIG_UPROBE_EVENTS)"
                              f"{uprobe_names.HINT if self.multi_off else ''}") from e
        self.attached[key] = (path, list(addr))
        return list(addr)

    def attach_profiler(self, path: Path, key: tuple[int, int]) -> int:
        """Attach the profiler plugin's USDT probe (every location of it) in `path`.

        Returns the number of locations attached (0: done before). Raises
        IngeroError, in one line, when the file has no probe this agent reads.
        """
        if "nccl" not in self.cfg.families or key in self.attached:
            return 0
        if "-DINGERO_NCCLPROF_REGS=1" not in self.cflags:
            raise IngeroError(f"the NCCL profiler probe is read on x86-64 only; {path} is not traced")
        from bcc import USDT
        from bcc.libbcc import BCC_USDT_ARGUMENT_FLAGS as F
        try:
            usdt = USDT(path=os.fsdecode(path))   # kept alive while its probes are read
            probes = usdt.enumerate_probes()
        except Exception as e:   # bcc raises USDTException / bare Exception
            raise IngeroError(f"reading the USDT notes of {path} failed ({e})") from e
        names = {(p.provider.decode(), p.name.decode()): p for p in probes}
        probe = names.get(("ingero", PROFILER_PROBE))
        if probe is None:
            theirs = sorted(n for prov, n in names if prov == "ingero")
            raise IngeroError(f"{path} has no USDT probe ingero:{PROFILER_PROBE}"
                              + (f" (it has {', '.join(theirs)}: a plugin of another version); rebuild it "
                                 "with `ingero profiler build`" if theirs else ""))
        by_reg: dict[str, list[int]] = {}
        for i in range(probe.num_locations):
            loc = probe.get_location(i)
            arg = loc.get_argument(0)
            reg = getattr(arg, "base_register_name", b"").decode()
            if arg.valid & F.DEREF_OFFSET or reg not in PROFILER_REGS:
                raise IngeroError(f"the probe ingero:{PROFILER_PROBE} in {path} passes its record as {arg}, "
                                  "not in a register; rebuild the plugin with `ingero profiler build`")
            by_reg.setdefault(reg, []).append(loc.address)
        try:
            self._attach_uprobes(path, [(f"ncclprof_{reg}", addrs, False) for reg, addrs in by_reg.items()])
        except Exception as e:
            raise IngeroError(f"attaching the USDT probe in {path} failed ({e}); check that uprobes "
                              f"are enabled (CONFIG_UPROBE_EVENTS)"
                              f"{uprobe_names.HINT if self.multi_off else ''}") from e
        self.attached[key] = (path, [PROFILER_PROBE])
        return sum(map(len, by_reg.values()))

    # ---- filter maps -------------------------------------------------------
    def _sync(self, table: str, want: set, make_key) -> bool:
        """Make the filter map `table` hold `want`; True when it changed."""
        t = self.bpf[table.encode()]
        cur = self._current[table]
        if want == cur:
            return False
        one = ct.c_uint8(1)
        for k in want - cur:
            t[make_key(t, k)] = one
        for k in cur - want:
            try:
                del t[make_key(t, k)]
            except KeyError:
                pass
        self._current[table] = set(want)
        return True

    def set_targets(self, cgroup_ids: set[int], tgids: set[int],
                    ips: set[tuple[int, bytes]]) -> None:
        cap = self.cfg.max_targets
        if max(len(cgroup_ids), len(tgids), len(ips)) > cap:
            raise IngeroError(f"more than {cap} target cgroups, pids or addresses; trace fewer pods")
        changed = self._sync("target_cgroups", cgroup_ids, lambda t, k: t.Key(k))
        changed |= self._sync("target_tgids", tgids, lambda t, k: t.Key(k))
        if changed:   # after the maps: verdicts cached in the kernel are now stale
            try:
                g = self.bpf[b"target_gen"]
            except KeyError:   # BPF sources of an older version (bench.uprobe_cost --baseline)
                return
            g[g.Key(0)] = g.Leaf(g[g.Key(0)].value + 1)
        if "tcp" in self.cfg.families:
            def ip(t, k):
                key = t.Key()
                key.family = k[0]
                ct.memmove(ct.addressof(key), k[1], 16)
                return key
            self._sync("target_ips", ips, ip)

    # ---- reader wake-ups ---------------------------------------------------
    def arm_wakeup(self, fam: str) -> None:
        """After draining `fam`: wake the reader once a quarter of its ring is unread again."""
        slot = RINGS[fam].lost_slot
        produced = self.bpf[b"ring_produced"]
        t = self.bpf[b"ring_wake_at"]
        t[t.Key(slot)] = t.Leaf(int(produced[produced.Key(slot)].produced) + self.wake_records[fam])

    def produced(self, fam: str) -> int:
        """Records the probes of `fam` offered to its ring (kept or lost)."""
        t = self.bpf[b"ring_produced"]
        return int(t[t.Key(RINGS[fam].lost_slot)].produced)

    # ---- counters ----------------------------------------------------------
    def lost(self) -> dict[str, int]:
        t = self.bpf[b"lost"]
        out = {}
        for ring in RINGS.values():
            out[ring.name] = int(sum(t[t.Key(ring.lost_slot)])) if ring.name in self.rings else 0
        return out

    def sched_totals(self) -> list[tuple[int, int, int, int]]:
        """(tgid, reason, total_ns, intervals) summed in the kernel."""
        if "sched" not in self.cfg.families:
            return []
        return [(k.tgid, k.reason, v.total_ns, v.intervals)
                for k, v in self.bpf[b"sched_totals"].items()]

    def close(self) -> None:
        for r in self.rings.values():
            r.close()
        self.rings = {}
        if self.exec_notes is not None:
            self.exec_notes.close()
            self.exec_notes = None
        if self.waiter is not None:
            self.waiter.close()
            self.waiter = None
        names = list(self.bpf.uprobe_fds)
        links, self.links = self.links, []
        try:
            # Each detach waits in the kernel for a grace period (uprobe_unregister_sync,
            # tracepoint_synchronize_unregister): side by side, the waits that can overlap do
            # (links' always; perf events' not, as the kernel holds its event_mutex across
            # each). bcc's cleanup() then finds nothing left.
            close_side_by_side([lambda fd=fd: os.close(fd) for fd in links]
                               + [lambda n=n: self.bpf.detach_uprobe_event(n) for n in names]
                               + [lambda tp=tp: self.bpf.detach_tracepoint(tp)
                                  for tp in list(self.bpf.tracepoint_fds)])
            self.bpf.cleanup()
        except Exception:
            pass
        uprobe_names.remove_left(names)   # any whose removal met a not yet released event


def close_side_by_side(jobs: list) -> None:
    """Run each of `jobs` (detaches, closes) in a thread of its own; an exception is dropped
    (bcc's cleanup() tries again what is still attached)."""
    def one(job):
        try:
            job()
        except Exception:
            pass
    if len(jobs) < 2:
        for job in jobs:
            one(job)
        return
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=min(64, len(jobs)), thread_name_prefix="detach") as pool:
        list(pool.map(one, jobs))
