"""Exploratory tables beyond the paper's: the softness sweep, table 4 at strengths matched on
routing, training-time routing drift, and which RPB reading anchors.

As tables 1-5 (`rpb.report.table1` ... `table5`), each is a pure frame function (results and spec
in, DataFrames out; runs read through `rpb.report.run_records` and
`rpb.report.tables.accuracy_record`) and a `build_*` entry point that writes through
`rpb.report.render`. Accuracy columns come in the tables' measures: exact match, and p(target)
beside it (`in_domain_p`, `ood_mean_p`) wherever it is measured (`rpb.report.tables.measures`).

- Sweep (`build_sweep`): accuracy and retention against each method's strength.
- Table 4 at matched strengths (`build_table4_matched`, part of the sweep's outputs).
- Drift (`build_drift`): training-time routing drift curves from the training histories.
- RPB readings (`build_readings`): each reading's position between `none` and `hard`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rpb.method_config import MethodConfig
from rpb.report.registry import DATA, TABLE, Output, ReportJob, Shape, table_outputs
from rpb.report.render import write_csv, write_table
from rpb.report.run_records import DRIFT, RETENTION, runs_text, training_history
from rpb.report.table4 import table4_frames
from rpb.report.tables import accuracy_columns, accuracy_record, measures_text
from rpb.specs import spec_runs

# The report jobs this module builds (rpb.report.registry reads them from this source).
REPORT_ENTRIES = (
    ReportJob(
        "sweep",
        "build_sweep",
        "softness sweep: accuracy and retention against strength",
        "Sweep",
        table_outputs(
            "sweep",
            Output("runs", "sweep_runs.csv"),
            Output("matched", "sweep_table4_matched.csv", DATA, "Data"),
            Output("matched_md", "sweep_table4_matched.md"),
            Output("matched_html", "sweep_table4_matched.html", TABLE, "Table"),
            Output("figure", "figures/sweep.png", "sweep_figure.rst", "Figures"),
            heatmaps=False,
        ),
    ),
    ReportJob(
        "drift",
        "build_drift",
        "training-time routing drift curves",
        "Training drift",
        (Output("csv", "drift.csv"), Output("figure", "figures/drift.png", "drift.rst")),
        shape=Shape(reads=("train_history",), exploratory=True),
    ),
    ReportJob(
        "readings",
        "build_readings",
        "which RPB reading anchors (the default's rule)",
        "RPB readings",
        table_outputs(
            "rpb_readings",
            Output("runs", "rpb_readings_runs.csv"),
            Output("figure", "figures/rpb_readings.png", "readings_figure.rst", "Figures"),
            heatmaps=False,
        ),
        # The methods between `lower` (unanchored) and `upper` (hard routing).
        shape=Shape(("lower", "methods", "upper"), exploratory=True),
    ),
)

# --- softness sweep ----------------------------------------------------------------------------


def method_strength(method: MethodConfig) -> float:
    """The x position of a method on a softness axis: 0 for plain fine-tuning (`none`), infinity
    for hard routing (the strength -> infinity limit), else its strength."""
    if method.kind == "none":
        return 0.0
    if method.kind == "hard":
        return math.inf
    return float(method.strength)


# Evaluation protocols of a sweep point: the model routes with its own router, or keeps the
# method's steering at evaluation (`hard`, `keep_bias_at_eval`).
OWN_ROUTER, KEPT_AT_EVAL = "own_router", "kept_at_eval"


def eval_protocol(method: MethodConfig) -> str:
    """OWN_ROUTER or KEPT_AT_EVAL: whether the method keeps steering routing at evaluation
    (its `keep_bias_at_eval` option, or the family's default for it)."""
    return KEPT_AT_EVAL if method.keeps_routing_at_eval else OWN_ROUTER


def sweep_frames(results: Path, spec: dict[str, Any]) -> dict[str, pd.DataFrame]:
    """`table` (per curve and point: seed means of accuracy, retention and drift, with the
    point's strength and evaluation protocol) and `runs` (every run of every point)."""
    results = Path(results)
    model, corpus, runs = spec["model"], spec["corpus"], spec_runs(spec)
    records = []
    for curve, labels in spec["curves"].items():
        for label in labels:
            entry = spec["methods"].get(label)
            if entry is None:
                raise ValueError(f"sweep curve {curve!r}: label {label!r} is not a method")
            method = MethodConfig.from_dict(entry, where=f"sweep method {label!r}")
            strength, protocol = method_strength(method), eval_protocol(method)
            for run in runs:
                rec = accuracy_record(results, spec, model, corpus, label, run)
                records.append(
                    {"curve": curve, "label": label, "strength": strength, "protocol": protocol}
                    | rec
                )
    frame = pd.DataFrame(records)
    metrics = [*accuracy_columns(spec), *RETENTION, *DRIFT]
    table = (
        frame.groupby(["curve", "label", "strength", "protocol"], sort=False)[metrics]
        .mean()
        .reset_index()
        .sort_values(["curve", "strength"], kind="stable")
    )
    table.insert(4, "n_seeds", len(runs))
    return {"table": table, "runs": frame}


def build_sweep(results: Path, spec: dict[str, Any], out_csv: Path) -> pd.DataFrame:
    """Per curve and point: mean in-domain, OOD, retention and drift over the sweep's seeds
    (`sweep.csv`), every run (`sweep_runs.csv`), the curves figure `figures/sweep`, and table 4
    at matched strengths (`sweep_table4_matched*`, `build_table4_matched`). Each point carries
    its evaluation `protocol`: a curve is drawn through its own-router points only, and a point
    kept at evaluation (`hard`) is marked apart."""
    from rpb.report.figures import plot_sweep

    frames = sweep_frames(results, spec)
    table, runs = frames["table"], frames["runs"]
    out_csv = Path(out_csv)
    note = (
        f"Model {spec['model']}, corpus {spec['corpus']}, {runs_text(spec_runs(spec))} "
        f"({spec.get('scale')} scale); means over seeds. {measures_text(spec)} "
        "strength 0 is plain fine-tuning (`none`: rpb with lambda = 0 and every anchor "
        "at mu = 0 are exactly it); inf is the lambda -> infinity limit, trained with the base "
        f"router's selection. protocol `{OWN_ROUTER}`: evaluated with the model's own router "
        f"(every finite point, and rpb's infinite arm); `{KEPT_AT_EVAL}`: base routing kept at "
        "evaluation (`hard`, table 5's arm), not a point of the own-router curve."
    )
    stem = write_table(
        out_csv, table, title="Softness sweep (exploratory)", note=note, side={"runs": runs}
    )
    plot_sweep(
        runs, out_csv.parent / "figures" / "sweep", ["in_domain", "ood_mean", "community_nmi"]
    )
    # Matching needs both bounds on the sweep (none and the kept-at-evaluation hard arm).
    if (table["strength"] == 0).any() and (
        np.isinf(table["strength"]) & (table["protocol"] == KEPT_AT_EVAL)
    ).any():
        build_table4_matched(
            results, spec, stem.with_name(f"{stem.name}_table4_matched.csv"), sweep=table
        )
    return table


# --- table 4 at matched strengths (docs/methods.md, "Comparing the anchors at matched strength")

MATCH_METRIC = "topk_overlap_with_base"
MATCH_POSITION = 0.5
MATCH_TOLERANCE = 0.15


def _bound_label(sweep: pd.DataFrame, strength: float, protocol: str | None, what: str) -> str:
    rows = sweep[sweep["strength"] == strength]
    if protocol is not None:
        rows = rows[rows["protocol"] == protocol]
    if rows.empty:
        raise ValueError(f"table 4 at matched strengths: the sweep has no {what} point")
    return str(rows["label"].iloc[0])


def match_strengths(
    sweep: pd.DataFrame,
    position: float = MATCH_POSITION,
    tolerance: float = MATCH_TOLERANCE,
    metric: str = MATCH_METRIC,
) -> pd.DataFrame:
    """Per curve of the sweep table (seed means), the point whose routing reaches the target:
    its position (metric - lower) / (upper - lower) closest to `position`, lower = the strength-0
    point (`none`), upper = the infinite point kept at evaluation (`hard`); candidates are the
    finite strengths > 0, ties go to the smaller strength. Reads `metric` only, never accuracy.
    Also the curve's default point (the label named like the curve) and its position."""
    lower = _bound_label(sweep, 0.0, None, "strength-0 (none)")
    upper = _bound_label(sweep, math.inf, KEPT_AT_EVAL, "kept-at-evaluation hard")
    value = sweep.drop_duplicates("label").set_index("label")[metric]
    gap = float(value[upper] - value[lower])

    def pos(label: str) -> float:
        return float((value[label] - value[lower]) / gap) if gap > 0 else math.nan

    rows = []
    for curve, points in sweep.groupby("curve", sort=False):
        labels = list(points["label"])
        default = curve if curve in labels else None
        row: dict[str, Any] = {
            "curve": curve,
            "target_position": position,
            "default_label": default or "",
            "default_strength": (
                float(points.set_index("label").at[default, "strength"]) if default else math.nan
            ),
            "default_position": pos(default) if default else math.nan,
        }
        candidates = points[np.isfinite(points["strength"]) & (points["strength"] > 0)]
        if gap <= 0 or candidates.empty:
            row |= {"matched_label": "", "matched_strength": math.nan}
            row |= {"matched_position": math.nan, "reached": "undetermined"}
        else:
            scored = candidates.assign(
                _position=[pos(label) for label in candidates["label"]],
            )
            scored = scored.assign(_distance=(scored["_position"] - position).abs())
            best = scored.sort_values(["_distance", "strength"], kind="stable").iloc[0]
            row |= {
                "matched_label": best["label"],
                "matched_strength": float(best["strength"]),
                "matched_position": float(best["_position"]),
                "reached": "yes" if best["_distance"] <= tolerance else "no",
            }
        rows.append(row)
    return pd.DataFrame(rows)


def table4_matched_frames(
    results: Path, spec: dict[str, Any], sweep: pd.DataFrame
) -> dict[str, pd.DataFrame]:
    """`table` (the matched and default points per curve, each side's mean in-domain and OOD
    score and mean rank), `consistency` and `pairs` (table 4's, per side) on the sweep's runs."""
    selection = match_strengths(sweep)
    sides = {
        "default": [label for label in selection["default_label"] if label],
        "matched": [label for label in selection["matched_label"] if label],
    }
    scores: dict[tuple[str, str], dict[str, float]] = {}
    consistency, pairs = [], []
    for side, labels in sides.items():
        if len(labels) < 2:
            continue
        frames = table4_frames(results, spec | {"methods": labels, "corpora": [spec["corpus"]]})
        for row in frames["summary"].to_dict("records"):
            entry = scores.setdefault((side, row["method"]), {})
            entry[f"{row['metric']}"] = row["score"]
            entry[f"rank_{row['metric']}"] = row["mean_rank"]
        consistency += [{"strengths": side} | r for r in frames["consistency"].to_dict("records")]
        pairs += [{"strengths": side} | r for r in frames["pairs"].to_dict("records")]
    table = selection.copy()
    accuracy = accuracy_columns(spec)
    for side in sides:
        for metric in [*accuracy, *(f"rank_{m}" for m in accuracy)]:
            table[f"{side}_{metric}"] = [
                scores.get((side, label), {}).get(metric, math.nan)
                for label in selection[f"{side}_label"]
            ]
    return {
        "table": table,
        "consistency": pd.DataFrame(consistency),
        "pairs": pd.DataFrame(pairs),
    }


def build_table4_matched(
    results: Path, spec: dict[str, Any], out_csv: Path, sweep: pd.DataFrame | None = None
) -> pd.DataFrame:
    """Table 4 at strengths matched on routing (`match_strengths`), beside the curves' defaults,
    both on the sweep's own runs (model, corpus, seeds): the selection with each label's mean
    in-domain and OOD score and mean rank (the CSV), `_consistency` and `_pairs` side tables in
    table 4's format, and Markdown. `sweep` is `build_sweep`'s table (else read from
    `<out_csv stem without _table4_matched>.csv`)."""
    results, out_csv = Path(results), Path(out_csv)
    if sweep is None:
        sweep = pd.read_csv(out_csv.with_name(out_csv.name.replace("_table4_matched", "")))
    frames = table4_matched_frames(results, spec, sweep)
    note = (
        f"Model {spec['model']}, corpus {spec['corpus']}, {runs_text(spec_runs(spec))} "
        f"({spec.get('scale')} scale), the softness sweep's runs. Matched: per curve, the trained "
        f"strength whose top-k overlap with the base (evaluation routing, seed mean) lies closest "
        f"to position {MATCH_POSITION} of the none -> hard gap (reached: within "
        f"{MATCH_TOLERANCE}); chosen on routing alone, by the rule fixed in docs/methods.md "
        "before results. Default: the curve's point at its configured strength. "
        f"{measures_text(spec)} <side>_rank_<column>: mean rank, 1 = best within a seed block; "
        "table 4's statistics on each side."
    )
    write_table(
        out_csv,
        frames["table"],
        title="Table 4 at matched strengths (exploratory)",
        note=note,
        sections=[
            ("Matched and default strengths", frames["table"]),
            ("Is any ordering consistent?", frames["consistency"]),
            ("Pairwise differences", frames["pairs"]),
        ],
        side={part: frames[part] for part in ("consistency", "pairs")},
    )
    return frames["table"]


# --- training-time routing drift ----------------------------------------------------------------


def drift_frame(results: Path, spec: dict[str, Any]) -> pd.DataFrame:
    """Training histories of each method and run as one long table: the run's `base` and `seed`,
    `step`, the losses and the layer-mean drift metrics."""
    rows = []
    for label in spec["methods"]:
        for run in spec_runs(spec):
            history = training_history(Path(results), spec["model"], spec["corpus"], label, run)
            for entry in history:
                row = {"method": label, "base": run.base, "seed": run.seed, "step": entry["step"]}
                for key in ("task_loss", "router_loss"):
                    row[key] = entry.get(key, math.nan)
                for key in (*DRIFT, "usage_entropy"):
                    row[key] = entry.get(f"mean/{key}", math.nan)
                rows.append(row)
    return pd.DataFrame(rows)


def build_drift(results: Path, spec: dict[str, Any], out_csv: Path) -> pd.DataFrame:
    """The drift curves' long table (CSV) and the curves figure `figures/drift`."""
    from rpb.report.figures import plot_curves

    table = drift_frame(results, spec)
    out_csv = Path(out_csv)
    write_csv(table, out_csv)
    ys = [y for y in ("task_loss", *DRIFT, "usage_entropy") if table[y].notna().any()]
    plot_curves(table, "step", ys, "method", out_csv.parent / "figures" / "drift")
    return table


# --- which RPB reading anchors (docs/methods.md, "Choosing the default RPB reading") -------------

ANCHOR_METRICS = ["topk_overlap_with_base", "community_nmi"]


def readings_frames(results: Path, spec: dict[str, Any]) -> dict[str, pd.DataFrame]:
    """`table`: the RPB readings between their bounds `lower` (unanchored, `none`) and `upper`
    (`hard`), scored by the mechanistic rule fixed in docs/methods.md before any result: a
    reading anchors when, for every metric in ANCHOR_METRICS (seed means of the routing used at
    evaluation), it covers at least `min_gain` of the gap from `lower` to `upper`; the default
    (`default_by_rule`) is the first anchoring reading in the configured order. Accuracy is
    listed after the verdict and plays no part in it. `runs`: every run."""
    results = Path(results)
    model, corpus, of = spec["model"], spec["corpus"], spec_runs(spec)
    lower, upper, min_gain = spec["lower"], spec["upper"], float(spec["min_gain"])
    labels = [lower, *spec["methods"], upper]
    runs = pd.DataFrame(
        [
            accuracy_record(results, spec, model, corpus, label, run)
            for label in labels
            for run in of
        ]
    )
    accuracy = accuracy_columns(spec)
    means = runs.groupby("method", sort=False)[
        [*ANCHOR_METRICS, *RETENTION[1:], "kl_to_base", *accuracy]
    ].mean()
    gaps = {m: means.at[upper, m] - means.at[lower, m] for m in ANCHOR_METRICS}
    rows = []
    for label in labels:
        role = {lower: "lower bound", upper: "upper bound"}.get(label, "reading")
        row: dict[str, Any] = {"method": label, "role": role, "n_seeds": len(of)}
        row |= means.loc[label].to_dict()
        for metric, gap in gaps.items():
            # Where hard does not retain more than `none`, "between" has no meaning.
            position = (
                (means.at[label, metric] - means.at[lower, metric]) / gap if gap > 0 else math.nan
            )
            row[f"{metric}_position"] = position
        positions = [row[f"{m}_position"] for m in ANCHOR_METRICS]
        if row["role"] != "reading":
            row["anchors"] = ""
        elif any(math.isnan(p) for p in positions):
            row["anchors"] = "undetermined"
        else:
            row["anchors"] = "yes" if all(p >= min_gain for p in positions) else "no"
        rows.append(row)
    table = pd.DataFrame(rows)
    first = [r["method"] for r in rows if r["anchors"] == "yes"]
    table["default_by_rule"] = table["method"].eq(first[0]) if first else False
    columns = [
        "method",
        "role",
        "n_seeds",
        *ANCHOR_METRICS,
        *[f"{m}_position" for m in ANCHOR_METRICS],
        "anchors",
        "default_by_rule",
        *RETENTION[1:],
        "kl_to_base",
        *accuracy,
    ]
    return {"table": table[columns], "runs": runs}


def build_readings(results: Path, spec: dict[str, Any], out_csv: Path) -> pd.DataFrame:
    """The readings table (`readings_frames`): the CSV, Markdown, `<stem>_runs.csv` and the
    figure `figures/<stem>`."""
    from rpb.report.figures import plot_retention_vs_accuracy

    frames = readings_frames(results, spec)
    table, runs = frames["table"], frames["runs"]
    lower, upper = spec["lower"], spec["upper"]
    first = list(table.loc[table["default_by_rule"].astype(bool), "method"])
    verdict = (
        f"default by the rule: `{first[0]}`"
        if first
        else "no reading anchors, so the rule picks no default (the configured `rpb` stays; say so)"
    )
    note = (
        f"Model {spec['model']}, corpus {spec['corpus']}, {runs_text(spec_runs(spec))} "
        f"({spec.get('scale')} scale); seed means of "
        f"the routing each model uses at evaluation, on the analysis probe set. *_position: the "
        f"share of the {lower} -> {upper} gap a reading covers; it anchors when every position is "
        f">= {float(spec['min_gain'])}. {verdict}. Accuracy columns are shown for information "
        f"only: the rule does not read them (docs/methods.md). {measures_text(spec)}"
    )
    out_csv = Path(out_csv)
    stem = write_table(
        out_csv, table, title="RPB readings (exploratory)", note=note, side={"runs": runs}
    )
    plot_retention_vs_accuracy(
        runs,
        out_csv.parent / "figures" / stem.name,
        x="topk_overlap_with_base",
        y="community_nmi",
        title=f"RPB readings between {lower} and {upper} (per run)",
    )
    return table
