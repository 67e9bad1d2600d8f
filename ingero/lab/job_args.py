"""The lab job's shape on the command line: flags shared by `ingero lab run` and `ingero demo`."""

from __future__ import annotations

from ingero.errors import IngeroError


def add_job_shape_args(r) -> None:
    """The job's shape and its shape-specific faults (`ingero lab run` and `ingero demo`)."""
    from ingero.lab.faults import SCHEDULES, SHARDINGS

    r.add_argument("--layout", metavar="tp=T,pp=P,dp=D",
                   help="a tensor x pipeline x data parallel job (Megatron's rank order and groups, "
                        "communicators split from the world, no collective over every rank in a step); "
                        "T*P*D = nodes x ranks-per-node; default: the data-parallel job")
    r.add_argument("--microbatches", type=int, default=4, help="microbatches per step with --layout; default 4")
    r.add_argument("--schedule", choices=SCHEDULES, default="1f1b",
                   help="pipeline schedule with --layout: 1f1b (default; grouped send+recv as "
                        "batch_isend_irecv), gpipe (all forwards, then all backwards; single calls) or "
                        "interleaved (--virtual-stages model chunks per rank)")
    r.add_argument("--virtual-stages", type=int, default=2,
                   help="interleaved: model chunks per rank; default 2 (--microbatches a multiple of pp)")
    r.add_argument("--sharding", choices=SHARDINGS, default="optimizer",
                   help="data parallelism with --layout: optimizer (default; the distributed optimizer's "
                        "reduce-scatter and all-gather per step) or fsdp (no pipeline: per layer, the "
                        "parameters all-gathered before the forward and the backward and the gradients "
                        "reduce-scattered, each a coalesced group; no collective once per step)")
    r.add_argument("--layers", type=int, default=4, help="fsdp: layers per step; default 4")
    r.add_argument("--replicas", type=int, default=1,
                   help="fsdp: HSDP with this many replicas (shard groups of dp/replicas ranks, an all-reduce "
                        "per layer across them); default 1 (FSDP)")
    r.add_argument("--stage", type=int, default=1, help="slow-stage: the stage that is slower; default 1")
    r.add_argument("--slow-factor", type=float, default=None,
                   help="slow-rank / slow-stage: compute multiplier; default 2 (slow-rank), 1.5 (slow-stage)")
    r.add_argument("--imbalance", type=float, default=1.0,
                   help="imbalance: per-step compute factor drawn from [1, 1 + this]; default 1")


def ranks_per_node(args) -> int:
    """--ranks-per-node, or with --layout and without it, the layout's world over the nodes."""
    if args.ranks_per_node is not None or not args.layout:
        return 2 if args.ranks_per_node is None else args.ranks_per_node
    from ingero.lab.faults import parse_layout

    t, p_, d = parse_layout(args.layout, None) or (1, 1, 1)   # a layout was given
    if (t * p_ * d) % max(args.nodes, 1):
        raise IngeroError(f"--layout {args.layout} has {t * p_ * d} ranks, which {args.nodes} nodes cannot share "
                          "evenly; give --nodes or --ranks-per-node")
    return t * p_ * d // max(args.nodes, 1)


def job_shape(args) -> dict:
    """LabConfig fields from add_job_shape_args' flags (the slow factor checked, its default
    per scenario)."""
    out = {"layout": args.layout, "microbatches": args.microbatches, "stage": args.stage,
           "imbalance": args.imbalance, "schedule": args.schedule, "virtual_stages": args.virtual_stages,
           "sharding": args.sharding, "layers": args.layers, "replicas": args.replicas}
    if args.slow_factor is not None:
        if not 1.0 < args.slow_factor <= 100:
            raise IngeroError(f"--slow-factor {args.slow_factor} is out of range: use more than 1, at most 100")
        out["slow_factor"] = args.slow_factor
    elif args.scenario == "slow-stage":
        out["slow_factor"] = 1.5
    return out
