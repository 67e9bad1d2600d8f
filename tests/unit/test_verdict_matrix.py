"""A ground-truth matrix for the verdict: planted causes over tensor x pipeline x data layouts.

Every case is a simulated job (``bench.synthetic.pipeline_session``: Megatron rank order,
3% jitter on every piece of work) in one of three shapes: GPipe with ungrouped send/recv, a
data-parallel all-reduce and a world all-reduce ending each step; or as Megatron runs it,
1F1B with every exchange grouped (``batch_isend_irecv``), the distributed optimizer's
reduce-scatter and all-gather per stage, an embedding all-reduce between the first and last
stage and no collective that spans every rank; or FSDP (tp x dp, no pipeline): per layer the
parameters all-gathered before the forward and again before the backward, the gradients
reduce-scattered after it, each a coalesced group over the shard group, HSDP's all-reduce
over the replicate group on some layouts, and no collective once per step. It is written
through the real segment store with each node's clock off by up to 5 ms, then merged and
judged along the operator's own path (``gather.build_artifact`` with clock offsets that are
off by up to 50 us, as the measured ones are). The planted saving is the same run, same noise, without the fault.

Asserted per case: the rank, group or node named; the cause; and the saving within
+-25% of the planted one (never above the step). The floors and shares in
``ingero.analysis.verdict`` are justified by this matrix (plus the real lab runs in
tests/bpf and bench/verdict_lab), not by one lab run.
"""

from __future__ import annotations

import numpy as np
import pytest

from bench.synthetic import pipeline_session
from ingero.analysis.verdict import SAVING_FLOOR_PCT, SPREAD_FLOOR_PCT

# (tp, pp, dp, nodes)
LAYOUTS = [(2, 2, 2, 2), (1, 4, 2, 2), (2, 4, 1, 2), (4, 2, 2, 4), (1, 2, 4, 2), (2, 3, 2, 3), (1, 8, 1, 2),
           (2, 2, 4, 4), (4, 1, 2, 2)]
FAULTS = ["clean", "slow-rank", "cpu-contention", "io", "slow-stage", "slow-node", "imbalance", "network"]
CAUSE = {"slow-rank": "compute/unknown", "cpu-contention": "cpu-contention", "io": "io"}
# Cases whose figure lies outside +-25% for a reason the test names (strict: a fix shows up).
KNOWN = {"tp2pp4dp1-imbalance-1f1b": "'spread' is named right, but fixing every rank's excess (each slot capped at "
                                     "its median) saves 1.27x the planted 'everyone at the median draw': capping keeps "
                                     "the faster ranks fast; the ratio spans 0.74-1.27 over layouts and seeds"}
# HSDP on streams: each layer's replicate all-reduce runs beside the next layer's backward, which
# never waits for it. A device trace cannot tell that from a wait (an event follows the latest end
# on each of its rank's streams), so work done while the all-reduce ran counts as waiting for it.
_BESIDE = ("the replicate all-reduce's end is taken as a wait of the next layer's backward, which ran beside "
           "it: shortening it frees work that never waited (replayed saving {}x the planted)")
KNOWN["tp1pp1dp8r2-network-fsdp-streams"] = _BESIDE.format(2.8)
KNOWN["tp1pp1dp8r2-imbalance-fsdp-streams"] = _BESIDE.format(1.4)
SHAPES = {"gpipe-world": {}, "1f1b": {"schedule": "1f1b", "world": False, "dist_opt": True, "embedding": True}}
# On GPUs with the profiler plugin, every process group on its own stream: the step's data-parallel
# reduce-scatter and embedding all-reduce side by side (async), HSDP's replicate all-reduce beside
# the next layer's backward. Layouts (a subset: each case costs seconds)
STREAMS = {"schedule": "1f1b", "world": False, "dist_opt": True, "embedding": True, "gpu": "plugin", "streams": True}
STREAM_LAYOUTS = [(2, 2, 2, 2), (1, 4, 2, 2)]
# FSDP: (tp, pp, dp, nodes, replicas); replicas > 1 is HSDP
FSDP_LAYOUTS = [(1, 1, 4, 2, 1), (2, 1, 4, 2, 1), (1, 1, 8, 4, 1), (2, 1, 2, 2, 1), (1, 1, 8, 2, 2), (2, 1, 4, 4, 2)]
FSDP_LAYERS = 4


def _cases():
    rng = np.random.default_rng(2026)
    out = []
    fsdp = [((tp, pp, dp, nodes), {"fsdp": {"fsdp": FSDP_LAYERS, "replicas": rep, "world": False}})
            for tp, pp, dp, nodes, rep in FSDP_LAYOUTS]
    fsdp += [((tp, pp, dp, nodes), {"fsdp-streams": {"fsdp": FSDP_LAYERS, "replicas": rep, "world": False,
                                                     "gpu": "plugin", "streams": True}})
             for tp, pp, dp, nodes, rep in FSDP_LAYOUTS if rep > 1]
    shaped = [(lay, {**SHAPES, "1f1b-streams": STREAMS} if lay in STREAM_LAYOUTS else SHAPES) for lay in LAYOUTS]
    for (tp, pp, dp, nodes), shapes in shaped + fsdp:
        world = tp * pp * dp
        for fault in FAULTS:
            kw = {"fault": fault, "seed": int(rng.integers(1, 10_000)),
                  "skew_ns": [int(x) for x in rng.integers(-5_000_000, 5_000_000, nodes)]}
            if fault in CAUSE:
                kw.update(victim=int(rng.integers(0, world)), slow=round(float(rng.uniform(1.4, 2.0)), 2))
            elif fault == "slow-stage":
                kw.update(stage_slow=int(rng.integers(0, pp)), slow=round(float(rng.uniform(1.3, 1.6)), 2))
            elif fault == "network":
                kw.update(lossy_node=int(rng.integers(0, nodes)), loss_ms=round(float(rng.uniform(1.5, 4.0)), 1))
            elif fault == "slow-node":
                kw.update(lossy_node=int(rng.integers(0, nodes)), slow=round(float(rng.uniform(1.3, 1.6)), 2))
            if fault == "slow-stage" and pp == 1:
                continue
            for shape, skw in shapes.items():
                name = f"tp{tp}pp{pp}dp{dp}r{skw['replicas']}" if skw.get("replicas", 1) > 1 else f"tp{tp}pp{pp}dp{dp}"
                name += f"-{fault}-{shape}"
                out.append(pytest.param((tp, pp, dp, nodes), {**kw, **skw}, id=name,
                                        marks=[pytest.mark.xfail(strict=True, reason=KNOWN[name])] if name in KNOWN else []))
    return out


CASES = _cases()


def test_the_matrix_has_at_least_40_cases_over_every_fault_in_each_shape():   # FSDP has no stage
    for shape in SHAPES:
        mine = [c for c in CASES if c.id.endswith("-" + shape)]
        assert len(mine) >= 40
        assert {c.values[1]["fault"] for c in mine} == set(FAULTS)
    fsdp = [c for c in CASES if c.id.endswith("-fsdp")]
    assert len(fsdp) >= 40 and {c.values[1]["fault"] for c in fsdp} == set(FAULTS) - {"slow-stage"}
    assert any(c.values[1]["replicas"] > 1 for c in fsdp)
    streams = [c for c in CASES if "-streams" in c.id]
    assert {c.values[1]["fault"] for c in streams} == set(FAULTS)


# A loss reduced for logging every few steps (torchtitan, Megatron): a collective seen 3+ times,
# rarer than any once-per-step one, that must not become the step. (tp, pp, dp, nodes), shape
LOGGED = [((2, 2, 2, 2), SHAPES["1f1b"]), ((1, 4, 2, 2), SHAPES["1f1b"]),
          ((2, 1, 4, 2), {"fsdp": FSDP_LAYERS, "world": False})]


def _logged_cases():
    rng = np.random.default_rng(10)
    out = []
    for every in (4, 10):
        for (tp, pp, dp, nodes), skw in LOGGED:
            for fault in ("clean", "slow-rank", "network"):
                kw = {"fault": fault, "seed": int(rng.integers(1, 10_000)), "log_every": every,
                      "skew_ns": [int(x) for x in rng.integers(-5_000_000, 5_000_000, nodes)], **skw}
                if fault == "slow-rank":
                    kw.update(victim=int(rng.integers(0, tp * pp * dp)), slow=1.6)
                elif fault == "network":
                    kw.update(lossy_node=int(rng.integers(0, nodes)), loss_ms=3.0)
                shape = "fsdp" if "fsdp" in skw else "1f1b"
                out.append(pytest.param((tp, pp, dp, nodes), kw, id=f"tp{tp}pp{pp}dp{dp}-{fault}-{shape}-log{every}"))
    return out


def _judged(tmp_path, layout, kw, steps=12):
    """The case's session through the operator's own path: (report, ground truth)."""
    from ingero_operator import gather

    tp, pp, dp, nodes = layout
    gt = pipeline_session(tmp_path / "work" / "nodes", tp, pp, dp, nodes=nodes, steps=steps, **kw)
    err = np.random.default_rng(kw["seed"]).integers(-50_000, 50_000, nodes)   # the offsets' own error
    offsets = {n: o + int(e) for (n, o), e in zip(sorted(gt["offsets"].items()), err)}
    rep, _ = gather.build_artifact(gather.LocalSession(tmp_path), offsets)
    return rep, gt


@pytest.mark.parametrize("layout,kw", _logged_cases())
def test_a_loss_logged_every_few_steps_leaves_the_step_one_step(tmp_path, layout, kw):
    """Seen 3 or more times (16 steps logging every 4th, 32 every 10th), the logged loss is the
    rarest collective; the step is still one step, and the verdict the planted one."""
    rep, gt = _judged(tmp_path, layout, kw, steps=8 + 3 * kw["log_every"])
    assert rep.step_ms == pytest.approx(gt["step_ms"], rel=0.10), (rep.step_ms, gt["step_ms"])
    assert rep.mean_step_ms == pytest.approx(gt["step_ms"], rel=0.10), (rep.mean_step_ms, gt["step_ms"])
    _check(rep, gt, kw)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_step_of_one_kind_of_call_repeated_keeps_its_once_per_step_marker(tmp_path, tp):
    """Tensor parallel only: 8 all-reduces of one group, then the step's world all-reduce over
    the same ranks (as a data-parallel job's gradient buckets, then a once-per-step call). The
    all-reduces between two world ones repeat and connect every rank, yet are no steps."""
    kw = {"fault": "slow-rank", "victim": 1, "slow": 1.6, "seed": 11, "skew_ns": [0]}
    rep, gt = _judged(tmp_path, (tp, 1, 1, 1), kw)
    assert rep.step_ms == pytest.approx(gt["step_ms"], rel=0.10), (rep.step_ms, gt["step_ms"])
    _check(rep, gt, kw)


@pytest.mark.parametrize("layout,kw", CASES)
def test_the_verdict_names_the_planted_cause(tmp_path, layout, kw):
    rep, gt = _judged(tmp_path, layout, kw)
    _check(rep, gt, kw)


def _check(rep, gt, kw):
    s, fault = rep.straggler, kw["fault"]
    planted_pct = 100 * gt["planted_saving_ms"] / gt["step_ms"]
    where = (f"{fault}: {s}; best {rep.best_candidate} {rep.best_saving_pct}%; planted "
             f"{gt['planted_saving_ms']:.2f} ms ({planted_pct:.1f}%)")
    floor = SPREAD_FLOOR_PCT if fault == "imbalance" else SAVING_FLOOR_PCT
    if fault == "clean" or planted_pct < 0.8 * floor:   # below the floor: nobody, with the figure
        assert s is None and rep.best_saving_pct < floor, where
        return
    if s is None and planted_pct < 1.25 * floor:        # near the floor: nobody, with the right figure
        assert rep.best_saving_pct == pytest.approx(planted_pct, rel=0.25), where
        return
    assert s is not None, where
    if fault in CAUSE:
        assert (s.kind, s.rank, s.cause) == ("rank", kw["victim"], CAUSE[fault]), where
    elif fault == "slow-stage":
        stage_ranks = gt["stage_ranks"]
        if len(stage_ranks) == 1:     # a stage of one rank is that rank
            assert (s.kind, s.ranks) == ("rank", stage_ranks), where
        else:
            assert s.kind == "stage" and s.ranks == stage_ranks, where
    elif fault == "slow-node":   # or the stage it is, when it holds exactly one stage
        st = gt["layout"]["stage"]
        same_stage = sorted(r for r in st if st[r] == st[gt["node_ranks"][0]])
        assert s.ranks in (gt["node_ranks"], same_stage) and s.kind in ("node", "stage"), where
    elif fault == "imbalance":
        assert (s.kind, s.cause) == ("spread", "imbalance"), where
    elif fault == "network":
        assert (s.cause, s.node) == ("network", gt["lossy_node"]), where
    assert 0 < s.saving_ms_per_step < rep.mean_step_ms, where
    assert s.saving_ms_per_step == pytest.approx(gt["planted_saving_ms"], rel=0.25), where


# A busy machine's jitter on every sync event: "fix everyone" caps each event at its slot's
# median and removes that jitter too, which adds up with the sync events per step (FSDP: ~20
# per rank). (tp, pp, dp, nodes), shape
JITTERY = [((2, 1, 4, 2), {"fsdp": FSDP_LAYERS, "world": False}), ((1, 1, 8, 2), {"fsdp": FSDP_LAYERS, "world": False}),
           ((2, 2, 2, 2), SHAPES["1f1b"])]


@pytest.mark.parametrize("jitter", [0.15, 0.2])
@pytest.mark.parametrize("fault", ["clean", "imbalance"])
@pytest.mark.parametrize("layout,skw", JITTERY, ids=["fsdp-tp2dp4", "fsdp-dp8", "1f1b-tp2pp2dp2"])
def test_jitter_on_every_sync_event_is_no_imbalance(tmp_path, layout, skw, fault, jitter):
    """Clean: nobody (per-event capping saved 13-20% here); every rank-step 1-2x (the lab's): spread,
    with the planted saving (everyone at the median draw, no jitter)."""
    kw = {"fault": fault, "seed": 3, "jitter": jitter, "imbalance": 1.0, **skw}
    rep, gt = _judged(tmp_path, layout, kw)
    _check(rep, gt, kw)
