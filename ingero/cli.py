"""The `ingero` command: one subcommand per module, loaded only when used.

Each subcommand module exposes ``add_parser(subparsers)`` (returns its parser)
and ``run(args) -> int``. Modules that need bcc import it inside ``run`` so
that `ingero --help` and `ingero query` work on machines without it.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

from ingero import __version__
from ingero.errors import IngeroError, trace_error

# name -> module; order is the order shown in --help.
SUBCOMMANDS: dict[str, str] = {
    "trace": "ingero_agent.trace_cli",
    "query": "ingero.query_cli",
    "report": "ingero.report_cli",
    "lab": "ingero.lab.cli",
    "profiler": "ingero_agent.profiler_build",
    "agent": "ingero_agent.server",
    "operator": "ingero_operator.cli",
    "demo": "ingero_operator.demo",
    "check": "ingero_agent.check",
    "fleet": "ingero.fleet_cli",
    "merge": "ingero.merge_cli",
    "export": "ingero.export_cli",
    "mcp": "ingero.mcp_cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ingero",
        description="Trace NCCL calls, TCP retransmits and scheduler stalls of distributed "
        "training jobs with eBPF, and find the straggler rank.",
        epilog="examples:\n"
        "  ingero lab run --scenario lossy-link --trace --out out/lab\n"
        "  ingero trace --duration 30s --cgroup /sys/fs/cgroup/unified/kubepods.slice --out t.duckdb\n"
        "  ingero query t.duckdb \"SELECT op, rank, nranks, duration_ns/1e6 AS ms "
        "FROM nccl_events ORDER BY duration_ns DESC LIMIT 20\"",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ingero {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            # An image may ship only part of Ingero (the operator has no agent), or
            # lack an optional dependency: every other subcommand must still work.
            p = sub.add_parser(name, help=f"(not available here: {e.name} is not installed)")
            p.set_defaults(_run=_missing(name, module, e.name or "?"))
            continue
        p = mod.add_parser(sub)
        p.set_defaults(_run=mod.run)
    return parser


# Third-party packages of the optional extras in pyproject.toml.
_EXTRA_OF = {"kopf": "operator", "kmock": "operator", "jsonschema": "operator", "yaml": "operator", "mcp": "mcp"}


def _missing(name: str, module: str, missing: str):
    top = missing.split(".")[0]

    def run(_args) -> int:
        if module.startswith(top):
            raise IngeroError(f"'ingero {name}' is not part of this installation ({module} is missing); "
                              "install the full ingero package")
        extra = _EXTRA_OF.get(top)
        fix = f"pip install 'ingero[{extra}]'" if extra else f"install the Python package {top}"
        raise IngeroError(f"'ingero {name}' needs the Python package {top}, which is not installed: {fix}")
    return run


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    complete(parser)
    args, extra = parser.parse_known_args(argv)
    if extra:       # the usage of the (sub)command that got them, not the top level's
        innermost(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    return guarded(args._run, args)


def complete(parser: argparse.ArgumentParser) -> None:
    """Shell completion when the shell asks for it (argcomplete, Debian's python3-argcomplete;
    bash: eval "$(register-python-argcomplete ingero)"); nothing otherwise."""
    try:
        import argcomplete
    except ImportError:
        return
    argcomplete.autocomplete(parser)


def innermost(parser: argparse.ArgumentParser, args) -> argparse.ArgumentParser:
    """The deepest subcommand parser `args` went through (`ingero lab run`, `ingero query`)."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs and subs[0].dest else None
        if name not in (subs[0].choices if subs else {}):
            return parser
        parser = subs[0].choices[name]


def guarded(run, args, prog: str = "ingero") -> int:
    """run(args), with what a user can cause printed as one line `<prog>: ...`, no traceback."""
    try:
        return int(run(args) or 0)
    except IngeroError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except BrokenPipeError:
        return 0
    except Exception as e:
        # a trace DuckDB cannot read (damaged, crafted, of another version): one line, not a traceback
        line = trace_error(e)
        if line is None:
            raise
        print(f"{prog}: {line}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
