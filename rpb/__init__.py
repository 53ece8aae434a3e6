"""rpb: Router Prior Bias and its sibling router anchors for MoE post-training.

Reproduction library and pipeline for "Router Prior Bias: Preserving Base Routing Structure in
MoE Post-Training" (arXiv:2609.08115).
"""

__version__ = "0.1.0"
