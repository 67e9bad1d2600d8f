"""NTP-style clock offsets between this machine and a node's agent.

We note our wall clock before (t0) and after (t1) asking the agent for its
wall clock (a). Assuming the answer was taken half-way, offset = a - (t0 + t1) / 2
and the error is at most half the round trip, so of several samples the one
with the lowest round trip wins. A node timestamp ts is then ``ts - offset``
on our clock.

Shared by the operator and ``ingero fleet``; both measure against the agent's
``/v1/time`` through ``ingero.http_client.Agent.clock_offset``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Awaitable, Callable


@dataclass(frozen=True)
class ClockSample:
    t0_ns: int       # our wall clock when the request left
    agent_ns: int    # the agent's wall clock in its answer
    t1_ns: int       # our wall clock when the answer arrived

    @property
    def rtt_ns(self) -> int:
        return self.t1_ns - self.t0_ns

    @property
    def offset_ns(self) -> int:
        return self.agent_ns - (self.t0_ns + self.t1_ns) // 2


def estimate_offset(samples: list[ClockSample]) -> tuple[int, int]:
    """(offset_ns, rtt_ns) of the sample with the lowest round trip."""
    good = [s for s in samples if s.rtt_ns >= 0]
    if not good:
        raise ValueError("no usable clock sample (every round trip was negative)")
    best = min(good, key=lambda s: s.rtt_ns)
    return best.offset_ns, best.rtt_ns


async def measure_offset(agent_wall_ns: Callable[[], Awaitable[int]], samples: int = 8) -> tuple[int, int]:
    """Await `agent_wall_ns()` `samples` times, one after the other; (offset_ns, rtt_ns)."""
    got = []
    for _ in range(max(1, samples)):
        t0 = time.time_ns()
        a = await agent_wall_ns()
        got.append(ClockSample(t0, int(a), time.time_ns()))
    return estimate_offset(got)
