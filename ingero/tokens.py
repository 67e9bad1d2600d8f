"""Bearer tokens read from files (a mounted Secret), shared by every server Ingero runs."""

from __future__ import annotations

from pathlib import Path

from ingero.errors import IngeroError

MIN_TOKEN_CHARS = 16


def read_token(path: Path) -> bytes:
    """The token in `path`, stripped; a one-line error if unreadable or too short."""
    try:
        token = Path(path).read_text().strip().encode()
    except OSError as e:
        raise IngeroError(f"--token-file {path}: {e.strerror}; point it at a file holding the token "
                          "(the mounted Secret's token)") from None
    if len(token) < MIN_TOKEN_CHARS:
        raise IngeroError(f"--token-file {path} holds a token shorter than {MIN_TOKEN_CHARS} characters; "
                          "use a random token (e.g. `openssl rand -hex 32`)")
    return token
