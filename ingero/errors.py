"""User-facing errors.

Anything a user can cause (bad input, missing permission, missing headers)
raises ``IngeroError`` with one line that names the problem and the fix. The
CLI prints it as ``ingero: <message>`` and exits non-zero, without a traceback.
"""

from __future__ import annotations


class IngeroError(Exception):
    """A problem the user can fix; the message says what and how."""

    exit_code = 2

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class NotPermitted(IngeroError):
    """Missing privilege (root / CAP_BPF / CAP_PERFMON)."""

    exit_code = 77


HINTS = ("Did you mean", "Candidate bindings")      # DuckDB's own suggestion lines


def duckdb_line(e: BaseException) -> str:
    """A DuckDB error as one line: its first line, and its "Did you mean ..." or
    "Candidate bindings: ..." hint when it gives one."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
    hint = next((ln for ln in lines[1:] if ln.startswith(HINTS)), None)
    return f"{lines[0]} {hint}" if hint else lines[0]


def trace_error(e: BaseException) -> str | None:
    """The one line to show for an error a trace caused (an IngeroError, or a DuckDB error on a
    damaged or crafted trace); None for anything else (a bug: let it raise)."""
    if isinstance(e, IngeroError):
        return str(e)
    if type(e).__module__.split(".")[0] in ("duckdb", "_duckdb"):
        return f"cannot read the trace: {duckdb_line(e)}"
    return None
