"""The pipeline wing: the stages that the Snakemake workflow runs (corpora, tokenizer, pretraining,
post-training, evaluation, co-activation analysis, controls, the testbed calibration) and the
`rpb` command that runs them. It imports the library (`rpb.*`) and calls the report (`rpb.report`)
for the tables; the library never imports it. Needs the `pipeline` extra."""

from rpb.artifacts import install_recorder
from rpb.pipeline.results_folder import IntegrityRecords

# Every pipeline job imports this package first: from then on the library's atomic writes record
# the integrity of what they write under the results folder (rpb.artifacts.ArtifactRecorder says
# why the library only tells, and the pipeline records).
install_recorder(IntegrityRecords())
