# Controls of the claims audit (docs/claims.md, "Controls"). The placebo arm (claims.placebo) is
# an ordinary method label and trains through `posttrain`. The prior-permutation control trains
# a method whose entry says `prior: permuted` with the base prior's experts permuted per layer:
# `permute_prior` writes that prior; the training rules read it through `method_prior`
# (rpb.pipeline.plan), and the run's analysis still compares with the base's own prior.


rule permute_prior:
    input:
        prior=PRIOR,
    output:
        prior=PERMUTED_PRIOR,
        record=PERMUTED_PRIOR.replace(".safetensors", ".permutation.json"),
    log:
        f"{RESULTS}/logs/prior/{{model}}_base{{base}}_{{corpus}}_permuted.log",
    conda:
        CONDA_ENV
    shell:
        "rpb pipeline permute-prior --prior {input.prior} --out {output.prior} --seed 0 > {log} 2>&1"
