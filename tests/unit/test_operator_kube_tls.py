"""The operator's client certificate from a kubeconfig (inline data) leaves no file behind:
load_cert_chain needs files, and the client key used to stay in /tmp for good."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import tempfile

import kopf
import pytest

from ingero_operator.kube import _ssl_context

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")


def _pair(d, name: str = ""):
    """A self-signed certificate and its key (PEM files in `d`)."""
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=op",
                    "-keyout", str(d / f"{name}k.pem"), "-out", str(d / f"{name}c.pem")],
                   check=True, capture_output=True)


def _scratch(tmp_path, monkeypatch):
    """An empty folder the tempfile module writes into for this test."""
    d = tmp_path / "scratch"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def test_inline_client_certificate_and_key_are_loaded_and_no_file_outlives_the_call(tmp_path, monkeypatch):
    _pair(tmp_path)
    scratch = _scratch(tmp_path, monkeypatch)
    info = kopf.ConnectionInfo(server="https://127.0.0.1:6443", certificate_data=(tmp_path / "c.pem").read_bytes(),
                               private_key_data=(tmp_path / "k.pem").read_bytes())
    ctx = _ssl_context(info)
    assert ctx.verify_mode.name == "CERT_REQUIRED"
    assert list(scratch.iterdir()) == []


def test_a_key_that_does_not_match_is_an_ssl_error_and_still_leaves_nothing(tmp_path, monkeypatch):
    for name in ("a", "b"):
        _pair(tmp_path, name)
    scratch = _scratch(tmp_path, monkeypatch)
    info = kopf.ConnectionInfo(server="https://127.0.0.1:6443", certificate_data=(tmp_path / "ac.pem").read_bytes(),
                               private_key_data=(tmp_path / "bk.pem").read_bytes())
    with pytest.raises(ssl.SSLError):
        _ssl_context(info)
    assert list(scratch.iterdir()) == []
