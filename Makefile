# Ingero: the two commands a new user runs are `make demo` and `make test`.
# Both set up what is missing first (Debian packages, kernel headers link,
# tracefs, the virtual environment), so they work on a fresh Debian machine as root.

SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# `make test` runs the suite in two worker processes (pytest-xdist): the lab's verdict and
# timing tests one after another in one of them (tests/conftest.py, SERIAL), everything else
# beside them in the other. PYTEST_JOBS=0: one process, as `pytest` alone runs it.
PYTEST_JOBS ?= 2
DEB_PACKAGES := python3-bpfcc python3-venv linux-headers-amd64 nftables iproute2 ethtool gcc make libc6-dev kmod procps systemtap-sdt-dev openssl prometheus python3-argcomplete
# ... and for the images (`make images`, `make test-images`): docker and a Debian base bootstrap
IMAGE_PACKAGES := docker.io mmdebstrap
SCENARIO ?= lossy-link
DEMO_ARGS ?=

.PHONY: setup system venv lint test images-started test-lab-all test-unit test-bpf demo demo-trace readme-demo bench clean chart-lint e2e \
	images test-images release mutation mutation-listed

setup: system venv

# Debian packages and the host facts the agent needs (headers link, tracefs).
system:
	@bash scripts/setup-system.sh $(DEB_PACKAGES)

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || /usr/bin/python3 -m venv --system-site-packages $(VENV)
	@$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	@touch $@

venv: $(VENV)/.installed

# Static checks, before the suite (pyproject.toml: [tool.ruff], [tool.mypy] and the layer
# contract [tool.importlinter]; the tools come with the venv, pyproject's dev extras).
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/mypy

# The suite, with the images (tests/images; the whole flow's lossy-link job runs the agents and
# the operator from them). Their build starts first, in the background (images-started), beside
# the venv's install and the lint; the lab group's first tests wait for it to end while the other
# worker goes on with its files (tests/conftest.py, IMAGES_FIRST), so that no lab job runs beside
# a build. A first build on a machine costs ~110 s of CPU; later ones reuse docker's layer cache.
test: system images-started venv lint
	$(PY) -m pytest -n $(PYTEST_JOBS) $(PYTEST_ARGS)

# docker and mmdebstrap, then `make images` in the background (its log: out/images-build.log).
# The tests' own call of scripts/images.sh waits for it (a lock) and finds everything built.
# A run of chosen test paths (PYTEST_ARGS=tests/...) starts no build: the tests that use the
# images build them when they need them.
images-started: system
	@bash scripts/setup-system.sh $(IMAGE_PACKAGES)
	@if [ -z "$(filter tests%,$(PYTEST_ARGS))" ]; then \
		mkdir -p out && bash scripts/images.sh >out/images-build.log 2>&1 & fi

# The images alone: built (`make images`), then checked: what they hold, the chart's check
# container on this node, and the whole flow's lossy-link job traced with the agent image and
# completed with the operator image (the tests marked `images`).
test-images: setup
	@bash scripts/setup-system.sh $(IMAGE_PACKAGES)
	$(PY) -m pytest -m images tests/images tests/cluster/test_whole_flow.py $(PYTEST_ARGS)

# The suite with the extended lab jobs too: those that repeat a fault CI covers in another
# shape (tests/conftest.py, LAB_ALL); ~8 min more.
test-lab-all: setup
	INGERO_TEST_LAB_ALL=1 $(PY) -m pytest -n $(PYTEST_JOBS) $(PYTEST_ARGS)

test-unit: venv
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

test-bpf: setup
	$(PY) -m pytest tests/bpf $(PYTEST_ARGS)

# The main job on the embedded default: an in-process Kubernetes API server,
# the operator, one agent per lab node, a lab training job with a fault, a
# TraceSession applied with kubectl, and the verdict it writes into status.
demo: setup
	$(VENV)/bin/ingero demo --scenario $(SCENARIO) $(DEMO_ARGS)

# README's demo block (and docs/operator.md's) from a real run: the transcript is kept in
# docs/demo-output.txt; tests/unit/test_readme_demo.py checks the blocks agree with it.
readme-demo: setup
	$(VENV)/bin/ingero demo --scenario lossy-link | tee docs/demo-output.txt
	$(PY) scripts/readme_demo.py docs/demo-output.txt

# The node tracer alone on a lab job (no operator): trace, query, report.
demo-trace: setup
	$(VENV)/bin/ingero lab run --scenario $(SCENARIO) --trace --out out/demo-trace
	$(VENV)/bin/ingero query out/demo-trace/trace.duckdb "SELECT op, rank, nranks, duration_ns/1e6 AS ms FROM nccl_events ORDER BY duration_ns DESC LIMIT 10"
	$(VENV)/bin/ingero report out/demo-trace/trace.duckdb

# The Helm chart: rendered and linted by Helm's engine, validated against Kubernetes schemas.
chart-lint: venv
	$(PY) -m pytest tests/chart/test_chart_render.py tests/chart/test_crds.py $(PYTEST_ARGS)

# The agent and operator images, tagged with the package version (pyproject.toml), built on a
# Debian base made here from the mirror: no image registry is asked (scripts/images.sh;
# IMAGE_REGISTRY=ghcr.io/you prefixes their names, BASE_IMAGE=debian:bookworm-slim pulls one).
images: system
	@bash scripts/setup-system.sh $(IMAGE_PACKAGES)
	@bash scripts/images.sh

# The release artifacts in out/release: the wheel, the chart package, the krew plugin archive
# and manifest (scripts/release.py), after the images. RELEASE_URL: where the krew archive
# will be downloaded from. .github/workflows/release.yml runs it on a version tag and pushes.
release: venv images
	$(PY) scripts/release.py build --out out/release $(if $(IMAGE_REGISTRY),--registry $(IMAGE_REGISTRY)) \
	  $(if $(RELEASE_URL),--url $(RELEASE_URL))

# Images, a kind cluster, `helm install`, a two-pod training job traced with and without a
# fault. Needs docker (with a daemon), kind and kubectl; skips with the reason otherwise.
e2e: setup
	INGERO_E2E=1 $(PY) -m pytest tests/e2e -rs $(PYTEST_ARGS)

bench: setup
	$(PY) -m bench.run_all

# Mutation score of the verdict against its hand-built unit tests (mutmut; slow, not in CI):
# scripts/mutation.sh says how to run some mutants only.
mutation: venv
	VENV=$(VENV) scripts/mutation.sh

# The thirty hand-written mutations of ingero/analysis (scripts/mutation_listed.py), killed or not.
mutation-listed: venv
	VENV=$(VENV) scripts/mutation.sh --listed

clean:
	rm -rf $(VENV) out build *.egg-info
