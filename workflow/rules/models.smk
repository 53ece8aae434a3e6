# Base models: tiny bases pretrained in the pipeline; the frozen base router's prior.


rule pretrain_base:
    input:
        ancient(TRACKING_READY),
        manifest=f"{RESULTS}/data/manifest.json",
        tokenizer=f"{RESULTS}/data/tokenizer",
    output:
        model=directory(f"{RESULTS}/models/{{model}}/base/model"),
        history=f"{RESULTS}/models/{{model}}/base/train_history.json",
        run=f"{RESULTS}/models/{{model}}/base/mlflow_run.json",
    log:
        f"{RESULTS}/logs/pretrain/{{model}}.log",
    benchmark:
        f"{BENCHMARKS}/pretrain/{{model}}.tsv"
    wildcard_constraints:
        model="|".join(PRETRAINED_MODELS) or "^$",
    conda:
        CONDA_ENV
    threads: THREADS
    resources:
        mem_mb=4000,
    params:
        track=TRACK,
        corpus=f"{RESULTS}/data/pretrain.jsonl",
        out=parent_dir("history"),
        model_type=lambda wc: PLAN.config.models[wc.model].entry["model_type"],
        architecture=lambda wc: as_json(
            PLAN.config.models[wc.model].entry["architecture"]
        ),
        spec=lambda wc: as_json(PLAN.pretrain_spec(wc.model)),
        lbl=lambda wc: PLAN.config.models[wc.model].entry["pretrain"]["lbl_coef"],
        experts=experts_flag,
        base_of=base_of_flags,
    shell:
        "rpb pipeline pretrain --name {wildcards.model} --model-type {params.model_type}"
        " --architecture {params.architecture} --spec {params.spec} --lbl-coef {params.lbl}"
        " --tokenizer {input.tokenizer} --corpus {params.corpus} --out {params.out}"
        " --threads {threads} {params.experts} {params.base_of} {params.track} > {log} 2>&1"


rule extract_prior:
    input:
        ancient(TRACKING_READY),
        model=f"{RESULTS}/models/{{model}}/base/model",
        data=corpus_inputs,
    output:
        prior=f"{RESULTS}/priors/{{model}}/{{corpus}}.safetensors",
        meta=f"{RESULTS}/priors/{{model}}/{{corpus}}.json",
        run=f"{RESULTS}/priors/{{model}}/{{corpus}}.run/mlflow_run.json",
    log:
        f"{RESULTS}/logs/prior/{{model}}_{{corpus}}.log",
    benchmark:
        f"{BENCHMARKS}/prior/{{model}}_{{corpus}}.tsv"
    conda:
        CONDA_ENV
    threads: THREADS
    resources:
        mem_mb=4000,
    params:
        track=TRACK,
        corpus=post_corpus,
        trust=trust_remote_code_flag,
        experts=experts_flag,
        base_of=base_of_flags,
    shell:
        "rpb pipeline prior --name {wildcards.model} --model {input.model} --corpus {params.corpus}"
        " --out {output.prior} {params.trust} {params.experts} {params.base_of}"
        " {params.track} > {log} 2>&1"
