"""The release artifacts, all versioned by pyproject.toml's `version` (the one version source).

    python scripts/release.py version          # prints it (the Makefile's VERSION)
    python scripts/release.py build --out out/release [--registry R] [--url U]

`build` writes into --out:

- `ingero-<v>-py3-none-any.whl`: the Python package (CLI, agent, operator, kubectl plugin);
- `ingero-<v>.tgz`: the Helm chart, its version and appVersion set to <v> (so the images'
  default tag is <v>), and with --registry its images' repositories under that registry;
- `kubectl-ingero-<v>.tar.gz` and `ingero.yaml`: the kubectl plugin for krew. The archive
  holds a launcher, `kubectl-ingero`, and the wheel: on first use the launcher installs the
  wheel into a virtual environment of its own (python3 >= 3.11 and PyPI access needed), then
  runs the plugin from it. `ingero.yaml` is krew's Plugin manifest for it, its uri
  --url/kubectl-ingero-<v>.tar.gz and the archive's sha256;
- `SHA256SUMS` of all of them.

The images are built by `make images` (scripts/images.sh), tagged <v>; the release workflow
(.github/workflows/release.yml) pushes them.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "ingero"
IMAGES = ("ingero-agent", "ingero-operator")
LAUNCHER = """#!/bin/sh
# kubectl ingero, as krew installs it: the wheel beside this script, installed on first use
# into a virtual environment of its own, runs the plugin.
set -e
here=$(dirname "$(readlink -f "$0")")
venv=${XDG_CACHE_HOME:-$HOME/.cache}/ingero/kubectl-ingero-@VERSION@
if [ ! -x "$venv/bin/kubectl-ingero" ]; then
  echo "kubectl-ingero: installing ingero @VERSION@ into $venv (once)" >&2
  if ! { python3 -m venv "$venv" && "$venv/bin/pip" install -q "$here/@WHEEL@"; } >&2; then
    rm -rf "$venv"
    echo "kubectl-ingero: could not install ingero @VERSION@; it needs python3 (>= 3.11) with venv and pip access to PyPI" >&2
    exit 1
  fi
fi
exec "$venv/bin/kubectl-ingero" "$@"
"""


def version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def chart_versions(chart: Path = CHART) -> dict[str, str]:
    import yaml

    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    return {k: str(meta[k]) for k in ("version", "appVersion")}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_wheel(out: Path) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", tmp, str(ROOT)], check=True)
        [wheel] = Path(tmp).glob("ingero-*.whl")
        return Path(shutil.copy2(wheel, out))


def package_chart(out: Path, v: str, registry: str | None) -> Path:
    """The chart as `helm package` makes it, version and appVersion <v>; with a registry, the
    images' repositories under it."""
    import helm_python

    with tempfile.TemporaryDirectory() as tmp:
        chart = Path(tmp) / "ingero"
        shutil.copytree(CHART, chart)
        if registry:
            values = chart / "values.yaml"
            text = values.read_text()
            for image in IMAGES:
                text, n = re.subn(rf"^(\s+repository: ){image}$", rf"\g<1>{registry.rstrip('/')}/{image}", text,
                                  flags=re.M)
                assert n == 1, f"values.yaml: no `repository: {image}` line"
            values.write_text(text)
        return Path(helm_python.package(str(chart), destination=str(out), version=v, app_version=v))


def krew_archive(out: Path, v: str, wheel: Path) -> Path:
    path = out / f"kubectl-ingero-{v}.tar.gz"
    launcher = LAUNCHER.replace("@VERSION@", v).replace("@WHEEL@", wheel.name).encode()
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo("kubectl-ingero")
        info.size, info.mode = len(launcher), 0o755
        tar.addfile(info, io.BytesIO(launcher))
        tar.add(wheel, arcname=wheel.name)
    return path


def krew_manifest(v: str, archive: Path, url: str) -> dict:
    return {
        "apiVersion": "krew.googlecontainertools.github.com/v1alpha2",
        "kind": "Plugin",
        "metadata": {"name": "ingero"},
        "spec": {
            "version": f"v{v}",
            "shortDescription": "Trace a training job's ranks and name its straggler",
            "description": "Creates Ingero TraceSessions (eBPF tracing of NCCL calls, TCP retransmits and "
                           "scheduler stalls per rank) and reads their verdicts, Events and merged traces "
                           "through the API server: trace, list, logs, report, get-artifact, export, delete.",
            "caveats": "Needs python3 (>= 3.11) with venv: the first run installs the ingero package into "
                       "~/.cache/ingero. The cluster needs the Ingero chart (operator and agents).",
            "platforms": [{
                "selector": {"matchExpressions": [{"key": "os", "operator": "In", "values": ["linux", "darwin"]}]},
                "uri": f"{url.rstrip('/')}/{archive.name}",
                "sha256": sha256(archive),
                "bin": "kubectl-ingero",
                "files": [{"from": "*", "to": "."}],
            }],
        },
    }


def build(out: Path, registry: str | None, url: str | None) -> list[Path]:
    import yaml     # the venv's (`make release`); `version` needs only the standard library

    v = version()
    if chart_versions() != {"version": v, "appVersion": v}:
        raise SystemExit(f"release: charts/ingero/Chart.yaml has {chart_versions()}, pyproject.toml {v}; "
                         f"set both chart fields to {v}")
    out.mkdir(parents=True, exist_ok=True)
    wheel = build_wheel(out)
    chart = package_chart(out, v, registry)
    archive = krew_archive(out, v, wheel)
    manifest = out / "ingero.yaml"
    manifest.write_text(yaml.safe_dump(krew_manifest(v, archive, url or out.resolve().as_uri()), sort_keys=False))
    made = [wheel, chart, archive, manifest]
    (out / "SHA256SUMS").write_text("".join(f"{sha256(p)}  {p.name}\n" for p in made))
    return made + [out / "SHA256SUMS"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="release.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("version", help="print the package version")
    b = sub.add_parser("build", help="write the release artifacts")
    b.add_argument("--out", type=Path, default=ROOT / "out" / "release")
    b.add_argument("--registry", help="registry the images are pushed to (e.g. ghcr.io/you): the packaged "
                                      "chart's default image repositories")
    b.add_argument("--url", help="where the krew archive will be downloaded from (a release's download URL); "
                                 "default: the --out folder as a file:// URL, for a local `kubectl krew install "
                                 "--manifest`")
    args = p.parse_args(argv)
    if args.cmd == "version":
        print(version())
        return 0
    for path in build(args.out, args.registry, args.url):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
