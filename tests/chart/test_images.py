"""The two Dockerfiles against the repository: what they copy exists and is not excluded by
.dockerignore, `pip install .` finds everything it needs in the build context, and the
images match what the chart expects (entrypoint, user, BPF folder). tests/images builds and
runs them."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import PurePosixPath

import pytest

from tests.chart.chartlib import ROOT, args_of, container, render

DOCKERFILES = ("Dockerfile.agent", "Dockerfile.operator")


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / name).read_text())
    out = []
    for line in text.splitlines():
        s = line.strip()
        if s and not s.startswith("#"):
            word, _, rest = s.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def ignore_patterns() -> list[str]:
    return [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore keeps `path` (relative, posix) out of the build context."""
    parts = PurePosixPath(path).parts
    out = False
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        for i in range(1, len(parts) + 1):   # a pattern matching a folder excludes what is inside
            prefix = "/".join(parts[:i])
            if fnmatch.fnmatchcase(prefix, pat) or (pat.startswith("**/") and
                                                    fnmatch.fnmatchcase(parts[i - 1], pat[3:])):
                out = not neg
                break
    return out


def context_files() -> list[str]:
    files = []
    for p in ROOT.rglob("*"):
        rel = p.relative_to(ROOT).as_posix()
        if p.is_file() and not rel.startswith((".git/", ".venv/")) and not ignored(rel, ignore_patterns()):
            files.append(rel)
    return files


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_every_copied_path_exists_and_is_in_the_build_context(dockerfile):
    pats = ignore_patterns()
    copies = [a for w, a in instructions(dockerfile) if w == "COPY" and "--from=" not in a]
    assert copies
    for args in copies:
        *sources, _dest = args.split()
        for src in sources:
            assert (ROOT / src).exists(), f"{dockerfile}: COPY {src}: no such path"
            assert not ignored(src.rstrip("/"), pats), f"{dockerfile}: COPY {src} is excluded by .dockerignore"


def test_pip_install_finds_every_package_and_data_file_in_the_context():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    files = set(context_files())
    assert project["project"]["readme"] in files
    for where in project["tool"]["setuptools"]["packages"]["find"]["where"]:
        for pkg in (ROOT / where).iterdir():
            if (pkg / "__init__.py").is_file() and any(fnmatch.fnmatch(pkg.name, pat) for pat in
                                                       project["tool"]["setuptools"]["packages"]["find"]["include"]):
                srcs = [p.relative_to(ROOT).as_posix() for p in pkg.rglob("*.py") if "__pycache__" not in p.parts]
                assert srcs and set(srcs) <= files, f"{pkg} is not fully in the build context"
    for pkg, globs in project["tool"]["setuptools"].get("package-data", {}).items():
        for g in globs:
            matches = [p.relative_to(ROOT).as_posix() for p in (ROOT / pkg).glob(g)]
            assert matches and set(matches) <= files, f"package data {pkg}/{g} missing from the context"
    # ... and nothing heavy or private rides along.
    assert not [f for f in files if f.startswith(("out/", "tests/", "bench/", ".venv/")) or f.endswith(".pyc")]


def test_both_images_are_built_on_one_debian_bookworm_base_with_its_python():
    for name in DOCKERFILES:
        ins = instructions(name)
        assert ins[0] == ("ARG", "BASE_IMAGE=debian:bookworm-slim"), (name, ins[0])    # scripts/images.sh sets it
        froms = [a for w, a in ins if w == "FROM"]
        assert froms == ["${BASE_IMAGE} AS deps", "deps AS build", "deps"], (name, froms)
        assert any(w == "COPY" and "--from=build" in a for w, a in ins)
        assert not any(w == "COPY" and "/opt/ingero/venv" in a for w, a in ins)    # the final stage's own


def test_the_operators_stages_are_the_agents_up_to_the_wheel_so_docker_builds_them_once():
    """Docker's layer cache shares a layer only while every instruction before it is the same:
    one differing line and a cold `make images` installs Python and downloads the Debian
    packages and the Python dependencies twice."""
    def stages(name: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        ins = instructions(name)
        last = [i for i, (w, _) in enumerate(ins) if w == "FROM"][-1]
        return ins[:last], ins[last:]

    (agent, agent_final), (operator, operator_final) = stages("Dockerfile.agent"), stages("Dockerfile.operator")
    wheel = next(i for i, (w, a) in enumerate(operator) if w == "RUN" and "pip wheel" in a)
    assert operator[:wheel + 1] == agent[:wheel + 1]
    assert operator[wheel + 1:] == []     # the agent's plugin build is its own
    assert agent_final[0] == operator_final[0] == ("FROM", "deps")


def test_agent_image_has_debian_bcc_and_a_venv_with_system_site_packages():
    ins = instructions("Dockerfile.agent")
    text = " ".join(a for _, a in ins)
    assert "python3-bpfcc" in text and "--system-site-packages" in text
    assert "/usr/bin/python3 -m venv" in text   # Debian's interpreter: the one bcc is built for
    env = " ".join(a for w, a in ins if w == "ENV")
    bpf = next(e["value"] for e in container(render(), "DaemonSet", "agent")["env"] if e["name"] == "INGERO_BPF_DIR")
    assert f"INGERO_BPF_DIR={bpf}" in env


def test_operator_image_runs_as_the_non_root_user_the_chart_expects():
    users = [a for w, a in instructions("Dockerfile.operator") if w == "USER"]
    assert users == ["65532:65532"]
    pod = [d for d in render() if d["kind"] == "Deployment"][0]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == 65532 and pod["securityContext"]["runAsNonRoot"] is True


@pytest.mark.parametrize("dockerfile,kind,name", [("Dockerfile.agent", "DaemonSet", "agent"),
                                                  ("Dockerfile.operator", "Deployment", "operator")])
def test_the_chart_runs_the_image_entrypoint_with_ingero_subcommands(dockerfile, kind, name):
    entry = [a for w, a in instructions(dockerfile) if w == "ENTRYPOINT"]
    assert entry == ['["ingero"]']
    c = container(render(), kind, name)
    assert "command" not in c and c["args"][:2] == ([name, "serve"] if name == "agent" else [name, "run"])
    assert args_of(c)   # flags follow
