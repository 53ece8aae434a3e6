# Controls of the claims audit (docs/claims.md, "Controls"). The placebo arm (claims.placebo) is
# an ordinary method label and trains through `posttrain`. The prior-permutation control trains
# a method whose entry says `prior: permuted` with the base prior's experts permuted per layer:
# `permute_prior` writes that prior and `posttrain_permuted_prior` is `posttrain` reading it.

from snakemake.exceptions import WorkflowError
from snakemake.io import is_flagged

PERMUTED_PRIOR_LABELS = [
    m for m, e in config["methods"].items() if (e or {}).get("prior") == "permuted"
]


def permuted_prior_path(model, corpus):
    return f"{RESULTS}/priors/{model}/permuted/{corpus}.safetensors"


rule permute_prior:
    input:
        prior=f"{RESULTS}/priors/{{model}}/{{corpus}}.safetensors",
    output:
        prior=permuted_prior_path("{model}", "{corpus}"),
        record=f"{RESULTS}/priors/{{model}}/permuted/{{corpus}}.permutation.json",
    log:
        f"{RESULTS}/logs/prior/{{model}}_{{corpus}}_permuted.log",
    conda:
        CONDA_ENV
    shell:
        "rpb permute-prior --prior {input.prior} --out {output.prior} --seed 0 > {log} 2>&1"


def _inputs_with_prior(rule_input, prior):
    """`posttrain`'s inputs (positional first, as Python syntax orders them) with `prior`
    swapped, so this rule follows any change to `posttrain`'s other inputs."""
    named = dict(rule_input.items())
    n_named = sum(len(v) if isinstance(v, list) else 1 for v in named.values())
    return list(rule_input)[: len(rule_input) - n_named], named | {"prior": prior}


def _outputs_for_labels(rule, labels):
    """`posttrain`'s named outputs with the method wildcard restricted to `labels`: the patterns
    as written (the `rules` proxy; the rule object's carry the global wildcard constraints) with
    the rule object's directory() flags."""
    outputs = {}
    flagged = dict(workflow.get_rule(rule).output.items())
    for name, pattern in dict(getattr(rules, rule).output.items()).items():
        text = str(pattern)
        if "{method}" not in text:
            raise WorkflowError(f"controls.smk: output {name} of {rule} has no {{method}}")
        text = text.replace("{method}", "{method," + "|".join(labels) + "}")
        outputs[name] = directory(text) if is_flagged(flagged[name], "directory") else text
    return outputs


if PERMUTED_PRIOR_LABELS:
    _POSITIONAL, _NAMED = _inputs_with_prior(
        rules.posttrain.input, permuted_prior_path("{model}", "{corpus}")
    )

    use rule posttrain as posttrain_permuted_prior with:
        input:
            *_POSITIONAL,
            **_NAMED,
        output:
            **_outputs_for_labels("posttrain", PERMUTED_PRIOR_LABELS),

    ruleorder: posttrain_permuted_prior > posttrain


def controls_inputs(wildcards):
    """Runs the audit's controls compare (table 1's model and corpus, the tables' seeds)."""
    if CLAIMS is None:
        return []
    labels = [CLAIMS[k] for k in ("placebo", "permuted") if CLAIMS.get(k)]
    t1 = config["table1"]
    return run_outputs(t1["model"], t1["corpus"], labels, TABLE_SEEDS)


def claims_extra_inputs(wildcards):
    """What the audit's manipulation checks read beyond the tables: the readings rule's runs
    (M2), the testbed report's split-half stability (M6, tiny scale), and the controls."""
    paths = controls_inputs(wildcards)
    readings = TABLES.get("readings")
    if readings is not None and CLAIMS is not None:
        labels = [readings["lower"], CLAIMS["method"], readings["upper"]]
        paths += run_outputs(readings["model"], readings["corpus"], labels, TABLE_SEEDS)
    if config["scale"] != "paper":
        paths.append(f"{RESULTS}/testbed.json")
    return paths
