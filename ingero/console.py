"""What the command-line programs (`ingero`, `kubectl ingero`) share: text tables and
lines safe for a terminal, durations on the command line, completion and one-line errors."""

from __future__ import annotations

import argparse
import re
import signal
import sys

from ingero.errors import IngeroError, trace_error

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` with terminal control characters written as escapes (\\x1b, \\u202e): a name
    from a trace cannot retitle or clear the terminal, move the cursor or break a line."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", text)


def _fmt(v) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, float):
        return f"{v:.3f}"
    return printable(str(v))


def print_table(names: list[str], rows: list[tuple], out=None) -> None:
    """A text table of `rows` under `names`, every cell printable."""
    out = out or sys.stdout
    names = [printable(str(n)) for n in names]
    cells = [[_fmt(v) for v in r] for r in rows]
    widths = [max([len(n)] + [len(r[i]) for r in cells]) for i, n in enumerate(names)]
    numeric = [all(isinstance(r[i], (int, float)) or r[i] is None for r in rows) and rows
               for i in range(len(names))]

    def line(vals):
        return "  ".join(v.rjust(w) if numeric[i] else v.ljust(w)
                         for i, (v, w) in enumerate(zip(vals, widths))).rstrip()

    print(line(names), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for r in cells:
        print(line(r), file=out)


_SECONDS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s|m|h)?\s*$")
_UNITS = {None: 1.0, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_seconds(text: str, flag: str, allow_zero: bool = False) -> float:
    """'10s', '500ms', '2m', '1h' or plain seconds -> seconds."""
    m = _SECONDS.match(str(text))
    if not m or (float(m.group(1)) <= 0 and not allow_zero):
        raise IngeroError(f"{flag} {text!r} is not a duration: use e.g. 10s, 500ms, 2m or plain seconds")
    return float(m.group(1)) * _UNITS[m.group(2)]


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
