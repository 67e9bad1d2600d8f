"""The slow-node rule (ingero.analysis.verdict._slow_nodes) on hand-built rows: which ranks
count, the reference each is compared with, each threshold at its figure, and the order."""

from __future__ import annotations

from ingero.analysis.model import RankRow
from ingero.analysis.verdict import NODE_SLOW, _slow_nodes


def _rows(nodes: dict) -> dict:
    return {r: RankRow(rank=r, node=nd, pod=None, pid=r) for r, nd in nodes.items()}


def _found(rows: dict, own: dict, stage: dict | None = None) -> list:
    return [(s.node, s.ranks, s.ratio) for s in _slow_nodes(rows, own, stage or {})]


def test_three_ranks_are_enough_and_a_rank_without_a_row_is_left_out():
    rows = _rows({0: "a", 1: "a", 2: "b"})
    assert _found(rows, {0: 2.0, 1: 2.0, 2: 1.0, 9: 5.0}) == [("a", [0, 1], {0: 2.0, 1: 2.0})]


def test_a_one_rank_node_is_never_slow_and_does_not_stop_the_others():
    rows = _rows({0: "a", 1: "b", 2: "b", 3: "c", 4: "c"})
    assert _found(rows, {0: 9.0, 1: 2.0, 2: 2.0, 3: 1.0, 4: 1.0}) == [("b", [1, 2], {1: 2.0, 2: 2.0})]


def test_ranks_without_a_stage_are_role_0_compared_with_role_0_elsewhere():
    rows = _rows({0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c"})
    own = {0: 2.0, 1: 2.0, 2: 4.0, 3: 4.0, 4: 1.0, 5: 1.0}
    # node b holds role 1 whole: its ranks are compared with the other nodes' ranks (median 1.5)
    assert _found(rows, own, {2: 1, 3: 1}) == [("b", [2, 3], {2: 4.0 / 1.5, 3: 4.0 / 1.5}),
                                               ("a", [0, 1], {0: 2.0, 1: 2.0})]


def test_own_work_under_one_unit_still_gives_its_ratio():
    rows = _rows({0: "a", 1: "a", 2: "b", 3: "b"})
    assert _found(rows, {0: 0.5, 1: 0.5, 2: 0.25, 3: 0.25}) == [("a", [0, 1], {0: 2.0, 1: 2.0})]


def test_a_node_at_node_slow_exactly_is_slow():
    rows = _rows({0: "a", 1: "a", 2: "b", 3: "b"})
    assert NODE_SLOW == 1.05
    assert _found(rows, {0: 1.05, 1: 1.05, 2: 1.0, 3: 1.0}) == [("a", [0, 1], {0: 1.05, 1: 1.05})]


def test_ranks_alike_at_node_alike_exactly_are_one_slow_node():
    rows = _rows({0: "a", 1: "a", 2: "b", 3: "b"})
    # excesses 0.7 and 1.0: the least slow has exactly NODE_ALIKE of the slowest one's
    assert _found(rows, {0: 1.7, 1: 2.0, 2: 1.0, 3: 1.0}) == [("a", [0, 1], {0: 1.7, 1: 2.0})]


def test_slow_nodes_come_slowest_first():
    rows = _rows({0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c", 6: "d", 7: "d"})
    own = {0: 1.5, 1: 1.5, 2: 3.0, 3: 3.0, 4: 1.0, 5: 1.0, 6: 1.0, 7: 1.0}
    assert [n for n, _, _ in _found(rows, own)] == ["b", "a"]
