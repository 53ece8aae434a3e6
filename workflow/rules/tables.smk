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
        ),
        md=f"{RESULTS}/table1.md",
        html=report(
            f"{RESULTS}/table1.html",
            caption="../report/table.rst",
            category="Table 1",
            subcategory="Table",
        ),
        heatmaps=f"{RESULTS}/figures/table1_coactivation.png",
        heatmaps_runs=report(
            directory(f"{RESULTS}/figures/table1_coactivation_runs"),
            patterns=["{corpus}_seed{seed}.png"],
            caption="../report/coactivation.rst",
            category="Table 1",
            subcategory="Co-activation per run",
            labels={"run": "{corpus} seed {seed}"},
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


# Tables 2-5, the sweep and the drift curves: each reads the runs it compares (rpb.pipeline.plan) and
# writes its CSV (the table), Markdown, side tables and figures; docs/claims.md says what each
# measures.


rule table2:
    input:
        table_inputs("table2"),
    output:
        csv=report(
            f"{RESULTS}/table2.csv",
            caption="../report/data.rst",
            category="Table 2",
            subcategory="Data",
        ),
        md=f"{RESULTS}/table2.md",
        html=report(
            f"{RESULTS}/table2.html",
            caption="../report/table.rst",
            category="Table 2",
            subcategory="Table",
        ),
        heatmaps=f"{RESULTS}/figures/table2_coactivation.png",
        heatmaps_runs=report(
            directory(f"{RESULTS}/figures/table2_coactivation_runs"),
            patterns=["{corpus}_seed{seed}.png"],
            caption="../report/coactivation.rst",
            category="Table 2",
            subcategory="Co-activation per run",
            labels={"run": "{corpus} seed {seed}"},
        ),
    log:
        f"{RESULTS}/logs/table2.log",
    conda:
        CONDA_ENV
    params:
        track=TRACK,
        spec=lambda wc: as_json(PLAN.table_spec("table2")),
        results=parent_dir(0),
    shell:
        "rpb pipeline table2 --results {params.results} --spec {params.spec} --out {output.csv}"
        " {params.track} > {log} 2>&1"


rule table3:
    input:
        table_inputs("table3"),
    output:
        csv=report(
            f"{RESULTS}/table3.csv",
            caption="../report/data.rst",
            category="Table 3",
            subcategory="Data",
        ),
        md=f"{RESULTS}/table3.md",
        html=report(
            f"{RESULTS}/table3.html",
            caption="../report/table.rst",
            category="Table 3",
            subcategory="Table",
        ),
    log:
        f"{RESULTS}/logs/table3.log",
    conda:
        CONDA_ENV
    params:
        track=TRACK,
        spec=lambda wc: as_json(PLAN.table_spec("table3")),
        results=parent_dir(0),
    shell:
        "rpb pipeline table3 --results {params.results} --spec {params.spec} --out {output.csv}"
        " {params.track} > {log} 2>&1"


rule table4:
    input:
        table_inputs("table4"),
    output:
        csv=report(
            f"{RESULTS}/table4.csv",
            caption="../report/data.rst",
            category="Table 4",
            subcategory="Data",
        ),
        md=f"{RESULTS}/table4.md",
        html=report(
            f"{RESULTS}/table4.html",
            caption="../report/table.rst",
            category="Table 4",
            subcategory="Table",
        ),
        summary=f"{RESULTS}/table4_summary.csv",
        consistency=report(
            f"{RESULTS}/table4_consistency.csv",
            caption="../report/data.rst",
            category="Table 4",
            subcategory="Data",
        ),
        pairs=report(
            f"{RESULTS}/table4_pairs.csv",
            caption="../report/data.rst",
            category="Table 4",
            subcategory="Data",
        ),
        heatmaps=f"{RESULTS}/figures/table4_coactivation.png",
        heatmaps_runs=report(
            directory(f"{RESULTS}/figures/table4_coactivation_runs"),
            patterns=["{corpus}_seed{seed}.png"],
            caption="../report/coactivation.rst",
            category="Table 4",
            subcategory="Co-activation per run",
            labels={"run": "{corpus} seed {seed}"},
        ),
    log:
        f"{RESULTS}/logs/table4.log",
    conda:
        CONDA_ENV
    params:
        track=TRACK,
        spec=lambda wc: as_json(PLAN.table_spec("table4")),
        results=parent_dir(0),
    shell:
        "rpb pipeline table4 --results {params.results} --spec {params.spec} --out {output.csv}"
        " {params.track} > {log} 2>&1"


rule table5:
    input:
        table_inputs("table5"),
    output:
        csv=report(
            f"{RESULTS}/table5.csv",
            caption="../report/data.rst",
            category="Table 5",
            subcategory="Data",
        ),
        md=f"{RESULTS}/table5.md",
        html=report(
            f"{RESULTS}/table5.html",
            caption="../report/table.rst",
            category="Table 5",
            subcategory="Table",
        ),
        correlation=report(
            f"{RESULTS}/table5_correlation.csv",
            caption="../report/data.rst",
            category="Table 5",
            subcategory="Data",
        ),
        hard=report(
            f"{RESULTS}/table5_hard.csv",
            caption="../report/data.rst",
            category="Table 5",
            subcategory="Data",
        ),
        base=report(
            f"{RESULTS}/table5_base.csv",
            caption="../report/data.rst",
            category="Table 5",
            subcategory="Data",
        ),
        runs=f"{RESULTS}/table5_runs.csv",
        retention_in=report(
            f"{RESULTS}/figures/retention_vs_in_domain.png",
            caption="../report/retention.rst",
            category="Table 5",
            subcategory="Figures",
        ),
        retention_ood=report(
            f"{RESULTS}/figures/retention_vs_ood_mean.png",
            caption="../report/retention.rst",
            category="Table 5",
            subcategory="Figures",
        ),
        heatmaps=f"{RESULTS}/figures/table5_coactivation.png",
        heatmaps_runs=report(
            directory(f"{RESULTS}/figures/table5_coactivation_runs"),
            patterns=["{corpus}_seed{seed}.png"],
            caption="../report/coactivation.rst",
            category="Table 5",
            subcategory="Co-activation per run",
            labels={"run": "{corpus} seed {seed}"},
        ),
    log:
        f"{RESULTS}/logs/table5.log",
    conda:
        CONDA_ENV
    params:
        track=TRACK,
        spec=lambda wc: as_json(PLAN.table_spec("table5")),
        results=parent_dir(0),
    shell:
        "rpb pipeline table5 --results {params.results} --spec {params.spec} --out {output.csv}"
        " {params.track} > {log} 2>&1"


rule sweep:
    input:
        lambda wc: PLAN.sweep_inputs(),
    output:
        csv=report(
            f"{RESULTS}/sweep.csv",
            caption="../report/data.rst",
            category="Sweep",
            subcategory="Data",
        ),
        md=f"{RESULTS}/sweep.md",
        html=report(
            f"{RESULTS}/sweep.html",
            caption="../report/table.rst",
            category="Sweep",
            subcategory="Table",
        ),
        runs=f"{RESULTS}/sweep_runs.csv",
        matched=report(
            f"{RESULTS}/sweep_table4_matched.csv",
            caption="../report/data.rst",
            category="Sweep",
            subcategory="Data",
        ),
        matched_md=f"{RESULTS}/sweep_table4_matched.md",
        matched_html=report(
            f"{RESULTS}/sweep_table4_matched.html",
            caption="../report/table.rst",
            category="Sweep",
            subcategory="Table",
        ),
        figure=report(
            f"{RESULTS}/figures/sweep.png",
            caption="../report/sweep_figure.rst",
            category="Sweep",
            subcategory="Figures",
        ),
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
        spec=lambda wc: as_json(PLAN.table_spec("drift")),
        results=parent_dir(0),
    shell:
        "rpb pipeline drift --results {params.results} --spec {params.spec} --out {output.csv}"
        " {params.track} > {log} 2>&1"


rule claims:
    input:
        # The tables first (the audit restates their numbers), then every run it reads.
        tables=[f"{RESULTS}/table{i}.csv" for i in (1, 2, 3, 4, 5)],
        runs=lambda wc: PLAN.claims_runs(),
    output:
        csv=report(
            f"{RESULTS}/claims.csv",
            caption="../report/data.rst",
            category="Claims",
            subcategory="Data",
        ),
        md=f"{RESULTS}/claims.md",
        html=report(
            f"{RESULTS}/claims.html",
            caption="../report/claims.rst",
            category="Claims",
            subcategory="Verdicts",
        ),
        # One page per table: its claims, their verdicts and the premises they depend on, shown
        # in that table's category.
        by_table=report(
            directory(f"{RESULTS}/claims_by_table"),
            patterns=["table{n}_claims.html"],
            caption="../report/claims_by_table.rst",
            category="Table {n}",
            subcategory="Claims on this table",
        ),
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


rule readings:
    input:
        table_inputs("readings"),
    output:
        csv=report(
            f"{RESULTS}/rpb_readings.csv",
            caption="../report/data.rst",
            category="RPB readings",
            subcategory="Data",
        ),
        md=f"{RESULTS}/rpb_readings.md",
        html=report(
            f"{RESULTS}/rpb_readings.html",
            caption="../report/table.rst",
            category="RPB readings",
            subcategory="Table",
        ),
        runs=f"{RESULTS}/rpb_readings_runs.csv",
        figure=report(
            f"{RESULTS}/figures/rpb_readings.png",
            caption="../report/readings_figure.rst",
            category="RPB readings",
            subcategory="Figures",
        ),
    log:
        f"{RESULTS}/logs/readings.log",
    conda:
        CONDA_ENV
    params:
        track=TRACK,
        spec=lambda wc: as_json(PLAN.table_spec("readings")),
        results=parent_dir(0),
    shell:
        "rpb pipeline readings --results {params.results} --spec {params.spec} --out {output.csv}"
        " {params.track} > {log} 2>&1"
