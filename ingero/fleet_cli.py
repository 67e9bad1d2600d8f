"""`ingero fleet query "SQL"`: the same read-only query on every node's agent, one table back.

Agents are named with --nodes NAME=HOST:PORT (no cluster needed), or found
in the cluster as the operator finds them (agent Pods in --agent-namespace,
read with kubectl): every node with an agent, the nodes named in --nodes,
or the nodes running the pods of --selector. Each node's clock offset is
measured alongside (NTP-style) and its wall-clock columns (timestamp_ns,
started_ns, ended_ns, first_seen_ns) are corrected by it; --show-clock adds
the offsets to the table. A node that is down, slow or answers with other
columns is left out with a warning; the command fails only when every node
failed.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from pathlib import Path

from ingero.console import parse_seconds
from ingero.errors import IngeroError

def add_parser(sub):
    p = sub.add_parser("fleet", help="ask every node's agent the same read-only query",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_subparsers(dest="fleet_command", metavar="ACTION")
    q = s.add_parser(
        "query", help="run one SELECT on every node's agent; one table with `node` first",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  ingero fleet query \"SELECT op, count(*) AS calls FROM nccl_events GROUP BY op\" \\\n"
        "      --nodes gpu-1=10.0.0.7:9464,gpu-2=10.0.0.8:9464 --token-file token\n"
        "  ingero fleet query \"SELECT COUNT(*) FROM tcp_events WHERE event = 'tcp_retransmit_skb'\" \\\n"
        "      --selector job-name=train -n default --show-clock\n"
        "  ingero fleet query \"SELECT max(timestamp_ns) FROM nccl_events\" --nodes gpu-1,gpu-2 --timeout 5s")
    q.add_argument("sql", help="one SELECT statement ('-' reads it from stdin)")
    q.add_argument("--nodes", help="NAME=HOST:PORT,... (or NAME,... looked up in the cluster)")
    q.add_argument("--selector", help="only the nodes running pods with these labels (e.g. job-name=train)")
    q.add_argument("-n", "--namespace", default="default", help="namespace of --selector's pods (default default)")
    q.add_argument("--agent-namespace", default=os.environ.get("POD_NAMESPACE") or "ingero-system",
                   help="where the agent Pods and their token Secret live (default ingero-system)")
    q.add_argument("--kubeconfig", help="kubeconfig for the lookups (default: kubectl's)")
    q.add_argument("--context", help="kubeconfig context")
    q.add_argument("--session", help="only this session's data (default: every session on each agent)")
    q.add_argument("--timeout", default="10s", help="per node, for the clock and the query (default 10s)")
    q.add_argument("--show-clock", action="store_true", help="add each node's clock offset and round trip")
    q.add_argument("--token-file", type=Path, default=os.environ.get("INGERO_AGENT_TOKEN_FILE"),
                   help="the agents' bearer token (default: Secret ingero-agent-token via kubectl)")
    q.add_argument("--tls", action="store_true", help="https to the agents (implied by the --tls-* options)")
    q.add_argument("--tls-ca", help="CA bundle for agent certificates (default: system store)")
    q.add_argument("--tls-client-cert", help="client certificate (PEM), for agents run with --tls-client-ca")
    q.add_argument("--tls-client-key", help="... and its key (PEM)")
    q.add_argument("--tls-server-name", help="name the agent certificates carry (agents are dialled by IP)")
    q.add_argument("--max-rows", type=int, default=1000, help="rows per node at most (default 1000)")
    q.add_argument("--format", choices=("table", "csv", "json"), default="table")
    p.set_defaults(_fleet_parser=p)
    return p


def _token(args, kube) -> str:
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as e:
            raise IngeroError(f"--token-file {args.token_file}: {e.strerror}; point it at the agents' token") from None
        if not token:
            raise IngeroError(f"--token-file {args.token_file} is empty; point it at the agents' token")
        return token
    try:
        return kube.token(args.agent_namespace)
    except IngeroError as e:
        raise IngeroError(f"no agent token: pass --token-file, or a kubeconfig that can read Secret "
                          f"{args.agent_namespace}/ingero-agent-token ({e})") from None


def _print(names: list[str], rows: list[list], fmt: str) -> None:
    from ingero.console import print_table

    if fmt == "csv":
        w = csv.writer(sys.stdout)
        w.writerow(names)
        w.writerows(rows)
    elif fmt == "json":
        for r in rows:
            print(json.dumps(dict(zip(names, r)), default=str))
    else:
        print_table(names, [tuple(r) for r in rows])


def run(args) -> int:
    from ingero.fleet import Tls, fan_out
    from ingero.fleet_targets import Kubectl, resolve

    if getattr(args, "fleet_command", None) != "query":
        args._fleet_parser.print_help()
        return 2
    sql = sys.stdin.read() if args.sql == "-" else args.sql
    if not sql.strip():
        raise IngeroError('no SQL given: ingero fleet query "SELECT ..."')
    timeout = parse_seconds(args.timeout, "--timeout")
    if args.max_rows < 1:
        raise IngeroError("--max-rows must be >= 1")
    if bool(args.tls_client_cert) != bool(args.tls_client_key):
        raise IngeroError("a client certificate needs both --tls-client-cert and --tls-client-key")
    kube = Kubectl(args.kubeconfig, args.context)
    targets, warnings = resolve(args.nodes, args.selector, args.namespace, args.agent_namespace, kube)
    token = _token(args, kube)
    tls = None
    if args.tls or args.tls_ca or args.tls_client_cert or args.tls_server_name:
        tls = Tls(args.tls_ca, args.tls_client_cert, args.tls_client_key, args.tls_server_name)
    res = fan_out(targets, token, sql, timeout, args.session, args.max_rows, tls, args.show_clock)
    for w in warnings + res.warnings:
        print(f"ingero: warning: {w}", file=sys.stderr)
    _print(res.columns, res.rows, args.format)
    ok = sum(1 for a in res.answers if not a.error)
    if args.format == "table":
        print(f"({len(res.rows)} row{'s' if len(res.rows) != 1 else ''} from {ok} of "
              f"{len(targets)} nodes)", file=sys.stderr)
    return 0
