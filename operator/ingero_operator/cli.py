"""`ingero operator run`: the TraceSession operator (kopf).

    ingero operator run --namespace ingero-system --artifacts /var/lib/ingero/artifacts
    KUBECONFIG=out/demo/kubeconfig ingero operator run --standalone --artifacts out/demo/artifacts
    ingero operator run --artifact-port 8082 --artifact-service ingero-operator:artifacts
    ingero operator run --webhook-port 9443 --webhook-cert tls.crt --webhook-key tls.key

Credentials: the in-cluster service account, else $KUBECONFIG (~/.kube/config).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import secrets
from pathlib import Path

from ingero import serving
from ingero.errors import IngeroError

SERVICE = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?(:[a-z0-9]([-a-z0-9]{0,13}[a-z0-9])?)?")


def add_parser(sub):
    p = sub.add_parser("operator", help="run the TraceSession operator (kopf)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_subparsers(dest="operator_command", metavar="ACTION")
    r = s.add_parser("run", help="watch TraceSessions and drive the node agents")
    r.add_argument("--namespace", default=None,
                   help="the operator's namespace: agent Pods and the token Secret live there "
                   "(default $POD_NAMESPACE or ingero-system)")
    r.add_argument("--watch-namespace", action="append", default=[], metavar="NS",
                   help="serve TraceSessions of this namespace only (repeatable; default: all)")
    r.add_argument("--artifacts", type=Path, default=None,
                   help="where merged traces go (default $INGERO_ARTIFACTS_DIR or /var/lib/ingero/artifacts)")
    r.add_argument("--artifacts-max-bytes", type=int, default=None, metavar="N",
                   help="keep the artifact folder under N bytes: when a session completes, the oldest "
                        "merged traces are deleted (ArtifactExpired on their sessions); default no cap")
    r.add_argument("--node-max-bytes", type=int, default=None, metavar="N",
                   help="segments one node may send a session; past it the node counts as failed "
                        "(default 32 GiB)")
    r.add_argument("--session-max-bytes", type=int, default=None, metavar="N",
                   help="segments all nodes may send a session; the node that would pass it counts as "
                        "failed (default 128 GiB)")
    r.add_argument("--live-window", type=float, default=None, metavar="S",
                   help="while a session runs, judge the last S seconds (and at least 40 steps) alone, so "
                        "a fault that starts mid-session is named quickly and a refresh costs the same at "
                        "any session length; 0 judges the whole session every refresh (default 6)")
    r.add_argument("--refresh-interval", type=float, default=None, metavar="S",
                   help="live status refresh period while a session runs, seconds (default 2)")
    r.add_argument("--final-max-calls", type=int, default=None, metavar="N",
                   help="a finished session with more NCCL calls than this is judged in windows of whole "
                        "steps holding about N each (the analysis needs ~0.4 GB per million calls of a "
                        "window); default 1250000")
    r.add_argument("--standalone", action="store_true", help="no kopf peering (one operator only)")
    r.add_argument("--peering", default=None, metavar="NAME",
                   help="kopf peering object (ClusterKopfPeering, or KopfPeering per watched namespace): "
                   "the operator stays paused until it exists and no live peer has a higher priority")
    r.add_argument("--priority", default=None, metavar="N|random",
                   help="peering priority; the highest live one acts, the others wait. 'random' (for "
                   "Deployment replicas, which share one spec) draws 1..2^31-1 at start (default 0)")
    r.add_argument("--liveness", default=None, metavar="URL",
                   help="serve kopf's liveness probe here, e.g. http://0.0.0.0:8080/healthz")
    r.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics at http://0.0.0.0:PORT/metrics (sessions by phase, the "
                        "straggler and its saving, per-rank lateness, retransmits and off-CPU time, agent "
                        "reachability, lost events, gather/analysis durations)")
    r.add_argument("--metrics-address", default="0.0.0.0", metavar="ADDR", help="address of --metrics-port")
    r.add_argument("--artifact-port", type=int, default=None, metavar="PORT",
                   help="serve finished artifacts (report.json, trace.duckdb, the whole folder as a tar) at "
                        "http://ADDR:PORT/v1/artifacts/<namespace>/<name>/<file>?key=<status.artifact.readKey>, "
                        "for `kubectl ingero` through the API server's service proxy")
    r.add_argument("--artifact-address", default="0.0.0.0", metavar="ADDR", help="address of --artifact-port")
    r.add_argument("--artifact-service", default=None, metavar="NAME[:PORT]",
                   help="the Service in --namespace that fronts --artifact-port (port name default "
                        "'artifacts'): sessions then carry their artifact's API server path in "
                        "status.artifact.proxy")
    r.add_argument("--webhook-port", type=int, default=None, metavar="PORT",
                   help="serve the mutating admission webhook that injects Ingero's NCCL profiler plugin "
                        "into opted-in pods (label ingero.io/profiler=enabled on the pod or its namespace) "
                        "over HTTPS at ADDR:PORT/profiler-pod and /profiler-namespace; needs --webhook-cert "
                        "and --webhook-key")
    r.add_argument("--webhook-address", default="0.0.0.0", metavar="ADDR", help="address of --webhook-port")
    r.add_argument("--webhook-cert", type=Path, default=None, metavar="FILE",
                   help="PEM certificate of the webhook server (re-read when the file changes)")
    r.add_argument("--webhook-key", type=Path, default=None, metavar="FILE", help="its PEM private key")
    r.add_argument("--profiler-plugin-dir", default=None, metavar="DIR",
                   help="the node folder the agent puts the plugin in (the chart's profilerPlugin.hostPath), "
                        "mounted read-only into opted-in pods (default /var/lib/ingero/plugin)")
    r.add_argument("--verbose", action="store_true", help="kopf's debug logging (same as --log-level debug)")
    r.add_argument("--log-format", choices=("text", "full", "json"), default="full",
                   help="kopf's log format: text (message only), full (time, logger, level; default) "
                        "or json (one JSON object per line)")
    r.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    p.set_defaults(_op_parser=p)
    return p


def quiet_timers(record: logging.LogRecord) -> bool:
    """Drop kopf's "Timer 'refresh' succeeded." (one a refresh interval per running
    session: a routine success, not news); --log-level debug keeps it."""
    return not (record.levelno == logging.INFO and record.getMessage().startswith("Timer '")
                and record.getMessage().endswith("' succeeded."))


def _serve(flag: str, port: int, start):
    """Start a server (or bind its socket) on `port` now, so that a bad or taken port fails the
    start naming `flag`; what `start` returns."""
    if not 1 <= port <= 65535:
        raise IngeroError(f"{flag} {port} is out of range: use 1 to 65535")
    try:
        return start()
    except OSError as e:
        raise IngeroError(f"{flag} {port}: {os.strerror(e.errno) if e.errno else e}; pick a free port") from None


def run(args) -> int:
    if getattr(args, "operator_command", None) != "run":
        args._op_parser.print_help()
        return 2
    import kopf

    from ingero_operator import settings as st

    s = st.SETTINGS
    if args.namespace:
        s.namespace = args.namespace
    if args.artifacts:
        s.artifacts_dir = args.artifacts
    if args.artifacts_max_bytes is not None:
        if args.artifacts_max_bytes < 1:
            raise IngeroError("--artifacts-max-bytes must be a positive number of bytes")
        s.artifacts_max_bytes = args.artifacts_max_bytes
    for flag, value, attr in (("--node-max-bytes", args.node_max_bytes, "node_max_bytes"),
                              ("--session-max-bytes", args.session_max_bytes, "session_max_bytes")):
        if value is not None:
            if value < 1:
                raise IngeroError(f"{flag} must be a positive number of bytes")
            setattr(s.gather, attr, value)
    if args.live_window is not None:
        if args.live_window < 0:
            raise IngeroError("--live-window must be >= 0 seconds (0: judge the whole session only)")
        s.timing.live_window_s = args.live_window
    if args.refresh_interval is not None:
        if args.refresh_interval <= 0:
            raise IngeroError("--refresh-interval must be > 0 seconds")
        s.timing.refresh_interval_s = args.refresh_interval
    if args.final_max_calls is not None:
        if not 10_000 <= args.final_max_calls <= 10**9:
            raise IngeroError(f"--final-max-calls {args.final_max_calls} is out of range: use 10000 to 1000000000")
        s.timing.final_max_calls = args.final_max_calls
    s.artifacts_dir = Path(s.artifacts_dir).resolve()
    try:
        s.artifacts_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise IngeroError(f"--artifacts {s.artifacts_dir}: {e.strerror}; pass a writable folder") from None
    if not os.access(s.artifacts_dir, os.W_OK):
        raise IngeroError(f"--artifacts {s.artifacts_dir} is not writable; pass a writable folder")
    if args.standalone and args.peering:
        raise IngeroError("--standalone and --peering exclude each other; pass one of them")
    priority = None
    if args.priority is not None:
        if args.priority == "random":
            priority = secrets.randbelow(2**31 - 1) + 1
        else:
            try:
                priority = int(args.priority)
            except ValueError:
                raise IngeroError(f"--priority {args.priority!r} is not an integer or 'random'") from None
    if args.metrics_port is not None:
        from ingero_operator import metrics

        _serve("--metrics-port", args.metrics_port, lambda: metrics.serve(args.metrics_port, args.metrics_address))
    if args.artifact_service:
        if not SERVICE.fullmatch(args.artifact_service):
            raise IngeroError(f"--artifact-service {args.artifact_service!r} is not NAME or NAME:PORT "
                              "(a Service name, and a port name or number)")
        s.artifact_service = args.artifact_service if ":" in args.artifact_service \
            else f"{args.artifact_service}:artifacts"
    if args.artifact_port is not None:
        from ingero_operator import artifact_server

        _serve("--artifact-port", args.artifact_port,
               lambda: artifact_server.serve(s.artifacts_dir, args.artifact_port, args.artifact_address))
    webhook_cfg = webhook_sock = None
    if args.webhook_port is not None:
        from ingero_operator import webhook

        if args.webhook_cert is None or args.webhook_key is None:
            raise IngeroError("--webhook-port needs --webhook-cert and --webhook-key: the API server calls "
                              "admission webhooks over HTTPS only")
        webhook_cfg = webhook.check_config(webhook.WebhookConfig(
            address=args.webhook_address, cert=args.webhook_cert, key=args.webhook_key,
            plugin_dir=args.profiler_plugin_dir or webhook.DEFAULT_PLUGIN_DIR))
        webhook_sock = _serve("--webhook-port", args.webhook_port,
                              lambda: serving.bind(args.webhook_port, args.webhook_address))
    elif args.webhook_cert or args.webhook_key or args.profiler_plugin_dir:
        raise IngeroError("--webhook-cert, --webhook-key and --profiler-plugin-dir belong to the webhook: "
                          "add --webhook-port")
    fmt = {"text": kopf.LogFormat.PLAIN, "full": kopf.LogFormat.FULL, "json": kopf.LogFormat.JSON}[args.log_format]
    level = "debug" if args.verbose else args.log_level
    kopf.configure(verbose=level == "debug", quiet=level in ("warning", "error"), log_format=fmt)
    logging.getLogger().setLevel(getattr(logging, level.upper()))
    logging.getLogger("ingero.operator").setLevel(getattr(logging, level.upper()))
    if level != "debug":
        logging.getLogger("kopf.objects").addFilter(quiet_timers)
    from ingero_operator import handlers  # noqa: F401  (registers the handlers with kopf)
    if webhook_cfg is not None and webhook_sock is not None:   # both set together
        webhook.register(webhook_cfg, webhook_sock)

    if args.peering or priority is not None:
        logging.getLogger("ingero.operator").info(
            "peering %s, priority %s", args.peering or "auto-detected", priority if priority is not None else 0)
    kopf.run(standalone=args.standalone or None, clusterwide=not args.watch_namespace,
             namespaces=args.watch_namespace, peering_name=args.peering, priority=priority,
             liveness_endpoint=args.liveness)
    return 0
