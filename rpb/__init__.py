"""rpb: Router Prior Bias and its sibling router anchors for MoE post-training.

Reproduction library and pipeline for "Router Prior Bias: Preserving Base Routing Structure in
MoE Post-Training" (Lee et al., arXiv:2609.08115), in three wings. The modules at the top of this
package and in rpb/router/ are the library (`pip install .`: rpb.methods, rpb.routing,
rpb.prior, rpb.coactivation, rpb.trainer, ...); they import neither `rpb.pipeline` (the Snakemake
stages and the `rpb` command; the `pipeline` extra) nor `rpb.report` (tables, claims, figures,
read from the pipeline's files). Co-activation communities need the `analysis` extra, rpb.trl
the `trl` extra.
"""

__version__ = "0.1.0"
