"""Table 4: the anchors and RPB per corpus and run (a base and a seed), with each method's rank
within its block, a check of whether any ordering is consistent across blocks, and every pair's
paired difference (`rpb.report.tables.TableContext.compare_row`)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pandas as pd

from rpb.report.registry import DATA, Output, ReportJob, Shape, table_outputs
from rpb.report.render import table_figures, write_table
from rpb.report.run_records import runs_text
from rpb.report.stats import block_ranks, rank_consistency
from rpb.report.tables import TableContext, accuracy_columns, interval_text, measures_text
from rpb.specs import spec_runs

# The report jobs this module builds (rpb.report.registry reads them from this source).
REPORT_ENTRIES = (
    ReportJob(
        "table4",
        "build_table4",
        "table 4: anchors and RPB, ranks and ordering consistency",
        "Table 4",
        table_outputs(
            "table4",
            Output("summary", "table4_summary.csv"),
            Output("consistency", "table4_consistency.csv", DATA, "Data"),
            Output("pairs", "table4_pairs.csv", DATA, "Data"),
        ),
        (("method", "base", "seed"), ("in_domain", "ood_mean", "rank_in_domain", "rank_ood_mean")),
        Shape(corpora=True, base="first corpus", audited=True, lists_claims=("method",)),
    ),
)

# A block of table 4: one corpus and one run (its base and seed), every method trained on it.
BLOCK = ["corpus", "base", "seed"]


def table4_frames(results: Path, spec: dict[str, Any]) -> dict[str, pd.DataFrame]:
    """`runs` (per corpus, run and method: scores and ranks within the block), `summary` (mean
    score and rank per method), `consistency` (per accuracy column: is any ordering consistent
    across blocks?) and `pairs` (every pair's paired difference over runs x items of all
    corpora), each accuracy in every measure of the scale (`accuracy_columns`)."""
    context, methods = TableContext.of(results, spec), list(spec["methods"])
    corpora, of = list(spec["corpora"]), spec_runs(spec)
    alpha = 1.0 - float(spec.get("confidence", 0.95))
    runs = pd.DataFrame(
        [
            context.record(corpus, label, run)
            for corpus in corpora
            for run in of
            for label in methods
        ]
    )
    accuracy = accuracy_columns(spec)
    summary, consistency = [], []
    for metric in accuracy:
        scores = runs.pivot(index=BLOCK, columns="method", values=metric)[methods]
        ranks = pd.DataFrame(block_ranks(scores.to_numpy()), index=scores.index, columns=methods)
        runs = runs.join(ranks.stack().rename(f"rank_{metric}"), on=[*BLOCK, "method"])
        check = rank_consistency(scores.to_numpy(), methods)
        consistency.append(
            {
                "metric": metric,
                "n_blocks": check.n_blocks,
                "kendall_w": check.kendall_w,
                "friedman_p": check.friedman_p,
                "consistent_ordering": bool(check.friedman_p < alpha),
                "identical_ranking": check.identical_ranking,
                "same_best": check.same_best or "",
                "mean_rank_order": rank_order(check.mean_rank),
            }
        )
        summary += [
            {
                "metric": metric,
                "method": label,
                "score": float(scores[label].mean()),
                "mean_rank": check.mean_rank[label],
            }
            for label in methods
        ]
    pairs = []
    for i, first in enumerate(methods):
        for second in methods[i + 1 :]:
            for metric in ("in_domain", "ood"):
                row = context.compare_row(corpora, first, second, metric, of)
                pairs.append({"metric": metric} | row)
    columns = ["model", *BLOCK, "method", *accuracy, *(f"rank_{m}" for m in accuracy)]
    runs = runs[columns].sort_values([*BLOCK, "rank_in_domain"], kind="stable")
    return {
        "runs": runs.reset_index(drop=True),
        "summary": pd.DataFrame(summary),
        "consistency": pd.DataFrame(consistency),
        "pairs": pd.DataFrame(pairs),
    }


def rank_order(mean_rank: dict[str, float]) -> str:
    """`a > b = c`: methods by mean rank (1 = best), equal mean ranks joined by `=`."""
    ordered = sorted(mean_rank, key=mean_rank.get)
    text = ordered[0]
    for prev, name in itertools.pairwise(ordered):
        text += (" = " if math.isclose(mean_rank[prev], mean_rank[name]) else " > ") + name
    return text


def build_table4(results: Path, spec: dict[str, Any], out_csv: Path) -> pd.DataFrame:
    """Table 4: per (corpus, run) each method's in-domain and OOD accuracy and rank (the CSV),
    side tables `_summary`, `_consistency`, `_pairs`, Markdown of all, and heatmaps."""
    frames = table4_frames(results, spec)
    out_csv = Path(out_csv)
    alpha = 1.0 - float(spec.get("confidence", 0.95))
    note = (
        f"Model {spec['model']}, corpora {list(spec['corpora'])}, {runs_text(spec_runs(spec))} "
        f"({spec.get('scale')} scale). {measures_text(spec)} rank_<column>: rank of that "
        "column within a (corpus, run) block, 1 = best, ties averaged. Consistency, per "
        "accuracy column (metric): Kendall's W across blocks and the Friedman test "
        f"(consistent_ordering: p < {alpha:.2g}); identical_ranking: the same strict order in "
        "every block; same_best: one method first in every block. Pairs: mean paired per-run "
        f"difference, one run per (corpus, run), {interval_text(spec, 'runs')}, p-value and MDE."
    )
    write_table(
        out_csv,
        frames["runs"],
        title="Table 4",
        note=note,
        sections=[
            ("Per corpus and seed", frames["runs"]),
            ("Mean score and rank", frames["summary"]),
            ("Is any ordering consistent?", frames["consistency"]),
            ("Pairwise differences", frames["pairs"]),
        ],
        side={part: frames[part] for part in ("summary", "consistency", "pairs")},
    )
    table_figures(results, spec, out_csv.parent / "figures" / f"{out_csv.stem}_coactivation")
    return frames["runs"]
