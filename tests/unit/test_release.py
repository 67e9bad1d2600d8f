"""The release artifacts (scripts/release.py, `make release`) carry pyproject.toml's version,
the one version source: the chart, its images' tag, the wheel, the krew plugin archive and
manifest, and what `ingero --version` prints."""

from __future__ import annotations

import hashlib
import subprocess
import tarfile
import zipfile

import pytest
import yaml

from scripts import release
from tests.conftest import ROOT

REGISTRY = "ghcr.io/example"


def test_the_chart_and_the_package_have_one_version():
    import ingero

    v = release.version()
    assert release.chart_versions() == {"version": v, "appVersion": v}
    assert ingero.__version__ == v    # the installed metadata: pyproject's, through `make venv`


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("release")
    paths = release.build(out, REGISTRY, "https://example.com/download/v1")
    return out, {p.name: p for p in paths}


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_every_artifact_carries_the_version_and_its_checksum(built):
    out, paths = built
    v = release.version()
    assert sorted(paths) == sorted([f"ingero-{v}-py3-none-any.whl", f"ingero-{v}.tgz", f"kubectl-ingero-{v}.tar.gz",
                                    "ingero.yaml", "SHA256SUMS"])
    sums = dict(reversed(ln.split("  ")) for ln in (out / "SHA256SUMS").read_text().splitlines())
    assert sums == {name: sha(p) for name, p in paths.items() if name != "SHA256SUMS"}
    with zipfile.ZipFile(paths[f"ingero-{v}-py3-none-any.whl"]) as whl:
        meta = whl.read(f"ingero-{v}.dist-info/METADATA").decode()
    assert f"\nVersion: {v}\n" in meta


def test_the_krew_manifest_names_the_archive_with_its_checksum(built):
    _, paths = built
    v = release.version()
    doc = yaml.safe_load(paths["ingero.yaml"].read_text())
    assert (doc["kind"], doc["metadata"]["name"], doc["spec"]["version"]) == ("Plugin", "ingero", f"v{v}")
    [platform] = doc["spec"]["platforms"]
    archive = paths[f"kubectl-ingero-{v}.tar.gz"]
    assert platform["uri"] == f"https://example.com/download/v1/{archive.name}"
    assert platform["sha256"] == sha(archive) and platform["bin"] == "kubectl-ingero"
    with tarfile.open(archive) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert set(members) == {"kubectl-ingero", f"ingero-{v}-py3-none-any.whl"}
        assert members["kubectl-ingero"].mode == 0o755
        launcher = tar.extractfile("kubectl-ingero").read().decode()
    assert f"ingero-{v}-py3-none-any.whl" in launcher and f"kubectl-ingero-{v}" in launcher
    assert subprocess.run(["sh", "-n"], input=launcher, text=True).returncode == 0


def test_the_chart_package_runs_the_images_of_its_version_from_the_registry(built):
    helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed: pip install -e '.[test]'")
    _, paths = built
    v = release.version()
    chart = helm_python.Chart.load(str(paths[f"ingero-{v}.tgz"]))
    docs = [d for path, text in chart.render(None, name="ingero", namespace="ingero-system", is_install=True,
                                             is_upgrade=False).items()
            if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    images = {c["image"] for d in docs if d["kind"] in ("DaemonSet", "Deployment")
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == {f"{REGISTRY}/ingero-agent:{v}", f"{REGISTRY}/ingero-operator:{v}"}


def test_the_release_workflow_builds_with_the_same_scripts():
    flow = (ROOT / ".github" / "workflows" / "release.yml").read_text()
    for step in ("scripts/release.py version", "scripts/images.sh", "scripts/release.py build"):
        assert step in flow, step
