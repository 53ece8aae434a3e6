"""Table 5: community retention, accuracy, their rank correlation across the soft methods, hard
routing against the soft methods, and the base's non-uniformity."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rpb.report.registry import DATA, Output, ReportJob, Shape, table_outputs
from rpb.report.render import table_figures, write_table
from rpb.report.run_records import ACCURACY, DRIFT, RETENTION, base_analysis, base_runs, runs_text
from rpb.report.stats import paired_runs, within_cluster_spearman
from rpb.report.tables import (
    Comparison,
    TableContext,
    accuracy_columns,
    comparison_row,
    interval_text,
    measures_text,
    row_accuracy_columns,
)
from rpb.specs import spec_runs

# The report jobs this module builds (rpb.report.registry reads them from this source).
REPORT_ENTRIES = (
    ReportJob(
        "table5",
        "build_table5",
        "table 5: structure retention vs accuracy, hard routing",
        "Table 5",
        table_outputs(
            "table5",
            Output("correlation", "table5_correlation.csv", DATA, "Data"),
            Output("hard", "table5_hard.csv", DATA, "Data"),
            Output("base", "table5_base.csv", DATA, "Data"),
            Output("runs", "table5_runs.csv"),
            Output(
                "retention_in", "figures/retention_vs_in_domain.png", "retention.rst", "Figures"
            ),
            Output(
                "retention_ood", "figures/retention_vs_ood_mean.png", "retention.rst", "Figures"
            ),
        ),
        (
            ("method",),
            (
                "community_nmi",
                "coact_cosine",
                "topk_overlap_with_base",
                "in_domain",
                "in_domain_ci_low",
                "in_domain_ci_high",
                "ood_mean",
            ),
        ),
        Shape(
            ("methods", "correlate"),
            base="every corpus",
            spec=("kinds", "trunk_frozen"),
            audited=True,
            lists_claims=("method",),
        ),
    ),
)


def base_nonuniformity(results: Path, model: str, corpus: str, seed: int = 0) -> pd.DataFrame:
    """Per MoE layer and their mean: the base's usage entropy and modularity on the probe set
    beside uniformly random top-k routing with the same experts, k and token count (chance)."""
    from rpb.coactivation import uniform_baseline

    summary, counts = base_analysis(results, model, corpus)
    tokens = int(summary["probe"]["tokens"])
    n_experts = counts.shape[1]
    # Each token adds k to the diagonal (usage counts) of every layer.
    k = round(float(np.trace(counts[0])) / tokens)
    uniform = uniform_baseline(n_experts, k, tokens, seed=seed)
    frame = pd.DataFrame(
        [
            {
                "layer": str(layer["layer"]),
                "usage_entropy": float(layer["usage_entropy"]),
                "uniform_usage_entropy": uniform["usage_entropy"],
                "modularity": float(layer["modularity"]),
                "uniform_modularity": uniform["modularity"],
                "n_communities": float(layer["n_communities"]),
            }
            for layer in summary["layers"]
        ]
    )
    mean = {"layer": "mean", **frame.drop(columns="layer").mean().to_dict()}
    frame = pd.concat([frame, pd.DataFrame([mean])], ignore_index=True)
    frame.insert(0, "model", model)
    frame["experts"], frame["top_k"], frame["tokens"] = n_experts, k, tokens
    return frame


def hard_labels(spec: dict[str, Any]) -> list[str]:
    """The labels among `spec['methods']` whose kind is `hard` (`spec['kinds']`: label -> kind)."""
    kinds = spec.get("kinds", {})
    return [m for m in spec["methods"] if kinds.get(m, m) == "hard"]


def table5_frames(results: Path, spec: dict[str, Any]) -> dict[str, pd.DataFrame]:
    """`table` (retention, modularity, accuracy and drift per method, base first), `runs` (every
    run of the methods and the correlated soft methods), `correlation` (Spearman of each
    retention metric with each accuracy column across the soft runs), `hard` (each hard method
    minus each other method, paired) and `base` (the base's non-uniformity); accuracy in every
    measure of the scale."""
    context, corpus = TableContext.of(results, spec), spec["corpus"]
    methods, of, soft = list(spec["methods"]), spec_runs(spec), list(spec["correlate"])
    level = context.level
    labels = list(dict.fromkeys([*methods, *soft]))
    runs = pd.DataFrame([context.record(corpus, m, run) for m in labels for run in of])
    rows = [
        context.method_row(corpus, label, label_runs)
        for label, label_runs in [("base", base_runs(of)), *((m, of) for m in methods)]
    ]
    columns = ["model", "method", "n_seeds", *RETENTION, "modularity"]
    columns += [*row_accuracy_columns(spec, corpus, per_task=False), *DRIFT]
    table = pd.DataFrame(rows).reindex(columns=columns)
    soft_runs = runs[runs["method"].isin(soft)]
    correlation = []
    for retention in RETENTION:
        for accuracy in accuracy_columns(spec):
            pts = soft_runs[[retention, accuracy, "base", "seed"]].dropna()
            # Within each run across the methods: the methods' runs of one (base, seed) share the
            # initial model and data order, so pooled runs are not independent points
            # (docs/claims.md).
            corr = within_cluster_spearman(
                pts[retention].to_numpy(),
                pts[accuracy].to_numpy(),
                pts.groupby(["base", "seed"], sort=False).ngroup().to_numpy(),
                **level,
            )
            correlation.append(
                {
                    "retention": retention,
                    "accuracy": accuracy,
                    "spearman_rho": corr.estimate,
                    "rho_ci_low": corr.low,
                    "rho_ci_high": corr.high,
                    "p_value": corr.p_value,
                    "n_runs": len(pts),
                    "n_seeds": corr.n_seeds,
                    "rho_sd": corr.sd,
                    "mde": corr.mde,
                    "methods": " ".join(soft),
                }
            )
    hard = hard_labels(spec)
    hard_rows = []
    for h in hard:
        for other in [m for m in methods if m not in hard]:
            for metric in ("in_domain", "ood", "community_nmi"):
                if metric == "community_nmi":
                    per_run = runs.set_index(["method", "base", "seed"])[metric]
                    a = np.array([per_run[(h, run.base, run.seed)] for run in of])
                    b = np.array([per_run[(other, run.base, run.seed)] for run in of])
                    if not (np.isfinite(a).all() and np.isfinite(b).all()):
                        continue  # NMI is undefined where the base has a single community
                    diff = paired_runs(a, b, **level)
                    row = comparison_row(
                        h, other, Comparison(float(a.mean()), float(b.mean()), diff)
                    )
                else:
                    row = context.compare_row([corpus], h, other, metric, of)
                hard_rows.append({"metric": metric} | row)
    return {
        "table": table,
        "runs": runs,
        "correlation": pd.DataFrame(correlation),
        # NMI rows have no p(target) twin: their `_p` cells are NaN.
        "hard": pd.DataFrame(hard_rows),
        "base": base_nonuniformity(context.results, context.model, corpus),
    }


def build_table5(results: Path, spec: dict[str, Any], out_csv: Path) -> pd.DataFrame:
    """Table 5 (per method) with side tables `_correlation`, `_hard`, `_base`, `_runs`,
    Markdown of all, retention-vs-accuracy scatter plots and co-activation heatmaps."""
    from rpb.report.figures import plot_retention_vs_accuracy

    frames = table5_frames(results, spec)
    out_csv = Path(out_csv)
    note = (
        f"Model {spec['model']}, corpus {spec['corpus']}, {runs_text(spec_runs(spec))} "
        f"({spec.get('scale')} scale). Retention: the live model's co-activation structure "
        "against the base's on the same probe set (community NMI / ARI of Louvain partitions, "
        f"cosine of the co-activation matrices), mean over MoE layers. {measures_text(spec)} "
        f"Correlation: Spearman's rho across {list(spec['correlate'])} within each run (a "
        f"base and a seed), the mean over runs with the {interval_text(spec, 'the per-run rhos')} "
        "(an association; the methods' runs of one base and seed are not independent), one row "
        "per retention metric and "
        "accuracy column. Hard: paired per-run difference hard - other with its "
        f"{interval_text(spec, 'runs')} and MDE (community_nmi rows: no p(target) twin). Base: "
        "non-uniformity of the "
        "base router against uniformly random top-k routing with the same experts, k and tokens."
        + (
            " Hard is handicapped by construction here: post-training leaves the trunk frozen "
            "and hard routes as the base, so only its routed experts can adapt (the damped-trunk "
            "arm, diagnostic table 1, trains the trunk at a tenth of the rate)."
            if spec.get("trunk_frozen")
            else ""
        )
    )
    write_table(
        out_csv,
        frames["table"],
        title="Table 5",
        note=note,
        sections=[
            ("Per method", frames["table"]),
            ("Does retention track accuracy?", frames["correlation"]),
            ("Hard routing vs the other methods", frames["hard"]),
            ("How non-uniform is the base router?", frames["base"]),
        ],
        side={part: frames[part] for part in ("correlation", "hard", "base", "runs")},
    )
    figures = out_csv.parent / "figures"
    runs = frames["runs"]
    # NMI is undefined where the base has a single community (a barely trained smoke base);
    # the partition-free cosine then stands in for it.
    x = "community_nmi" if runs["community_nmi"].notna().any() else "coact_cosine"
    for accuracy in ACCURACY:
        plot_retention_vs_accuracy(
            runs.dropna(subset=[x]), figures / f"retention_vs_{accuracy}", x=x, y=accuracy
        )
    table_figures(results, spec, figures / f"{out_csv.stem}_coactivation")
    return frames["table"]
