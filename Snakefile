# rpb: reproduction pipeline for "Router Prior Bias" (arXiv:2609.08115).
# Thin entry point: configuration, rule modules, targets. Logic lives in the `rpb` package.

from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/download.smk"
include: "workflow/rules/models.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/tables.smk"
include: "workflow/rules/controls.smk"


rule all:
    default_target: True
    input:
        f"{RESULTS}/table1.csv",
        report_targets(),
