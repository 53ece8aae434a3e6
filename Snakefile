# rpb: reproduction pipeline for "Router Prior Bias" (arXiv:2609.08115).
# Thin entry point: configuration, rule modules, targets. Logic lives in the `rpb` package.

import sys

from snakemake.utils import min_version

from rpb.pipeline.config_check import ConfigError, check_yaml_syntax

min_version("9.0")

# Snakemake's own message for a YAML syntax error names neither the file nor the line, and its
# loader runs YTE templates and builds Python tags: config/config.yaml is checked before the
# `configfile:` directive reads it. --configfile files were read with the command line, before any
# workflow code (`rpb check-config FILE` checks them first); a templated one still stops here.
for _configfile in ["config/config.yaml", *(workflow.overwrite_configfiles or [])]:
    try:
        check_yaml_syntax(_configfile)
    except ConfigError as err:
        sys.exit(f"config error: {err}")


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


# Before Snakemake builds its DAG (and compares timestamps): a damaged artifact stops everything.
check_integrity()


# One MLflow parent run per invocation that runs jobs (not for dry runs or "nothing to be done").
onstart:
    from rpb.pipeline.tracking import TrackingUnavailable, start_invocation

    try:
        start_invocation(
            TRACKING_INVOCATION,
            TRACKING_URI,
            EXPERIMENT,
            config=config,
            configfiles=workflow.overwrite_configfiles or [],
        )
    except TrackingUnavailable as err:
        # Locked past RPB_TRACKING_WAIT_S, or full: one line, no traceback.
        sys.exit(f"tracking error: {err}")


onsuccess:
    from rpb.pipeline.results_folder import (
        clear_finished_notes,
        release_results_lock,
    )
    from rpb.pipeline.tracking import end_invocation

    end_invocation(TRACKING_INVOCATION, "FINISHED")
    clear_finished_notes(RESULTS)  # this invocation saw every job end
    release_results_lock(RESULTS)


onerror:
    from rpb.pipeline.results_folder import (
        clear_finished_notes,
        release_results_lock,
    )
    from rpb.pipeline.tracking import end_invocation

    end_invocation(TRACKING_INVOCATION, "FAILED")
    clear_finished_notes(RESULTS)  # this invocation saw every job end
    release_results_lock(RESULTS)


rule all:
    default_target: True
    input:
        f"{RESULTS}/table1.csv",
        report_targets(),
