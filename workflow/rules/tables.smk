# Tables with the paper's reported numbers beside the measured ones.


rule table1:
    input:
        table1_inputs,
    output:
        csv=report(
            f"{RESULTS}/table1.csv",
            caption="../report/table1.rst",
            category="Table 1",
        ),
        md=f"{RESULTS}/table1.md",
        heatmaps=report(
            f"{RESULTS}/figures/table1_coactivation.png",
            caption="../report/coactivation.rst",
            category="Table 1",
        ),
    log:
        f"{RESULTS}/logs/table1.log",
    conda:
        CONDA_ENV
    params:
        track=TRACK,
        spec=lambda wc: as_json(
            _common_spec()
            | {
                "model": config["table1"]["model"],
                "family": config["models"][config["table1"]["model"]]["family"],
                "corpus": config["table1"]["corpus"],
                "methods": config["table1"]["methods"],
                "seeds": runs(config["table1"]["model"], SEEDS),
                "in_domain": config["evaluation"]["in_domain"],
                "ood": config["evaluation"]["ood"],
                "corpus_tasks": config["evaluation"].get("corpus_tasks") or {},
                "scale": config["scale"],
            }
        ),
        results=parent_dir(0),
    shell:
        "rpb table1 --results {params.results} --spec {params.spec} --out {output.csv}"
        " {params.track} > {log} 2>&1"


rule testbed_report:
    input:
        testbed_inputs,
    output:
        md=f"{RESULTS}/testbed.md",
        json=f"{RESULTS}/testbed.json",
    log:
        f"{RESULTS}/logs/testbed.log",
    conda:
        CONDA_ENV
    params:
        track=TRACK,
        spec=lambda wc: as_json(
            {
                "models": ORIGINAL_PRETRAINED,
                "corpus": config["table1"]["corpus"],
                "seeds": SEEDS,
                "tasks": eval_tasks(),
            }
        ),
        results=parent_dir(0),
    shell:
        "rpb testbed --results {params.results} --spec {params.spec} --out {output.md}"
        " {params.track} > {log} 2>&1"


# Tables 2-5, the sweep and the drift curves: each reads the runs it compares (common.smk) and
# writes its CSV (the table), Markdown, side tables and figures; docs/claims.md says what each
# measures.


rule table2:
    input:
        table_inputs("table2"),
    output:
        csv=report(
            f"{RESULTS}/table2.csv", caption="../report/table2.rst", category="Table 2"
        ),
        md=f"{RESULTS}/table2.md",
        heatmaps=report(
            f"{RESULTS}/figures/table2_coactivation.png",
            caption="../report/coactivation.rst",
            category="Table 2",
        ),
    log:
        f"{RESULTS}/logs/table2.log",
    conda:
        CONDA_ENV
    params:
        track=TRACK,
        spec=lambda wc: as_json(table_spec("table2")),
        results=parent_dir(0),
    shell:
        "rpb table2 --results {params.results} --spec {params.spec} --out {output.csv}"
        " {params.track} > {log} 2>&1"


rule table3:
    input:
        table_inputs("table3"),
    output:
        csv=report(
            f"{RESULTS}/table3.csv", caption="../report/table3.rst", category="Table 3"
        ),
        md=f"{RESULTS}/table3.md",
    log:
        f"{RESULTS}/logs/table3.log",
    conda:
        CONDA_ENV
    params:
        track=TRACK,
        spec=lambda wc: as_json(table_spec("table3")),
        results=parent_dir(0),
    shell:
        "rpb table3 --results {params.results} --spec {params.spec} --out {output.csv}"
        " {params.track} > {log} 2>&1"


rule table4:
    input:
        table_inputs("table4"),
    output:
        csv=report(
            f"{RESULTS}/table4.csv", caption="../report/table4.rst", category="Table 4"
        ),
        md=f"{RESULTS}/table4.md",
        summary=f"{RESULTS}/table4_summary.csv",
        consistency=report(
            f"{RESULTS}/table4_consistency.csv",
            caption="../report/table4_consistency.rst",
            category="Table 4",
        ),
        pairs=report(
            f"{RESULTS}/table4_pairs.csv",
            caption="../report/table4_pairs.rst",
            category="Table 4",
        ),
        heatmaps=report(
            f"{RESULTS}/figures/table4_coactivation.png",
            caption="../report/coactivation.rst",
            category="Table 4",
        ),
    log:
        f"{RESULTS}/logs/table4.log",
    conda:
        CONDA_ENV
    params:
        track=TRACK,
        spec=lambda wc: as_json(table_spec("table4")),
        results=parent_dir(0),
    shell:
        "rpb table4 --results {params.results} --spec {params.spec} --out {output.csv}"
        " {params.track} > {log} 2>&1"


rule table5:
    input:
        table_inputs("table5"),
    output:
        csv=report(
            f"{RESULTS}/table5.csv", caption="../report/table5.rst", category="Table 5"
        ),
        md=f"{RESULTS}/table5.md",
        correlation=report(
            f"{RESULTS}/table5_correlation.csv",
            caption="../report/table5_correlation.rst",
            category="Table 5",
        ),
        hard=report(
            f"{RESULTS}/table5_hard.csv",
            caption="../report/table5_hard.rst",
            category="Table 5",
        ),
        base=report(
            f"{RESULTS}/table5_base.csv",
            caption="../report/table5_base.rst",
            category="Table 5",
        ),
        runs=f"{RESULTS}/table5_runs.csv",
        retention_in=report(
            f"{RESULTS}/figures/retention_vs_in_domain.png",
            caption="../report/retention.rst",
            category="Table 5",
        ),
        retention_ood=report(
            f"{RESULTS}/figures/retention_vs_ood_mean.png",
            caption="../report/retention.rst",
            category="Table 5",
        ),
        heatmaps=report(
            f"{RESULTS}/figures/table5_coactivation.png",
            caption="../report/coactivation.rst",
            category="Table 5",
        ),
    log:
        f"{RESULTS}/logs/table5.log",
    conda:
        CONDA_ENV
    params:
        track=TRACK,
        spec=lambda wc: as_json(table_spec("table5")),
        results=parent_dir(0),
    shell:
        "rpb table5 --results {params.results} --spec {params.spec} --out {output.csv}"
        " {params.track} > {log} 2>&1"


rule sweep:
    input:
        sweep_inputs,
    output:
        csv=report(
            f"{RESULTS}/sweep.csv", caption="../report/sweep.rst", category="Sweep"
        ),
        md=f"{RESULTS}/sweep.md",
        runs=f"{RESULTS}/sweep_runs.csv",
        matched=report(
            f"{RESULTS}/sweep_table4_matched.csv",
            caption="../report/sweep.rst",
            category="Sweep",
        ),
        matched_md=f"{RESULTS}/sweep_table4_matched.md",
        figure=report(
            f"{RESULTS}/figures/sweep.png",
            caption="../report/sweep_figure.rst",
            category="Sweep",
        ),
    log:
        f"{RESULTS}/logs/sweep.log",
    conda:
        CONDA_ENV
    params:
        track=TRACK,
        spec=lambda wc: as_json(sweep_spec()),
        results=parent_dir(0),
    shell:
        "rpb sweep --results {params.results} --spec {params.spec} --out {output.csv}"
        " {params.track} > {log} 2>&1"


rule drift:
    input:
        table_inputs("drift"),
    output:
        csv=f"{RESULTS}/drift.csv",
        figure=report(
            f"{RESULTS}/figures/drift.png",
            caption="../report/drift.rst",
            category="Training drift",
        ),
    log:
        f"{RESULTS}/logs/drift.log",
    conda:
        CONDA_ENV
    params:
        track=TRACK,
        spec=lambda wc: as_json(table_spec("drift")),
        results=parent_dir(0),
    shell:
        "rpb drift --results {params.results} --spec {params.spec} --out {output.csv}"
        " {params.track} > {log} 2>&1"


rule claims:
    input:
        # The tables first (the audit restates their numbers), then every run it reads.
        tables=[f"{RESULTS}/table{i}.csv" for i in (1, 2, 3, 4, 5)],
        runs=lambda wc: sorted(
            set(
                table1_inputs(wc)
                + sum(
                    (
                        table_inputs(t)(wc)
                        for t in ("table2", "table3", "table4", "table5")
                    ),
                    [],
                )
                + claims_extra_inputs(wc)
            )
        ),
    output:
        csv=report(
            f"{RESULTS}/claims.csv", caption="../report/claims.rst", category="Claims"
        ),
        md=f"{RESULTS}/claims.md",
    log:
        f"{RESULTS}/logs/claims.log",
    conda:
        CONDA_ENV
    params:
        track=TRACK,
        spec=lambda wc: as_json(claims_spec()),
        results=parent_dir("csv"),
    shell:
        "rpb claims --results {params.results} --spec {params.spec} --out {output.csv}"
        " {params.track} > {log} 2>&1"


rule readings:
    input:
        table_inputs("readings"),
    output:
        csv=report(
            f"{RESULTS}/rpb_readings.csv",
            caption="../report/readings.rst",
            category="RPB readings",
        ),
        md=f"{RESULTS}/rpb_readings.md",
        runs=f"{RESULTS}/rpb_readings_runs.csv",
        figure=report(
            f"{RESULTS}/figures/rpb_readings.png",
            caption="../report/readings.rst",
            category="RPB readings",
        ),
    log:
        f"{RESULTS}/logs/readings.log",
    conda:
        CONDA_ENV
    params:
        track=TRACK,
        spec=lambda wc: as_json(table_spec("readings")),
        results=parent_dir(0),
    shell:
        "rpb readings --results {params.results} --spec {params.spec} --out {output.csv}"
        " {params.track} > {log} 2>&1"
