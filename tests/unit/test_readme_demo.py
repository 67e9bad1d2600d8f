"""The README's demo block and docs/operator.md's `kubectl get` lines are those of the saved
real `make demo` transcript (docs/demo-output.txt), as scripts/readme_demo.py writes them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("readme_demo", ROOT / "scripts" / "readme_demo.py")
readme_demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(readme_demo)


def test_the_docs_demo_blocks_equal_the_real_transcripts_excerpts():
    assert readme_demo.main(["--check"]) == 0


def test_the_excerpt_is_the_transcripts_own_lines_in_order():
    text = readme_demo.TRANSCRIPT.read_text()
    blocks = readme_demo.excerpts(text)
    lines = text.splitlines()
    for block in blocks.values():
        shown = [ln for ln in block.splitlines() if ln not in ("", "...")]
        at = [lines.index(ln) for ln in shown]
        assert at == sorted(at), "lines out of the transcript's order"
    assert blocks["README.md"].startswith("$ kubectl get tracesessions\nNAME ")
    assert "\nverdict: straggler\nstraggler: rank 3 " in blocks["README.md"]


def test_a_stale_block_is_found_and_rewritten(tmp_path, monkeypatch, capsys):
    for name in ("README.md", "docs/operator.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("intro\n<!-- demo-output -->\n```\nold\n```\n<!-- /demo-output -->\nrest\n")
    monkeypatch.setattr(readme_demo, "ROOT", tmp_path)
    assert readme_demo.main([str(readme_demo.TRANSCRIPT), "--check"]) == 1
    assert "README.md, docs/operator.md differ" in capsys.readouterr().err
    assert readme_demo.main([str(readme_demo.TRANSCRIPT)]) == 0
    assert readme_demo.main([str(readme_demo.TRANSCRIPT), "--check"]) == 0
    assert (tmp_path / "README.md").read_text().endswith("```\n<!-- /demo-output -->\nrest\n")


def test_a_transcript_that_is_not_the_demos_is_refused(tmp_path):
    (tmp_path / "t.txt").write_text("hello\n")
    with pytest.raises(SystemExit, match="no '\\$ kubectl get tracesessions'"):
        readme_demo.main([str(tmp_path / "t.txt"), "--check"])
