# Tracking store, synthetic corpora and tokenizer.


rule tracking_init:
    output:
        touch(TRACKING_READY),
    log:
        f"{RESULTS}/logs/tracking_init.log",
    conda:
        CONDA_ENV
    params:
        track=TRACK,
    shell:
        "rpb pipeline init-tracking {params.track} > {log} 2>&1"


rule corpora:
    input:
        ancient(TRACKING_READY),
    output:
        manifest=f"{RESULTS}/data/manifest.json",
        tokenizer=directory(f"{RESULTS}/data/tokenizer"),
        run=f"{RESULTS}/data/mlflow_run.json",
    log:
        f"{RESULTS}/logs/corpora.log",
    conda:
        CONDA_ENV
    params:
        track=TRACK,
        out=parent_dir("manifest"),
        seed=PLAN.config.data.seed,
        preset=PLAN.config.data.preset,
        level=PLAN.config.data.level,
        holdout=holdout_arg(PLAN.config.data.holdout),
    shell:
        "rpb pipeline corpora --out {params.out} --seed {params.seed} --preset {params.preset}"
        " --level {params.level}{params.holdout} {params.track}"
        " > {log} 2>&1"


# An eval-only set (rpb.specs.EVAL_SETS["eval_only"]) named in the evaluation: written beside the
# corpora by its own job, so no base, prior or corpus depends on it.
rule eval_only_set:
    input:
        ancient(TRACKING_READY),
        manifest=f"{RESULTS}/data/manifest.json",
    output:
        eval=f"{RESULTS}/data/eval/{{task}}.jsonl",
        run=f"{RESULTS}/data/eval/{{task}}.run/mlflow_run.json",
    log:
        f"{RESULTS}/logs/eval_set_{{task}}.log",
    wildcard_constraints:
        task="|".join(EVAL_ONLY_SETS) or "^$",
    conda:
        CONDA_ENV
    params:
        track=TRACK,
        data=lambda wc, input: os.path.dirname(input.manifest),
    shell:
        "rpb pipeline eval-set --data {params.data} --task {wildcards.task} {params.track}"
        " > {log} 2>&1"


# A model's own post-training hold-out (models.<m>.holdout, differing from data.holdout): the
# same generator and seed with that hold-out; only its post/ corpora are read.
rule holdout_corpora:
    input:
        ancient(TRACKING_READY),
    output:
        corpora=expand(
            f"{RESULTS}/data/holdout/{{{{holdout}}}}/post/{{corpus}}.jsonl",
            corpus=CORPORA,
        ),
    log:
        f"{RESULTS}/logs/corpora_{{holdout}}.log",
    wildcard_constraints:
        holdout="(corner|below)[0-9][0-9]|none",
    conda:
        CONDA_ENV
    params:
        track=TRACK,
        out=lambda wc: f"{RESULTS}/data/holdout/{wc.holdout}",
        seed=PLAN.config.data.seed,
        preset=PLAN.config.data.preset,
        level=PLAN.config.data.level,
        holdout=lambda wc: holdout_arg(None if wc.holdout == "none" else wc.holdout),
    shell:
        "rpb pipeline corpora --out {params.out} --seed {params.seed} --preset {params.preset}"
        " --level {params.level}{params.holdout} {params.track}"
        " > {log} 2>&1"
