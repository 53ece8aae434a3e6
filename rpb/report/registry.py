"""The report wing's registry: which report jobs exist besides table 1, and which of a table's
columns its MLflow run logs as headline metrics. Plain data: the pipeline's CLI and config check
read it without importing a builder."""

from __future__ import annotations

# Report jobs besides table 1: stage -> (builder "module:function", help). The CLI makes one job
# per entry, `rpb pipeline <key>` with the key's underscores as dashes (`router-swap-table`), and
# imports the builder lazily (`rpb pipeline --help` stays fast); the config's `tables` keys are
# checked against it (rpb.pipeline.config_check).
REPORT_JOBS: dict[str, tuple[str, str]] = {
    "table2": ("rpb.report.tables:build_table2", "table 2: table 1's rows for the family-B model"),
    "table3": (
        "rpb.report.tables:build_table3",
        "table 3: method vs reference on the independent corpus",
    ),
    "table4": (
        "rpb.report.tables:build_table4",
        "table 4: anchors and RPB, ranks and ordering consistency",
    ),
    "table5": (
        "rpb.report.tables:build_table5",
        "table 5: structure retention vs accuracy, hard routing",
    ),
    "sweep": (
        "rpb.report.exploratory:build_sweep",
        "softness sweep: accuracy and retention against strength",
    ),
    "drift": ("rpb.report.exploratory:build_drift", "training-time routing drift curves"),
    "readings": (
        "rpb.report.exploratory:build_readings",
        "which RPB reading anchors (the default's rule)",
    ),
    "claims": ("rpb.report.claims:build_claims", "claims audit C1-C6 (results/claims.csv)"),
    "router_swap_table": (
        "rpb.report.router_swap_table:build_router_swap_table",
        "router-swap decomposition of a method's change by part (routers, experts, trunk)",
    ),
    "diagnostic_table1": (
        "rpb.report.tables:build_table1",
        "table 1's rows in the diagnostic regime (posttrain.trainable; results/diagnostic)",
    ),
}

_TABLE1_HEADLINE = (
    ("method",),
    (
        "in_domain",
        "in_domain_ci_low",
        "in_domain_ci_high",
        "in_domain_p",
        "in_domain_p_ci_low",
        "in_domain_p_ci_high",
        "ood_mean",
        "ood_mean_p",
    ),
)
# Per table stage: the columns naming a row, and the columns logged as its headline metrics.
TABLE_HEADLINES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "table1": _TABLE1_HEADLINE,
    "table2": _TABLE1_HEADLINE,
    "diagnostic_table1": _TABLE1_HEADLINE,
    "table3": (
        ("metric", "method", "reference"),
        ("diff", "diff_ci_low", "diff_ci_high", "p_value", "diff_p", "diff_p_ci_low",
         "diff_p_ci_high", "p_value_p"),
    ),
    "table4": (("method", "seed"), ("in_domain", "ood_mean", "rank_in_domain", "rank_ood_mean")),
    "table5": (
        ("method",),
        ("community_nmi", "coact_cosine", "topk_overlap_with_base", "in_domain",
         "in_domain_ci_low", "in_domain_ci_high", "ood_mean"),
    ),
    "claims": (("part",), ("estimate", "ci_low", "ci_high")),
}  # fmt: skip
