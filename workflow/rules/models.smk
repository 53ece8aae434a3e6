# Base models: tiny bases pretrained in the pipeline; the frozen base router's prior.


rule pretrain_base:
    input:
        ancient(TRACKING_READY),
        manifest=f"{RESULTS}/data/manifest.json",
        tokenizer=f"{RESULTS}/data/tokenizer",
        fixed=fixed_base_files,
    output:
        model=directory(BASE_MODEL),
        history=f"{os.path.dirname(BASE_MODEL)}/train_history.json",
        run=f"{os.path.dirname(BASE_MODEL)}/mlflow_run.json",
    log:
        f"{RESULTS}/logs/pretrain/{{model}}_base{{base}}.log",
    benchmark:
        f"{BENCHMARKS}/pretrain/{{model}}_base{{base}}.tsv"
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
        name=base_name,
        model_type=lambda wc: PLAN.config.models[wc.model].entry["model_type"],
        architecture=lambda wc: as_json(
            PLAN.config.models[wc.model].entry["architecture"]
        ),
        spec=lambda wc: as_json(PLAN.pretrain_spec(base_name(wc))),
        lbl=lambda wc: PLAN.config.models[wc.model].entry["pretrain"]["lbl_coef"],
        experts=experts_flag,
        base_of=base_of_flags,
        fixed=fixed_base_flag,
    shell:
        "rpb pipeline pretrain --name {params.name} --model-type {params.model_type}"
        " --architecture {params.architecture} --spec {params.spec} --lbl-coef {params.lbl}"
        " --tokenizer {input.tokenizer} --corpus {params.corpus} --out {params.out}"
        " --threads {threads} {params.experts} {params.base_of} {params.fixed} {params.track}"
        " > {log} 2>&1"


rule extract_prior:
    input:
        ancient(TRACKING_READY),
        model=BASE_MODEL,
        data=corpus_inputs,
    output:
        prior=PRIOR,
        meta=PRIOR.replace(".safetensors", ".json"),
        run=PRIOR.replace(".safetensors", ".run/mlflow_run.json"),
    log:
        f"{RESULTS}/logs/prior/{{model}}_base{{base}}_{{corpus}}.log",
    benchmark:
        f"{BENCHMARKS}/prior/{{model}}_base{{base}}_{{corpus}}.tsv"
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
        name=base_name,
    shell:
        "rpb pipeline prior --name {params.name} --model {input.model} --corpus {params.corpus}"
        " --out {output.prior} {params.trust} {params.experts} {params.base_of}"
        " {params.track} > {log} 2>&1"
