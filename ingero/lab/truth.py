"""What the machine did to a lab job, from the kernel's own counts rather than the tracer.

A clean lab job beside other work is not always clean: the machine may starve one of its
ranks (a CI run beside a cpu-hog lab can: rank 1 of the GPU-like clean job then waits
1.85x its peers in the runqueue and works 9.8 ms/step more). Naming that rank with
cause cpu-contention is then the right verdict, and "nobody" is no longer the only one.
Whether it happened is judged here from each rank's runqueue wait over its steps as the
kernel counts it (``run_delay`` of /proc/<pid>/task/*/schedstat, which the lab worker
reads at the first and the last step and reports as ``runq_ms``), independent of the
eBPF probes and of the analysis whose verdict it checks.
"""

from __future__ import annotations

from statistics import median

# a named rank's extra runqueue wait over the steps must hold at least this share of the
# saving its verdict claims (the analysis names cpu-contention when the extra wait inside
# its own work is at least half of its excess own work)
STARVED_SHARE_OF_SAVING = 0.5


def machine_starved(stats: dict, rank: int, saving_ms_per_step: float) -> str:
    """'' when the kernel's counts say the machine starved `rank` enough for a verdict saving
    `saving_ms_per_step`: its runqueue wait over the steps is beyond its peers' median by
    STARVED_SHARE_OF_SAVING of the claimed saving over its steps. (Not necessarily the
    longest: a rank that waits for a CPU inside its collectives, where it waits for the
    others anyway, slows nobody.) Otherwise why not, in one line. `stats`: {rank: the
    worker's final stats}."""
    waits = {r: s.get("runq_ms") for r, s in stats.items()}
    if rank not in waits or any(w is None for w in waits.values()) or len(waits) < 2:
        return f"no runqueue wait from the kernel for every rank: {waits}"
    peers = median(w for r, w in waits.items() if r != rank)
    steps = int(stats[rank].get("steps") or 0)
    need = STARVED_SHARE_OF_SAVING * saving_ms_per_step * steps
    if waits[rank] - peers < need:
        return (f"rank {rank} waited {waits[rank]:.0f} ms for a CPU over {steps} steps vs a peer median of "
                f"{peers:.0f} ms: less than {need:.0f} ms more ({STARVED_SHARE_OF_SAVING:.0%} of the "
                f"{saving_ms_per_step:.1f} ms/step saving claimed)")
    return ""


def clean_verdict_problem(straggler, stats: dict) -> str:
    """'' when `straggler` is right for a clean job run on this machine: nobody, or a rank the
    machine starved, named cpu-contention (`machine_starved`). Otherwise what is wrong, in
    one line. `straggler`: an ingero.analysis Straggler, a TraceSession status's straggler
    (a dict), or None."""
    if straggler is None:
        return ""
    if isinstance(straggler, dict):
        kind, rank, cause = straggler.get("kind"), straggler.get("rank"), straggler.get("cause")
        group, saving = straggler.get("group"), float(straggler.get("savingMsPerStep") or 0.0)
    else:
        kind, rank, cause = straggler.kind, straggler.rank, straggler.cause
        group, saving = straggler.group, straggler.saving_ms_per_step
    if kind != "rank" or cause != "cpu-contention":
        return f"a clean job named {kind} {group or rank} ({cause})"
    why = machine_starved(stats, rank, saving)
    return f"a clean job named rank {rank} cpu-contention, but {why}" if why else ""


def hang_problem(hang, lab: dict) -> str:
    """'' when `hang` is right for the lab run `lab` (its lab.json): a hang scenario that
    stopped its victim for good is a hang that names the victim, and only it, as the rank
    the others wait for; any other run (the victim continued, or no hang scenario) has no
    hang. Otherwise what is wrong, in one line. `hang`: an ingero.analysis Hang, a report's
    "hang" (a dict), or None."""
    if isinstance(hang, dict) or hang is None:
        missing, waiting = (hang or {}).get("missing"), (hang or {}).get("waiting")
    else:
        missing, waiting = hang.missing, hang.waiting
    cfg = lab.get("config") or {}
    stopped = lab.get("scenario") == "hang" and cfg.get("hang_s") is None
    if not stopped:
        return f"a run that did not hang was judged a hang: missing {missing}" if hang else ""
    victim = lab.get("victim_rank")
    if not hang:
        return f"rank {victim} was stopped for good, yet no hang was found"
    if missing != [victim]:
        return f"rank {victim} was stopped for good, yet the hang names {missing} as missing"
    if not waiting or any(w["rank"] == victim for w in waiting):
        return f"the hang's waiting ranks are wrong: {[w['rank'] for w in waiting or []]}"
    return ""
