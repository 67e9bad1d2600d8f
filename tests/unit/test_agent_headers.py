"""Kernel headers for bcc: an existing build dir is used, Debian's -amd64 headers
are linked in when the release has none, and a clear error otherwise."""

from __future__ import annotations

import pytest

from ingero.errors import IngeroError
from ingero_agent.headers import ensure_kernel_build_dir


def _headers(src, name):
    (src / name / "include").mkdir(parents=True)
    return src / name


def test_an_existing_build_dir_is_returned_untouched(tmp_path):
    mods, src = tmp_path / "modules", tmp_path / "src"
    (mods / "6.18.0-x" / "build" / "include").mkdir(parents=True)
    assert ensure_kernel_build_dir("6.18.0-x", mods, src) == mods / "6.18.0-x" / "build"


def test_newest_debian_headers_are_linked_as_build_and_common_as_source(tmp_path):
    mods, src = tmp_path / "modules", tmp_path / "src"
    _headers(src, "linux-headers-6.1.0-20-amd64")
    new = _headers(src, "linux-headers-6.1.0-56-amd64")
    common = _headers(src, "linux-headers-6.1.0-56-common")
    build = ensure_kernel_build_dir("6.18.44-fc-v657", mods, src)
    assert build.resolve() == new.resolve()
    assert (mods / "6.18.44-fc-v657" / "source").resolve() == common.resolve()
    assert ensure_kernel_build_dir("6.18.44-fc-v657", mods, src) == build   # idempotent


def test_missing_headers_raise_one_line_with_the_fix(tmp_path):
    with pytest.raises(IngeroError) as e:
        ensure_kernel_build_dir("6.18.0-x", tmp_path / "modules", tmp_path / "src")
    msg = str(e.value)
    assert "kernel headers not found for 6.18.0-x" in msg and "linux-headers-amd64" in msg
    assert "\n" not in msg
