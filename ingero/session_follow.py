"""Following a TraceSession from the command line (`kubectl ingero trace --wait`).

A `kubectl get --watch -o json` of the session feeds one line per change:
the phase and its message, the straggler as its StragglerDetected condition
names it (live, then final), a hang as its Hung condition names it, and while
tracing a progress line (ranks, nodes tracing, events, step time) at most
every PROGRESS_EVERY_S. It ends when the session does: the verdict (a
straggler, nobody, a hang, or "cannot judge" and why) and exit 0 when
Completed; the reason, on stderr, and exit 1 when Failed (or deleted while
followed).
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time

from ingero.errors import IngeroError
from ingero.console import printable

RESOURCE = "tracesessions.ingero.io"
TERMINAL = ("Completed", "Failed")
PROGRESS_EVERY_S = 10.0       # a session refreshes every 2 s: one progress line per 5 refreshes is enough
REWATCH_S = 1.0               # the API server ended the watch (its timeout): watch again after this


def json_docs(lines):
    """The objects of kubectl's `-o json --watch` output: indented JSON documents one after
    another, each closed by a `}` alone on its line."""
    buf: list[str] = []
    for line in lines:
        buf.append(line)
        if line.rstrip("\r\n") == "}":
            yield json.loads("".join(buf))
            buf = []


def condition(st: dict, ctype: str) -> dict:
    return next((c for c in st.get("conditions") or [] if c.get("type") == ctype), {})


def progress_line(st: dict) -> str:
    nodes = st.get("nodes") or []
    parts = [f"{st['ranks']} ranks"] if st.get("ranks") else []
    parts.append(f"{sum(n.get('state') == 'running' for n in nodes)}/{len(nodes)} nodes tracing")
    parts.append(f"{sum(int(n.get('events') or 0) for n in nodes):,} events")
    if st.get("stepMs"):
        parts.append(f"step ~{st['stepMs']:.1f} ms")
    v = st.get("verdict") or {}
    if v.get("kind") == "cannot-judge":
        parts.append(f"cannot judge yet: {v.get('reason')}")
    return "progress: " + ", ".join(parts)


class Lines:
    """What changed since the last status seen, as lines to print."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.phase: tuple | None = None
        self.straggler: str | None = None
        self.hang: str | None = None
        self.progress: str | None = None
        self.progress_at: float | None = None

    def update(self, st: dict) -> list[str]:
        out = []
        phase = (st.get("phase"), st.get("message"))
        if phase[0] and phase != self.phase:
            out.append(f"{phase[0]}: {phase[1]}" if phase[1] else phase[0])
            self.phase = phase
        strag = condition(st, "StragglerDetected")
        if strag.get("status") == "True" and strag.get("message") != self.straggler:
            self.straggler = strag.get("message")
            out.append(f"straggler: {self.straggler}")
        hung = condition(st, "Hung")
        if hung.get("status") == "True" and hung.get("message") != self.hang:
            self.hang = hung.get("message")
            out.append(f"hang: {self.hang}")
        if phase[0] == "Running":
            line, now = progress_line(st), self.clock()
            if line != self.progress and (self.progress_at is None or now - self.progress_at >= PROGRESS_EVERY_S):
                self.progress, self.progress_at = line, now
                out.append(line)
        return out


def _pump(stream, q: queue.Queue) -> None:
    try:
        for doc in json_docs(stream):
            q.put(doc)
    except ValueError:
        pass                      # a cut-off document: kubectl's exit status says why
    q.put(None)


def verdict_line(st: dict) -> str:
    """The final verdict as its conditions give it: a hang, "cannot judge" and why, the
    straggler, or nobody (with the ranks it covers when not every rank of the job)."""
    hung, judged, strag = (condition(st, t) for t in ("Hung", "Judged", "StragglerDetected"))
    if hung.get("status") == "True":
        return f"hang: {hung.get('message')}"
    if judged.get("status") == "False":
        return f"cannot judge: {judged.get('message')}"
    partial = f" ({judged['message']})" if judged.get("reason") == "PartialRanks" else ""
    if strag.get("status") == "True":
        return f"{strag.get('message')}{partial}"
    return f"no straggler: {strag.get('message') or 'no rank or group stands out'}{partial}"


def verdict(ns: str, name: str, st: dict, out) -> int:
    if st.get("phase") == "Failed":
        why = condition(st, "Failed").get("reason") or "Failed"
        raise IngeroError(f"TraceSession {ns}/{name} failed ({why}): {st.get('message')}", exit_code=1)
    print(printable(f"verdict: {verdict_line(st)}"), file=out)
    print(f"report: kubectl ingero report {name} -n {ns}", file=out, flush=True)
    return 0


def follow(k, ns: str, name: str, timeout_s: float | None = None, out=None) -> int:
    """Print the session's changes until it ends (see the module doc). `k` is an
    ingero.kubectl.Kubectl; `timeout_s` None waits as long as it takes."""
    out = out or sys.stdout
    lines = Lines()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        proc = k.popen("get", RESOURCE, name, "--namespace", ns, "-o", "json", "--watch",
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        docs: queue.Queue = queue.Queue()
        threading.Thread(target=_pump, args=(proc.stdout, docs), daemon=True).start()
        try:
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise IngeroError(f"TraceSession {ns}/{name} did not end within --timeout; it goes on: "
                                      f"kubectl get trs {name} -n {ns} -w", exit_code=1)
                try:
                    doc = docs.get(timeout=min(left, 1.0) if left is not None else None)
                except queue.Empty:
                    continue
                if doc is None:
                    break
                st = doc.get("status") or {}
                stamp = time.strftime("%H:%M:%S")
                for line in lines.update(st):
                    print(printable(f"{stamp} {line}"), file=out, flush=True)
                if st.get("phase") in TERMINAL:
                    return verdict(ns, name, st, out)
                if (doc.get("metadata") or {}).get("deletionTimestamp"):
                    raise IngeroError(f"TraceSession {ns}/{name} was deleted before it completed", exit_code=1)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        err = proc.stderr.read()
        if proc.returncode != 0:
            raise IngeroError(f"following TraceSession {ns}/{name} failed: {k.message(err)}; "
                              "check --kubeconfig/--context/-n")
        time.sleep(REWATCH_S)
