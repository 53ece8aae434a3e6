#!/usr/bin/env bash
# Run by Snakemake (--sdm conda) inside the new environment, from the workflow directory: install
# the rpb package of this checkout (its dependencies are already in the environment).
set -euo pipefail
python -m pip install --no-deps -e .
