"""Column-wise analysis of NCCL collectives straight from Parquet segments.

``analysis.analyse`` computes its per-row statistics in SQL (window median
per collective instance, quantiles per rank). On a session of 1,024 ranks x
100,000 collectives (~100 M rows) that takes minutes and many GiB in DuckDB,
most of it in holistic aggregates over 100 M values. This module computes
the same numbers column-wise, in one pass over the segments, in bounded
memory:

* NCCL numbers each communicator's calls (``seq``) and every member calls
  each of them, so a communicator is a dense matrix (member x seq) of arrival
  times and one of durations, with one op per seq. Rows are sorted into it
  file by file: pyarrow decodes the next files and groups their rows (pool
  threads, no GIL) while the main thread writes the previous ones in; no
  per-row keys are kept and the session is never sorted as a whole. (pyarrow
  rather than a DuckDB scan: ~15% less CPU to decode the same columns, and
  a file is one node's, so its rows need no file index.)
* Per instance (comm, seq): arrivals, their median (DuckDB's interpolation,
  in double precision, as the SQL computes it), the last arrival and the count.
* Per rank: durations' p50/p99 per op and overall, median lateness per op,
  share of instances where it came last, vectorised over blocks of ranks.

The results are the SQL's, bit for bit (``tests/unit/test_analysis_dense.py``
compares both on every lab fault and on awkward data). Data this layout
cannot represent exactly (one rank calling the same (communicator, seq)
twice, two ops at one seq, a process whose rank only NCCL's own numbering
gives, a node folder holding another node's rows...) raises ``Unsupported``
and the caller uses the SQL.
"""

from __future__ import annotations

import math
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ingero.schema import COLLECTIVE_OPS, NCCL_OK_RETS

# Op codes in string order, so that "ORDER BY op" and code order agree. 0 = no op.
OPS = sorted(COLLECTIVE_OPS)
_I64_MAX = np.iinfo(np.int64).max
_I64_MIN = np.iinfo(np.int64).min
_U32_MAX = np.iinfo(np.uint32).max
_SUB = 64                       # instances per transposed block of the per-instance pass (cache-sized)


class Unsupported(Exception):
    """The data needs the general SQL path; the message says why."""


@dataclass
class Segments:
    """Where a session's nccl_events rows are: Parquet files per node folder
    (``<folder>/nccl_events/*.parquet``, the operator's gather layout), and the
    clock offset (ns) to subtract from their timestamps."""

    units: list[tuple[list[Path], int]]


# ---- DuckDB's quantile_cont, reproduced -----------------------------------------------
# RN = (n - 1) * q; lo, hi = the floor(RN)-th and ceil(RN)-th smallest values cast to
# double; result = lo * (1 - d) + hi * d with d = RN - floor(RN), which the x86-64 build
# evaluates as fma(lo, 1 - d, hi * d) (one rounding). For the median d is 0 or 0.5 and
# both products are exact, so plain double arithmetic gives the same bits.

def _interp(lo: float, hi: float, d: float) -> float:
    if d == 0.0:
        return lo
    if d == 0.5:
        return lo * 0.5 + hi * 0.5
    return float(Fraction(lo) * Fraction(1.0 - d) + Fraction(hi * d))


def _kth(n: int, q: float) -> tuple[int, int, float]:
    rn = float(n - 1) * q
    f = math.floor(rn)
    return f, math.ceil(rn), rn - f


def quantiles(values: np.ndarray, qs: tuple[float, ...], inplace: bool = False) -> list[float | None]:
    """quantile_cont(values, q) for each q, as DuckDB computes it (None when empty).

    `inplace`: sort `values` itself (it is scratch) instead of a copy."""
    n = len(values)
    if n == 0:
        return [None] * len(qs)
    # numpy's vectorised sort beats np.partition several times over at these sizes
    if inplace:
        values.sort()
        part = values
    else:
        part = np.sort(values)
    return [_interp(float(part[f]), float(part[c]), d) for f, c, d in (_kth(n, q) for q in qs)]


def _as_slice(idx: np.ndarray):
    """The index array as a slice when it is an arithmetic progression (then indexing is a view)."""
    if len(idx) == 1:
        return slice(int(idx[0]), int(idx[0]) + 1)
    step = int(idx[1] - idx[0]) if len(idx) > 1 else 1
    if len(idx) > 1 and step > 0 and int(idx[-1] - idx[0]) == step * (len(idx) - 1) and (np.diff(idx) == step).all():
        return slice(int(idx[0]), int(idx[-1]) + 1, step)
    return idx


def _sorted(parts: list[np.ndarray], scratch: bool = False) -> np.ndarray:
    """The parts concatenated and sorted, never sorting a caller's array in place
    (unless `scratch`: the parts are this caller's own)."""
    if len(parts) == 1:
        if scratch:
            parts[0].sort()
            return parts[0]
        return np.sort(parts[0])
    out = np.concatenate(parts)
    out.sort()
    return out


def _sorted_quantiles(srt: np.ndarray, n: int, qs: tuple[float, ...]) -> list[float]:
    """quantile_cont(q) of the first n values of sorted `srt`, as DuckDB computes it."""
    return [_interp(float(srt[f]), float(srt[c]), d) for f, c, d in (_kth(n, q) for q in qs)]


def _threads() -> int:
    return max(1, min(2, os.cpu_count() or 1))


# ---- one communicator ----------------------------------------------------------------------

class _Comm:
    """A communicator: one arrival row and one duration row per member (rank), indexed
    by seq and written as the read batches come in, one op per seq; after ``finish``,
    per seq the number of calls and the median, max and min arrival. A member's row
    holds max int (durations: the type's max) where it has no call."""

    def __init__(self, h: int):
        self.hash = h
        self.trows: dict[int, np.ndarray] = {}      # rank -> arrivals, columns base .. base + cap
        self.drows: dict[int, np.ndarray] = {}      # rank -> durations
        self.spans: dict[int, list] = {}            # rank -> written (first, last) seqs, or seq arrays
        self.base = 0                               # seq of column 0
        self.cap = 0
        self.opc = np.zeros(0, np.int8)             # op code per seq (0: not called)
        self.lo = self.hi = None                    # lowest / highest seq called
        self.dtype = np.uint32                      # durations; int64 once one does not fit
        self.full = True                            # every member called every seq
        self.cnt = self.med = self.mx = self.mn = None

    def _cover(self, lo: int, hi: int) -> None:
        if self.lo is None:
            self.base, self.cap = lo, max(hi - lo + 1, 1024)
            self.opc = np.zeros(self.cap, np.int8)
        elif lo < self.base or hi >= self.base + self.cap:
            new_lo = min(lo, self.base) if lo >= self.base else min(lo, self.base - self.cap)
            new_hi = max(hi, self.base + self.cap - 1)
            if hi >= self.base + self.cap:
                new_hi = max(new_hi, self.base + 2 * self.cap - 1)
            shift, cap = self.base - new_lo, new_hi - new_lo + 1
            opc = np.zeros(cap, np.int8)
            opc[shift:shift + self.cap] = self.opc
            self.opc = opc
            for rows in (self.trows, self.drows):
                for r, old in rows.items():
                    new = np.empty(cap, old.dtype)
                    new[shift:shift + self.cap] = old
                    rows[r] = new
            self.base, self.cap = new_lo, cap
        self.lo = lo if self.lo is None else min(self.lo, lo)
        self.hi = hi if self.hi is None else max(self.hi, hi)

    def add(self, rank: int, seq0: int, t: np.ndarray, d: np.ndarray, ops: np.ndarray,
            seqs: np.ndarray | None = None) -> None:
        """Write one process's calls: contiguous seqs from seq0 (seqs None) or sorted `seqs`."""
        last = seq0 + len(t) - 1 if seqs is None else int(seqs[-1])
        self._cover(seq0, last)
        at = slice(seq0 - self.base, last + 1 - self.base) if seqs is None else seqs - self.base
        have = self.opc[at]
        if not np.array_equal(have, ops):          # first writer of these seqs, or a conflict
            if ((have != 0) & (have != ops)).any():
                raise Unsupported("two different ops at one (communicator, seq)")
            self.opc[at] = ops
        if d.dtype != self.dtype and self.dtype == np.uint32:    # a duration beyond 32 bits: widen
            self.dtype = np.int64
            for r, old in self.drows.items():
                self.drows[r] = old.astype(np.int64)
        trow = self.trows.get(rank)
        if trow is None:
            trow = self.trows[rank] = np.empty(self.cap, np.int64)
            self.drows[rank] = np.empty(self.cap, self.dtype)
            self.spans[rank] = []
        trow[at] = t
        self.drows[rank][at] = d
        self.spans[rank].append((seq0, last) if seqs is None else seqs)

    def finish(self) -> None:
        """Check each member's calls, mark the missing ones, and compute the per-seq statistics."""
        S = self.hi - self.lo + 1
        off = self.lo - self.base
        self.opc = self.opc[off:off + S]
        dmax = np.iinfo(self.dtype).max
        for rank, spans in self.spans.items():
            ranges = sorted((sp[0], sp[1]) if isinstance(sp, tuple) else (int(sp[0]), int(sp[-1])) for sp in spans)
            n = sum(sp[1] - sp[0] + 1 if isinstance(sp, tuple) else len(sp) for sp in spans)
            if any(b1 >= a2 for (_, b1), (a2, _) in zip(ranges, ranges[1:])):   # overlapping writes:
                mine = np.concatenate([np.arange(sp[0], sp[1] + 1) if isinstance(sp, tuple) else sp
                                       for sp in spans])                      # any seq twice?
                if len(np.unique(mine)) != len(mine):
                    raise Unsupported(f"rank {rank} calls one (communicator, seq) more than once")
            self.trows[rank] = self.trows[rank][off:off + S]
            self.drows[rank] = self.drows[rank][off:off + S]
            if n != S:                                            # gaps: calls it did not make
                self.full = False
                called = np.zeros(S, bool)
                for sp in spans:
                    called[slice(sp[0] - self.lo, sp[1] + 1 - self.lo) if isinstance(sp, tuple) else sp - self.lo] = True
                self.trows[rank][~called] = _I64_MAX
                self.drows[rank][~called] = dmax
        self.spans = {}
        self.ranks = sorted(self.trows)
        self.row = {r: i for i, r in enumerate(self.ranks)}
        self.trows = [self.trows[r] for r in self.ranks]
        self.drows = [self.drows[r] for r in self.ranks]
        self.base = self.lo
        self.S = S
        self.dmax = dmax
        self._instance_stats()

    def tcols(self, rows, cols) -> np.ndarray:
        """Arrivals of the given members (row indexes) at the given seq columns, rows x cols."""
        return np.stack([self.trows[i][cols] for i in rows])

    def dcols(self, rows, cols) -> np.ndarray:
        return np.stack([self.drows[i][cols] for i in rows])

    def _instance_stats(self) -> None:
        """Per seq: calls, and the median (as DuckDB's median(t), in double), max and min arrival."""
        M, S = len(self.trows), self.S
        self.cnt = np.zeros(S, np.int32)
        self.med = np.zeros(S, np.float64)
        self.mx = np.full(S, _I64_MIN, np.int64)
        self.mn = np.full(S, _I64_MAX, np.int64)
        step = _SUB * 64

        def chunk(s0: int) -> None:
            X = self.tcols(range(M), slice(s0, min(S, s0 + step)))      # member x seq
            for j0 in range(0, X.shape[1], _SUB):
                Y = np.ascontiguousarray(X[:, j0:j0 + _SUB].T)          # seq x member, cache-sized
                Y.sort(axis=1)                                          # missing calls (max int) sort last
                self._sorted_stats(Y, s0 + j0, M)

        with ThreadPoolExecutor(_threads()) as ex:
            list(ex.map(chunk, range(0, S, step)))

    def _sorted_stats(self, Y: np.ndarray, at: int, M: int) -> None:
        if Y[:, M - 1].max() < _I64_MAX:                    # every member called these seqs
            n = np.full(len(Y), M)
        else:
            n = M - np.count_nonzero(Y == _I64_MAX, axis=1)
        self.cnt[at:at + len(Y)] = n
        where = np.arange(at, at + len(Y))
        some = n > 0
        if not some.all():
            Y, n, where = Y[some], n[some], where[some]
        rows = np.arange(len(Y))
        self.mn[where] = Y[:, 0]
        self.mx[where] = Y[rows, n - 1]
        f, c = (n - 1) // 2, n // 2
        lo = Y[rows, f].astype(np.float64)
        hi = Y[rows, c].astype(np.float64)
        self.med[where] = np.where(f == c, lo, lo * 0.5 + hi * 0.5)


def _codes(col: np.ndarray, few: int = 8) -> tuple[list, np.ndarray]:
    """(distinct values, code per row) for a column with a handful of distinct values."""
    codes = np.zeros(len(col), np.int32)
    values = [col[0]]
    left = col != values[0]
    while left.any():
        if len(values) == few:
            enc = pc.dictionary_encode(pa.array(col))
            return enc.dictionary.to_pylist(), enc.indices.to_numpy().astype(np.int32)
        v = col[int(np.argmax(left))]
        same = col == v
        codes[same] = len(values)
        values.append(v)
        left &= ~same
    return [int(v) for v in values], codes


# The columns the analysis reads, and the rows it keeps (the SQL's filter, _WHERE below).
_READ = ("timestamp_ns", "duration_ns", "seq", "op", "comm_id_hash", "pid", "ret")


def _load(path: str):
    """One file's rows the analysis keeps, as numpy columns (t, d, seq, op code, comm, pid);
    None if it keeps none. Rows are kept as ``op IN OPS AND comm_id_hash <> 0 AND ret IN NCCL_OK_RETS``
    keeps them (a NULL in any of those drops the row); a NULL in another column of a kept
    row is not handled here (Unsupported)."""
    tbl = pq.read_table(path, columns=list(_READ), read_dictionary=["op"], use_threads=False)
    if tbl.num_rows == 0:
        return None
    keep = None

    def also(ok) -> None:
        nonlocal keep
        keep = ok if keep is None else keep & ok

    ops = []
    for ch in tbl.column("op").chunks:
        if not pa.types.is_dictionary(ch.type):
            ch = ch.dictionary_encode()
        lut = np.array([OPS.index(o) + 1 if o in OPS else 0 for o in ch.dictionary.to_pylist()] + [0],
                       np.int8)
        idx = ch.indices
        if idx.null_count:
            idx = pc.fill_null(idx, len(lut) - 1)
        ops.append(lut[idx.to_numpy()])
    opc = ops[0] if len(ops) == 1 else np.concatenate(ops)
    also(opc > 0)

    def ints(name: str, excluding_nulls: bool):
        col = tbl.column(name)
        if col.null_count:
            if not excluding_nulls:
                return col, None
            also(~col.is_null().to_numpy(zero_copy_only=False))
            col = col.fill_null(0)
        return col, col.to_numpy()

    _, cm = ints("comm_id_hash", True)
    also(cm != 0)
    _, ret = ints("ret", True)
    also(np.isin(ret, NCCL_OK_RETS))
    out = []
    for name in ("timestamp_ns", "duration_ns", "seq", "pid"):
        col, v = ints(name, False)
        if v is None:        # NULLs: only those in dropped rows are harmless
            if (col.is_null().to_numpy(zero_copy_only=False) & keep).any():
                raise Unsupported(f"NULL {name} in nccl_events")
            v = col.fill_null(0).to_numpy()
        out.append(v)
    t, d, seq, pid = out
    if keep.all():
        return t, d, seq, opc, cm, pid
    if not keep.any():
        return None
    return t[keep], d[keep], seq[keep], opc[keep], cm[keep], pid[keep]


def _prepare(path: str, off: int, max_off: int):
    """Everything about one file that needs no shared state, in a pool thread (numpy and
    pyarrow release the GIL): its kept rows, clock offset applied, grouped by (communicator,
    pid), each group sorted by seq and cut into pieces for ``_Comm.add``:
    [(comm hash, pid, [(seq0, t, d, op codes[, seqs]), ...]), ...]."""
    cols = _load(path)
    if cols is None:
        return None
    t, d, seq, opc, cm, pid = cols
    if t.max() >= _I64_MAX - max_off:
        raise Unsupported("a timestamp at the largest BIGINT")
    dlo, dhi = int(d.min()), int(d.max())
    if dlo >= 0 and dhi < _U32_MAX:
        d = d.astype(np.uint32)
    elif dhi == _I64_MAX:
        raise Unsupported("a duration at the largest BIGINT")
    lo, hi = int(seq.min()), int(seq.max())
    if lo >= 0 and hi < 1 << 31:
        seq = seq.astype(np.int32)
    plo, phi = int(pid.min()), int(pid.max())
    if phi - plo < 1 << 12:
        pids = range(plo, phi + 1)
        proc = pid - plo
    else:
        pid_enc = pc.dictionary_encode(pa.array(pid))
        pids = pid_enc.dictionary.to_pylist()
        proc = pid_enc.indices.to_numpy()
    nproc = len(pids)
    hashes, cc = _codes(cm)
    if len(hashes) * nproc <= 1 << 16:
        key = (cc * nproc + proc).astype(np.uint16)
    else:
        key = cc.astype(np.int64) * nproc + proc
    perm = np.argsort(key, kind="stable")
    ks = key[perm]
    t, d, seq, opc = t[perm], d[perm], seq[perm], opc[perm]
    if off:
        t -= off                      # this node's clock offset (t is this file's copy)
    bounds = np.concatenate(([0], np.flatnonzero(ks[1:] != ks[:-1]) + 1, [len(ks)]))
    groups = []
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        k = int(ks[a])
        sq, st, sd, so = seq[a:b], t[a:b], d[a:b], opc[a:b]
        step = np.diff(sq)
        if not (step > 0).all():      # calls not in seq order
            o = np.argsort(sq, kind="stable")
            sq, st, sd, so = sq[o], st[o], sd[o], so[o]
            step = np.diff(sq)
            if (step == 0).any():
                raise Unsupported(f"process {pids[k % nproc]} calls one (communicator, seq) more than once")
        if b - a == 1 or int(sq[-1] - sq[0]) == b - a - 1:
            pieces = [(int(sq[0]), st, sd, so)]
        else:
            cuts = np.flatnonzero(step != 1) + 1
            if len(cuts) * 64 > b - a:       # scattered seqs: keep them
                pieces = [(int(sq[0]), st, sd, so, sq.astype(np.int64))]
            else:                             # contiguous runs
                pieces = [(int(sq[i]), st[i:j], sd[i:j], so[i:j])
                          for i, j in zip([0] + cuts.tolist(), cuts.tolist() + [b - a])]
        groups.append((hashes[k // nproc], pids[k % nproc], pieces))
    return groups


def _result(job):
    unit, fut = job
    try:
        return unit, fut.result()
    except (pa.ArrowException, OSError, KeyError) as e:
        raise Unsupported(f"cannot read the segments column-wise: {e}") from e


def _sql_list(paths) -> str:
    return "[" + ", ".join("'" + str(p).replace("'", "''") + "'" for p in paths) + "]"


def _sql_str(v) -> str:
    return "'" + str(v).replace("'", "''") + "'"


_WHERE = (f"op IN ({', '.join(repr(o) for o in OPS)}) AND comm_id_hash <> 0 "
          f"AND ret IN ({', '.join(map(str, NCCL_OK_RETS))})")


# ---- the analysis ----------------------------------------------------------------------------

class Dense:
    """The statistics ``analysis`` needs, from the matrices (same interface as ``analysis._Sql``)."""

    def __init__(self, con):
        self.con = con
        self.comms: dict[int, _Comm] = {}
        self.meta: dict[int, tuple] = {}        # rank -> (node, pod, pid) of its latest call
        self._latest: dict[int, tuple] = {}     # rank -> (time of its latest call, node, pod, pid)
        self._rank_stats: dict = {}
        self._comms_of: dict[int, list[_Comm]] = {}

    @classmethod
    def from_segments(cls, con, segments: Segments) -> "Dense":
        self = cls(con)
        self._read(segments)
        comms_of: dict[int, list[_Comm]] = {}
        for c in self.comms.values():
            c.finish()
            for r in c.ranks:
                comms_of.setdefault(r, []).append(c)
        self._comms_of = {r: sorted(cs, key=lambda c: c.hash) for r, cs in comms_of.items()}
        return self

    def _read(self, segments: Segments) -> None:
        """One pass over every node's files, file by file (each file is one node's)."""
        units = [(list(map(str, files)), int(off)) for files, off in segments.units if files]
        if not units:
            return
        self._files = [f for fs, _ in units for f in fs]
        self._rmap = {(node, pid): [rank, pod] for node, pid, rank, pod in self.con.execute(
            "SELECT node, pid, any_value(rank), any_value(pod) FROM ranks GROUP BY node, pid").fetchall()}
        self._facts = None
        self._ranks: dict = {}
        self._pods: dict = {}
        # Each node folder's rows carry its name (checked from the Parquet statistics, so
        # no row is read): the folder says which node a row is from.
        self._unit_node = [Path(fs[0]).parent.parent.name for fs, _ in units]
        check = " UNION ALL ".join(
            f"SELECT count(*) AS n FROM read_parquet({_sql_list(fs)}) WHERE node <> {_sql_str(name)} OR node IS NULL"
            for (fs, _), name in zip(units, self._unit_node))
        if self.con.execute(f"SELECT sum(n) FROM ({check})").fetchone()[0]:
            raise Unsupported("a node folder holds rows of another node")
        self._unit_off = [off for _, off in units]
        self._max_off = max(abs(off) for off in self._unit_off)
        jobs = [(u, f) for u, (fs, _) in enumerate(units) for f in fs]
        # pyarrow decodes the next files (in pool threads, without the GIL) while this one
        # is sorted in; a few files ahead at most, so memory stays bounded.
        ahead = 2 * _threads()
        ex = ThreadPoolExecutor(_threads())
        pending: deque = deque()
        try:
            for u, f in jobs:
                pending.append((u, ex.submit(_prepare, f, self._unit_off[u], self._max_off)))
                if len(pending) > ahead:
                    self._file(*_result(pending.popleft()))
            while pending:
                self._file(*_result(pending.popleft()))
        finally:
            ex.shutdown(wait=True, cancel_futures=True)
            pa.default_memory_pool().release_unused()     # the decoded files' buffers

    def _rank_of(self, node: str, pid: int) -> tuple[int, str | None]:
        """COALESCE(ranks.rank, global_rank) and COALESCE(ranks.pod, pod) for a process."""
        rank, pod = self._rmap.get((node, pid), (None, None))
        if rank is None or pod is None:
            if self._facts is None:   # once, and only when the ranks table does not say
                self._facts = {(n, p): (grs, nulls, pd) for n, p, grs, nulls, pd in self.con.execute(
                    f"SELECT node, pid, list(DISTINCT global_rank) FILTER (WHERE global_rank IS NOT NULL), "
                    f"count(*) FILTER (WHERE global_rank IS NULL), any_value(pod) "
                    f"FROM read_parquet(?) WHERE {_WHERE} GROUP BY ALL", [self._files]).fetchall()}
            grs, nulls, rows_pod = self._facts.get((node, pid), (None, 1, None))
            if rank is None:
                if nulls or not grs or len(grs) != 1:
                    raise Unsupported(f"process {pid} on {node} has no single global rank")
                rank = grs[0]
            pod = pod if pod is not None else rows_pod
        return rank, pod

    def _file(self, unit: int, groups) -> None:
        """Write one file's calls (all from node folder `unit`, grouped by ``_prepare``)
        into the matrices."""
        node = self._unit_node[unit]
        for h, pid_, pieces in groups or ():
            rank = self._ranks.get((node, pid_))
            if rank is None:
                rank, pod = self._rank_of(node, pid_)
                self._ranks[(node, pid_)] = rank
                self._pods[(node, pid_)] = pod
            comm = self.comms.get(h)
            if comm is None:
                comm = self.comms[h] = _Comm(h)
            for piece in pieces:
                comm.add(rank, *piece)
            # a rank seen in two processes (restarted, maybe on another node) is shown
            # where it called last, as the SQL's arg_max(node, t)
            t_last = max((float(p[1].max()) for p in pieces if len(p[1])), default=None)
            if t_last is not None and (rank not in self._latest or t_last > self._latest[rank][0]):
                self._latest[rank] = (t_last, node, self._pods[(node, pid_)], pid_)
                self.meta[rank] = self._latest[rank][1:]

    # ---- the statistics analysis.py asks for
    def step_ns(self) -> float:
        best = None
        for c in self.comms.values():
            calls = np.bincount(c.opc, weights=c.cnt, minlength=len(OPS) + 1)
            for code in range(1, len(OPS) + 1):
                n = int(calls[code])
                if n:
                    key = (-n, c.hash, OPS[code - 1])
                    if best is None or key < best[0]:
                        best = (key, c, code)
        if best is None:
            return 0.0
        _, c, code = best
        gaps = np.diff(c.mn[(c.opc == code) & (c.cnt > 0)])
        return float(quantiles(gaps, (0.5,), inplace=True)[0] or 0.0)

    def rank_rows(self, slow_collective_ms: float | None):
        from ingero.analysis import RankRow

        slow_ns = int(slow_collective_ms * 1e6) if slow_collective_ms is not None else None
        groups: dict[tuple, list[int]] = {}     # ranks on the same communicators share a layout
        for r, cs in self._comms_of.items():
            groups.setdefault(tuple(c.hash for c in cs), []).append(r)
        jobs = []
        for sig, ranks in groups.items():
            lay = self._layout(sig)
            jobs += [(lay, ranks[i:i + 16]) for i in range(0, len(ranks), 16)]

        def job(lay, ranks):
            return {r: self._rank_stats_of(lay, r, slow_ns) for r in ranks}

        with ThreadPoolExecutor(_threads()) as ex:
            for res in ex.map(lambda j: job(*j), jobs):
                self._rank_stats.update(res)
        rows, warnings = {}, []
        for r in sorted(self._rank_stats):
            s = self._rank_stats[r]
            node, pod, pid = self.meta[r]
            rows[r] = RankRow(rank=r, node=node, pod=pod, pid=pid, collectives=s["n"],
                              p50_ms=s["p50"] / 1e6, p99_ms=s["p99"] / 1e6,
                              late_ms=(s["late"] or 0) / 1e6,
                              last_share=s["last"] / s["arrived"] if s["arrived"] else 0.0)
            rows[r].per_op = s["per_op"]
            if slow_ns is not None:
                rows[r].slow_collectives = s["slow"]
            if s["arrived"] == 0:
                warnings.append(f"rank {r}: no collective matched on another rank "
                                "(other ranks not traced?)")
        return rows, warnings

    def _layout(self, sig: tuple) -> list:
        """Per communicator of `sig`, per op: its seqs, and those other ranks called too with
        their median arrival."""
        out = []
        for h in sig:
            c = self.comms[h]
            arr = c.cnt > 1
            ops = []
            for code in range(1, len(OPS) + 1):
                cols = np.flatnonzero(c.opc == code)
                if len(cols):
                    cols_arr = cols[arr[cols]]
                    ops.append((code, _as_slice(cols), _as_slice(cols_arr), c.med[cols_arr]))
            out.append((c, arr, ops))
        return out

    def _rank_stats_of(self, lay: list, rank: int, slow_ns: int | None) -> dict:
        """Every per-rank statistic of one rank, from its rows of the matrices (views)."""
        d_all, d_op, late_op = [], {}, {}
        n = arrived = last = slow = 0
        t_min, t_max, end_max = _I64_MAX, _I64_MIN, _I64_MIN
        for c, arr, ops in lay:
            t, d = c.trows[c.row[rank]], c.drows[c.row[rank]]
            have = None if c.full else t != _I64_MAX
            if have is None:
                n += len(t)
                arrived += int(np.count_nonzero(arr))
                d_all.append(d)
                tt, dd = t, d
            else:
                n += int(np.count_nonzero(have))
                arrived += int(np.count_nonzero(have & arr))
                tt, dd = t[have], d[have]
                d_all.append(dd)
            if not len(tt):
                continue
            last += int(np.count_nonzero((t == c.mx) & arr))
            if slow_ns is not None:
                slow += int(np.count_nonzero(dd > slow_ns))
            t_min, t_max = min(t_min, int(tt.min())), max(t_max, int(tt.max()))
            end_max = max(end_max, int((tt + dd).max()))
            for code, cols, cols_arr, med in ops:
                dk, tk = d[cols], t[cols_arr]          # views when an op recurs at a fixed stride
                if have is not None:
                    dk = dk[have[cols]]
                    keep = have[cols_arr]
                    tk, med = tk[keep], med[keep]
                lk = tk.astype(np.float64)           # late = arrival - instance median, in double (SQL)
                lk -= med
                d_op.setdefault(code, []).append(dk)
                late_op.setdefault(code, []).append(lk)
        per_op, late_max = {}, None
        for code in sorted(d_op):
            dk = _sorted(d_op[code])
            if not len(dk):
                continue
            q50, q99 = _sorted_quantiles(dk, len(dk), (0.5, 0.99))
            per_op[OPS[code - 1]] = {"calls": len(dk), "p50_ms": q50 / 1e6, "p99_ms": q99 / 1e6}
            lk = _sorted(late_op[code], scratch=True)
            if len(lk):
                m = _sorted_quantiles(lk, len(lk), (0.5,))[0]
                late_max = m if late_max is None else max(late_max, m)
        d = _sorted(d_all)
        p50, p99 = _sorted_quantiles(d, len(d), (0.5, 0.99))
        return dict(n=n, p50=p50, p99=p99, per_op=per_op, late=late_max, arrived=arrived, last=last,
                    slow=slow, t_min=t_min, t_max=t_max, end_max=end_max)

    def traced_ns(self) -> int:
        s = self._rank_stats.values()
        return (max(x["end_max"] for x in s) - min(x["t_min"] for x in s)) if s else 0

    def span_ns(self) -> int:
        s = self._rank_stats.values()
        return (max(x["t_max"] for x in s) - min(x["t_min"] for x in s)) if s else 0

    def retransmits_by_rank(self) -> list[tuple[int, int, int]]:
        from ingero.analysis import _RETX_BY_RANK

        out = []
        for rank, tss in self.con.execute(f"""
                SELECT grank, list(DISTINCT ts) FILTER (WHERE ts IS NOT NULL)
                FROM ({_RETX_BY_RANK}) WHERE grank IS NOT NULL GROUP BY grank""").fetchall():
            ts = np.array(sorted(tss or []), dtype=np.int64)
            hit = np.zeros(len(ts), bool)
            for c in self._comms_of.get(rank, ()) if len(ts) else ():
                t = c.trows[c.row[rank]]
                e = t + c.drows[c.row[rank]]
                if not c.full:
                    have = t != _I64_MAX
                    t, e = t[have], e[have]
                if not len(t):
                    continue
                if not (np.diff(t) >= 0).all():   # calls out of seq order: sort them by arrival
                    o = np.argsort(t, kind="stable")
                    t, e = t[o], e[o]
                # in a window: some call that started at or before ts ends at or after it
                reach = np.maximum.accumulate(e)
                i = np.searchsorted(t, ts, side="right") - 1
                hit |= (i >= 0) & (reach[np.maximum(i, 0)] >= ts)
            out.append((rank, len(ts), int(np.count_nonzero(hit))))
        return out

    @staticmethod
    def _col_chunks(c: _Comm, width: int = 4096) -> list[slice]:
        return [slice(a, min(a + width, c.S)) for a in range(0, c.S, width)]

    def lateness_total_ns(self, late: list) -> int | None:
        late = {int(k) for k in late}
        total = groups = 0
        for c in self.comms.values():
            lr = [i for i, r in enumerate(c.ranks) if r in late]
            orows = [i for i, r in enumerate(c.ranks) if r not in late]
            if not lr or not orows:
                continue
            for cs in self._col_chunks(c):
                lt, ot = c.tcols(lr, cs), c.tcols(orows, cs)
                if not c.full:
                    lt = np.where(lt == _I64_MAX, _I64_MIN, lt)
                    ot = np.where(ot == _I64_MAX, _I64_MIN, ot)
                lt, ot = lt.max(axis=0), ot.max(axis=0)
                both = (lt > _I64_MIN) & (ot > _I64_MIN)
                groups += int(np.count_nonzero(both))
                total += int(np.maximum(lt[both] - ot[both], 0).sum())
        return total if groups else None

    def retransmit_windows(self) -> tuple:
        """Median duration of calls without / with a retransmit (any connection) in flight, the
        instances with one, and all instances. Member row by member row: durations are counted
        in a histogram (all calls, and those with a retransmit in flight), then only the
        values in the bins that hold the medians are gathered."""
        retx = np.array(sorted(ts for (ts,) in self.con.execute(
            "SELECT timestamp_ns FROM tcp_events WHERE event = 'tcp_retransmit_skb' "
            "AND timestamp_ns IS NOT NULL").fetchall()), dtype=np.int64)
        comms = list(self.comms.values())
        instances = sum(int(np.count_nonzero(c.cnt)) for c in comms)
        narrow = all(c.dtype == np.uint32 for c in comms)
        plans = []                                   # per comm: candidate seqs, their first retransmit, count
        for c in comms:
            cand = np.zeros(0, np.int64)
            if len(retx):
                reach = np.full(c.S, _I64_MIN, np.int64)
                for t, d in zip(c.trows, c.drows):
                    e = t + d
                    if not c.full:
                        e[t == _I64_MAX] = _I64_MIN
                    np.maximum(reach, e, out=reach)
                first = np.searchsorted(retx, c.mn)
                k = np.searchsorted(retx, reach, side="right") - first   # retransmits in the instance's span
                k[c.cnt == 0] = 0
                cand = np.flatnonzero(k > 0)
                plans.append((cand, first[cand], k[cand]))
            else:
                plans.append((cand, cand, cand))

        def covered(c, rows, plan) -> np.ndarray:
            """For member rows `rows`: which candidate seqs they called with a retransmit in flight."""
            cand, fc, kc = plan
            t = np.stack([c.trows[i][cand] for i in rows])
            e = t + np.stack([c.drows[i][cand] for i in rows])
            hit = np.zeros(t.shape, bool)
            few = kc <= 16
            for j in range(int(kc[few].max()) if few.any() else 0):
                cols = np.flatnonzero(few & (kc > j))
                r = retx[fc[cols] + j]
                hit[:, cols] |= (t[:, cols] <= r) & (r <= e[:, cols])
            many = np.flatnonzero(~few)
            if len(many):      # a long instance with many retransmits: search per call
                jj = np.searchsorted(retx, t[:, many])
                hit[:, many] = (jj < len(retx)) & (retx[np.minimum(jj, len(retx) - 1)] <= e[:, many])
            if not c.full:
                hit &= t != _I64_MAX
            return hit

        marks: dict = {}     # (comm, group) -> packed bits of the calls with a retransmit in flight

        def groups_of(c, plan, size=64):
            """Member rows in groups: (durations, calls with a retransmit in flight, calls made
            without one) for each group."""
            for g in range(0, len(c.ranks), size):
                rows = range(g, min(g + size, len(c.ranks)))
                d = c.dcols(rows, slice(None))
                packed = marks.get((c.hash, g))
                if packed is None:
                    cov = np.zeros(d.shape, bool)
                    if len(plan[0]):
                        cov[:, plan[0]] = covered(c, rows, plan)
                    marks[(c.hash, g)] = np.packbits(cov, axis=1)
                else:
                    cov = np.unpackbits(packed, axis=1, count=d.shape[1]).view(bool)
                # calls made without a retransmit in flight (None: all others, ~cov)
                clean = None if c.full else (c.tcols(rows, slice(None)) != _I64_MAX) & ~cov
                yield d, cov, clean

        def count(job):
            c, plan = job
            hall = np.zeros(1 << 16, np.int64)
            hslow = np.zeros(1 << 16, np.int64)
            n_clean = n_slow = 0
            hit_cols = np.zeros(c.S, bool)
            for d, cov, clean in groups_of(c, plan):
                slow = int(np.count_nonzero(cov))
                n_slow += slow
                n_clean += d.size - slow if clean is None else int(np.count_nonzero(clean))
                hit_cols |= cov.any(axis=0)
                if narrow:       # clean = all calls made - those with a retransmit in flight
                    top = (d >> 16).ravel()
                    hall += np.bincount(top if clean is None else top[(clean | cov).ravel()],
                                        minlength=1 << 16)
                    hslow += np.bincount(top[cov.ravel()], minlength=1 << 16)
            return hall, hslow, n_clean, n_slow, int(np.count_nonzero(hit_cols))

        with ThreadPoolExecutor(_threads()) as ex:
            counted = list(ex.map(count, zip(comms, plans)))
        slow_instances = sum(x[4] for x in counted)
        n_clean, n_slow = sum(x[2] for x in counted), sum(x[3] for x in counted)
        if not narrow:          # 64-bit durations: gather them all
            clean_v, slow_v = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
            for c, plan in zip(comms, plans):
                for d, cov, clean in groups_of(c, plan):
                    clean_v.append(d[~cov if clean is None else clean].astype(np.int64))
                    slow_v.append(d[cov].astype(np.int64))
            return (quantiles(np.concatenate(clean_v), (0.5,), inplace=True)[0],
                    quantiles(np.concatenate(slow_v), (0.5,), inplace=True)[0], slow_instances, instances)
        hslow = sum(x[1] for x in counted)
        hclean = sum(x[0] for x in counted) - hslow
        want = _Hist([hclean, hslow], [n_clean, n_slow], True).wanted()
        bins = [{b for b, _ in w[0]} if w else set() for w in want]

        def pick(job):
            c, plan = job
            got = [{b: [] for b in bs} for bs in bins]
            for d, cov, clean in groups_of(c, plan):
                top = d >> 16
                for k, m in ((0, ~cov if clean is None else clean), (1, cov)):
                    for b in bins[k]:
                        got[k][b].append(d[(top == b) & m])
            return got

        with ThreadPoolExecutor(_threads()) as ex:
            picked = list(ex.map(pick, zip(comms, plans)))
        out = []
        for k, w in enumerate(want):
            if w is None:
                out.append(None)
                continue
            (b0, r0), (b1, r1) = w[0]
            sel = {b: np.sort(np.concatenate([v for p in picked for v in p[k][b]])) for b in bins[k]}
            out.append(_interp(float(sel[b0][r0]), float(sel[b1][r1]), w[1]))
        return out[0], out[1], slow_instances, instances


class _Hist:
    """Counts of unsigned 32-bit values by their top 16 bits, for exact medians of value sets
    too large to gather: the bins that hold the middle values are found from the counts."""

    def __init__(self, counts: list, n: list, narrow: bool):
        self.counts, self.n, self.narrow = counts, n, narrow

    def wanted(self) -> list:
        """Per set: ([(bin, rank within the bin) of the floor and ceil order statistics], d), or None."""
        out = []
        for counts, n in zip(self.counts, self.n):
            if not n or not self.narrow:
                out.append(None)
                continue
            cum = np.cumsum(counts)
            f, c, d = _kth(n, 0.5)
            picks = []
            for j in (f, c):
                b = int(np.searchsorted(cum, j, side="right"))
                picks.append((b, j - (int(cum[b - 1]) if b else 0)))
            out.append((picks, d))
        return out
