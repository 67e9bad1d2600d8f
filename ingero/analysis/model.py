"""What the analysis returns: per-rank rows, the straggler verdict and the report."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class RankRow:
    rank: int
    node: str | None
    pod: str | None
    pid: int
    collectives: int = 0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    late_ms: float = 0.0          # median arrival lateness vs the instance median (largest per-op median)
    last_share: float = 0.0       # share of collectives where it arrived last
    late_z: float = 0.0
    retransmits: int = 0          # on its own connections, whole trace
    retransmits_in_window: int = 0
    slow_collectives: int | None = None   # collectives over the session's threshold, when one is set
    offcpu_ms: dict = field(default_factory=dict)  # reason -> ms
    offcpu_waits: dict = field(default_factory=dict)  # reason -> number of waits (from kernel totals only)
    per_op: dict = field(default_factory=dict)     # op -> {"calls", "p50_ms", "p99_ms"}; ms None: not measured
    stage: int | None = None      # pipeline stage, when the job has a pipeline
    own_ms: float = 0.0           # own work per step: time between its blocking calls
    wait_ms: float = 0.0          # per step: time blocked on other ranks at its calls
    net_wait_ms: float | None = None  # its sends' wait on the network, whole trace (nccl_proxy)


Rows = dict[int, RankRow]     # rank -> its row: what the analysis's modules hand each other


@dataclass
class Straggler:
    rank: int | None              # the rank named (for a group: the worst rank in it)
    node: str | None
    pod: str | None
    cause: str                    # network | cpu-contention | io | compute/unknown | imbalance
    score: float
    evidence: str
    saving_ms_per_step: float     # replayed: measured step - predicted step with the fix
    saving_pct: float
    group: str | None = None      # "stage 1 (ranks 4-7)", "node lab-node-b", "spread: no single rank"
    kind: str = "rank"            # rank | stage | node | spread
    ranks: list = field(default_factory=list)
    propagated: list = field(default_factory=list)   # "rank 12 is late because it waits on rank 4"


@dataclass
class Hang:
    """A job stopped in NCCL: ranks wait in a call that one or more ranks never entered."""

    waiting: list                 # [{"rank", "op", "comm", "seq", "since_ns"}]: calls entered, not returned
    missing: list                 # ranks that never entered the call the others wait in
    op: str | None                # the call the others wait in (ALL_REDUCE, RECV, ...)
    comm: str | None              # its communicator (hash, hex)
    seq: int | None
    waited_s: float               # how long the longest waiter has waited, at the trace's end
    evidence: str                 # one sentence: who waits in what, who never came, what its threads do


@dataclass
class Report:
    ranks: list[RankRow]
    straggler: Straggler | None
    step_ms: float
    collectives: int
    retransmits: int
    warnings: list[str]
    mean_step_ms: float = 0.0         # replayed step of the measured run (whole steps)
    predicted_step_ms: float | None = None   # with the named fix
    best_saving_pct: float = 0.0      # the best single fix's saving, named or not (below the floor)
    best_candidate: str | None = None
    timing: str = "host"              # device (the profiler plugin's GPU times), host, host-enqueue
    # Why the trace cannot support a verdict (no calls, no steps, ranks or communicators
    # unknown): then `straggler` is None and that is no all-clear. None: judged.
    cannot_judge: str | None = None
    covered_ranks: list | None = None  # the ranks a verdict covers, when not every rank of the job
    hang: Hang | None = None

    @property
    def verdict(self) -> str:
        """hang | cannot-judge | straggler | none (a judged job with nobody to name)."""
        if self.hang is not None:
            return "hang"
        if self.cannot_judge:
            return "cannot-judge"
        return "straggler" if self.straggler is not None else "none"

    def to_dict(self) -> dict:
        return {**asdict(self), "verdict": self.verdict}

    @classmethod
    def from_dict(cls, d: dict) -> "Report":
        """The report `to_dict` wrote (e.g. the operator's report.json; keys it does not know
        are ignored). Raises ValueError when a required field is missing."""
        try:
            s, h = d.get("straggler"), d.get("hang")
            return cls(**{**_known(cls, d), "ranks": [RankRow(**_known(RankRow, r)) for r in d["ranks"]],
                          "straggler": Straggler(**_known(Straggler, s)) if s else None,
                          "hang": Hang(**_known(Hang, h)) if h else None})
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a report: {e}") from None


def _known(cls, d: dict) -> dict:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in d.items() if k in names}
