"""Token files for the agent API and the MCP server: one reader, one-line errors."""

from __future__ import annotations

import pytest

from ingero.errors import IngeroError
from ingero.tokens import read_token


def test_token_is_read_stripped(tmp_path):
    f = tmp_path / "token"
    f.write_text("  0123456789abcdef0123\n")
    assert read_token(f) == b"0123456789abcdef0123"


@pytest.mark.parametrize("content,message", [("short", "shorter than 16"), (None, "--token-file")])
def test_short_or_missing_token_is_a_one_line_error(tmp_path, content, message):
    f = tmp_path / "token"
    if content is not None:
        f.write_text(content)
    with pytest.raises(IngeroError, match=message) as e:
        read_token(f)
    assert "\n" not in str(e.value)
