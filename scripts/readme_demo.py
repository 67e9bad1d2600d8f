"""The README's demo block (and docs/operator.md's `kubectl get` lines) from a real run.

    make readme-demo        # = ingero demo | tee docs/demo-output.txt; python scripts/readme_demo.py

A saved `ingero demo --scenario lossy-link` transcript (docs/demo-output.txt) is the
source: the block between `<!-- demo-output -->` and `<!-- /demo-output -->` in each
document is rewritten from it, so the figures a reader sees are those of a real run.
tests/unit/test_readme_demo.py fails when a block and the transcript disagree.
`--check` only compares (exit 1 and the file names when one is stale).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRANSCRIPT = ROOT / "docs" / "demo-output.txt"
BLOCK = re.compile(r"(<!-- demo-output -->\n```\n)(.*?)(```\n<!-- /demo-output -->)", re.S)


def section(text: str, command: str, blank_ends: bool = True) -> list[str]:
    """The `$ command` line of the transcript and the lines it printed (up to the next
    command, or up to a blank line)."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith(f"$ {command}")), None)
    if start is None:
        raise SystemExit(f"readme_demo: the transcript has no '$ {command}': is it `ingero demo` output?")
    out = [lines[start]]
    for ln in lines[start + 1:]:
        if ln.startswith("$ ") or (blank_ends and not ln.strip()):
            break
        out.append(ln)
    return out


def excerpts(text: str) -> dict[str, str]:
    """document name -> the block its demo-output markers hold, from one transcript."""
    table = section(text, "kubectl get tracesessions")
    report = section(text, "kubectl ingero report", blank_ends=False)
    verdict = [ln for ln in report if ln.startswith(("step ~", "verdict:", "straggler:", "evidence:"))]
    metrics = section(text, "curl -s http://127.0.0.1:") if "ingero_straggler_saving_ratio" in text else []
    readme = [*table, "", report[0], "...", *verdict]
    if metrics:
        readme += ["", *metrics]
    return {"README.md": "\n".join(readme) + "\n", "docs/operator.md": "\n".join(table) + "\n"}


def rewrite(doc: str, block: str, name: str) -> str:
    if not BLOCK.search(doc):
        raise SystemExit(f"readme_demo: {name} has no <!-- demo-output --> block")
    return BLOCK.sub(lambda m: m.group(1) + block + m.group(3), doc, count=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("transcript", type=Path, nargs="?", default=TRANSCRIPT,
                   help="`ingero demo` output (default docs/demo-output.txt)")
    p.add_argument("--check", action="store_true", help="compare only; exit 1 when a block is stale")
    args = p.parse_args(argv)
    stale = []
    for name, block in excerpts(args.transcript.read_text()).items():
        path = ROOT / name
        doc = path.read_text()
        new = rewrite(doc, block, name)
        if new != doc:
            stale.append(name)
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print(f"readme_demo: {', '.join(stale)} differ from {args.transcript}: run make readme-demo", file=sys.stderr)
        return 1
    print(f"readme_demo: {'rewrote ' + ', '.join(stale) if stale else 'up to date'} from {args.transcript}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
