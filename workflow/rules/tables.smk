# Tables with the paper's reported numbers beside the measured ones.


rule table1:
    input:
        lambda wc: PLAN.table1_inputs(),
    output:
        csv=report(
            f"{RESULTS}/table1.csv",
            caption="../report/data.rst",
            category="Table 1",
            subcategory="Data",
            labels={"file": "table1.csv (every column, 4 decimals)"},
        ),
        md=f"{RESULTS}/table1.md",
        html=report(
            f"{RESULTS}/table1.html",
            caption="../report/table.rst",
            category="Table 1",
            subcategory="Table",
            labels={"file": "table1.html (every column, its full caption)"},
        ),
        heatmaps=f"{RESULTS}/figures/table1_coactivation.png",
        heatmaps_runs=report(
            directory(f"{RESULTS}/figures/table1_coactivation_runs"),
            patterns=list(RUN_FIGURES),
            caption="../report/coactivation.rst",
            category="Table 1",
            subcategory="Co-activation per run",
            labels=dict(RUN_LABELS),
        ),
    log:
        f"{RESULTS}/logs/table1.log",
    conda:
        CONDA_ENV
    params:
        track=TRACK,
        spec=lambda wc: as_json(PLAN.table1_spec()),
        results=parent_dir(0),
        claims=lambda wc: table1_claims_option(),
    shell:
        "rpb pipeline table1 --results {params.results} --spec {params.spec} --out {output.csv}"
        " {params.claims} {params.track} > {log} 2>&1"


rule testbed_report:
    input:
        lambda wc: PLAN.testbed_inputs(),
    output:
        md=f"{RESULTS}/testbed.md",
        json=f"{RESULTS}/testbed.json",
    log:
        f"{RESULTS}/logs/testbed.log",
    conda:
        CONDA_ENV
    params:
        track=TRACK,
        spec=lambda wc: as_json(PLAN.testbed_spec()),
        results=parent_dir(0),
    shell:
        "rpb pipeline testbed --results {params.results} --spec {params.spec} --out {output.md}"
        " {params.track} > {log} 2>&1"


# Tables 2-5, the drift curves, the RPB readings and any other table whose module declares a
# report job with a shape (rpb.report.registry.REPORTS): one rule each, inputs and spec from the
# planner (which reads the shape), outputs (and how the Snakemake report shows them) from the
# entry. Each reads the runs it compares and writes its CSV (the table), Markdown, side tables and
# figures; docs/claims.md says what each measures.
for job in PLANNED_REPORTS:

    rule:
        name:
            job.key
        input:
            table_inputs(job.key),
        output:
            **report_outputs(job),
        log:
            f"{RESULTS}/logs/{job.key}.log",
        conda:
            CONDA_ENV
        params:
            track=TRACK,
            spec=table_spec_param(job.key),
            results=parent_dir(0),
            job=job.command,
        # The job's name comes through params: Snakemake evaluates the shell string again when
        # the job runs, and by then the loop's `job` is its last entry.
        shell:
            "rpb pipeline {params.job} --results {params.results} --spec {params.spec}"
            " --out {output.csv} {params.track} > {log} 2>&1"


rule sweep:
    input:
        lambda wc: PLAN.sweep_inputs(),
    output:
        **report_outputs(REPORTS["sweep"]),
    log:
        f"{RESULTS}/logs/sweep.log",
    conda:
        CONDA_ENV
    params:
        track=TRACK,
        spec=lambda wc: as_json(PLAN.sweep_spec()),
        results=parent_dir(0),
    shell:
        "rpb pipeline sweep --results {params.results} --spec {params.spec} --out {output.csv}"
        " {params.track} > {log} 2>&1"


rule claims:
    input:
        # The tables first (the audit restates their numbers), then every run it reads.
        tables=[f"{RESULTS}/table{i}.csv" for i in (1, 2, 3, 4, 5)],
        runs=lambda wc: PLAN.claims_runs(),
    output:
        **report_outputs(REPORTS["claims"]),
    log:
        f"{RESULTS}/logs/claims.log",
    conda:
        CONDA_ENV
    params:
        track=TRACK,
        spec=lambda wc: as_json(PLAN.claims_spec()),
        results=parent_dir("csv"),
    shell:
        "rpb pipeline claims --results {params.results} --spec {params.spec} --out {output.csv}"
        " {params.track} > {log} 2>&1"
