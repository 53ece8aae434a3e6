"""Tables 1-5: the paper's reported numbers beside the ones this run measured.

Every number in a table is read from an evaluation or analysis output of this run
(`rpb.report.run_records`); the only constants are the paper's own reported scores (`PAPER_TABLE1`),
shown in their own column. Each table is a pure frame function (`*_frame(s)`: results and spec
in, DataFrames out, nothing written) and a `build_*` entry point that writes the frames through
`rpb.report.render`; a method's row with its interval is built in one place (`method_row`), and so
is a paired comparison's (`comparison_row`).

- Tables 1 and 2 (`build_table1`, `build_table2`): one row per method on one model and corpus.
- Table 3 (`build_table3`): method vs reference on the independent corpus, per model, as a paired
  per-run difference with its t-interval, p-value and minimum detectable effect.
- Table 4 (`build_table4`): anchors and RPB per corpus and seed, with ranks and a check of whether
  any ordering is consistent across blocks.
- Table 5 (`build_table5`): community retention, accuracy, their rank correlation across the
  soft methods, hard routing against the soft methods, and the base's non-uniformity.

The exploratory tables (sweep, drift, RPB readings) are in `rpb.report.exploratory`.

Scores are percentages; retention metrics (NMI, ARI, cosine) and modularity are fractions.
Intervals are run-level (docs/claims.md): a run's score is the mean over its benchmarks of each
benchmark's item mean, and runs (a base and a seed each) are the unit of replication.

Accuracy is shown in two measures side by side (`measures`): exact match (columns without a
suffix, as ever) and, wherever the eval sets are the testbed's own (every scale but `paper`),
p(target), the probability of the target answer and the end token (docs/claims.md, "The primary
metric at tiny scale"). A p(target) column is named like its exact-match twin with `_p` after the
score's name (`in_domain_p`, `in_domain_p_ci_low`, `ood_<task>_p`, `ood_mean_p`; in a paired
comparison `method_score_p`, `diff_p`, `diff_p_ci_low`, `p_value_p`, `mde_p`, ...), and a long
table keyed by an accuracy name (`metric`, `accuracy`) gets rows `in_domain_p`, `ood_mean_p`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rpb.artifacts import write_text
from rpb.report.registry import DATA, TABLE1_HEADLINE, Output, ReportJob, Shape, table_outputs
from rpb.report.render import table_figures, write_table
from rpb.report.run_records import (
    ACCURACY,
    DRIFT,
    RETENTION,
    analysis_mean,
    base_analysis,
    base_runs,
    exact_match_items,
    in_domain_tasks,
    metric_tasks,
    numeric_paths,
    read_json,
    run_record,
    run_score,
    run_scores,
    runs_text,
)
from rpb.report.stats import (
    DEFAULT_POWER,
    ITEM_INTERVAL,
    RUN_INTERVAL,
    Difference,
    block_ranks,
    describe_interval,
    item_interval,
    item_sd_of_difference,
    paired_runs,
    rank_consistency,
    run_interval,
    within_cluster_spearman,
)
from rpb.specs import Run, eval_path, spec_runs

# The report jobs this module builds (rpb.report.registry reads them from this source).
REPORT_ENTRIES = (
    ReportJob(
        "table1",
        None,
        "table 1: each method's accuracy and structure retention (family A)",
        headline=TABLE1_HEADLINE,
    ),
    ReportJob(
        "table2",
        "build_table2",
        "table 2: table 1's rows for the family-B model",
        "Table 2",
        table_outputs("table2"),
        TABLE1_HEADLINE,
        Shape(
            base="every corpus",
            spec=("family",),
            audited=True,
            lists_claims=("method", "reference"),
        ),
    ),
    ReportJob(
        "table3",
        "build_table3",
        "table 3: method vs reference on the independent corpus",
        "Table 3",
        table_outputs("table3", heatmaps=False),
        (
            ("metric", "method", "reference"),
            (
                "diff",
                "diff_ci_low",
                "diff_ci_high",
                "p_value",
                "diff_p",
                "diff_p_ci_low",
                "diff_p_ci_high",
                "p_value_p",
            ),
        ),
        # claims.method against claims.reference on each model.
        Shape(
            ("claims.method", "claims.reference"),
            models=True,
            spec=("claims", "families"),
            audited=True,
        ),
    ),
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
    ReportJob(
        "diagnostic_table1",
        "build_table1",
        "table 1's rows in the diagnostic regime (posttrain.trainable; results/diagnostic)",
        headline=TABLE1_HEADLINE,
    ),
)

# Moonlight-16B-A3B math post-training, in-domain accuracy (%), as the paper's abstract reports.
PAPER_TABLE1 = {"rpb": 45.77, "lbl": 31.91, "none": 29.44}
PAPER_FAMILY = "A"

# Layer-mean analysis metrics a method row carries (seed means).
ROW_METRICS = ["modularity", *RETENTION, *DRIFT, "usage_entropy"]
TABLE1_STRUCTURE = ["modularity", "community_nmi", "coact_cosine"]

# --- the accuracy measures: exact match and p(target) ------------------------------------------

EXACT_MATCH, P_TARGET = "exact_match", "p_target"
# A p(target) column is its exact-match twin's name with this suffix after the score's name.
SUFFIX = {EXACT_MATCH: "", P_TARGET: "_p"}
MEASURE_NAMES = {EXACT_MATCH: "exact match", P_TARGET: "p(target)"}


def measures(spec: dict[str, Any]) -> list[str]:
    """The accuracy measures of `spec`'s scale, exact match first: p(target) beside it wherever
    the eval sets are the testbed's own (every scale but `paper`, whose standard lm-eval tasks
    have no loglikelihood twin carrying `p_target`)."""
    return [EXACT_MATCH] if spec.get("scale") == "paper" else [EXACT_MATCH, P_TARGET]


def primary_measure(spec: dict[str, Any]) -> str:
    """The measure accuracy is judged on (docs/claims.md, "The primary metric at tiny scale"):
    p(target) where it is measured (the tiny testbed, and the smoke run that exercises its
    path), exact match, the standard tasks' own metric, at paper scale."""
    return measures(spec)[-1]


def accuracy_columns(spec: dict[str, Any]) -> list[str]:
    """A run record's accuracy columns, each exact-match column followed by its p(target) twin:
    `in_domain`, `in_domain_p`, `ood_mean`, `ood_mean_p` (ACCURACY alone at paper scale)."""
    return [f"{column}{SUFFIX[m]}" for column in ACCURACY for m in measures(spec)]


def measure_items(eval_result: dict[str, Any], task: str, path: Path, measure: str) -> np.ndarray:
    """Per-item scores (fractions) of `task` in one evaluation output: exact match
    (`rpb.report.run_records.exact_match_items`), or p(target), the `p_target` items of the eval
    set's loglikelihood task `rpb_<task>_ll` (the same items in the same order)."""
    if measure == EXACT_MATCH:
        return exact_match_items(eval_result, task, path)
    if measure != P_TARGET:
        raise ValueError(f"unknown accuracy measure {measure!r} ({EXACT_MATCH} or {P_TARGET})")
    entry = eval_result.get("tasks", {}).get(f"rpb_{task}_ll") or {}
    if "p_target" not in entry:
        raise ValueError(
            f"{path}: no p_target items of task 'rpb_{task}_ll' in the evaluation output "
            "(p(target) is read from the eval set's loglikelihood task; an output written "
            "before p(target) needs its evaluation rerun)"
        )
    return np.asarray(entry["p_target"], dtype=float)


def measure_score(
    eval_result: dict[str, Any], tasks: Sequence[str], path: Path, measure: str
) -> tuple[float, dict[str, float], int]:
    """One run's score (%) on `measure` over `tasks`: the mean of each task's item mean (the
    same two-level mean as `rpb.report.run_records.run_score`, docs/claims.md), each task's mean and
    the item count."""
    return run_score(
        eval_result,
        tasks,
        path,
        lambda result, task, where: measure_items(result, task, where, measure),
    )


def measure_scores(
    results: Path,
    spec: dict[str, Any],
    model: str,
    corpus: str,
    label: str,
    runs: Sequence[Run],
    metric: str,
    measure: str,
) -> tuple[np.ndarray, int]:
    """`rpb.report.run_records.run_scores` on `measure`: per-run scores (%) of `label` on `metric`
    ("in_domain" or "ood"), one per run, and the items per run."""
    return run_scores(
        results,
        spec,
        model,
        corpus,
        label,
        runs,
        metric,
        lambda result, task, where: measure_items(result, task, where, measure),
    )


def accuracy_record(
    results: Path, spec: dict[str, Any], model: str, corpus: str, label: str, run: Run
) -> dict[str, Any]:
    """`rpb.report.run_records.run_record` (exact match and the analysis metrics) with the run's
    p(target) beside its exact match where measured: `in_domain_p` (the mean over the corpus's
    in-domain tasks) and `ood_mean_p` (the mean over the OOD tasks)."""
    record = run_record(results, spec, model, corpus, label, run)
    if P_TARGET not in measures(spec):
        return record
    path = eval_path(results, model, corpus, label, run)
    result = read_json(path)
    tasks = {"in_domain": in_domain_tasks(spec, corpus), "ood_mean": list(spec["ood"])}
    out: dict[str, Any] = {}
    for key, value in record.items():
        out[key] = value
        if key in tasks:
            out[f"{key}_p"] = measure_score(result, tasks[key], path, P_TARGET)[0]
    return out


def _level_kwargs(spec: dict[str, Any]) -> dict[str, float]:
    """The run-level intervals' settings: `claims.confidence` and `claims.power`."""
    return {
        "confidence": float(spec.get("confidence", 0.95)),
        "power": float(spec.get("power", DEFAULT_POWER)),
    }


def _interval(spec: dict[str, Any], over: str, kind: str = RUN_INTERVAL) -> str:
    """The caption's name of the interval computed at `spec['confidence']` over `over`
    (`rpb.report.stats.describe_interval`), e.g. "95% t-interval over runs"."""
    return describe_interval(float(spec.get("confidence", 0.95)), over, kind)


def _in_domain_text(tasks: Sequence[str]) -> str:
    if len(tasks) == 1:
        return f"the items of {tasks[0]}"
    return (
        f"the mean of the benchmarks {', '.join(tasks)} (each the mean of its items; "
        "in_domain_<task> per benchmark)"
    )


def measures_text(spec: dict[str, Any]) -> str:
    """What the accuracy columns of a table measure, for its note (and Markdown)."""
    if P_TARGET not in measures(spec):
        return (
            "Accuracy: exact match in percent (the standard tasks' own metric; p(target) is "
            "measured on the tiny testbed's eval sets only)."
        )
    return (
        "Accuracy in two measures, in percent: columns without a suffix are exact match "
        "(greedy answer equals the target); columns with `_p` after the score's name "
        "(in_domain_p, ood_<task>_p, ood_mean_p, diff_p, ...) are p(target), the probability of "
        "the target answer and the end token, the mean over items (rows in_domain_p, ood_mean_p "
        "where a table lists accuracies by row); p(target) is the primary metric at this scale "
        "(docs/claims.md)."
    )


# --- the rows every table shares -----------------------------------------------------------------


def _score_interval(
    evals: Sequence[tuple[Path, dict[str, Any]]],
    tasks: Sequence[str],
    measure: str,
    level: dict[str, float],
) -> tuple[float, float, float]:
    """The mean over runs `evals` of each run's score on `tasks` (the mean of its task means) and
    its interval: a t-interval over the runs, or for a single run the interval of its items."""
    if len(evals) == 1:
        path, result = evals[0]
        items = [measure_items(result, t, path, measure) for t in tasks]
        return item_interval(items, level["confidence"])
    scores = [measure_score(result, tasks, path, measure)[0] for path, result in evals]
    interval = run_interval(scores, **level)
    # A score lies in [0, 100]; so does its interval (cutting it there loses no coverage).
    return interval.estimate, max(0.0, interval.low), min(100.0, interval.high)


def _accuracy_cells(
    evals: Sequence[tuple[Path, dict[str, Any]]],
    tasks: Sequence[str],
    ood: Sequence[str],
    measure: str,
    level: dict[str, float],
) -> dict[str, float]:
    """One measure's cells of a method row over its runs' eval outputs `evals`."""
    s = SUFFIX[measure]
    per_task: dict[str, list[float]] = {t: [] for t in tasks}
    ood_means: dict[str, list[float]] = {t: [] for t in ood}
    for path, result in evals:
        _, means, _ = measure_score(result, tasks, path, measure)
        for task, value in means.items():
            per_task[task].append(value)
        for task in ood:
            ood_means[task].append(measure_score(result, [task], path, measure)[0])
    estimate, low, high = _score_interval(evals, tasks, measure, level)
    cells = {f"in_domain{s}": estimate, f"in_domain{s}_ci_low": low, f"in_domain{s}_ci_high": high}
    for task, values in per_task.items():
        cells[f"in_domain_{task}{s}"] = float(np.mean(values))
    for task, values in ood_means.items():
        cells[f"ood_{task}{s}"] = float(np.mean(values))
    cells[f"ood_mean{s}"] = float(np.mean([cells[f"ood_{task}{s}"] for task in ood]))
    return cells


def method_row(
    results: Path, spec: dict[str, Any], model: str, corpus: str, label: str, runs: Sequence[Run]
) -> dict[str, Any]:
    """One method's row over its runs (`runs`; the base: each base's, `base_runs`), in each
    measure (`measures`; p(target)'s columns with `_p`): in-domain (the mean of its benchmarks)
    with a t-interval over the runs at `spec['confidence']` (a single run: the interval of its
    item sampling), each in-domain benchmark `in_domain_<task>`, each OOD task `ood_<task>` and
    `ood_mean`; and the run means of the layer-mean analysis metrics (ROW_METRICS; NaN where an
    output lacks one)."""
    level = _level_kwargs(spec)
    tasks = in_domain_tasks(spec, corpus)
    evals = []
    analysis: dict[str, list[float]] = {key: [] for key in ROW_METRICS}
    for run in runs:
        path = eval_path(results, model, corpus, label, run)
        evals.append((path, read_json(path)))
        mean = analysis_mean(results, model, corpus, label, run)
        for key, values in analysis.items():
            values.append(mean.get(key, math.nan))
    row: dict[str, Any] = {"model": model, "method": label, "n_seeds": len(runs)}
    for measure in measures(spec):
        row |= _accuracy_cells(evals, tasks, spec["ood"], measure, level)
    for key, values in analysis.items():
        row[key] = float(np.mean(values))
    return row


def row_accuracy_columns(spec: dict[str, Any], corpus: str, per_task: bool = True) -> list[str]:
    """A method row's accuracy columns in table order, each exact-match column followed by its
    p(target) twin: in-domain with its interval, per in-domain benchmark (several only), per
    OOD task (`per_task`), the OOD mean."""
    suffixes = [SUFFIX[m] for m in measures(spec)]
    tasks = in_domain_tasks(spec, corpus)
    columns = [f"in_domain{s}{part}" for s in suffixes for part in ("", "_ci_low", "_ci_high")]
    if len(tasks) > 1:
        columns += [f"in_domain_{t}{s}" for t in tasks for s in suffixes]
    if per_task:
        columns += [f"ood_{t}{s}" for t in spec["ood"] for s in suffixes]
    return columns + [f"ood_mean{s}" for s in suffixes]


def comparison_row(
    method: str,
    other: str,
    a: float,
    b: float,
    diff: Difference,
    other_name: str = "other",
    suffix: str = "",
) -> dict[str, Any]:
    """A paired comparison's row: `method`, the `other` (column `other_name`), their mean scores
    and the difference's columns (`Difference.as_dict`: estimate, interval, p-value, MDE). With
    a `suffix` (p(target): `_p`), the same columns of a second measure, named with it after the
    score's name (`method_score_p`, `diff_p`, `diff_p_ci_low`, `p_value_p`, `mde_p`, ...) and
    without the method names and counts, which the first measure's columns carry."""
    if suffix:
        d = f"diff{suffix}"
        cells = diff.as_dict(d)
        return {
            f"method_score{suffix}": a,
            f"{other_name}_score{suffix}": b,
            d: cells[d],
            f"{d}_ci_low": cells[f"{d}_ci_low"],
            f"{d}_ci_high": cells[f"{d}_ci_high"],
            f"p_value{suffix}": cells["p_value"],
            f"{d}_sd": cells[f"{d}_sd"],
            f"mde{suffix}": cells["mde"],
            f"mde_equivalence{suffix}": cells["mde_equivalence"],
        }
    return {
        "method": method,
        other_name: other,
        "method_score": a,
        f"{other_name}_score": b,
        **diff.as_dict("diff"),
    }


# --- tables 1 and 2: one row per method --------------------------------------------------------


def method_table_frame(results: Path, spec: dict[str, Any]) -> pd.DataFrame:
    """One row per method (base first) on `spec`'s model and corpus, with the paper's number
    (family A only)."""
    results = Path(results)
    model, corpus = spec["model"], spec["corpus"]
    runs = spec_runs(spec)
    labels = [("base", base_runs(runs)), *((label, runs) for label in spec["methods"])]
    rows = [method_row(results, spec, model, corpus, label, of) for label, of in labels]
    for row in rows:
        paper = PAPER_TABLE1.get(row["method"])
        paper = paper if spec.get("family", PAPER_FAMILY) == PAPER_FAMILY else None
        row["paper_in_domain"] = paper if paper is not None else math.nan
    columns = ["model", "method", "n_seeds", *row_accuracy_columns(spec, corpus)]
    return pd.DataFrame(rows)[[*columns, *TABLE1_STRUCTURE, "paper_in_domain"]]


def build_method_table(
    results: Path,
    spec: dict[str, Any],
    out_csv: Path,
    title: str = "Table 1",
    verdicts: Sequence[str] = (),
) -> pd.DataFrame:
    """One row per method (base first) on one model and corpus: CSV, Markdown, HTML, provenance
    side file and the co-activation heatmaps `figures/<csv stem>_coactivation.{png,pdf}` (the
    first seed), every run's in `figures/<csv stem>_coactivation_runs/`. `verdicts` (lines of
    `rpb.report.claims.table_verdicts`) open the caption, so the table cannot be read without
    them."""
    table = method_table_frame(results, spec)
    out_csv = Path(out_csv)
    tasks = in_domain_tasks(spec, spec["corpus"])
    over_runs = _interval(spec, "the method's runs")
    provenance = {
        "scale": spec.get("scale"),
        "model": spec["model"],
        "corpus": spec["corpus"],
        "runs": list(spec["runs"]),
        "measures": measures(spec),
        "verdicts": list(verdicts),
        # Which CPU numeric paths trained the runs and their bases (rpb.numerics), with counts.
        "numeric_paths": numeric_paths(results, spec),
        "note": (
            "".join(f"{line} " for line in [smoke_note(spec)] if line)
            + "".join(f"{line} " for line in verdicts)
            + f"{measures_text(spec)} in_domain: {_in_domain_text(tasks)}, "
            f"{over_runs} (a run is a base and a seed; the base row, one run per base; a single "
            f"run: the {_interval(spec, 'its items', ITEM_INTERVAL)})"
            + ("; in_domain_p the same for p(target). " if P_TARGET in measures(spec) else ". ")
            + "paper_in_domain: Moonlight-16B-A3B in-domain accuracy reported by "
            "arXiv:2609.08115 (family A only)"
            + (
                ", beside the mean of the benchmarks: the paper does not say whether its number "
                "is a benchmark mean or pooled items (pooling weights benchmarks by size)"
                if len(tasks) > 1
                else ""
            )
            + "; all other columns measured by this run."
        ),
    }
    write_table(
        out_csv,
        table,
        title=_title(title, spec),
        note=provenance["note"],
        meta=provenance,
        floatfmt=".2f",
    )
    table_figures(results, spec, out_csv.parent / "figures" / f"{out_csv.stem}_coactivation")
    return table


def build_table1(
    results: Path,
    spec: dict[str, Any],
    out_csv: Path,
    verdicts: Sequence[str] = (),
    lead: Sequence[str] = (),
    checks: Sequence[Any] = (),
    comparisons: Sequence[str] = (),
) -> pd.DataFrame:
    """Write table1 (CSV, Markdown, and a provenance side file) from this run's outputs, its
    caption opened by `verdicts`; a spec's `title` names another table of the same rows (the
    diagnostic table 1). Beside them its landing page `<stem>.landing.html` (`write_landing`):
    `lead` (a sentence per verdict), the headline table, `checks` (rpb.report.audit.Check) and
    `comparisons` (the parts behind the verdicts), and the per-task table
    (`rpb.report.claims.TableJudgement.landing` gives the three)."""
    title = spec.get("title", "Table 1")
    table = build_method_table(results, spec, out_csv, title, verdicts)
    write_landing(
        Path(out_csv).with_suffix(LANDING_SUFFIX),
        _title(title, spec),
        headline_frame(results, spec, table),
        per_task_frame(spec, table),
        lead=lead,
        checks=checks,
        comparisons=comparisons,
        notes=(headline_note(spec), per_task_note(spec)),
        banner=smoke_note(spec),
        view=table_view_page(table, _title(title, spec), spec),
    )
    return table


# Table 1 as the report shows it (issue 58: at 1400 px 9 of its 25 columns showed): a row per
# method in the columns a reader needs, accuracy in both measures and the structure columns;
# the intervals, the per-task columns and every other column are in the CSV and its caption.
READER_COLUMNS = (
    "method",
    "n_seeds",
    *(f"{column}{SUFFIX[m]}" for column in ACCURACY for m in (EXACT_MATCH, P_TARGET)),
    *TABLE1_STRUCTURE,
    "paper_in_domain",
)


def table_view_page(table: pd.DataFrame, title: str, spec: dict[str, Any]) -> str:
    """The report's page of table 1 (`READER_COLUMNS` of `table`, 2 decimals), its note naming
    the columns and where the rest are."""
    from rpb.report.report_html import page, table_html

    columns = [c for c in READER_COLUMNS if c in table.columns]
    note = (
        "".join(f"{line} " for line in [smoke_note(spec)] if line)
        + "The columns a reader needs; the intervals, the per-task columns and the full caption "
        "are in table1.csv and table1.html (the menu's Table 1, then Table). "
        f"{measures_text(spec)} modularity, community_nmi, coact_cosine: co-activation "
        "structure (unitless; the last two against the base); paper_in_domain: the paper's "
        "in-domain accuracy (Moonlight-16B-A3B, family A only)."
    )
    # Narrow: the text column at its content's width, headers wrapped at their underscores.
    narrow = (
        "<style>table.rpb td.text { min-width: 0; } table.rpb th { word-break: break-word; "
        "max-width: 7em; }</style>\n</head>"
    )
    html = page(title, note, [("", table_html(table[columns], ".2f"))])
    return html.replace("</head>", narrow, 1)


# --- table 1's landing page: the verdicts, the headline, the checks, the tasks ------------------

LANDING_SUFFIX = ".landing.html"  # beside the table's CSV (rpb.report.render.TABLE_SUFFIXES)
HEADLINE_METRICS = {"in_domain": "in-domain", "ood_mean": "OOD mean"}
STRUCTURE_NAMES = {
    "modularity": "modularity",
    "community_nmi": "community NMI with the base",
    "coact_cosine": "co-activation cosine with the base",
}
PAPER_ROW = "paper in-domain (Moonlight-16B-A3B)"


# What a smoke run's outputs say first (config `scale: smoke`, config/smoke.yaml): its models are
# trained for seconds on a few hundred tokens to check that every rule runs, so its numbers, its
# verdicts and its checks' outcomes carry no meaning (issue 58).
SMOKE_NOTE = (
    "Smoke run (config scale: smoke): a few seconds of training on tiny models, to check that the "
    'pipeline runs end to end. Its numbers carry no meaning: 0.00 accuracies, verdicts "not '
    'testable" and checks "not met" are expected here and say nothing about the paper\'s claims; '
    "table 1's numbers come from `make table1`."
)


def smoke_note(spec: dict[str, Any]) -> str:
    """`SMOKE_NOTE` for a smoke run's spec (`scale: smoke`), else nothing."""
    return SMOKE_NOTE if spec.get("scale") == "smoke" else ""


def _title(title: str, spec: dict[str, Any]) -> str:
    return (
        f"{title} ({spec.get('scale')} scale, model {spec['model']}, corpus {spec['corpus']}, "
        f"{runs_text(spec_runs(spec))})"
    )


def _number(value: Any, digits: int = 2) -> str:
    """A cell's number, or nothing for a missing one (NaN, None)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{float(value):.{digits}f}"


def with_interval(estimate: float, low: float, high: float, digits: int = 2) -> str:
    """ "12.50 [10.00, 15.00]"; the estimate alone where the interval is missing."""
    if any(v is None or math.isnan(v) for v in (low, high)):
        return _number(estimate, digits)
    return f"{_number(estimate, digits)} [{_number(low, digits)}, {_number(high, digits)}]"


def headline_frame(results: Path, spec: dict[str, Any], table: pd.DataFrame) -> pd.DataFrame:
    """Table 1's headline columns, one row per method of `table` (its frame): the runs, then in
    each measure in-domain and the OOD mean, each with its interval as text. In-domain's is
    table 1's own; the OOD mean's is computed here the same way (`_score_interval`: a t-interval
    over the runs' OOD means, a single run's over its items), table 1 having none."""
    results = Path(results)
    level = _level_kwargs(spec)
    rows = []
    runs = spec_runs(spec)
    for _, row in table.iterrows():
        label = str(row["method"])
        of = base_runs(runs) if label == "base" else runs
        paths = [eval_path(results, spec["model"], spec["corpus"], label, run) for run in of]
        evals = [(path, read_json(path)) for path in paths]
        cells: dict[str, Any] = {"method": label, "runs": int(row["n_seeds"])}
        for column, name in HEADLINE_METRICS.items():
            for measure in measures(spec):
                s = SUFFIX[measure]
                if column == "in_domain":
                    low, high = row[f"in_domain{s}_ci_low"], row[f"in_domain{s}_ci_high"]
                else:
                    _, low, high = _score_interval(evals, spec["ood"], measure, level)
                cells[f"{name} {MEASURE_NAMES[measure]}"] = with_interval(
                    float(row[f"{column}{s}"]), float(low), float(high)
                )
        rows.append(cells)
    return pd.DataFrame(rows)


def headline_note(spec: dict[str, Any]) -> str:
    tasks = in_domain_tasks(spec, spec["corpus"])
    judged = MEASURE_NAMES[primary_measure(spec)]
    return (
        f"Percent; {_interval(spec, 'runs')} (a run is a base and a seed; the base row, one run "
        f"per base; a single run: the {_interval(spec, 'its items', ITEM_INTERVAL)}). In-domain: "
        f"{_in_domain_text(tasks)}; OOD mean: the mean of {', '.join(spec['ood'])}. Claims are "
        f"judged on {judged}."
    )


def per_task_frame(spec: dict[str, Any], table: pd.DataFrame) -> pd.DataFrame:
    """Table 1's other columns turned on their side, one column per method: a row per in-domain
    benchmark and per OOD task (its measures' means as "exact match / p(target)"), the structure
    metrics, and the paper's in-domain number where table 1 has one."""
    tasks = in_domain_tasks(spec, spec["corpus"])
    suffixes = [SUFFIX[m] for m in measures(spec)]
    stems = [
        ("in-domain " + t, "in_domain" if len(tasks) == 1 else f"in_domain_{t}") for t in tasks
    ]
    stems += [(f"OOD {t}", f"ood_{t}") for t in spec["ood"]]
    methods = [str(m) for m in table["method"]]
    rows = []
    for name, stem in stems:
        cells = [
            " / ".join(_number(r[f"{stem}{s}"]) for s in suffixes) for _, r in table.iterrows()
        ]
        rows.append({"": name, **dict(zip(methods, cells, strict=True))})
    for column, name in STRUCTURE_NAMES.items():
        if column in table.columns:
            rows.append({"": name, **dict(zip(methods, map(_number, table[column]), strict=True))})
    if "paper_in_domain" in table.columns and table["paper_in_domain"].notna().any():
        paper = map(_number, table["paper_in_domain"])
        rows.append({"": PAPER_ROW, **dict(zip(methods, paper, strict=True))})
    return pd.DataFrame(rows, columns=["", *methods])


def per_task_note(spec: dict[str, Any]) -> str:
    shown = " / ".join(MEASURE_NAMES[m] for m in measures(spec))
    return (
        f"Each task's mean over the method's runs, in percent ({shown}); the structure metrics "
        "are the layer means of the runs' co-activation analysis; the paper's number is the "
        "in-domain accuracy arXiv:2609.08115 reports (family A only)."
    )


def write_landing(
    path: Path,
    title: str,
    headline: pd.DataFrame,
    per_task: pd.DataFrame,
    *,
    lead: Sequence[str] = (),
    checks: Sequence[Any] = (),
    comparisons: Sequence[str] = (),
    notes: tuple[str, str] = ("", ""),
    banner: str = "",
    view: str = "",
) -> Path:
    """The landing page's HTML fragment (`rpb.report.report_html.landing_html`) at `path`."""
    from rpb.report.report_html import landing_html

    shown = [(c.id, c.outcome(), c.value, c.passed) for c in checks]
    text = landing_html(title, lead, headline, per_task, shown, comparisons, notes, banner, view)
    return write_text(Path(path), text)


def build_table2(results: Path, spec: dict[str, Any], out_csv: Path) -> pd.DataFrame:
    """Table 2: table 1's rows for the family-B model (the paper reports no numbers for it)."""
    return build_method_table(results, spec, out_csv, "Table 2")


# --- paired comparisons --------------------------------------------------------------------------


def compare(
    results: Path,
    spec: dict[str, Any],
    model: str,
    corpora: Sequence[str],
    method: str,
    other: str,
    metric: str,
    runs: Sequence[Run],
    measure: str = EXACT_MATCH,
) -> tuple[float, float, Difference]:
    """`method` - `other` (percent) on `measure` (exact match or p(target)) by paired per-run
    differences: one per (corpus, run), its score the mean over `metric`'s tasks of each
    task's item mean ("in_domain": each corpus's in-domain tasks, `in_domain_tasks`; "ood": the
    OOD tasks). The t-interval over the runs at `spec['confidence']`, with its MDE at
    `spec['power']`, the per-run spread floored by the items' own (`item_sd_of_difference`).
    Returns (method's mean score, other's mean score, the Difference)."""
    a_runs, b_runs, n_items, item_pairs = [], [], 0, []
    for corpus in corpora:
        a, n_items = measure_scores(results, spec, model, corpus, method, runs, metric, measure)
        b, n_other = measure_scores(results, spec, model, corpus, other, runs, metric, measure)
        if n_other != n_items:
            raise ValueError(
                f"{model}/{corpus}: {method} has {n_items} {metric} items per run, {other} "
                f"{n_other}: runs are not paired item by item"
            )
        a_runs.append(a)
        b_runs.append(b)
        tasks = metric_tasks(spec, corpus, metric)
        for run in runs:
            pa = eval_path(results, model, corpus, method, run)
            pb = eval_path(results, model, corpus, other, run)
            ra, rb = read_json(pa), read_json(pb)
            item_pairs.append(
                [
                    (
                        100 * measure_items(ra, t, pa, measure),
                        100 * measure_items(rb, t, pb, measure),
                    )
                    for t in tasks
                ]
            )
    a, b = np.concatenate(a_runs), np.concatenate(b_runs)
    diff = paired_runs(
        a, b, n_items=n_items, item_sd=item_sd_of_difference(item_pairs), **_level_kwargs(spec)
    )
    return float(a.mean()), float(b.mean()), diff


def compare_row(
    results: Path,
    spec: dict[str, Any],
    model: str,
    corpora: Sequence[str],
    method: str,
    other: str,
    metric: str,
    runs: Sequence[Run],
    other_name: str = "other",
) -> dict[str, Any]:
    """`comparison_row` of `compare` in every measure of `spec`'s scale, side by side (exact
    match's columns as ever, p(target)'s with `_p`)."""
    row: dict[str, Any] = {}
    for measure in measures(spec):
        a, b, diff = compare(results, spec, model, corpora, method, other, metric, runs, measure)
        row |= comparison_row(method, other, a, b, diff, other_name, SUFFIX[measure])
    return row


# --- table 3: method vs reference on the independent corpus -----------------------------------


def table3_frame(results: Path, spec: dict[str, Any]) -> pd.DataFrame:
    """Per model and metric: method - reference on `spec['corpus']` (see `compare`)."""
    corpus, method, reference = spec["corpus"], spec["method"], spec["reference"]
    rows = []
    for model in spec["models"]:
        for metric in ("in_domain", "ood"):
            family = spec.get("families", {}).get(model, "")
            rows.append(
                {"model": model, "family": family, "corpus": corpus, "metric": metric}
                | compare_row(
                    Path(results),
                    spec,
                    model,
                    [corpus],
                    method,
                    reference,
                    metric,
                    spec_runs(spec),
                    other_name="reference",
                )
            )
    return pd.DataFrame(rows)


def build_table3(results: Path, spec: dict[str, Any], out_csv: Path) -> pd.DataFrame:
    """Table 3 (CSV and Markdown): method vs reference per model on the independent corpus,
    paired per run (base and seed), with a t-interval, p-value and MDE (scores in percent)."""
    table = table3_frame(results, spec)
    note = (
        f"{spec['method']} minus {spec['reference']} after post-training on the independently "
        f"generated corpus `{spec['corpus']}` ({spec.get('scale')} scale, "
        f"{runs_text(spec_runs(spec))}). {measures_text(spec)} diff: mean of the per-run paired "
        f"differences (a run's in_domain: {_in_domain_text(in_domain_tasks(spec, spec['corpus']))}"
        "; ood: the mean of the OOD tasks), "
        f"{_interval(spec, 'runs')} and the paired t-test's p-value, so p < 1 - level "
        "exactly when the CI excludes zero; mde: the difference found with "
        f"{100 * _level_kwargs(spec)['power']:g}% power (docs/claims.md)."
    )
    write_table(Path(out_csv), table, title="Table 3", note=note)
    return table


# --- table 4: anchors and RPB, ranks per corpus and run ----------------------------------------

# A block of table 4: one corpus and one run (its base and seed), every method trained on it.
BLOCK = ["corpus", "base", "seed"]


def table4_frames(results: Path, spec: dict[str, Any]) -> dict[str, pd.DataFrame]:
    """`runs` (per corpus, run and method: scores and ranks within the block), `summary` (mean
    score and rank per method), `consistency` (per accuracy column: is any ordering consistent
    across blocks?) and `pairs` (every pair's paired difference over runs x items of all
    corpora), each accuracy in every measure of the scale (`accuracy_columns`)."""
    results = Path(results)
    model, methods = spec["model"], list(spec["methods"])
    corpora, of = list(spec["corpora"]), spec_runs(spec)
    alpha = 1.0 - float(spec.get("confidence", 0.95))
    runs = pd.DataFrame(
        [
            accuracy_record(results, spec, model, corpus, label, run)
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
                row = compare_row(results, spec, model, corpora, first, second, metric, of)
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
        f"difference, one run per (corpus, run), {_interval(spec, 'runs')}, p-value and MDE."
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


# --- table 5: structure retention vs accuracy --------------------------------------------------


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
    results = Path(results)
    model, corpus = spec["model"], spec["corpus"]
    methods, of, soft = list(spec["methods"]), spec_runs(spec), list(spec["correlate"])
    level = _level_kwargs(spec)
    labels = list(dict.fromkeys([*methods, *soft]))
    runs = pd.DataFrame(
        [accuracy_record(results, spec, model, corpus, m, run) for m in labels for run in of]
    )
    rows = [
        method_row(results, spec, model, corpus, label, label_runs)
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
                    row = comparison_row(h, other, float(a.mean()), float(b.mean()), diff)
                else:
                    row = compare_row(results, spec, model, [corpus], h, other, metric, of)
                hard_rows.append({"metric": metric} | row)
    return {
        "table": table,
        "runs": runs,
        "correlation": pd.DataFrame(correlation),
        # NMI rows have no p(target) twin: their `_p` cells are NaN.
        "hard": pd.DataFrame(hard_rows),
        "base": base_nonuniformity(results, model, corpus),
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
        f"base and a seed), the mean over runs with the {_interval(spec, 'the per-run rhos')} "
        "(an association; the methods' runs of one base and seed are not independent), one row "
        "per retention metric and "
        "accuracy column. Hard: paired per-run difference hard - other with its "
        f"{_interval(spec, 'runs')} and MDE (community_nmi rows: no p(target) twin). Base: "
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
