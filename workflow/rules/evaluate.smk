# lm-evaluation-harness evaluation and co-activation analysis of every model the tables need.


rule evaluate:
    input:
        TRACKING_READY,
        model=evaluated_model,
        data=EVAL_INPUTS,
    output:
        f"{RESULTS}/eval/{{model}}/{{corpus}}/{{method}}/seed{{seed}}.json",
    log:
        f"{RESULTS}/logs/eval/{{model}}_{{corpus}}_{{method}}_seed{{seed}}.log",
    conda:
        CONDA_ENV
    threads: THREADS
    resources:
        mem_mb=4000,
    params:
        track=TRACK,
        eval_dir=f"{RESULTS}/data/eval",
        tasks=",".join(eval_tasks()),
        limit=config["evaluation"].get("limit") or 0,
        batch_size=config["evaluation"].get("batch_size", 64),
        work=f"{RESULTS}/eval/{{model}}/{{corpus}}/{{method}}/seed{{seed}}.work",
        trust=trust_remote_code_flag,
    shell:
        "rpb eval --name {wildcards.model} --label {wildcards.method} --seed {wildcards.seed}"
        " --corpus-name {wildcards.corpus} --model {input.model} --eval-dir {params.eval_dir}"
        " --tasks {params.tasks} --limit {params.limit} --batch-size {params.batch_size}"
        " --work {params.work} --out {output} {params.trust} {params.track} > {log} 2>&1"


rule analyze:
    input:
        TRACKING_READY,
        model=evaluated_model,
        base=f"{RESULTS}/models/{{model}}/base/model",
        prior=f"{RESULTS}/priors/{{model}}/{{corpus}}.safetensors",
        data=PROBE_INPUTS,
    output:
        summary=f"{RESULTS}/analysis/{{model}}/{{corpus}}/{{method}}/seed{{seed}}.json",
        counts=f"{RESULTS}/analysis/{{model}}/{{corpus}}/{{method}}/seed{{seed}}.safetensors",
    log:
        f"{RESULTS}/logs/analysis/{{model}}_{{corpus}}_{{method}}_seed{{seed}}.log",
    conda:
        CONDA_ENV
    threads: THREADS
    resources:
        mem_mb=4000,
    params:
        track=TRACK,
        eval_dir=f"{RESULTS}/data/eval",
        tasks=",".join(config.get("analysis", {}).get("probe_tasks", eval_tasks())),
        limit=config.get("analysis", {}).get("probe_limit", 200),
        trust=trust_remote_code_flag,
    shell:
        "rpb analyze --name {wildcards.model} --label {wildcards.method} --seed {wildcards.seed}"
        " --corpus-name {wildcards.corpus} --model {input.model} --base {input.base}"
        " --prior {input.prior} --eval-dir {params.eval_dir} --tasks {params.tasks}"
        " --limit {params.limit} --out {output.summary} {params.trust} {params.track}"
        " > {log} 2>&1"
