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
include: "workflow/rules/diagnostics.smk"
include: "workflow/rules/regime.smk"


# One MLflow parent run per invocation that runs jobs (not for dry runs or "nothing to be done").
onstart:
    from rpb.tracking import start_invocation

    start_invocation(
        TRACKING_INVOCATION,
        TRACKING_URI,
        EXPERIMENT,
        config=config,
        configfiles=workflow.overwrite_configfiles or [],
    )


onsuccess:
    from rpb.tracking import end_invocation

    end_invocation(TRACKING_INVOCATION, "FINISHED")


onerror:
    from rpb.tracking import end_invocation

    end_invocation(TRACKING_INVOCATION, "FAILED")


rule all:
    default_target: True
    input:
        f"{RESULTS}/table1.csv",
        report_targets(),
