# Two entry points on a fresh machine: `make table1` (the main job) and `make test`.
# Each creates the virtual environment first (torch before the rest, so pip takes the CPU wheel).

VENV ?= .venv
PYTHON ?= python3
CORES ?= all
PY := $(VENV)/bin/python
CPU_LOCK := requirements/lock.txt
GPU_LOCK := requirements/lock-gpu.txt
# GPU=1 (or `make install-gpu`): the same versions with torch's CUDA build from PyPI
# (requirements/lock-gpu.txt; Linux x86_64, NVIDIA driver >= 580: docs/install.md).
GPU ?=
LOCK := $(if $(GPU),$(GPU_LOCK),$(CPU_LOCK))
STAMP := $(VENV)/.rpb-installed$(if $(GPU),-gpu)
# Where pip finds torch's CPU wheel when no copy lies on disk (the lock pins torch==2.13.0+cpu):
# make install TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=

export PATH := $(abspath $(VENV))/bin:$(PATH)
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install install-gpu lock lock-gpu bases compare-table1 table1 all report smoke check-config test test-fast bench lint format clean-results ui

# Exact versions with their hashes from the lock file (every dependency, torch's CPU build among
# them), then this project itself without resolving anything again.
$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	rm -f $(VENV)/.rpb-installed $(VENV)/.rpb-installed-gpu
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --require-hashes --no-deps -r $(LOCK) \
		$(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PY) -m pip check
	touch $@

install: $(STAMP)

install-gpu:
	$(MAKE) install GPU=1

# Regenerate the lock file from pyproject.toml's ranges and requirements/constraints.txt: after a
# change of either, or to take newer releases (then run make test, and compare table 1 with
# docs/reproducibility.md's: new versions may change its bits).
lock: install
	$(PY) -m piptools compile --quiet --extra dev --generate-hashes --strip-extras \
		--unsafe-package rpb --no-emit-index-url --no-emit-find-links \
		-c requirements/constraints.txt -o $(CPU_LOCK) pyproject.toml

# The GPU lock from the CPU lock: every version the CPU lock pins, torch's PyPI (CUDA) build of
# the same release, and what that build pulls in (nvidia-*, triton), resolved on PyPI alone.
# tests/test_envs.py checks that the two agree; run it after `make lock`. PyPI only, no pip config
# or find-links: a local torch-2.13.0+cpu wheel satisfies `torch==2.13.0` (a local version label)
# and would be locked instead of the CUDA build.
lock-gpu: install
	grep -E '^[A-Za-z0-9_.-]+==' $(CPU_LOCK) | sed 's/ \\$$//' | grep -v '^torch==' \
		> $(VENV)/pins-gpu.txt
	sed -E 's/^torch==([^+]*)\+cpu$$/torch==\1/' requirements/constraints.txt \
		> $(VENV)/constraints-gpu.txt
	env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null $(PY) -m piptools compile --quiet --extra dev \
		--generate-hashes --strip-extras --unsafe-package rpb --no-emit-index-url \
		--no-emit-find-links --index-url https://pypi.org/simple \
		-c $(VENV)/constraints-gpu.txt -c $(VENV)/pins-gpu.txt -o $(GPU_LOCK) pyproject.toml

# The results folder and config of the last `make table1`, `make all` or `make smoke`: `make ui`
# and `make report` open that run's store and tables.
LAST_RUN := .rpb-last-run
define ran
	@echo "$(1) $(2)" > $(LAST_RUN)
	@echo ""
	@echo "Done: table 1 is $(1)/table1.csv (caption and verdicts: $(1)/table1.md)."
	@echo "  make report   builds $(1)/report.html (tables, captions, figures) and prints its path"
	@echo "  make ui       opens MLflow's UI on this run's store, $(1)/mlflow.db"
endef

table1: install
	snakemake --cores $(CORES) results/table1.csv
	$(call ran,results,config/config.yaml)

# Every table, the claims audit, figures and diagnostics (hours on 2 cores).
all: install
	snakemake --cores $(CORES) all
	$(call ran,results,config/config.yaml)

# Pretrain every committed base here (bases/manifest.json) on the numeric path they were pretrained
# on (compatible), and say per base whether this machine gives the committed bytes
# (docs/reproducibility.md).
BASES_RESULTS ?= results/bases
bases: install
	snakemake --cores $(CORES) --config bases=pretrain cpu_numerics=compatible \
		results_dir=$(BASES_RESULTS) -- \
		$$($(PY) -m rpb.pipeline.bases targets $(BASES_RESULTS))
	$(PY) -m rpb.pipeline.bases compare $(BASES_RESULTS)

# Every output of `make table1` against the digests recorded on another machine.
compare-table1: install
	$(PY) bench/compare_results.py --against bench/results/reproducibility/table1.json results

smoke: install
	rpb check-config config/smoke.yaml
	snakemake --cores $(CORES) --configfile config/smoke.yaml -- results/smoke/table1.csv
	$(call ran,results/smoke,config/smoke.yaml)
	@echo ""
	@echo "This was the smoke run: it checks that the pipeline runs end to end, and its numbers carry"
	@echo "no meaning (0.00 accuracies, \"not testable\" and \"not met\" are expected at this size)."
	@echo "Table 1's numbers: make table1 (docs/testbed.md gives its time)."

# Snakemake reads a --configfile before any workflow code runs (a YTE template's code runs then,
# a file that is not UTF-8 is a traceback, a YAML syntax error names neither file nor line): every
# target here that gives Snakemake a --configfile checks it with `rpb check-config` first
# (tests/test_faults.py), and so does this one: make check-config CONFIGS=my.yaml
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
LAST_RESULTS = $(word 1,$(shell cat $(LAST_RUN) 2>/dev/null || echo results config/config.yaml))
LAST_CONFIG = $(word 2,$(shell cat $(LAST_RUN) 2>/dev/null || echo results config/config.yaml))
UI_STORE ?= $(LAST_RESULTS)/mlflow.db
ui: install
	@test -f $(UI_STORE) || { echo "no MLflow store at $(UI_STORE): run make table1 or make smoke first"; exit 1; }
	@echo "MLflow UI on $(UI_STORE): http://127.0.0.1:$(UI_PORT)/#/experiments/1/runs?workflowType=machine_learning"
	@echo "Table 1 by method on p(target): http://127.0.0.1:$(UI_PORT)/#/experiments/1/runs?workflowType=machine_learning&compareRunsMode=CHART&viewStateShareKey=table1"
	mlflow ui --backend-store-uri sqlite:///$(UI_STORE) --host 127.0.0.1 --port $(UI_PORT)

# Snakemake's report of the last run's table 1 (one HTML file; `all`'s report: make report-all).
report: install
	rpb check-config $(LAST_CONFIG)
	snakemake --configfile $(LAST_CONFIG) --report $(LAST_RESULTS)/report.html -- $(LAST_RESULTS)/table1.csv
	@echo "report: $(LAST_RESULTS)/report.html"

clean-results:
	rm -rf results
