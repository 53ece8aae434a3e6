# Tables with the paper's reported numbers beside the measured ones.


rule table1:
    input:
        table1_inputs,
    output:
        csv=f"{RESULTS}/table1.csv",
        md=f"{RESULTS}/table1.md",
        heatmaps=report(
            f"{RESULTS}/figures/table1_coactivation.png",
            caption="../report/coactivation.rst",
            category="Table 1",
        ),
    log:
        f"{RESULTS}/logs/table1.log",
    conda:
        CONDA_ENV
    params:
        track=TRACK,
        spec=lambda wc: as_json(
            {
                "model": config["table1"]["model"],
                "family": config["models"][config["table1"]["model"]]["family"],
                "corpus": config["table1"]["corpus"],
                "methods": config["table1"]["methods"],
                "seeds": SEEDS,
                "in_domain": config["evaluation"]["in_domain"],
                "ood": config["evaluation"]["ood"],
                "scale": config["scale"],
            }
        ),
        results=parent_dir(0),
    shell:
        "rpb table1 --results {params.results} --spec {params.spec} --out {output.csv}"
        " {params.track} > {log} 2>&1"


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
        track=TRACK,
        spec=lambda wc: as_json(
            {
                "models": PRETRAINED_MODELS,
                "corpus": config["table1"]["corpus"],
                "seeds": SEEDS,
                "tasks": eval_tasks(),
            }
        ),
        results=parent_dir(0),
    shell:
        "rpb testbed --results {params.results} --spec {params.spec} --out {output.md}"
        " {params.track} > {log} 2>&1"
