# Diagnostics beyond the paper (docs/testbed.md), in their own results tree `{RESULTS}/diagnostic/`
# so the main DAG is unchanged:
# - the router-swap decomposition by part: for each of a method's trained models T and its base B,
#   the models with each part (diagnostics.router_swap.parts: routers, routed experts, trunk) from
#   B or T, evaluated like every model -> router_swap.csv/.md (rpb.router_swap names the cells,
#   their models and the paths, so the rules and the table builder agree);
# - another training regime (diagnostics.regime; the default: the damped-trunk arm, the trunk at a
#   tenth of the rate instead of frozen): table 1's methods and hard -> diagnostic_table1.csv/.md.
# The training, evaluation and analysis rules are the main ones, re-targeted with `use rule`
# (`with:` replaces a rule's input and output wholesale but merges params by name).

# Imported as a module: every rule file shares one namespace (common.smk has a `table_inputs`).
import rpb.router_swap as part_swap


# One swapped model: the target's folder with one part of the source (labels `base_with_<m>_<part>`
# and `<m>_with_base_<part>`; `base` is the run's own base).
rule router_swap:
    input:
        unpack(
            lambda wc: part_swap.swap_input_dirs(
                RESULTS,
                PLAN.config.raw_models,
                wc.model,
                wc.corpus,
                wc.label,
                run_of(wc),
            )
        ),
        ancient(TRACKING_READY),
    output:
        model=directory(
            f"{SWAP_ROOT}/{PATHS['swapped_model'].replace('{method}', '{label}')}"
        ),
    log:
        f"{RESULTS}/logs/router_swap/{{model}}_{{corpus}}_{{label}}_base{{base}}_seed{{seed}}.log",
    benchmark:
        f"{BENCHMARKS}/router_swap/{{model}}_{{corpus}}_{{label}}_base{{base}}_seed{{seed}}.tsv"
    wildcard_constraints:
        label=part_swap.LABEL_PATTERN,
    conda:
        CONDA_ENV
    threads: THREADS
    resources:
        mem_mb=4000,
    params:
        part=lambda wc: part_swap.parse_label(wc.label)[2],
        track=DIAGNOSTIC_TRACK,
    shell:
        "rpb pipeline router-swap --name {wildcards.model} --label {wildcards.label}"
        " --base-index {wildcards.base} --seed {wildcards.seed} --corpus-name {wildcards.corpus}"
        " --target {input.target}"
        " --source {input.source} --parts {params.part} --out {output.model}"
        " {params.track} > {log} 2>&1"


use rule evaluate as router_swap_evaluate with:
    input:
        ancient(TRACKING_READY),
        model=swapped_model,
        data=EVAL_INPUTS,
    output:
        result=f"{SWAP_ROOT}/{PATHS['eval']}",
        run=f"{SWAP_ROOT}/{PATHS['eval'].replace('.json', '.run/mlflow_run.json')}",
        work=temp(directory(f"{SWAP_ROOT}/{PATHS['eval'].replace('.json', '.work')}")),
    log:
        f"{RESULTS}/logs/router_swap_eval/{RUN_LOG}.log",
    benchmark:
        f"{BENCHMARKS}/router_swap_eval/{RUN_LOG}.tsv"
    params:
        track=DIAGNOSTIC_TRACK,


# The table's spec: the plan's plus the factors (`parts`, default all three by the schema).
rule router_swap_table:
    input:
        lambda wc: part_swap.table_inputs(
            RESULTS,
            PLAN.router_swap_spec() | {"parts": list(DIAGNOSTICS.router_swap.parts)},
        ),
    output:
        csv=f"{RESULTS}/router_swap.csv",
        summary=f"{RESULTS}/router_swap_summary.csv",
        md=f"{RESULTS}/router_swap.md",
    log:
        f"{RESULTS}/logs/router_swap_table.log",
    conda:
        CONDA_ENV
    params:
        track=TRACK,
        spec=lambda wc: as_json(
            PLAN.router_swap_spec() | {"parts": list(DIAGNOSTICS.router_swap.parts)}
        ),
        results=parent_dir(0),
    shell:
        "rpb pipeline router-swap-table --results {params.results} --spec {params.spec}"
        " --out {output.csv} {params.track} > {log} 2>&1"


# --- the routing-sensitive regime ----------------------------------------------------------------


use rule posttrain as diagnostic_posttrain with:
    output:
        model=directory(f"{DIAG_ROOT}/{PATHS['model']}"),
        history=f"{DIAG_ROOT}/{PATHS['train_history']}",
        run=f"{DIAG_ROOT}/{os.path.dirname(PATHS['model'])}/mlflow_run.json",
    log:
        f"{RESULTS}/logs/diagnostic_posttrain/{RUN_LOG}.log",
    benchmark:
        f"{BENCHMARKS}/diagnostic_posttrain/{RUN_LOG}.tsv"
    params:
        spec=lambda wc: as_json(PLAN.diagnostic_spec(run_of(wc))),
        track=DIAGNOSTIC_TRACK,


use rule evaluate as diagnostic_evaluate with:
    input:
        ancient(TRACKING_READY),
        model=diagnostic_model_dir,
        data=EVAL_INPUTS,
    output:
        result=f"{DIAG_ROOT}/{PATHS['eval']}",
        run=f"{DIAG_ROOT}/{PATHS['eval'].replace('.json', '.run/mlflow_run.json')}",
        work=temp(directory(f"{DIAG_ROOT}/{PATHS['eval'].replace('.json', '.work')}")),
    log:
        f"{RESULTS}/logs/diagnostic_eval/{RUN_LOG}.log",
    benchmark:
        f"{BENCHMARKS}/diagnostic_eval/{RUN_LOG}.tsv"
    params:
        track=DIAGNOSTIC_TRACK,


use rule analyze as diagnostic_analyze with:
    input:
        ancient(TRACKING_READY),
        model=diagnostic_model_dir,
        base=BASE_MODEL,
        prior=PRIOR,
        data=PROBE_INPUTS,
    output:
        summary=f"{DIAG_ROOT}/{PATHS['analysis']}",
        counts=f"{DIAG_ROOT}/{PATHS['analysis_counts']}",
        run=f"{DIAG_ROOT}/{PATHS['analysis'].replace('.json', '.run/mlflow_run.json')}",
    log:
        f"{RESULTS}/logs/diagnostic_analysis/{RUN_LOG}.log",
    benchmark:
        f"{BENCHMARKS}/diagnostic_analysis/{RUN_LOG}.tsv"
    params:
        track=DIAGNOSTIC_TRACK,


rule diagnostic_table1:
    input:
        lambda wc: PLAN.diagnostic_table1_inputs(),
    output:
        csv=f"{RESULTS}/diagnostic_table1.csv",
        md=f"{RESULTS}/diagnostic_table1.md",
        heatmaps=f"{RESULTS}/figures/diagnostic_table1_coactivation.png",
    log:
        f"{RESULTS}/logs/diagnostic_table1.log",
    conda:
        CONDA_ENV
    params:
        track=TRACK,
        spec=lambda wc: as_json(PLAN.diagnostic_table1_spec()),
        results=lambda wc, output: os.path.join(
            os.path.dirname(output.csv), "diagnostic"
        ),
    shell:
        "rpb pipeline diagnostic-table1 --results {params.results} --spec {params.spec}"
        " --out {output.csv} {params.track} > {log} 2>&1"
