"""The router-swap table: a post-training change decomposed by part, read from the evaluations of
the factorial's swapped models (rpb.router_swap makes the models and names the cells; this module
only reads their eval outputs). Per model, corpus, metric and task group: each cell's score, the
total change, each factor's main effect, interactions, Shapley value and share, and put-back share
(the formulas: rpb.router_swap's docstring). Writes router_swap.csv, router_swap_summary.csv and
router_swap.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rpb.artifacts import atomic_path, write_text
from rpb.report.registry import ReportJob
from rpb.report.run_records import in_domain_tasks, read_json, runs_text
from rpb.router_swap import (
    PARTS,
    REST,
    cell_eval_paths,
    cells,
    decompose,
    decomposition_columns,
    effect_name,
    factors,
    subsets,
)
from rpb.specs import spec_runs

# The report jobs this module builds (rpb.report.registry reads them from this source).
REPORT_ENTRIES = (
    ReportJob(
        "router_swap_table",
        "build_router_swap_table",
        "router-swap decomposition of a method's change by part (routers, experts, trunk)",
    ),
)

# Rounding tolerance of the check that the effects add up to the total (they do by construction).
_ADD_UP_TOL = 1e-9
# The metrics of the table, in order, with their units.
METRICS = {
    "exact_match": "exact match, percent",
    "p_target": "p(target), percent",
    "ll_per_token": "mean per-token log-likelihood of the target, nats",
}


def task_scores(result: dict[str, Any], tasks: Sequence[str], path: Path) -> dict[tuple, float]:
    """(task, metric) -> score of one evaluation output: each task's main score in percent
    (exact match of `rpb_<task>`, or a standard task's metric), and for our eval sets also, from
    `rpb_<task>_ll`, p(target) in percent (the item mean of `p_target`, where the output has it)
    and the mean per-token log-likelihood of the target (`ll_per_token`, nats)."""
    entries = result.get("tasks", {})
    scores: dict[tuple, float] = {}
    for task in tasks:
        key = f"rpb_{task}" if f"rpb_{task}" in entries else task
        if key not in entries:
            raise ValueError(f"{path}: no task 'rpb_{task}' or '{task}' in the evaluation output")
        scores[(task, entries[key]["metric"])] = 100.0 * float(np.mean(entries[key]["items"]))
        ll = entries.get(f"rpb_{task}_ll")
        if ll is not None:
            if "p_target" in ll:
                scores[(task, "p_target")] = 100.0 * float(np.mean(ll["p_target"]))
            scores[(task, "ll_per_token")] = float(ll["score"])
    return scores


def _with_groups(
    scores: dict[tuple, float], groups: Mapping[str, Sequence[str]]
) -> dict[tuple, float]:
    """`scores` plus each group's mean over its tasks, per metric all its tasks have."""
    out = dict(scores)
    for metric in dict.fromkeys(m for _, m in scores):
        for group, members in groups.items():
            if all((t, metric) in scores for t in members):
                out[(group, metric)] = float(np.mean([scores[(t, metric)] for t in members]))
    return out


def router_swap_rows(results: Path, spec: dict[str, Any]) -> pd.DataFrame:
    """One row per (model, run, task, metric): the 2^k cells and their decomposition, plus the
    `in_domain` and `ood_mean` groups (means over their tasks; the decomposition is linear, so
    their effects add up too)."""
    results = Path(results)
    parts = spec.get("parts") or PARTS
    names = list(factors(parts))
    cell_sets = cells(parts)
    tasks = list(dict.fromkeys([*spec["in_domain"], *spec["ood"]]))
    groups = {"in_domain": in_domain_tasks(spec, spec["corpus"]), "ood_mean": list(spec["ood"])}
    rows = []
    for model in spec["models"]:
        for run in spec_runs(spec):
            scores = {
                cell: _with_groups(
                    task_scores(read_json(path, "the router-swap table"), tasks, path), groups
                )
                for cell, path in cell_eval_paths(results, spec, model, run).items()
            }
            keys = list(scores["base"])
            for cell, values in scores.items():
                if list(values) != keys:
                    raise ValueError(
                        f"router swap: cell {cell} of {model} run {run} scores other tasks or "
                        f"metrics than the base ({sorted(set(values) ^ set(keys))[0]})"
                    )
            for task, metric in keys:
                values = {cell: scores[cell][(task, metric)] for cell in cell_sets}
                parts_of = {cell_sets[c]: v for c, v in values.items()}
                rows.append(
                    {
                        "model": model,
                        "method": spec["method"],
                        "corpus": spec["corpus"],
                        # Its seed alone: column `base` is the base cell's score, and the table
                        # reads base 0's runs (rpb.pipeline.plan.Plan.router_swap_spec).
                        "seed": run.seed,
                        "task": task,
                        "metric": metric,
                        **values,
                        **decompose(parts_of, names),
                    }
                )
    frame = pd.DataFrame(rows)
    _check_adds_up(frame, names)
    return frame


def _residuals(frame: pd.DataFrame, names: Sequence[str]) -> tuple[float, float]:
    """Largest |total - sum of effects| and |total - sum of Shapley values| over the rows."""
    if not len(frame):
        return 0.0, 0.0
    effects = [effect_name(s) for s in subsets(names)]
    by_effects = (frame["total"] - frame[effects].sum(axis=1)).abs().max()
    by_shapley = (frame["total"] - frame[[f"shapley_{f}" for f in names]].sum(axis=1)).abs().max()
    return float(by_effects), float(by_shapley)


def _check_adds_up(frame: pd.DataFrame, names: Sequence[str]) -> None:
    if not len(frame):
        return
    scale = max(1.0, float(frame["total"].abs().max()))
    worst = max(_residuals(frame, names))
    if worst > _ADD_UP_TOL * scale:
        raise AssertionError(f"router swap: the effects do not add up (max {worst:.3g})")


def summarise(rows: pd.DataFrame, parts: Sequence[str] = PARTS) -> pd.DataFrame:
    """Mean over seeds per (model, task, metric) of the cells; the decomposition recomputed from
    the means (so each share is a ratio of means, as the premise screen's R)."""
    keys = ["model", "method", "corpus", "task", "metric"]
    cell_sets = cells(parts)
    names = list(factors(parts))
    mean = rows.groupby(keys, sort=False)[list(cell_sets)].mean().reset_index()
    n = rows.groupby(keys, sort=False)["seed"].count().reset_index(drop=True)
    decomposition = pd.DataFrame(
        [decompose({cell_sets[c]: r[c] for c in cell_sets}, names) for _, r in mean.iterrows()],
        columns=decomposition_columns(names),
    )
    return pd.concat([mean, decomposition, n.rename("n_seeds")], axis=1)


def build_router_swap_table(results: Path, spec: dict[str, Any], out_csv: Path) -> pd.DataFrame:
    """`router_swap.csv` (per model, seed, task, metric), `router_swap_summary.csv` (mean over
    seeds) and `router_swap.md` from the 2^k cells' evaluation outputs."""
    out_csv = Path(out_csv)
    parts = spec.get("parts") or PARTS
    rows = router_swap_rows(results, spec)
    summary = summarise(rows, parts)
    residual = max(_residuals(rows, list(factors(parts))))
    # Atomic and recorded (rpb.artifacts): a full disk or a kill leaves no partial table.
    with atomic_path(out_csv) as tmp:
        rows.to_csv(tmp, index=False, float_format="%.6g")
    with atomic_path(out_csv.with_name(f"{out_csv.stem}_summary.csv")) as tmp:
        summary.to_csv(tmp, index=False, float_format="%.6g")
    write_text(out_csv.with_suffix(".md"), _markdown(summary, spec, parts, residual))
    return rows


def _markdown(
    summary: pd.DataFrame, spec: dict[str, Any], parts: Sequence[str], residual: float
) -> str:
    m = spec["method"]
    groups = factors(parts)
    names = list(groups)
    cell_sets = cells(parts)
    rest = f" ({REST}: {', '.join(groups[REST])})" if REST in groups else ""
    text = (
        f"Router-swap decomposition by part ({spec.get('scale')} scale, method {m}, corpus "
        f"{spec['corpus']}, {runs_text(spec_runs(spec))}; mean over seeds, per-seed rows in "
        f"router_swap.csv). Factors: {', '.join(names)}{rest} (rpb.trainable.parameter_parts); "
        f"{len(cell_sets)} cells, each factor's tensors from the base (B) or from {m} (T). total "
        "= T - B; main = (B with T's part) - B; the main effects and interactions (in the CSV) "
        "add up to the total exactly, by construction, and so do the Shapley values (largest "
        f"rounding residual over all rows: {residual:.2g}). Shapley share = the part's mean "
        "marginal contribution over all orders of putting the parts in, over total. put-back "
        "share = ((T with B's part) - T) / (B - T), the share of the change that putting B's "
        "part back undoes; for the routers on ood_mean p(target) it is the testbed's premise "
        "gate R.\n"
    )
    short = {c: c.replace("trained", m) for c in cell_sets}
    for metric, unit in METRICS.items():
        if metric == "exact_match":  # standard tasks score by their own metric (acc)
            part = summary[~summary["metric"].isin([k for k in METRICS if k != metric])]
        else:
            part = summary[summary["metric"] == metric]
        if not len(part):
            continue
        for model, frame in part.groupby("model", sort=False):
            table = frame[["task", *cell_sets]].rename(columns=short)
            body = table.to_markdown(index=False, floatfmt=".3g")
            text += f"\n{model}: {unit}, cells\n\n{body}\n"
            columns = {"task": "task", "total": "total"}
            for f in names:
                columns[f"main_{f}"] = f"{f} main"
            for f in names:
                columns[f"shapley_share_{f}"] = f"{f} Shapley share"
            for f in names:
                columns[f"put_back_share_{f}"] = f"{f} put-back share"
            table = frame[list(columns)].rename(columns=columns)
            body = table.to_markdown(index=False, floatfmt=".3g")
            text += f"\n{model}: {unit}, by part\n\n{body}\n"
    return text
