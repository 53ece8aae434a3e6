# Tables with the paper's reported numbers beside the measured ones.


rule table1:
    input:
        table1_inputs,
    output:
        csv=f"{RESULTS}/table1.csv",
        md=f"{RESULTS}/table1.md",
    params:
        spec=lambda wc: as_json(
            {
                "model": config["table1"]["model"],
                "corpus": config["table1"]["corpus"],
                "methods": config["table1"]["methods"],
                "seeds": SEEDS,
                "in_domain": config["evaluation"]["in_domain"],
                "ood": config["evaluation"]["ood"],
                "scale": config["scale"],
            }
        ),
        results=RESULTS,
    log:
        f"{RESULTS}/logs/table1.log",
    conda:
        CONDA_ENV
    shell:
        "rpb table1 --results {params.results} --spec {params.spec} --out {output.csv}"
        " {TRACK} > {log} 2>&1"
