# Diagnostics beyond the paper (docs/testbed.md), in their own results tree `{RESULTS}/diagnostic/`
# so the main DAG is unchanged:
# - the router-swap decomposition: a method's trained models with the base's routers put back and
#   the base with their routers, evaluated like every model -> router_swap.csv/.md;
# - the routing-sensitive regime: table 1's methods post-trained with another posttrain.trainable
#   (routed experts and routers only) -> diagnostic_table1.csv/.md.
# The training, evaluation and analysis rules are the main ones, re-targeted with `use rule`
# (`with:` replaces a rule's input and output wholesale but merges params by name).

DIAGNOSTICS = config.get("diagnostics") or {}
DIAG_ROOT = f"{RESULTS}/diagnostic"
# The router-swap tree below RESULTS (rpb.router_swap reads it from the table's spec).
SWAP_TREE = "diagnostic/router_swap"
SWAP_ROOT = f"{RESULTS}/{SWAP_TREE}"


def diagnostic_seeds(section):
    return DIAGNOSTICS[section].get("seeds") or SEEDS


def swap_sources(label):
    """(non-router weights, routers) method labels of a swapped model's label
    (`<m>_with_base_routers`, `base_with_<m>_routers`, as rpb.router_swap.swap_labels).
    """
    if label.endswith("_with_base_routers"):
        return label.removesuffix("_with_base_routers"), "base"
    return "base", label.removeprefix("base_with_").removesuffix("_routers")


def swap_inputs(wildcards):
    weights, routers = swap_sources(wildcards.label)
    return {
        "weights": model_dir(
            wildcards.model, weights, wildcards.corpus, wildcards.seed
        ),
        "routers": model_dir(
            wildcards.model, routers, wildcards.corpus, wildcards.seed
        ),
    }


def swapped_model(wildcards):
    return f"{SWAP_ROOT}/models/{wildcards.model}/{wildcards.corpus}/{wildcards.method}/seed{wildcards.seed}/model"


def router_swap_inputs(wildcards):
    swap = DIAGNOSTICS["router_swap"]
    method, corpus = swap["method"], swap["corpus"]
    labels = [f"{method}_with_base_routers", f"base_with_{method}_routers"]
    paths = []
    for model in swap["models"]:
        paths.append(f"{RESULTS}/eval/{model}/{corpus}/base/seed0.json")
        for seed in diagnostic_seeds("router_swap"):
            paths.append(f"{RESULTS}/eval/{model}/{corpus}/{method}/seed{seed}.json")
            paths += [
                f"{SWAP_ROOT}/eval/{model}/{corpus}/{label}/seed{seed}.json"
                for label in labels
            ]
    return paths


def router_swap_spec():
    swap = DIAGNOSTICS["router_swap"]
    return _common_spec() | {
        "models": swap["models"],
        "corpus": swap["corpus"],
        "method": swap["method"],
        "seeds": diagnostic_seeds("router_swap"),
        "in_domain": config["evaluation"]["in_domain"],
        "swap_tree": SWAP_TREE,
    }


def diagnostic_model_dir(wildcards):
    if wildcards.method == "base":
        return f"{RESULTS}/models/{wildcards.model}/base/model"
    return f"{DIAG_ROOT}/runs/{wildcards.model}/{wildcards.corpus}/{wildcards.method}/seed{wildcards.seed}/model"


def diagnostic_table1_inputs(wildcards):
    """The diagnostic tree's evaluation and analysis outputs, laid out as table 1's."""
    regime = DIAGNOSTICS["regime"]
    paths = run_outputs(
        regime["model"],
        regime["corpus"],
        regime["methods"],
        diagnostic_seeds("regime"),
        base=True,
    )
    return [DIAG_ROOT + path.removeprefix(RESULTS) for path in paths]


def diagnostic_spec(seed):
    return posttrain_spec(seed) | {"trainable": DIAGNOSTICS["regime"]["trainable"]}


def diagnostic_table1_spec():
    regime = DIAGNOSTICS["regime"]
    model = regime["model"]
    return {
        "title": (
            f"Diagnostic table 1 (posttrain.trainable: {regime['trainable']}; the paper's "
            "numbers are for full post-training, not this regime)"
        ),
        "model": model,
        "family": config["models"][model]["family"],
        "corpus": regime["corpus"],
        "methods": regime["methods"],
        "seeds": diagnostic_seeds("regime"),
        "in_domain": config["evaluation"]["in_domain"],
        "ood": config["evaluation"]["ood"],
        "corpus_tasks": config["evaluation"].get("corpus_tasks") or {},
        "scale": config["scale"],
    }


# --- router swap ---------------------------------------------------------------------------------


rule router_swap:
    input:
        unpack(swap_inputs),
        TRACKING_READY,
    output:
        model=directory(
            f"{SWAP_ROOT}/models/{{model}}/{{corpus}}/{{label}}/seed{{seed}}/model"
        ),
    log:
        f"{RESULTS}/logs/router_swap/{{model}}_{{corpus}}_{{label}}_seed{{seed}}.log",
    wildcard_constraints:
        label="[a-z][a-z0-9_]*_with_base_routers|base_with_[a-z][a-z0-9_]*_routers",
    conda:
        CONDA_ENV
    threads: THREADS
    resources:
        mem_mb=4000,
    params:
        track=TRACK,
    shell:
        "rpb router-swap --name {wildcards.model} --label {wildcards.label}"
        " --seed {wildcards.seed} --corpus-name {wildcards.corpus} --weights {input.weights}"
        " --routers {input.routers} --out {output.model} {params.track} > {log} 2>&1"


use rule evaluate as router_swap_evaluate with:
    input:
        TRACKING_READY,
        model=swapped_model,
        data=EVAL_INPUTS,
    output:
        f"{SWAP_ROOT}/eval/{{model}}/{{corpus}}/{{method}}/seed{{seed}}.json",
    log:
        f"{RESULTS}/logs/router_swap_eval/{{model}}_{{corpus}}_{{method}}_seed{{seed}}.log",
    params:
        work=f"{SWAP_ROOT}/eval/{{model}}/{{corpus}}/{{method}}/seed{{seed}}.work",


rule router_swap_table:
    input:
        router_swap_inputs,
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
        spec=lambda wc: as_json(router_swap_spec()),
        results=RESULTS,
    shell:
        "rpb router_swap_table --results {params.results} --spec {params.spec}"
        " --out {output.csv} {params.track} > {log} 2>&1"


# --- the routing-sensitive regime ----------------------------------------------------------------


use rule posttrain as diagnostic_posttrain with:
    output:
        model=directory(
            f"{DIAG_ROOT}/runs/{{model}}/{{corpus}}/{{method}}/seed{{seed}}/model"
        ),
        history=f"{DIAG_ROOT}/runs/{{model}}/{{corpus}}/{{method}}/seed{{seed}}/train_history.json",
    log:
        f"{RESULTS}/logs/diagnostic_posttrain/{{model}}_{{corpus}}_{{method}}_seed{{seed}}.log",
    params:
        spec=lambda wc: as_json(diagnostic_spec(wc.seed)),


use rule evaluate as diagnostic_evaluate with:
    input:
        TRACKING_READY,
        model=diagnostic_model_dir,
        data=EVAL_INPUTS,
    output:
        f"{DIAG_ROOT}/eval/{{model}}/{{corpus}}/{{method}}/seed{{seed}}.json",
    log:
        f"{RESULTS}/logs/diagnostic_eval/{{model}}_{{corpus}}_{{method}}_seed{{seed}}.log",
    params:
        work=f"{DIAG_ROOT}/eval/{{model}}/{{corpus}}/{{method}}/seed{{seed}}.work",


use rule analyze as diagnostic_analyze with:
    input:
        TRACKING_READY,
        model=diagnostic_model_dir,
        base=f"{RESULTS}/models/{{model}}/base/model",
        prior=f"{RESULTS}/priors/{{model}}/{{corpus}}.safetensors",
        data=PROBE_INPUTS,
    output:
        summary=f"{DIAG_ROOT}/analysis/{{model}}/{{corpus}}/{{method}}/seed{{seed}}.json",
        counts=f"{DIAG_ROOT}/analysis/{{model}}/{{corpus}}/{{method}}/seed{{seed}}.safetensors",
    log:
        f"{RESULTS}/logs/diagnostic_analysis/{{model}}_{{corpus}}_{{method}}_seed{{seed}}.log",


rule diagnostic_table1:
    input:
        diagnostic_table1_inputs,
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
        spec=lambda wc: as_json(diagnostic_table1_spec()),
        results=DIAG_ROOT,
    shell:
        "rpb diagnostic_table1 --results {params.results} --spec {params.spec}"
        " --out {output.csv} {params.track} > {log} 2>&1"
