"""A group whose end was not traced: the probes attach its end first, and the analysis
does not let one such group chain every instance of the trace into one.

Probes reach a running job one function after the other. With ncclGroupStart probed
before ncclGroupEnd, a start can be seen without its end, and every later call of that
thread falls into one group: in a 3D lab job probed late on a busy machine, one event
holding 600 collectives. Joining the instances launched together (calls._join) would then
make one instance of them all, with many events of each other rank, which waits for
itself: the replay met 151 cycles."""

from __future__ import annotations

import numpy as np

from ingero.analysis.calls import _join
from ingero_agent.elfsyms import NCCL_SYMBOLS
from ingero_agent.probes import GROUP_CLOSERS, entry_order


def test_the_ends_of_groups_are_probed_before_their_starts():
    order = entry_order(NCCL_SYMBOLS)
    assert sorted(order) == sorted(NCCL_SYMBOLS)
    assert order.index("ncclGroupEnd") < order.index("ncclGroupStart")
    assert set(order[:len(GROUP_CLOSERS)]) == set(GROUP_CLOSERS)


def _events(groups: list[tuple[int, list[int]]]):
    """(instance of each row, event of each row, rank of each event) for events given as
    (rank, the instances of the collectives it holds)."""
    inst = [i for _, ins in groups for i in ins]
    owner = [e for e, (_, ins) in enumerate(groups) for _ in ins]
    return np.array(inst), np.array(owner), np.array([r for r, _ in groups])


def test_instances_launched_together_are_joined_on_every_rank():
    # a coalesced launch of instances 0 and 1 on ranks 0 and 1, then instance 2 alone
    got = _join(*_events([(0, [0, 1]), (0, [2]), (1, [0, 1]), (1, [2])]))
    assert got.tolist() == [0, 2, 0, 2]


def test_a_group_that_never_ends_does_not_chain_every_instance_into_one():
    # rank 0's group holds instances 0-3 (its end was not traced); rank 1 ran them one by one
    got = _join(*_events([(0, [0, 1, 2, 3]), (1, [0]), (1, [1]), (1, [2]), (1, [3])]))
    assert got.tolist() == [0, 0, 1, 2, 3]


def test_sends_and_receives_with_no_communicator_rank_known_have_no_peer():
    """No call names its communicator rank (every crank -1): a send's or receive's peer is
    unknown (-1), not an error."""
    from ingero.analysis.calls import _RECV, _SEND, _members_and_peers

    members, peer = _members_and_peers(np.array([0, 1]), np.array([_SEND, _RECV]), np.array([5, 5]),
                                       np.array([-1, -1]), np.array([1, 0]))
    assert members == {} and peer.tolist() == [-1, -1]
