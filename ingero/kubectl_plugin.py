"""kubectl ingero: trace a training job and read its verdict and artifact, through the API server only.

    kubectl ingero trace --selector job-name=train --duration 10m --wait
    kubectl ingero report trs/train-x7k2q
    kubectl ingero get-artifact train-x7k2q -o ./train-x7k2q
    kubectl ingero export perfetto train-x7k2q -o train.json
    kubectl ingero list -A
    kubectl ingero logs train-x7k2q
    kubectl ingero delete train-x7k2q

`trace` creates a TraceSession (kubectl create) and, with --wait, follows it
(phase, message, straggler, progress) until it completes: exit 0, or 1 when it
fails. `list` shows the TraceSessions (phase, straggler, cause, slowdown), `logs`
a session's Events in order and the operator's log lines about it, `delete`
removes it (the operator stops its tracers and deletes its merged trace).
`report`, `get-artifact` and `export` read the finished session's
artifact from the operator's artifact server through the API server's service
proxy (kubectl get --raw status.artifact.proxy/...), so what Kubernetes RBAC
allows you decides what you can read: `get` on the TraceSession (its status
holds the artifact's key) and `get` on services/proxy of the operator's Service
(the chart's <release>-artifact-reader ClusterRole; docs/install.md).

Every API call is kubectl itself: your kubeconfig, context, namespace and
credentials apply. Give --context, --kubeconfig and -n after `ingero` (kubectl
does not pass its own flags to plugins). Installed as the kubectl-ingero script
of the ingero Python package; kubectl finds it on PATH.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path, PurePosixPath
from urllib.parse import quote

from ingero import __version__
from ingero.errors import IngeroError
from ingero.families import NAMES as PROBES
from ingero.console import complete, guarded, innermost, parse_seconds
from ingero.kubectl import Kubectl
from ingero.session_follow import RESOURCE, follow

KINDS = {"trs", "tracesession", "tracesessions", "tracesession.ingero.io", RESOURCE}
MAX_BYTES = 64 << 30    # an artifact larger than this is refused unless --max-bytes says more
LABEL_TERM = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_./]{0,252})=([-A-Za-z0-9_.]{0,63})")
PROXY = re.compile(r"/api/v1/namespaces/(?P<opns>[a-z0-9-]+)/services/(https?:)?[a-z0-9-]+(:[a-z0-9-]+)?"
                   r"/proxy/v1/artifacts/(?P<ns>[^/]+)/(?P<name>[^/]+)")


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-n", "--namespace", help="the TraceSession's namespace (default: the context's)")
    common.add_argument("--context", help="the kubeconfig context to use")
    common.add_argument("--kubeconfig", help="the kubeconfig file to use")
    p = argparse.ArgumentParser(prog="kubectl ingero", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"kubectl-ingero {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    t = sub.add_parser("trace", parents=[common], help="create a TraceSession for a job's pods; --wait follows it")
    t.add_argument("--selector", "-l", required=True, metavar="K=V[,K=V]",
                   help="the job's pod labels (equality terms only), e.g. job-name=train")
    t.add_argument("--name", help="the session's name (default: the first label value plus a random suffix)")
    t.add_argument("--duration", help="trace this long, then gather (e.g. 90s, 10m); default: until the "
                   "job's pods finish")
    t.add_argument("--probes", help=f"probe families, comma-separated (default {','.join(PROBES)})")
    t.add_argument("--retention-hours", type=int, help="delete the merged trace this long after completion")
    t.add_argument("--wait", action="store_true", help="follow the session until it completes or fails")
    t.add_argument("--timeout", help="with --wait: give up after this long (e.g. 30m); default: no limit")
    t.set_defaults(_run=trace)
    r = sub.add_parser("report", parents=[common], help="the per-rank table and straggler verdict of a "
                       "finished session (its report.json, printed as `ingero report` does)")
    r.add_argument("session", help="NAME or trs/NAME")
    r.add_argument("--json", action="store_true", help="print report.json as it is")
    r.set_defaults(_run=report)
    g = sub.add_parser("get-artifact", parents=[common], help="download a finished session's artifact "
                       "folder (trace.duckdb, report.json, node segments)")
    g.add_argument("session", help="NAME or trs/NAME")
    g.add_argument("-o", "--out", type=Path, help="a new (or empty) folder; default ./NAME")
    g.add_argument("--max-bytes", type=int, default=MAX_BYTES, metavar="N",
                   help=f"refuse an artifact larger than this (default {MAX_BYTES >> 30} GiB)")
    g.set_defaults(_run=get_artifact)
    e = sub.add_parser("export", help="export a finished session's trace for other tools")
    es = e.add_subparsers(dest="format", metavar="FORMAT")
    pf = es.add_parser("perfetto", parents=[common], help="Chrome Trace Event JSON for ui.perfetto.dev "
                       "(as `ingero export perfetto` writes it)")
    pf.add_argument("session", help="NAME or trs/NAME")
    pf.add_argument("-o", "--out", type=Path, help="the JSON file to write (default ./NAME.perfetto.json)")
    pf.add_argument("--start", help="keep events from this long after the first event (e.g. 30s)")
    pf.add_argument("--end", help="... until this long after the first event")
    pf.add_argument("--max-events", type=int, help="sample whole collectives down to about N events")
    pf.set_defaults(_run=export_perfetto)
    e.set_defaults(_help=e)
    ls = sub.add_parser("list", aliases=["ls"], parents=[common], help="the TraceSessions: phase, straggler, "
                        "cause, slowdown")
    ls.add_argument("-A", "--all-namespaces", action="store_true", help="in every namespace")
    ls.add_argument("-l", "--selector", help="the sessions' own labels (kubectl's selector syntax, "
                    "set-based terms too: 'team in (ml,infra)')")
    ls.set_defaults(_run=list_sessions)
    lg = sub.add_parser("logs", parents=[common], help="a session's Events in order, and the operator's log "
                        "lines about it")
    lg.add_argument("session", help="NAME or trs/NAME")
    lg.add_argument("--operator-namespace", default="ingero-system",
                    help="where the operator runs (the chart's release namespace; default ingero-system)")
    lg.set_defaults(_run=logs)
    d = sub.add_parser("delete", parents=[common], help="delete a TraceSession (the operator stops its "
                       "tracers and deletes its merged trace)")
    d.add_argument("session", nargs="+", help="NAME or trs/NAME")
    d.set_defaults(_run=delete)
    return p


def kubectl_of(args) -> Kubectl:
    return Kubectl(args.kubeconfig, args.context, args.namespace,
                   missing_fix="install kubectl (v1.26 or newer); this plugin runs it for every API call")


def where(k: Kubectl) -> str:
    return f"namespace {k.namespace}" if k.namespace else "the current namespace"


def ns_flag(ns: str) -> str:
    return f" -n {ns}"


# ---- trace -------------------------------------------------------------------------------

def match_labels(selector: str) -> dict[str, str]:
    labels = {}
    for term in selector.split(","):
        m = LABEL_TERM.fullmatch(term.strip())
        if not m:
            raise IngeroError(f"--selector term {term.strip()!r} is not KEY=VALUE: a TraceSession selects "
                              "pods by equal labels only (spec.selector.matchLabels)")
        labels[m.group(1)] = m.group(2)
    return labels


def session_object(args) -> dict:
    labels = match_labels(args.selector)
    spec: dict = {"selector": {"matchLabels": labels}}
    if args.duration:
        spec["durationSeconds"] = max(1, math.ceil(parse_seconds(args.duration, "--duration")))
    if args.probes:
        probes = [x.strip() for x in args.probes.split(",") if x.strip()]
        bad = [x for x in probes if x not in PROBES]
        if bad or not probes:
            raise IngeroError(f"--probes {args.probes!r}: use some of {', '.join(PROBES)}")
        spec["probes"] = probes
    if args.retention_hours is not None:
        if not 1 <= args.retention_hours <= 8784:
            raise IngeroError("--retention-hours must be 1 to 8784")
        spec["artifact"] = {"retentionHours": args.retention_hours}
    if args.name:
        meta = {"name": args.name}
    else:
        stem = re.sub(r"[^a-z0-9-]+", "-", next(iter(labels.values())).lower()).strip("-")[:40] or "trace"
        meta = {"generateName": f"{stem}-"}
    return {"apiVersion": "ingero.io/v1alpha1", "kind": "TraceSession", "metadata": meta, "spec": spec}


def trace(args) -> int:
    k = kubectl_of(args)
    obj = session_object(args)
    timeout = parse_seconds(args.timeout, "--timeout") if args.timeout else None
    # No client-side validation: the object is built here, and the API server checks it
    # against the CRD's schema anyway (a bad value is refused naming the field).
    proc = k.run("create", "--validate=false", "-f", "-", "-o", "json", input=json.dumps(obj), namespaced=True)
    if proc.returncode != 0:
        msg = k.message(proc.stderr)
        fix = (f"pick another --name, or delete it: kubectl delete trs {args.name}" if "AlreadyExists" in msg
               else "install Ingero's CRD (docs/install.md)" if "no matches for kind" in msg
               else "check --kubeconfig/--context/-n and your rights to create TraceSessions")
        raise IngeroError(f"creating the TraceSession failed: {msg}; {fix}")
    made = json.loads(proc.stdout)
    ns, name = made["metadata"]["namespace"], made["metadata"]["name"]
    print(f"{RESOURCE}/{name} created in namespace {ns}", flush=True)
    if not args.wait:
        print(f"follow it: kubectl get trs {name}{ns_flag(ns)} -w; then kubectl ingero report {name}{ns_flag(ns)}")
        return 0
    return follow(k, ns, name, timeout)


# ---- a finished session's artifact ----------------------------------------------------------

def session_name(ref: str) -> str:
    kind, slash, name = ref.rpartition("/")
    if slash and kind.lower() not in KINDS:
        raise IngeroError(f"{ref!r} is not a TraceSession: pass NAME or trs/NAME")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name):
        raise IngeroError(f"{name!r} is not a TraceSession name")
    return name


def get_session(k: Kubectl, ref: str) -> dict:
    name = session_name(ref)
    proc = k.run("get", RESOURCE, name, "-o", "json", namespaced=True)
    if proc.returncode != 0:
        msg = k.message(proc.stderr)
        if "NotFound" in msg:
            raise IngeroError(f"no TraceSession {name} in {where(k)}; list them: kubectl get trs"
                              + (ns_flag(k.namespace) if k.namespace else ""))
        if "doesn't have a resource type" in msg:
            raise IngeroError("this cluster has no TraceSession CRD (tracesessions.ingero.io): install "
                              "Ingero (docs/install.md)")
        raise IngeroError(f"reading TraceSession {name} failed: {msg}; check --kubeconfig/--context/-n")
    return json.loads(proc.stdout)


def artifact_url(obj: dict, file: str) -> str:
    """The API server path of `file` of the session's artifact, or why there is none."""
    meta, st = obj["metadata"], obj.get("status") or {}
    ns, name = meta["namespace"], meta["name"]
    phase, art = st.get("phase"), st.get("artifact") or {}
    if phase == "Failed":
        raise IngeroError(f"TraceSession {ns}/{name} failed, so it has no artifact: {st.get('message')}",
                          exit_code=1)
    if phase != "Completed":
        raise IngeroError(f"TraceSession {ns}/{name} is {phase or 'not started yet'}: its artifact exists once "
                          f"it completes; wait for it: kubectl wait --for=condition=Completed trs/{name}{ns_flag(ns)}")
    if art.get("deleted"):
        raise IngeroError(f"the artifact of TraceSession {ns}/{name} expired at {art.get('expiresAt')} "
                          "(spec.artifact.retentionHours) and was deleted; trace the job again")
    proxy, key = art.get("proxy"), art.get("readKey")
    if not proxy or not key:
        raise IngeroError(f"TraceSession {ns}/{name} names no artifact server (status.artifact.proxy/readKey): "
                          "its operator runs without --artifact-port/--artifact-service (chart: "
                          f"operator.artifacts.serve=true); copy the folder instead: kubectl cp "
                          f"<operator pod>:{art.get('path', '<status.artifact.path>')} ./{name}")
    m = PROXY.fullmatch(proxy)
    if not m or (m["ns"], m["name"]) != (ns, name):
        raise IngeroError(f"status.artifact.proxy of TraceSession {ns}/{name} ({proxy[:120]}) is not the "
                          "service proxy path of this session's artifact; not fetching it")
    return f"{proxy}/{file}?key={quote(key, safe='')}"


def fetch_error(obj: dict, stderr) -> IngeroError:
    meta, msg = obj["metadata"], Kubectl.message(stderr)
    ns, name = meta["namespace"], meta["name"]
    m = PROXY.fullmatch(((obj.get("status") or {}).get("artifact") or {}).get("proxy") or "")
    op_ns = m["opns"] if m else "<operator namespace>"
    if "(Forbidden)" in msg:
        fix = ("reading artifacts needs get on services/proxy of the operator's Service: ask for the chart's "
               "<release>-artifact-reader ClusterRole (docs/install.md)")
    elif "(ServiceUnavailable)" in msg or "services \"" in msg:
        fix = ("the operator's artifact server is not reachable: is the operator running? "
               f"kubectl -n {op_ns} get pods -l app.kubernetes.io/component=operator")
    elif "no artifact of TraceSession" in msg:
        fix = ("the operator lost it: an operator pod replaced with the default emptyDir loses every artifact "
               "(operator.artifacts.existingClaim keeps them); trace the job again")
    else:
        fix = "check --kubeconfig/--context"
    return IngeroError(f"fetching the artifact of TraceSession {ns}/{name} failed: {msg}; {fix}")


def download(k: Kubectl, obj: dict, dest: Path, max_bytes: int = MAX_BYTES) -> list[str]:
    """Unpack the artifact folder (streamed: kubectl get --raw .../artifact.tar) into `dest`.
    Only plain files and folders below `dest` are written, each once, `max_bytes` in all.
    Returns the file names."""
    proc = k.popen("get", "--raw", artifact_url(obj, "artifact.tar"), stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE)
    names, size = [], 0
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            for m in tar:
                path = PurePosixPath(m.name)
                if path.is_absolute() or ".." in path.parts or not (m.isfile() or m.isdir()):
                    raise IngeroError(f"the artifact holds {m.name!r}, which is not a plain file inside "
                                      "its folder; refusing it")
                size += m.size
                if size > max_bytes:
                    raise IngeroError(f"the artifact of TraceSession {obj['metadata']['name']} is larger than "
                                      f"--max-bytes {max_bytes}; raise it to download it all")
                target = dest.joinpath(*path.parts)
                try:
                    if m.isdir():
                        target.mkdir(parents=True, exist_ok=True)
                        continue
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with tar.extractfile(m) as src, open(target, "xb") as out:
                        shutil.copyfileobj(src, out, 1 << 20)
                except (FileExistsError, NotADirectoryError, IsADirectoryError):
                    raise IngeroError(f"the artifact holds {m.name!r} twice, or a file and a folder of one "
                                      "name; refusing it") from None
                except OSError as e:
                    raise IngeroError(f"cannot write {target}: {e.strerror or e}") from None
                names.append(m.name)
    except tarfile.ReadError:
        pass            # no tar: kubectl failed, said why on stderr (below)
    finally:
        proc.stdout.close()
        err = proc.stderr.read()
        proc.wait()
    if proc.returncode != 0:
        raise fetch_error(obj, err)
    if "trace.duckdb" not in names or "report.json" not in names:
        raise IngeroError(f"the artifact download of TraceSession {obj['metadata']['name']} was cut short "
                          f"({len(names)} files); try again")
    return names


def fresh_folder(path: Path) -> bool:
    """Make `path` (or take it empty); True when it was made here."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise IngeroError(f"-o {path} exists and is not an empty folder; pick a new folder")
    if not path.parent.is_dir():
        raise IngeroError(f"-o {path}: folder {path.parent} does not exist")
    made = not path.exists()
    path.mkdir(exist_ok=True)
    return made


def report(args) -> int:
    from ingero.analysis.model import Report
    from ingero.report_text import render

    k = kubectl_of(args)
    obj = get_session(k, args.session)
    proc = k.run("get", "--raw", artifact_url(obj, "report.json"), binary=True)
    if proc.returncode != 0:
        raise fetch_error(obj, proc.stderr)
    try:
        doc = json.loads(proc.stdout)
        rep = Report.from_dict(doc)
    except ValueError as e:
        raise IngeroError(f"report.json of TraceSession {obj['metadata']['name']} is not a report this "
                          f"kubectl-ingero reads ({e}); upgrade the plugin") from None
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        render(rep)
    return 0


def get_artifact(args) -> int:
    k = kubectl_of(args)
    obj = get_session(k, args.session)
    artifact_url(obj, "artifact.tar")          # a session without an artifact fails before -o is made
    dest = args.out or Path(obj["metadata"]["name"])
    made = fresh_folder(dest)
    try:
        names = download(k, obj, dest, args.max_bytes)
    except BaseException:
        if made:
            shutil.rmtree(dest, ignore_errors=True)
        else:                       # the user's empty folder: emptied again
            for p in dest.iterdir():
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        raise
    size = sum((dest / n).stat().st_size for n in names)
    segments = sum(n.endswith(".parquet") for n in names)
    print(f"wrote {dest}: trace.duckdb, report.json and {segments} node segment files ({size / 1e6:.1f} MB); "
          f"read it with: ingero report {dest}")
    return 0


def export_perfetto(args) -> int:
    from ingero.perfetto import export

    k = kubectl_of(args)
    obj = get_session(k, args.session)
    name = obj["metadata"]["name"]
    out = args.out or Path(f"{name}.perfetto.json")
    artifact_url(obj, "artifact.tar")
    with tempfile.TemporaryDirectory(prefix="kubectl-ingero-") as tmp:
        download(k, obj, Path(tmp))
        export(Path(tmp), out, args.start, args.end, args.max_events,
               label=f"TraceSession {obj['metadata']['namespace']}/{name}")
    return 0


# ---- list, logs, delete ----------------------------------------------------------------------

def list_sessions(args) -> int:
    k = kubectl_of(args)
    extra = (["--all-namespaces"] if args.all_namespaces else []) + (["-l", args.selector] if args.selector else [])
    proc = k.run("get", RESOURCE, *extra, namespaced=not args.all_namespaces)
    if proc.returncode != 0:
        msg = k.message(proc.stderr)
        if "doesn't have a resource type" in msg:
            raise IngeroError("this cluster has no TraceSession CRD (tracesessions.ingero.io): install "
                              "Ingero (docs/install.md)")
        raise IngeroError(f"listing TraceSessions failed: {msg}; check --kubeconfig/--context/-n and -l")
    print(proc.stdout, end="")
    if not proc.stdout.strip():
        print(f"no TraceSessions in {'any namespace' if args.all_namespaces else where(k)}"
              + (f" matching {args.selector}" if args.selector else "")
              + "; start one: kubectl ingero trace --selector job-name=JOB", file=sys.stderr)
    return 0


def event_time(e: dict) -> str:
    return e.get("lastTimestamp") or e.get("eventTime") or e.get("firstTimestamp") or \
        e["metadata"].get("creationTimestamp") or ""


def logs(args) -> int:
    k = kubectl_of(args)
    obj = get_session(k, args.session)
    ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    proc = k.run("get", "events", "-n", ns, "--field-selector", f"involvedObject.name={name}", "-o", "json")
    if proc.returncode != 0:
        raise IngeroError(f"reading the Events of TraceSession {ns}/{name} failed: {k.message(proc.stderr)}; "
                          "check your rights to list events")
    events = [e for e in json.loads(proc.stdout).get("items") or []
              if e.get("involvedObject", {}).get("uid") == obj["metadata"]["uid"]]
    for e in sorted(events, key=lambda e: (event_time(e), int(e["metadata"].get("resourceVersion") or 0))):
        print(f"{event_time(e)}  {e.get('type', ''):<8}{e.get('reason', ''):<19}{e.get('message', '')}")
    st = obj.get("status") or {}
    print(f"now: {st.get('phase') or 'Pending'}: {st.get('message') or ''}".rstrip(": "))
    proc = k.run("logs", "-n", args.operator_namespace, "-l", "app.kubernetes.io/component=operator",
                 "--tail=-1", "--prefix")
    if proc.returncode != 0 or not proc.stdout.strip():
        why = k.message(proc.stderr) if proc.returncode else f"no operator pod logs in {args.operator_namespace}"
        print(f"(the operator's log lines are not readable: {why}; its namespace is --operator-namespace)",
              file=sys.stderr)
        return 0
    mine = [ln for ln in proc.stdout.splitlines() if f"{ns}/{name}:" in ln]
    print(f"\noperator log, {len(mine)} lines about {ns}/{name}:", *mine, sep="\n")
    return 0


def delete(args) -> int:
    k = kubectl_of(args)
    for ref in args.session:
        name = get_session(k, ref)["metadata"]["name"]         # NotFound: one line naming the fix
        proc = k.run("delete", RESOURCE, name, "--wait=false", namespaced=True)
        if proc.returncode != 0:
            raise IngeroError(f"deleting TraceSession {name} failed: {k.message(proc.stderr)}; check your rights "
                              "to delete TraceSessions")
        print(proc.stdout.strip())
    return 0


def main(argv: list[str] | None = None) -> int:

    parser = build_parser()
    complete(parser)
    args, extra = parser.parse_known_args(argv)
    if extra:
        innermost(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "_run", None):
        (getattr(args, "_help", None) or parser).print_help()
        return 2
    return guarded(args._run, args, prog="kubectl-ingero")


if __name__ == "__main__":
    sys.exit(main())
