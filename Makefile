# Two entry points on a fresh machine: `make table1` (the main job) and `make test`.
# Each creates the virtual environment first (torch before the rest, so pip takes the CPU wheel).

VENV ?= .venv
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
CORES ?= all
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rpb-installed

export PATH := $(abspath $(VENV))/bin:$(PATH)
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install table1 smoke check-config test test-fast bench lint format clean-results ui

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

install: $(STAMP)

table1: install
	snakemake --cores $(CORES) results/table1.csv

smoke: install
	rpb check-config config/smoke.yaml
	snakemake --cores $(CORES) --configfile config/smoke.yaml -- results/smoke/table1.csv

# Snakemake reads a --configfile before any workflow code runs, and its message for a YAML syntax
# error names neither the file nor the line; this names both: make check-config CONFIGS=my.yaml
CONFIGS ?= config/config.yaml config/smoke.yaml
check-config: install
	rpb check-config $(CONFIGS)

test: install
	pytest

# The unit tier: no pipeline run (tests marked slow share one smoke run of it) and no Snakemake
# (tests marked workflow), one worker per core, a test module per worker (`--dist loadfile`: each
# module's fixtures are built once). On 2 cores (AMD EPYC, 2026-12-04, commit a06460b, 1271 tests):
# 90-97 s of pytest over three runs (121-136 s before d188cdf; docs/performance.md, "The unit tier").
test-fast: install
	pytest -m "not slow and not workflow" -n auto --dist loadfile

# Cost of one tiny run against the reference commit, and the router methods' step overhead
# (docs/performance.md); minutes each.
bench: install
	$(PY) bench/pipeline_cost.py
	$(PY) bench/overhead.py

lint: install
	ruff check .
	ruff format --check .
	snakefmt --check Snakefile workflow/rules
	snakemake --lint

format: install
	ruff format .
	ruff check --fix .
	snakefmt Snakefile workflow/rules

# MLflow's UI on the results store (README, "Browse the results"); Ctrl-C stops it. The link opens
# the runs table: MLflow 3.17 opens an experiment in its GenAI view unless a link says otherwise,
# and after this one the browser keeps the Model training view (docs/tracking.md).
UI_PORT ?= 5000
UI_STORE ?= results/mlflow.db
ui: install
	@echo "MLflow UI: http://127.0.0.1:$(UI_PORT)/#/experiments/1/runs?workflowType=machine_learning"
	mlflow ui --backend-store-uri sqlite:///$(UI_STORE) --host 127.0.0.1 --port $(UI_PORT)

clean-results:
	rm -rf results
