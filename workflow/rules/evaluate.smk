# lm-evaluation-harness evaluation and co-activation analysis of every model the tables need
# (trained runs: rule posttrain_run instead, where one_process_per_run is set).


rule evaluate:
    input:
        ancient(TRACKING_READY),
        model=evaluated_model,
        data=EVAL_INPUTS,
    output:
        result=f"{EVAL_OUT}.json",
        run=f"{EVAL_OUT}.run/mlflow_run.json",
        # lm-eval's task YAMLs and datasets cache for this job only.
        work=temp(directory(f"{EVAL_OUT}.work")),
    log:
        f"{RESULTS}/logs/eval/{RUN_LOG}.log",
    benchmark:
        f"{BENCHMARKS}/eval/{RUN_LOG}.tsv"
    conda:
        CONDA_ENV
    threads: THREADS
    resources:
        mem_mb=4000,
    params:
        track=TRACK,
        eval_dir=EVAL_DIR,
        tasks=",".join(EVAL_TASKS),
        limit=PLAN.config.evaluation.limit,
        batch_size=PLAN.config.evaluation.batch_size,
        trust=trust_remote_code_flag,
        experts=experts_flag,
    shell:
        "rpb pipeline eval --name {wildcards.model} --label {wildcards.method}"
        " --base-index {wildcards.base} --seed {wildcards.seed} --corpus-name {wildcards.corpus}"
        " --model {input.model} --eval-dir {params.eval_dir}"
        " --tasks {params.tasks} --limit {params.limit} --batch-size {params.batch_size}"
        " --work {output.work} --out {output.result} {params.trust} {params.experts}"
        " {params.track} > {log} 2>&1"


rule analyze:
    input:
        ancient(TRACKING_READY),
        model=evaluated_model,
        base=run_base_dir,
        prior=run_base_prior,
        data=PROBE_INPUTS,
    output:
        summary=f"{ANALYSIS_OUT}.json",
        counts=f"{ANALYSIS_OUT}.safetensors",
        run=f"{ANALYSIS_OUT}.run/mlflow_run.json",
    log:
        f"{RESULTS}/logs/analysis/{RUN_LOG}.log",
    benchmark:
        f"{BENCHMARKS}/analysis/{RUN_LOG}.tsv"
    conda:
        CONDA_ENV
    threads: THREADS
    resources:
        mem_mb=4000,
    params:
        track=TRACK,
        eval_dir=EVAL_DIR,
        tasks=",".join(PROBE_TASKS),
        limit=PROBE_LIMIT,
        trust=trust_remote_code_flag,
        experts=experts_flag,
    shell:
        "rpb pipeline analyze --name {wildcards.model} --label {wildcards.method}"
        " --base-index {wildcards.base} --seed {wildcards.seed} --corpus-name {wildcards.corpus}"
        " --model {input.model} --base {input.base}"
        " --prior {input.prior} --eval-dir {params.eval_dir} --tasks {params.tasks}"
        " --limit {params.limit} --out {output.summary} {params.trust} {params.experts}"
        " {params.track} > {log} 2>&1"
