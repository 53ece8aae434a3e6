"""rpb: Router Prior Bias and its sibling router anchors for MoE post-training.

Reproduction library and pipeline for "Router Prior Bias: Preserving Base Routing Structure in
MoE Post-Training" (arXiv:2609.08115). `pip install rpb` is the library (rpb.methods, rpb.routing,
rpb.prior, rpb.coactivation, rpb.trainer, ...), which imports none of the pipeline's packages; the
Snakemake pipeline is the `pipeline` extra, co-activation communities `analysis`, TRL `trl`.
"""

__version__ = "0.1.0"
