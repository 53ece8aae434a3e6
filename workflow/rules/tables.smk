# Tables with the paper's reported numbers beside the measured ones.


rule table1:
    input:
        table1_inputs,
    output:
        csv=f"{RESULTS}/table1.csv",
        md=f"{RESULTS}/table1.md",
    log:
        f"{RESULTS}/logs/table1.log",
    conda:
        CONDA_ENV
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
    shell:
        "rpb table1 --results {params.results} --spec {params.spec} --out {output.csv}"
        " {TRACK} > {log} 2>&1"


rule testbed_report:
    input:
        testbed_inputs,
    output:
        md=f"{RESULTS}/testbed.md",
        json=f"{RESULTS}/testbed.json",
    log:
        f"{RESULTS}/logs/testbed.log",
    conda:
        CONDA_ENV
    params:
        spec=lambda wc: as_json(
            {
                "models": PRETRAINED_MODELS,
                "corpus": config["table1"]["corpus"],
                "seeds": SEEDS,
                "tasks": eval_tasks(),
            }
        ),
        results=RESULTS,
    shell:
        "rpb testbed --results {params.results} --spec {params.spec} --out {output.md}"
        " {TRACK} > {log} 2>&1"
