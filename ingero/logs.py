"""Log output of the long-running commands (agent, operator): text or one JSON object a line.

    --log-format text|json   --log-level debug|info|warning|error

JSON lines carry ``time`` (RFC 3339, UTC), ``level``, ``logger`` and ``message``, plus
``error`` with the exception when there is one: what log shippers (Loki, Fluent Bit,
Elasticsearch) parse without a pattern.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {"time": dt.datetime.fromtimestamp(record.created, dt.timezone.utc).isoformat(timespec="milliseconds")
               .replace("+00:00", "Z"), "level": record.levelname.lower(), "logger": record.name,
               "message": record.getMessage()}
        if record.exc_info:
            doc["error"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def add_arguments(parser) -> None:
    parser.add_argument("--log-format", choices=FORMATS, default="text",
                        help="text (default) or json: one JSON object per line")
    parser.add_argument("--log-level", choices=LEVELS, default="info", help="default info")


def setup(fmt: str, level: str, name: str) -> logging.Logger:
    """Configure the root logger once (stderr) and return the logger `name`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter("%(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper()))
    return logging.getLogger(name)
