# Post-training: one job per (model, corpus, method, seed); all methods share a seed's data order.


rule posttrain:
    input:
        TRACKING_READY,
        base=f"{RESULTS}/models/{{model}}/base/model",
        prior=f"{RESULTS}/priors/{{model}}/{{corpus}}.safetensors",
        data=CORPUS_INPUTS,
    output:
        model=directory(
            f"{RESULTS}/runs/{{model}}/{{corpus}}/{{method}}/seed{{seed}}/model"
        ),
        history=f"{RESULTS}/runs/{{model}}/{{corpus}}/{{method}}/seed{{seed}}/train_history.json",
    log:
        f"{RESULTS}/logs/posttrain/{{model}}_{{corpus}}_{{method}}_seed{{seed}}.log",
    conda:
        CONDA_ENV
    threads: THREADS
    resources:
        mem_mb=4000,
    params:
        track=TRACK,
        launcher=TRAIN_LAUNCHER,
        corpus=f"{RESULTS}/data/post/{{corpus}}.jsonl",
        out=parent_dir("history"),
        method=lambda wc: as_json(method_entry(wc.method)),
        spec=lambda wc: as_json(posttrain_spec(wc.seed)),
        trust=trust_remote_code_flag,
    shell:
        "{params.launcher} train --name {wildcards.model} --label {wildcards.method}"
        " --base {input.base} --prior {input.prior}"
        " --corpus {params.corpus} --corpus-name {wildcards.corpus} --method {params.method}"
        " --spec {params.spec} --out {params.out} {params.trust} {params.track} > {log} 2>&1"
