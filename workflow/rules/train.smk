# Post-training: one job per (model, corpus, method, base, seed); all methods share a seed's data order.
# With `one_process_per_run` (the tiny default) rule posttrain_run trains, evaluates and analyses
# a run in one job; the three-job path (posttrain, evaluate, analyze) stays for the paper scale and
# for the base, which is evaluated and analysed without training.


rule posttrain:
    input:
        ancient(TRACKING_READY),
        base=run_base_dir,
        prior=method_prior,
        data=corpus_inputs,
    output:
        model=directory(f"{RUN_DIR}/model"),
        history=f"{RUN_DIR}/train_history.json",
        run=f"{RUN_DIR}/mlflow_run.json",
    log:
        f"{RESULTS}/logs/posttrain/{RUN_LOG}.log",
    benchmark:
        f"{BENCHMARKS}/posttrain/{RUN_LOG}.tsv"
    conda:
        CONDA_ENV
    threads: THREADS
    resources:
        **TRAIN_RESOURCES,
    params:
        track=TRACK,
        launcher=TRAIN_LAUNCHER,
        corpus=post_corpus,
        out=parent_dir("history"),
        method=lambda wc: as_json(PLAN.method_entry(wc.method)),
        spec=lambda wc: as_json(PLAN.posttrain_spec(wc.model, run_of(wc))),
        trust=trust_remote_code_flag,
        experts=experts_flag,
    shell:
        "{params.launcher} pipeline train --name {wildcards.model} --label {wildcards.method}"
        " --base {input.base} --prior {input.prior}"
        " --corpus {params.corpus} --corpus-name {wildcards.corpus} --method {params.method}"
        " --spec {params.spec} --out {params.out} --threads {threads} {params.trust}"
        " {params.experts} {params.track} > {log} 2>&1"


if ONE_PROCESS_PER_RUN:

    # The same three jobs' outputs (and MLflow runs) from one process: one start-up instead of
    # three. It wins over posttrain, evaluate and analyze for every trained run.
    ruleorder: posttrain_run > posttrain
    ruleorder: posttrain_run > evaluate
    ruleorder: posttrain_run > analyze

    rule posttrain_run:
        input:
            ancient(TRACKING_READY),
            base=run_base_dir,
            prior=method_prior,
            base_prior=run_base_prior,
            data=lambda wc: list(
                dict.fromkeys(corpus_inputs(wc) + EVAL_INPUTS + PROBE_INPUTS)
            ),
        output:
            model=directory(f"{RUN_DIR}/model"),
            history=f"{RUN_DIR}/train_history.json",
            run=f"{RUN_DIR}/mlflow_run.json",
            eval=f"{EVAL_OUT}.json",
            eval_run=f"{EVAL_OUT}.run/mlflow_run.json",
            eval_work=temp(directory(f"{EVAL_OUT}.work")),
            summary=f"{ANALYSIS_OUT}.json",
            counts=f"{ANALYSIS_OUT}.safetensors",
            analysis_run=f"{ANALYSIS_OUT}.run/mlflow_run.json",
        log:
            f"{RESULTS}/logs/posttrain/{RUN_LOG}.log",
        benchmark:
            f"{BENCHMARKS}/posttrain_run/{RUN_LOG}.tsv"
        wildcard_constraints:
            method="(?!base(?![a-z0-9_]))[a-z][a-z0-9_]*",  # every label but base
        conda:
            CONDA_ENV
        threads: THREADS
        resources:
            mem_mb=4000,
        params:
            track=TRACK,
            launcher=TRAIN_LAUNCHER,
            corpus=post_corpus,
            out=parent_dir("history"),
            method=lambda wc: as_json(PLAN.method_entry(wc.method)),
            spec=lambda wc: as_json(PLAN.posttrain_spec(wc.model, run_of(wc))),
            trust=trust_remote_code_flag,
            experts=experts_flag,
            eval_dir=EVAL_DIR,
            tasks=",".join(EVAL_TASKS),
            limit=PLAN.config.evaluation.limit,
            batch_size=PLAN.config.evaluation.batch_size,
            probe_tasks=",".join(PROBE_TASKS),
            probe_limit=PROBE_LIMIT,
        # The last line of the log names the run and its wall time; the pipeline prints it.
        shell:
            "{params.launcher} pipeline run --name {wildcards.model} --label {wildcards.method}"
            " --base {input.base} --prior {input.prior}"
            " --corpus {params.corpus} --corpus-name {wildcards.corpus} --method {params.method}"
            " --spec {params.spec} --out {params.out} --threads {threads} {params.trust}"
            " {params.experts} --eval-dir {params.eval_dir} --tasks {params.tasks}"
            " --limit {params.limit} --batch-size {params.batch_size}"
            " --work {output.eval_work} --eval-out {output.eval}"
            " --probe-tasks {params.probe_tasks} --probe-limit {params.probe_limit}"
            " --analysis-out {output.summary} --analysis-prior {input.base_prior}"
            " {params.track} > {log} 2>&1"
            " && grep '^rpb pipeline run: ' {log}"
