"""Off-CPU figures the verdict's rules share (ingero.analysis.verdict): a rank's wait per
off-CPU interval against its peers', and the scale floor of an off-CPU outlier."""

from __future__ import annotations

from ingero.analysis.model import RankRow
from ingero.analysis.verdict import _offcpu_floor_ms, _per_wait_ratio


def _row(r: int, ms: dict, waits: dict) -> RankRow:
    return RankRow(rank=r, node="a", pod=None, pid=r, offcpu_ms=ms, offcpu_waits=waits)


def test_the_wait_per_interval_counts_every_rank_with_an_interval_count():
    # per interval: rank 0 30 ms in 1, rank 1 no runqueue time in 2, rank 2 1 ms in 2 (any reason)
    rows = {0: _row(0, {"runqueue": 30.0}, {"runqueue": 1}), 1: _row(1, {}, {"runqueue": 2}),
            2: _row(2, {"runqueue": 1.0}, {"runqueue": 1, "io": 1}), 3: _row(3, {"runqueue": 9.0}, {})}
    assert _per_wait_ratio(rows, 0) == 30.0 / 0.25          # the peers' median: (0 + 0.5) / 2
    assert _per_wait_ratio({0: rows[0], 2: rows[2]}, 0) == 60.0
    assert _per_wait_ratio(rows, 3) is None                 # no interval count
    assert _per_wait_ratio({0: rows[0]}, 0) is None         # no peer
    assert _per_wait_ratio({0: rows[0], 1: rows[1]}, 0) is None   # peers that never waited
    io = {0: _row(0, {"io": 8.0}, {"io": 2}), 2: _row(2, {"io": 1.0}, {"io": 1})}
    assert _per_wait_ratio(io, 0, "io") == 4.0


def test_the_off_cpu_floor_is_10_ms_or_0_2_percent_of_the_traced_time():
    assert _offcpu_floor_ms(1_000 * 1_000_000) == 10.0
    assert _offcpu_floor_ms(10_000 * 1_000_000) == 20.0
