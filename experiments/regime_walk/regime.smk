# The testbed regime rule (docs/regime.md): calibration runs of `none` on the development split,
# walked in the rule's order. Not part of `all`: its decision is written into config.yaml.


rule calibrate_regime:
    input:
        ancient(TRACKING_READY),
        bases=lambda wc: [
            model_dir(m, "base", None, None) for m in config["calibration"]["models"]
        ],
    output:
        json=f"{RESULTS}/calibration/{{regime_rule}}.json",
        md=f"{RESULTS}/calibration/{{regime_rule}}.md",
    log:
        f"{RESULTS}/logs/{{regime_rule}}.log",
    benchmark:
        f"{BENCHMARKS}/calibration_{{regime_rule}}.tsv"
    wildcard_constraints:
        regime_rule="regime|rule2|rule3|rule4",
    conda:
        CONDA_ENV
    threads: 64  # capped at --cores by Snakemake: calibration runs side by side
    params:
        track=TRACK,
        spec=lambda wc: as_json(regime_spec(wc.regime_rule)),
    shell:
        "rpb regime --spec {params.spec} --out {output.json} --cores {threads} {params.track}"
        " > {log} 2>&1"
