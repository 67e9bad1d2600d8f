"""The `ingero` command: one subcommand per module, registered by the package that owns it.

Each subcommand module exposes ``add_parser(subparsers)`` (returns its parser)
and ``run(args) -> int``. Modules that need bcc import it inside ``run`` so
that `ingero --help` and `ingero query` work on machines without it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import entry_points

from ingero import __version__
from ingero.console import complete, guarded, innermost
from ingero.errors import IngeroError

# name -> module, as the packages that own them register them (pyproject.toml,
# [project.entry-points."ingero.subcommands"]); --help lists them by name.
SUBCOMMANDS: dict[str, str] = {ep.name: ep.value for ep in sorted(entry_points(group="ingero.subcommands"),
                                                                    key=lambda ep: ep.name)}


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
    if not SUBCOMMANDS:
        raise IngeroError("no subcommands are registered: install the package (pip install -e . in the "
                          "repository) rather than running it from its folder")
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


if __name__ == "__main__":
    sys.exit(main())
