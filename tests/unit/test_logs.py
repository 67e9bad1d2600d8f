"""--log-format json: one JSON object per line, from the agent's real process."""

from __future__ import annotations

import json
import subprocess
import sys
import time


def test_agent_logs_one_json_object_per_line(tmp_path):
    tok = tmp_path / "token"
    tok.write_text("t" * 32)
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-m", "ingero", "agent", "serve", "--node", "n1", "--listen",
                             "127.0.0.1:0", "--data-dir", str(tmp_path / "data"), "--token-file", str(tok),
                             "--ready-file", str(ready), "--log-format", "json", "--max-memory-mb", "1024"],
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), proc.stderr.read() if proc.poll() is not None else "agent not ready"
    finally:
        proc.terminate()
        err = proc.communicate(timeout=30)[1]
    lines = [json.loads(ln) for ln in err.splitlines() if ln.strip()]
    first = lines[0]
    assert first["logger"] == "ingero.agent" and first["level"] == "info" and first["time"].endswith("Z")
    assert first["message"].startswith("node n1, http://127.0.0.1:0")


def test_a_bad_log_format_is_a_one_line_usage_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ingero", "agent", "serve", "--data-dir", str(tmp_path),
                          "--token-file", str(tmp_path / "t"), "--log-format", "xml"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "invalid choice: 'xml'" in out.stderr and "Traceback" not in out.stderr
