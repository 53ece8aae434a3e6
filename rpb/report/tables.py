"""What every table is built from: the accuracy measures, a cell with its interval, and the rows
that tables share, read from this run's outputs through one `TableContext`.

Every number in a table is read from an evaluation or analysis output of this run
(`rpb.report.run_records`). A table is a module of its own (`rpb.report.table1`: tables 1 and 2,
one row per method; `table3`: method vs reference; `table4`: anchors and RPB with ranks; `table5`:
structure retention vs accuracy; the exploratory tables in `rpb.report.exploratory`), each a pure
frame function (`*_frame(s)`: results and spec in, DataFrames out, nothing written) and a
`build_*` entry point that writes the frames through `rpb.report.render`. Their rows are built
here, each in one place: a method's row with its interval (`TableContext.method_row`) and a
paired comparison's (`TableContext.compare_row`, `comparison_row`).

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

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from rpb.report.run_records import (
    ACCURACY,
    DRIFT,
    RETENTION,
    analysis_mean,
    exact_match_items,
    in_domain_tasks,
    metric_tasks,
    read_json,
    run_record,
    run_score,
    run_scores,
)
from rpb.report.stats import (
    DEFAULT_POWER,
    RUN_INTERVAL,
    Difference,
    describe_interval,
    item_interval,
    item_sd_of_difference,
    paired_runs,
    run_interval,
)
from rpb.specs import Run, eval_path

# Layer-mean analysis metrics a method row carries (seed means).
ROW_METRICS = ["modularity", *RETENTION, *DRIFT, "usage_entropy"]

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


def run_level(spec: dict[str, Any]) -> dict[str, float]:
    """The run-level intervals' settings: `claims.confidence` and `claims.power`."""
    return {
        "confidence": float(spec.get("confidence", 0.95)),
        "power": float(spec.get("power", DEFAULT_POWER)),
    }


def interval_text(spec: dict[str, Any], over: str, kind: str = RUN_INTERVAL) -> str:
    """The caption's name of the interval computed at `spec['confidence']` over `over`
    (`rpb.report.stats.describe_interval`), e.g. "95% t-interval over runs"."""
    return describe_interval(float(spec.get("confidence", 0.95)), over, kind)


def in_domain_text(tasks: Sequence[str]) -> str:
    """What a row's in-domain score is the mean of, for a table's note."""
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


# --- a cell and a comparison ---------------------------------------------------------------------


def number_text(value: Any, digits: int = 2) -> str:
    """A cell's number, or nothing for a missing one (NaN, None)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{float(value):.{digits}f}"


@dataclass(frozen=True)
class Cell:
    """A score with its interval (percent): the mean over a method's runs and a t-interval over
    them, or a single run's score and the interval of its items; NaN bounds where there is none."""

    value: float
    low: float = math.nan
    high: float = math.nan

    def text(self, digits: int = 2) -> str:
        """ "12.50 [10.00, 15.00]"; the value alone where the interval is missing."""
        if any(v is None or math.isnan(v) for v in (self.low, self.high)):
            return number_text(self.value, digits)
        bounds = f"{number_text(self.low, digits)}, {number_text(self.high, digits)}"
        return f"{number_text(self.value, digits)} [{bounds}]"


class Comparison(NamedTuple):
    """A paired comparison of two methods' runs (`TableContext.compare`): their mean scores
    (percent) and the paired difference method - other."""

    method_score: float
    other_score: float
    diff: Difference


def comparison_row(
    method: str,
    other: str,
    comparison: Comparison,
    other_name: str = "other",
    suffix: str = "",
) -> dict[str, Any]:
    """A paired comparison's row: `method`, the `other` (column `other_name`), their mean scores
    and the difference's columns (`Difference.as_dict`: estimate, interval, p-value, MDE). With
    a `suffix` (p(target): `_p`), the same columns of a second measure, named with it after the
    score's name (`method_score_p`, `diff_p`, `diff_p_ci_low`, `p_value_p`, `mde_p`, ...) and
    without the method names and counts, which the first measure's columns carry."""
    a, b, diff = comparison
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


# --- the rows every table shares, read through one context ---------------------------------------

# A run's evaluation output: its path (for errors) and its contents.
Eval = tuple[Path, dict[str, Any]]


def score_cell(evals: Sequence[Eval], tasks: Sequence[str], measure: str, level: dict) -> Cell:
    """The mean over runs `evals` of each run's score on `tasks` (the mean of its task means) and
    its interval at `level` (confidence, power): a t-interval over the runs, or for a single run
    the interval of its items."""
    if len(evals) == 1:
        path, result = evals[0]
        items = [measure_items(result, t, path, measure) for t in tasks]
        return Cell(*item_interval(items, level["confidence"]))
    scores = [measure_score(result, tasks, path, measure)[0] for path, result in evals]
    interval = run_interval(scores, **level)
    # A score lies in [0, 100]; so does its interval (cutting it there loses no coverage).
    return Cell(interval.estimate, max(0.0, interval.low), min(100.0, interval.high))


def _accuracy_cells(
    evals: Sequence[Eval], tasks: Sequence[str], ood: Sequence[str], measure: str, level: dict
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
    in_domain = score_cell(evals, tasks, measure, level)
    cells = {
        f"in_domain{s}": in_domain.value,
        f"in_domain{s}_ci_low": in_domain.low,
        f"in_domain{s}_ci_high": in_domain.high,
    }
    for task, values in per_task.items():
        cells[f"in_domain_{task}{s}"] = float(np.mean(values))
    for task, values in ood_means.items():
        cells[f"ood_{task}{s}"] = float(np.mean(values))
    cells[f"ood_mean{s}"] = float(np.mean([cells[f"ood_{task}{s}"] for task in ood]))
    return cells


@dataclass(frozen=True)
class TableContext:
    """What a table's rows are read from: this run's results folder, the table's spec (its
    scale's measures, `confidence`, `power`, tasks) and the model whose runs the rows are of
    (`spec['model']` for a table of one model, `of`)."""

    results: Path
    spec: dict[str, Any]
    model: str

    @classmethod
    def of(cls, results: Path, spec: dict[str, Any]) -> TableContext:
        """The context of a table of one model, `spec['model']`."""
        return cls(Path(results), spec, spec["model"])

    @property
    def level(self) -> dict[str, float]:
        return run_level(self.spec)

    @property
    def measures(self) -> list[str]:
        return measures(self.spec)

    def evals(self, corpus: str, label: str, runs: Sequence[Run]) -> list[Eval]:
        """The evaluation outputs of `label`'s `runs` on `corpus`, in order."""
        paths = [eval_path(self.results, self.model, corpus, label, run) for run in runs]
        return [(path, read_json(path)) for path in paths]

    def record(self, corpus: str, label: str, run: Run) -> dict[str, Any]:
        """`accuracy_record` of one run of this context's model."""
        return accuracy_record(self.results, self.spec, self.model, corpus, label, run)

    def method_row(self, corpus: str, label: str, runs: Sequence[Run]) -> dict[str, Any]:
        """One method's row over its runs (`runs`; the base: each base's, `base_runs`), in each
        measure (`measures`; p(target)'s columns with `_p`): in-domain (the mean of its
        benchmarks) with a t-interval over the runs at `spec['confidence']` (a single run: the
        interval of its item sampling), each in-domain benchmark `in_domain_<task>`, each OOD
        task `ood_<task>` and `ood_mean`; and the run means of the layer-mean analysis metrics
        (ROW_METRICS; NaN where an output lacks one)."""
        level, tasks = self.level, in_domain_tasks(self.spec, corpus)
        evals = self.evals(corpus, label, runs)
        analysis: dict[str, list[float]] = {key: [] for key in ROW_METRICS}
        for run in runs:
            mean = analysis_mean(self.results, self.model, corpus, label, run)
            for key, values in analysis.items():
                values.append(mean.get(key, math.nan))
        row: dict[str, Any] = {"model": self.model, "method": label, "n_seeds": len(runs)}
        for measure in self.measures:
            row |= _accuracy_cells(evals, tasks, self.spec["ood"], measure, level)
        for key, values in analysis.items():
            row[key] = float(np.mean(values))
        return row

    def measure_scores(
        self, corpus: str, label: str, runs: Sequence[Run], metric: str, measure: str
    ) -> tuple[np.ndarray, int]:
        """`rpb.report.run_records.run_scores` on `measure`: per-run scores (%) of `label` on
        `metric` ("in_domain" or "ood"), one per run, and the items per run."""
        return run_scores(
            self.results,
            self.spec,
            self.model,
            corpus,
            label,
            runs,
            metric,
            lambda result, task, where: measure_items(result, task, where, measure),
        )

    def compare(
        self,
        corpora: Sequence[str],
        method: str,
        other: str,
        metric: str,
        runs: Sequence[Run],
        measure: str = EXACT_MATCH,
    ) -> Comparison:
        """`method` - `other` (percent) on `measure` (exact match or p(target)) by paired per-run
        differences: one per (corpus, run), its score the mean over `metric`'s tasks of each
        task's item mean ("in_domain": each corpus's in-domain tasks, `in_domain_tasks`; "ood":
        the OOD tasks). The t-interval over the runs at `spec['confidence']`, with its MDE at
        `spec['power']`, the per-run spread floored by the items' own
        (`item_sd_of_difference`)."""
        a_runs, b_runs, n_items, item_pairs = [], [], 0, []
        for corpus in corpora:
            a, n_items = self.measure_scores(corpus, method, runs, metric, measure)
            b, n_other = self.measure_scores(corpus, other, runs, metric, measure)
            if n_other != n_items:
                raise ValueError(
                    f"{self.model}/{corpus}: {method} has {n_items} {metric} items per run, "
                    f"{other} {n_other}: runs are not paired item by item"
                )
            a_runs.append(a)
            b_runs.append(b)
            tasks = metric_tasks(self.spec, corpus, metric)
            pairs = zip(
                self.evals(corpus, method, runs), self.evals(corpus, other, runs), strict=True
            )
            item_pairs += [
                [
                    (
                        100 * measure_items(ra, t, pa, measure),
                        100 * measure_items(rb, t, pb, measure),
                    )
                    for t in tasks
                ]
                for (pa, ra), (pb, rb) in pairs
            ]
        a, b = np.concatenate(a_runs), np.concatenate(b_runs)
        item_sd = item_sd_of_difference(item_pairs)
        diff = paired_runs(a, b, n_items=n_items, item_sd=item_sd, **self.level)
        return Comparison(float(a.mean()), float(b.mean()), diff)

    def compare_row(
        self,
        corpora: Sequence[str],
        method: str,
        other: str,
        metric: str,
        runs: Sequence[Run],
        other_name: str = "other",
    ) -> dict[str, Any]:
        """`comparison_row` of `compare` in every measure of the spec's scale, side by side
        (exact match's columns as ever, p(target)'s with `_p`)."""
        row: dict[str, Any] = {}
        for measure in self.measures:
            comparison = self.compare(corpora, method, other, metric, runs, measure)
            row |= comparison_row(method, other, comparison, other_name, SUFFIX[measure])
        return row
