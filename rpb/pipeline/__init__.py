"""The pipeline wing: the stages that the Snakemake workflow runs (corpora, tokenizer, pretraining,
post-training, evaluation, co-activation analysis, controls, the testbed calibration) and the
`rpb` command that runs them. It imports the library (`rpb.*`) and calls the report (`rpb.report`)
for the tables; the library never imports it. Needs the `pipeline` extra."""
