# Paper scale: models and corpora from the Hugging Face Hub at pinned revisions, and the lm-eval
# suite, fetched by local rules (they run where Snakemake runs, with network) so that every compute
# job runs offline. The work is done by workflow/scripts/hub_download.py.
#
#   hub models   -> {RESULTS}/models/{model}/base0/model    (the path the tiny pretrain rule makes)
#   hub corpora  -> {RESULTS}/data/post/{corpus}.jsonl      (prompt/completion, training)
#                   {RESULTS}/data/eval/{corpus}.jsonl      (prompt/target, held-out probe set)
#   lm-eval      -> {RESULTS}/data/eval/lm_eval_suite.json  (per-task few-shot and metric)
#                   {RESULTS}/data/eval/lm_eval_prefetch.json (datasets now in the HF cache)
#
# None of these rules matches in the tiny config (no hub models, no data.corpora). The *_INPUTS
# constants at the end are what the compute rules wait for, tiny or paper.

HUB_CORPORA = list(PLAN.config.data.corpora)
# Benchmarks run from lm-eval's own task library (every evaluation name at paper scale).
LM_EVAL_TASKS = [
    t for t in EVAL_TASKS if t in PLAN.config.evaluation.lm_eval.get("tasks", {})
]
LM_EVAL_SUITE = f"{RESULTS}/data/eval/lm_eval_suite.json"
LM_EVAL_PREFETCH = f"{RESULTS}/data/eval/lm_eval_prefetch.json"
HUB_SCRIPT = "../scripts/hub_download.py"


localrules:
    download_model,
    download_corpus,
    lm_eval_suite,
    prefetch_lm_eval,


rule download_model:
    output:
        model=directory(BASE_MODEL),
    log:
        f"{RESULTS}/logs/download/model_{{model}}_base{{base}}.log",
    wildcard_constraints:
        model="|".join(HUB_MODELS) or "^$",
        base="0",  # a hub model is its only base
    conda:
        CONDA_ENV
    params:
        entry=lambda wc: plain(PLAN.config.models[wc.model].entry),
        # Staged outside the outputs, so an interrupted download resumes.
        staging=f"{RESULTS}/downloads",
    script:
        HUB_SCRIPT


rule download_corpus:
    output:
        train=f"{RESULTS}/data/post/{{corpus}}.jsonl",
        probe=f"{RESULTS}/data/eval/{{corpus}}.jsonl",
        manifest=f"{RESULTS}/data/post/{{corpus}}.manifest.json",
    log:
        f"{RESULTS}/logs/download/corpus_{{corpus}}.log",
    wildcard_constraints:
        corpus="|".join(HUB_CORPORA) or "^$",
    conda:
        CONDA_ENV
    params:
        spec=lambda wc: plain(PLAN.config.data.corpora[wc.corpus]),
        seed=PLAN.config.data.seed,
    script:
        HUB_SCRIPT


rule lm_eval_suite:
    output:
        LM_EVAL_SUITE,
    log:
        f"{RESULTS}/logs/download/lm_eval_suite.log",
    conda:
        CONDA_ENV
    params:
        spec=plain(PLAN.config.evaluation.lm_eval),
        names=LM_EVAL_TASKS,
    script:
        HUB_SCRIPT


rule prefetch_lm_eval:
    output:
        LM_EVAL_PREFETCH,
    log:
        f"{RESULTS}/logs/download/lm_eval_prefetch.log",
    conda:
        CONDA_ENV
    params:
        names=LM_EVAL_TASKS,
    script:
        HUB_SCRIPT


# What compute rules wait for besides models: the synthetic corpora (tiny) or the downloads.
TINY_DATA = [] if HUB_CORPORA else [f"{RESULTS}/data/manifest.json"]
# Prior extraction and training read data/post/{corpus}.jsonl (post_corpus: or, for a tiny
# model with its own hold-out, data/holdout/<hold-out>/post/{corpus}.jsonl).
CORPUS_INPUTS = [f"{RESULTS}/data/post/{{corpus}}.jsonl"] if HUB_CORPORA else TINY_DATA
# Evaluation reads our eval sets (the eval-only ones it names: rule eval_only_set) and/or the
# lm-eval suite with its datasets in the cache.
EVAL_INPUTS = (
    TINY_DATA
    + [f"{RESULTS}/data/eval/{t}.jsonl" for t in EVAL_TASKS if t in EVAL_ONLY_SETS]
    + ([LM_EVAL_SUITE, LM_EVAL_PREFETCH] if LM_EVAL_TASKS else [])
)
# Analysis reads the probe sets data/eval/{task}.jsonl.
if TINY_DATA:
    PROBE_INPUTS = TINY_DATA + [
        f"{RESULTS}/data/eval/{t}.jsonl" for t in PROBE_TASKS if t in EVAL_ONLY_SETS
    ]
else:
    PROBE_INPUTS = [
        f"{RESULTS}/data/eval/{t}.jsonl"
        for t in config.get("analysis", {}).get("probe_tasks", [])
    ]
