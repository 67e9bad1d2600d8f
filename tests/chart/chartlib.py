"""Rendering the Helm chart with Helm's own engine (helm-python-sdk) and reading the result.

Shared by the chart tests; no cluster is contacted (``lookup`` returns nothing)
unless a kubeconfig is given.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "ingero"
RELEASE, NAMESPACE = "ingero", "ingero-system"
# The newest Kubernetes minor kubernetes-validate knows, and the oldest the chart supports
# (Chart.yaml kubeVersion).
OLDEST_KUBE = "1.26"


def helm():
    """The helm_python module, or a skip naming the missing package."""
    return pytest.importorskip("helm_python", reason="helm-python-sdk is not installed: pip install -e '.[test]'")


@functools.lru_cache(maxsize=None)
def _chart():
    return helm().Chart.load(str(CHART))


def render_files(values: dict | None = None, name: str = RELEASE, namespace: str = NAMESPACE,
                 kubeconfig: Path | None = None, upgrade: bool = False) -> dict[str, str]:
    """Template path -> rendered text, as `helm template` (or, with a kubeconfig, as an
    install or upgrade would render it, `lookup` answered by that API server)."""
    opts = dict(name=name, namespace=namespace, is_install=not upgrade, is_upgrade=upgrade)
    if kubeconfig is None:
        return _chart().render(values, **opts)
    h = helm()
    with h.Config(kubeconfig_path=str(kubeconfig), namespace=namespace) as cfg:
        return cfg.render(_chart(), values, **opts)


def render(values: dict | None = None, **kw) -> list[dict]:
    """Every object the chart installs (templates, in file order) for these values."""
    docs = []
    for path, text in sorted(render_files(values, **kw).items()):
        if path.endswith(".txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def crd_docs() -> list[dict]:
    """The CRDs under the chart's crds/ folder (Helm installs them before the templates)."""
    return [d for p in sorted((CHART / "crds").glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def find(docs: list[dict], kind: str, name: str | None = None) -> dict:
    got = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(got) == 1, f"expected one {kind} {name or ''}, got {[d['metadata']['name'] for d in got]}"
    return got[0]


def container(docs: list[dict], kind: str, name: str) -> dict:
    pod = find(docs, kind)["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == name)


def args_of(c: dict) -> dict[str, list[str]]:
    """--flag=value arguments of a container as flag -> values (bare flags map to [''])."""
    out: dict[str, list[str]] = {}
    for a in c.get("args", []):
        if a.startswith("--"):
            k, _, v = a.partition("=")
            out.setdefault(k, []).append(v)
    return out
