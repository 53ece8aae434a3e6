"""Tables: the paper's reported numbers beside the ones this run measured.

Every number in a table is read from an evaluation or analysis output of this run; the only
constants are the paper's own reported scores (`PAPER_TABLE1`), shown in their own column.

- Tables 1 and 2 (`build_table1`, `build_table2`): one row per method on one model and corpus.
- Table 3 (`build_table3`): method vs reference on the independent corpus, per model, as a paired
  per-run difference with its t-interval, p-value and minimum detectable effect.
- Table 4 (`build_table4`): anchors and RPB per corpus and seed, with ranks and a check of whether
  any ordering is consistent across blocks.
- Table 5 (`build_table5`): community retention, accuracy, their rank correlation across the
  soft methods, hard routing against the soft methods, and the base's non-uniformity.
- Sweep (`build_sweep`): accuracy and retention against each method's strength.
- Drift (`build_drift`): training-time routing drift curves from the training histories.

Scores are percentages; retention metrics (NMI, ARI, cosine) and modularity are fractions.
Intervals are run-level (docs/claims.md): a run's score is the mean over its benchmarks of each
benchmark's item mean, and runs (seeds) are the unit of replication.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats as scipy_stats

from rpb.specs import results_path
from rpb.stats import (
    DEFAULT_POWER,
    DEFAULT_RESAMPLES,
    Difference,
    block_ranks,
    item_sd_of_difference,
    paired_runs,
    rank_consistency,
    run_interval,
    within_cluster_spearman,
)

# Moonlight-16B-A3B math post-training, in-domain accuracy (%), as the paper's abstract reports.
PAPER_TABLE1 = {"rpb": 45.77, "lbl": 31.91, "none": 29.44}
PAPER_FAMILY = "A"

TABLE1_COLUMNS_HEAD = [
    "model",
    "method",
    "n_seeds",
    "in_domain",
    "in_domain_ci_low",
    "in_domain_ci_high",
]
TABLE1_COLUMNS_TAIL = ["ood_mean", "modularity", "community_nmi", "coact_cosine", "paper_in_domain"]
# Structure metrics of an analysis output ("mean" over MoE layers) that tables 5 and the sweep use.
RETENTION = ["community_nmi", "community_ari", "coact_cosine"]
DRIFT = ["kl_to_base", "topk_overlap_with_base"]
ACCURACY = ["in_domain", "ood_mean"]


# --- reading this run's outputs ---------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"missing input for the table: {path}")
    return json.loads(path.read_text())


def eval_path(results: Path, model: str, corpus: str, label: str, seed: int) -> Path:
    """Where the evaluation output of one trained model lies (`base`: the base, seed 0)."""
    return Path(results) / results_path("eval", model=model, corpus=corpus, method=label, seed=seed)


def analysis_path(results: Path, model: str, corpus: str, label: str, seed: int) -> Path:
    """Where the co-activation analysis of one trained model lies (JSON; counts beside it)."""
    return Path(results) / results_path(
        "analysis", model=model, corpus=corpus, method=label, seed=seed
    )


def exact_match_items(eval_result: dict[str, Any], task: str, path: Path) -> np.ndarray:
    """Per-item scores (0/1) of one task in an evaluation output: our eval set's generation task
    `rpb_<task>` (tiny scale), else the standard lm-eval task `<task>` (paper scale: gsm8k,
    mmlu, ... scored by the suite's metric)."""
    tasks = eval_result.get("tasks", {})
    key = f"rpb_{task}" if f"rpb_{task}" in tasks else task
    if key not in tasks:
        raise ValueError(f"{path}: no task 'rpb_{task}' or '{task}' in the evaluation output")
    return np.asarray(tasks[key]["items"], dtype=float)


def in_domain_tasks(spec: dict[str, Any], corpus: str) -> list[str]:
    """The tasks that score post-training on `corpus` in-domain: `spec["corpus_tasks"][corpus]`
    (config `evaluation.corpus_tasks`; paper scale: the math benchmarks), else the corpus's own
    held-out set (tiny scale)."""
    return list((spec.get("corpus_tasks") or {}).get(corpus, [corpus]))


def in_domain_items(
    eval_result: dict[str, Any], spec: dict[str, Any], corpus: str, path: Path
) -> np.ndarray:
    """The in-domain items of `corpus`: every in-domain task's items, side by side."""
    tasks = in_domain_tasks(spec, corpus)
    return np.concatenate([exact_match_items(eval_result, t, path) for t in tasks])


def task_items(
    results: Path, model: str, corpus: str, label: str, seeds: Sequence[int], tasks: Sequence[str]
) -> np.ndarray:
    """Seeds x items matrix of exact match for `label`: the items of `tasks` side by side.

    Items keep their order, so two labels' matrices are paired cell by cell (same seed, same item);
    a seed whose item count differs from the first seed's is an error naming its file.
    """
    rows = []
    for seed in seeds:
        path = eval_path(results, model, corpus, label, seed)
        result = _read_json(path)
        row = np.concatenate([exact_match_items(result, task, path) for task in tasks])
        if rows and row.shape != rows[0].shape:
            raise ValueError(f"{path}: {row.size} items, but seed {seeds[0]} has {rows[0].size}")
        rows.append(row)
    return np.stack(rows)


def analysis_mean(results: Path, model: str, corpus: str, label: str, seed: int) -> dict:
    """The layer-mean structure and drift metrics of one analysis output."""
    path = analysis_path(results, model, corpus, label, seed)
    summary = _read_json(path)
    if "mean" not in summary:
        raise ValueError(f"{path}: no 'mean' entry in the analysis output")
    return {k: float(v) for k, v in summary["mean"].items()}


def _pct(x: float) -> float:
    return 100.0 * float(x)


def _stat_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "confidence": float(spec.get("confidence", 0.95)),
        "n_resamples": int(spec.get("n_resamples", DEFAULT_RESAMPLES)),
    }


def _level_kwargs(spec: dict[str, Any]) -> dict[str, float]:
    """The run-level intervals' settings: `claims.confidence` and `claims.power`."""
    return {
        "confidence": float(spec.get("confidence", 0.95)),
        "power": float(spec.get("power", DEFAULT_POWER)),
    }


def run_score(
    result: dict[str, Any], tasks: Sequence[str], path: Path
) -> tuple[float, dict[str, float], int]:
    """One run's score (%) over `tasks`: the mean of each task's item mean, so every benchmark
    weighs the same whatever its size; also each task's mean and the item count."""
    per_task = {t: exact_match_items(result, t, path) for t in tasks}
    means = {t: _pct(items.mean()) for t, items in per_task.items()}
    return float(np.mean(list(means.values()))), means, sum(v.size for v in per_task.values())


def run_scores(
    results: Path,
    spec: dict[str, Any],
    model: str,
    corpus: str,
    label: str,
    seeds: Sequence[int],
    metric: str,
) -> tuple[np.ndarray, int]:
    """Per-run scores (%) of `label` on `metric` ("in_domain": the corpus's in-domain tasks;
    "ood": the OOD tasks), one per seed in order, and the items per run. A seed whose item count
    differs from the first seed's is an error naming its file (runs must be paired item by item)."""
    if metric not in ("in_domain", "ood"):
        raise ValueError(f"unknown comparison metric {metric!r} (in_domain or ood)")
    tasks = in_domain_tasks(spec, corpus) if metric == "in_domain" else list(spec["ood"])
    scores, n_items = [], None
    for seed in seeds:
        path = eval_path(results, model, corpus, label, seed)
        score, _, n = run_score(_read_json(path), tasks, path)
        if n_items is not None and n != n_items:
            raise ValueError(f"{path}: {n} items, but seed {seeds[0]} has {n_items}")
        scores.append(score)
        n_items = n
    return np.array(scores), int(n_items or 0)


def item_interval(per_task: Sequence[np.ndarray], confidence: float) -> tuple[float, float, float]:
    """Score (%) of ONE run (the mean of its task means) and the normal interval of its item
    sampling: the only variance a single run (the base) has."""
    means = [float(np.mean(v)) for v in per_task]
    var = sum(m * (1 - m) / max(len(v), 1) for m, v in zip(means, per_task, strict=True))
    half = scipy_stats.norm.ppf((1 + confidence) / 2) * math.sqrt(var) / len(means)
    mean = float(np.mean(means))
    return 100 * mean, 100 * max(0.0, mean - half), 100 * min(1.0, mean + half)


def _run_record(
    results: Path, spec: dict[str, Any], model: str, corpus: str, label: str, seed: int
) -> dict[str, Any]:
    """One trained model: in-domain and mean OOD accuracy (%) and its analysis metrics."""
    path = eval_path(results, model, corpus, label, seed)
    result = _read_json(path)
    record: dict[str, Any] = {"model": model, "corpus": corpus, "method": label, "seed": seed}
    record["in_domain"] = run_score(result, in_domain_tasks(spec, corpus), path)[0]
    record["ood_mean"] = run_score(result, spec["ood"], path)[0]
    mean = analysis_mean(results, model, corpus, label, seed)
    for key in ("modularity", *RETENTION, *DRIFT, "usage_entropy"):
        record[key] = mean.get(key, math.nan)
    return record


def _write_md(path: Path, title: str, note: str, sections: list[tuple[str, pd.DataFrame]]) -> None:
    text = f"{title}. {note}\n"
    for heading, frame in sections:
        body = frame.to_markdown(index=False, floatfmt=".3g") if len(frame) else "(no rows)"
        text += f"\n{heading}\n\n{body}\n" if heading else f"\n{body}\n"
    path.write_text(text)


def _write_csv(frame: pd.DataFrame, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(path, index=False, float_format="%.4f")


def _write_with_runs(table: pd.DataFrame, runs: pd.DataFrame, out_csv: Path) -> Path:
    """Write `table` to `out_csv` and the per-run rows beside it as `<stem>_runs.csv`; return
    the stem (for the Markdown and figure names)."""
    out_csv = Path(out_csv)
    _write_csv(table, out_csv)
    stem = out_csv.with_suffix("")
    _write_csv(runs, stem.with_name(stem.name + "_runs.csv"))
    return stem


# --- tables 1 and 2: one row per method --------------------------------------------------------


def _row(results: Path, spec: dict[str, Any], label: str, seeds: list[int]) -> dict[str, Any]:
    """One method's row: in-domain (mean of its benchmarks, and each benchmark where there are
    several) with a t-interval over its runs at `spec['confidence']` (the base, one run: the
    interval of its item sampling), each OOD task, structure metrics; the paper's number."""
    model, corpus = spec["model"], spec["corpus"]
    level = _level_kwargs(spec)
    tasks = in_domain_tasks(spec, corpus)
    scores, per_task, single_items = [], {t: [] for t in tasks}, []
    ood: dict[str, list[float]] = {task: [] for task in spec["ood"]}
    analysis: dict[str, list[float]] = {"modularity": [], "community_nmi": [], "coact_cosine": []}
    for seed in seeds:
        path = eval_path(results, model, corpus, label, seed)
        result = _read_json(path)
        score, means, _ = run_score(result, tasks, path)
        scores.append(score)
        for task, value in means.items():
            per_task[task].append(value)
        single_items = [exact_match_items(result, t, path) for t in tasks]
        for task in spec["ood"]:
            ood[task].append(exact_match_items(result, task, path).mean())
        summary = _read_json(analysis_path(results, model, corpus, label, seed))
        for key in analysis:
            analysis[key].append(float(summary["mean"][key]))
    if len(seeds) == 1:
        mean, low, high = item_interval(single_items, level["confidence"])
    else:
        interval = run_interval(scores, **level)
        # A score lies in [0, 100]; so does its interval (cutting it there loses no coverage).
        mean, low, high = interval.estimate, max(0.0, interval.low), min(100.0, interval.high)
    row: dict[str, Any] = {
        "model": model,
        "method": label,
        "n_seeds": len(seeds),
        "in_domain": mean,
        "in_domain_ci_low": low,
        "in_domain_ci_high": high,
    }
    if len(tasks) > 1:
        for task, values in per_task.items():
            row[f"in_domain_{task}"] = float(np.mean(values))
    for task, values in ood.items():
        row[f"ood_{task}"] = 100 * float(np.mean(values))
    row["ood_mean"] = float(np.mean([row[f"ood_{task}"] for task in spec["ood"]]))
    for key, values in analysis.items():
        row[key] = float(np.mean(values))
    paper = PAPER_TABLE1.get(label) if spec.get("family", PAPER_FAMILY) == PAPER_FAMILY else None
    row["paper_in_domain"] = paper if paper is not None else math.nan
    return row


def build_method_table(
    results: Path, spec: dict[str, Any], out_csv: Path, title: str = "Table 1"
) -> pd.DataFrame:
    """One row per method (base first) on one model and corpus: CSV, Markdown, provenance side
    file and the co-activation heatmaps `figures/<csv stem>_coactivation.{png,pdf}`."""
    results = Path(results)
    rows = [_row(results, spec, "base", [0])]
    rows += [_row(results, spec, label, list(spec["seeds"])) for label in spec["methods"]]
    tasks = in_domain_tasks(spec, spec["corpus"])
    per_benchmark = [f"in_domain_{t}" for t in tasks] if len(tasks) > 1 else []
    columns = TABLE1_COLUMNS_HEAD + per_benchmark + [f"ood_{t}" for t in spec["ood"]]
    columns += TABLE1_COLUMNS_TAIL
    table = pd.DataFrame(rows)[columns]
    out_csv = Path(out_csv)
    table.to_csv(out_csv, index=False, float_format="%.4f")
    provenance = {
        "scale": spec.get("scale"),
        "model": spec["model"],
        "corpus": spec["corpus"],
        "seeds": spec["seeds"],
        "note": (
            f"Scores in percent. in_domain: {_in_domain_text(tasks)}, {_level(spec)} t-interval "
            "over the method's runs (one run per seed; the base, a single run: the interval of "
            "its item sampling). paper_in_domain: Moonlight-16B-A3B numbers reported by "
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
    out_csv.with_suffix(".meta.json").write_text(json.dumps(provenance, indent=2) + "\n")
    header = (
        f"{title} ({spec.get('scale')} scale, model {spec['model']}, corpus {spec['corpus']}, "
        f"seeds {spec['seeds']}). {provenance['note']}\n\n"
    )
    out_csv.with_suffix(".md").write_text(
        header + table.to_markdown(index=False, floatfmt=".2f") + "\n"
    )
    stem = out_csv.parent / "figures" / f"{out_csv.stem}_coactivation"
    plot_method_coactivation(results, spec["model"], spec["corpus"], spec["methods"], spec, stem)
    return table


def _in_domain_text(tasks: Sequence[str]) -> str:
    if len(tasks) == 1:
        return f"the items of {tasks[0]}"
    return (
        f"the mean of the benchmarks {', '.join(tasks)} (each the mean of its items; "
        "in_domain_<task> per benchmark)"
    )


def build_table1(results: Path, spec: dict[str, Any], out_csv: Path) -> pd.DataFrame:
    """Write table1 (CSV, Markdown, and a provenance side file) from this run's outputs; a
    spec's `title` names another table of the same rows (the diagnostic table 1)."""
    return build_method_table(results, spec, out_csv, spec.get("title", "Table 1"))


def build_table2(results: Path, spec: dict[str, Any], out_csv: Path) -> pd.DataFrame:
    """Table 2: table 1's rows for the family-B model (the paper reports no numbers for it)."""
    return build_method_table(results, spec, out_csv, "Table 2")


def plot_table1_coactivation(results: Path, spec: dict[str, Any], path_stem: Path) -> list[Path]:
    """Co-activation heatmaps of the base and each method (first seed) on the same probe set."""
    return plot_method_coactivation(
        results, spec["model"], spec["corpus"], spec["methods"], spec, path_stem
    )


def plot_method_coactivation(
    results: Path,
    model: str,
    corpus: str,
    methods: Sequence[str],
    spec: dict[str, Any],
    path_stem: Path,
) -> list[Path]:
    """Heatmaps of the base and each method (first seed) of one model and corpus."""
    from safetensors.torch import load_file

    from rpb.figures import plot_coactivation_heatmaps

    seed = spec["seeds"][0]
    analysis = Path(results) / "analysis" / model / corpus
    # The base analysis is per (model, corpus); a corpus without one (math2) uses the base counts
    # that every analysis stores beside its own (the same base, the same probe set).
    base_file = analysis / "base" / "seed0.safetensors"
    if base_file.is_file():
        base = load_file(base_file)["counts"].numpy()
    else:
        base = load_file(analysis / methods[0] / f"seed{seed}.safetensors")["base_counts"].numpy()
    named = {"base": base}
    for label in methods:
        path = analysis / label / f"seed{seed}.safetensors"
        if not path.is_file():
            raise FileNotFoundError(f"missing input for the figure: {path}")
        named[f"{label} (seed {seed})"] = load_file(path)["counts"].numpy()
    path_stem.parent.mkdir(parents=True, exist_ok=True)
    return plot_coactivation_heatmaps(named, path_stem, base="base")


# --- paired comparisons --------------------------------------------------------------------------


def compare(
    results: Path,
    spec: dict[str, Any],
    model: str,
    corpora: Sequence[str],
    method: str,
    other: str,
    metric: str,
    seeds: Sequence[int],
) -> tuple[float, float, Difference]:
    """`method` - `other` (percent) by paired per-run differences: one run per (corpus, seed),
    its score the mean over `metric`'s tasks of each task's item mean ("in_domain": each
    corpus's in-domain tasks, `in_domain_tasks`; "ood": the OOD tasks). The t-interval over the
    runs at `spec['confidence']`, with its MDE at `spec['power']`. Returns (method's mean score,
    other's mean score, the Difference)."""
    a_runs, b_runs, n_items, item_pairs = [], [], 0, []
    for corpus in corpora:
        a, n_items = run_scores(results, spec, model, corpus, method, seeds, metric)
        b, n_other = run_scores(results, spec, model, corpus, other, seeds, metric)
        if n_other != n_items:
            raise ValueError(
                f"{model}/{corpus}: {method} has {n_items} {metric} items per run, {other} "
                f"{n_other}: runs are not paired item by item"
            )
        a_runs.append(a)
        b_runs.append(b)
        tasks = in_domain_tasks(spec, corpus) if metric == "in_domain" else list(spec["ood"])
        for seed in seeds:
            pa = eval_path(results, model, corpus, method, seed)
            pb = eval_path(results, model, corpus, other, seed)
            ra, rb = _read_json(pa), _read_json(pb)
            item_pairs.append(
                [
                    (100 * exact_match_items(ra, t, pa), 100 * exact_match_items(rb, t, pb))
                    for t in tasks
                ]
            )
    a, b = np.concatenate(a_runs), np.concatenate(b_runs)
    diff = paired_runs(
        a, b, n_items=n_items, item_sd=item_sd_of_difference(item_pairs), **_level_kwargs(spec)
    )
    return float(a.mean()), float(b.mean()), diff


# --- table 3: method vs reference on the independent corpus -----------------------------------


def table3_frame(results: Path, spec: dict[str, Any]) -> pd.DataFrame:
    """Per model and metric: method - reference on `spec['corpus']` (see `compare`)."""
    corpus, method, reference = spec["corpus"], spec["method"], spec["reference"]
    rows = []
    for model in spec["models"]:
        for metric in ("in_domain", "ood"):
            a, b, diff = compare(
                Path(results), spec, model, [corpus], method, reference, metric, spec["seeds"]
            )
            rows.append(
                {
                    "model": model,
                    "family": spec.get("families", {}).get(model, ""),
                    "corpus": corpus,
                    "metric": metric,
                    "method": method,
                    "reference": reference,
                    "method_score": a,
                    "reference_score": b,
                    **diff.as_dict("diff"),
                }
            )
    return pd.DataFrame(rows)


def build_table3(results: Path, spec: dict[str, Any], out_csv: Path) -> pd.DataFrame:
    """Table 3 (CSV and Markdown): method vs reference per model on the independent corpus,
    paired per run (seed), with a t-interval, p-value and MDE (scores in percent)."""
    table = table3_frame(results, spec)
    out_csv = Path(out_csv)
    _write_csv(table, out_csv)
    note = (
        f"{spec['method']} minus {spec['reference']} after post-training on the independently "
        f"generated corpus `{spec['corpus']}` ({spec.get('scale')} scale, seeds "
        f"{list(spec['seeds'])}). Scores in percent; diff: mean of the per-run (per-seed) paired "
        f"differences (a run's in_domain: {_in_domain_text(in_domain_tasks(spec, spec['corpus']))}"
        "; ood: the mean of the OOD tasks), "
        f"{_level(spec)} t-interval over runs and the paired t-test's p-value, so p < 1 - level "
        "exactly when the CI excludes zero; mde: the difference found with 80% power "
        "(docs/claims.md)."
    )
    _write_md(out_csv.with_suffix(".md"), "Table 3", note, [("", table)])
    return table


def _level(spec: dict[str, Any]) -> str:
    return f"{100 * float(spec.get('confidence', 0.95)):g}%"


# --- table 4: anchors and RPB, ranks per corpus and seed ---------------------------------------


def table4_frames(results: Path, spec: dict[str, Any]) -> dict[str, pd.DataFrame]:
    """`runs` (per corpus, seed and method: scores and ranks within the block), `summary` (mean
    score and rank per method), `consistency` (per metric: is any ordering consistent across
    blocks?) and `pairs` (every pair's paired difference over seeds x items of all corpora)."""
    results = Path(results)
    model, methods = spec["model"], list(spec["methods"])
    corpora, seeds = list(spec["corpora"]), list(spec["seeds"])
    alpha = 1.0 - float(spec.get("confidence", 0.95))
    runs = pd.DataFrame(
        [
            _run_record(results, spec, model, corpus, label, seed)
            for corpus in corpora
            for seed in seeds
            for label in methods
        ]
    )
    summary, consistency = [], []
    for metric in ACCURACY:
        scores = runs.pivot(index=["corpus", "seed"], columns="method", values=metric)[methods]
        ranks = pd.DataFrame(block_ranks(scores.to_numpy()), index=scores.index, columns=methods)
        runs = runs.join(ranks.stack().rename(f"rank_{metric}"), on=["corpus", "seed", "method"])
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
                "mean_rank_order": _rank_order(check.mean_rank),
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
                a, b, diff = compare(results, spec, model, corpora, first, second, metric, seeds)
                pairs.append(
                    {
                        "metric": metric,
                        "method": first,
                        "other": second,
                        "method_score": a,
                        "other_score": b,
                        **diff.as_dict("diff"),
                    }
                )
    columns = ["model", "corpus", "seed", "method", *ACCURACY, "rank_in_domain", "rank_ood_mean"]
    runs = runs[columns].sort_values(["corpus", "seed", "rank_in_domain"], kind="stable")
    return {
        "runs": runs.reset_index(drop=True),
        "summary": pd.DataFrame(summary),
        "consistency": pd.DataFrame(consistency),
        "pairs": pd.DataFrame(pairs),
    }


def _rank_order(mean_rank: dict[str, float]) -> str:
    """`a > b = c`: methods by mean rank (1 = best), equal mean ranks joined by `=`."""
    ordered = sorted(mean_rank, key=mean_rank.get)
    text = ordered[0]
    for prev, name in itertools.pairwise(ordered):
        text += (" = " if math.isclose(mean_rank[prev], mean_rank[name]) else " > ") + name
    return text


def _side_csv(out_csv: Path, part: str) -> Path:
    return out_csv.with_name(f"{out_csv.stem}_{part}.csv")


def build_table4(results: Path, spec: dict[str, Any], out_csv: Path) -> pd.DataFrame:
    """Table 4: per (corpus, seed) each method's in-domain and OOD accuracy and rank (the CSV),
    side tables `_summary`, `_consistency`, `_pairs`, Markdown of all, and heatmaps."""
    frames = table4_frames(results, spec)
    out_csv = Path(out_csv)
    _write_csv(frames["runs"], out_csv)
    for part in ("summary", "consistency", "pairs"):
        _write_csv(frames[part], _side_csv(out_csv, part))
    alpha = 1.0 - float(spec.get("confidence", 0.95))
    note = (
        f"Model {spec['model']}, corpora {list(spec['corpora'])}, seeds {list(spec['seeds'])} "
        f"({spec.get('scale')} scale). Scores in percent; rank 1 = best within a (corpus, seed) "
        "block, ties averaged. Consistency: Kendall's W across blocks and the Friedman test "
        f"(consistent_ordering: p < {alpha:.2g}); identical_ranking: the same strict order in "
        "every block; same_best: one method first in every block. Pairs: mean paired per-run "
        f"difference, one run per (corpus, seed), {_level(spec)} t-interval, p-value and MDE."
    )
    _write_md(
        out_csv.with_suffix(".md"),
        "Table 4",
        note,
        [
            ("Per corpus and seed", frames["runs"]),
            ("Mean score and rank", frames["summary"]),
            ("Is any ordering consistent?", frames["consistency"]),
            ("Pairwise differences", frames["pairs"]),
        ],
    )
    plot_method_coactivation(
        results,
        spec["model"],
        spec["corpora"][0],
        spec["methods"],
        spec,
        out_csv.parent / "figures" / f"{out_csv.stem}_coactivation",
    )
    return frames["runs"]


# --- table 5: structure retention vs accuracy --------------------------------------------------


def base_nonuniformity(results: Path, model: str, corpus: str, seed: int = 0) -> pd.DataFrame:
    """Per MoE layer and their mean: the base's usage entropy and modularity on the probe set
    beside uniformly random top-k routing with the same experts, k and token count (chance)."""
    from safetensors.torch import load_file

    from rpb.coactivation import uniform_baseline

    path = analysis_path(results, model, corpus, "base", 0)
    summary = _read_json(path)
    counts = load_file(path.with_suffix(".safetensors"))["counts"].numpy()
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
    retention metric with each accuracy across the soft runs), `hard` (each hard method minus
    each other method, paired) and `base` (the base's non-uniformity)."""
    results = Path(results)
    model, corpus = spec["model"], spec["corpus"]
    methods, seeds, soft = list(spec["methods"]), list(spec["seeds"]), list(spec["correlate"])
    level = _level_kwargs(spec)
    labels = list(dict.fromkeys([*methods, *soft]))
    runs = pd.DataFrame(
        [_run_record(results, spec, model, corpus, m, s) for m in labels for s in seeds]
    )
    rows = []
    for label, label_seeds in [("base", [0]), *((m, seeds) for m in methods)]:
        records = pd.DataFrame(
            [_run_record(results, spec, model, corpus, label, s) for s in label_seeds]
        )
        if len(label_seeds) == 1:
            path = eval_path(results, model, corpus, label, label_seeds[0])
            result = _read_json(path)
            items = [exact_match_items(result, t, path) for t in in_domain_tasks(spec, corpus)]
            mean, low, high = item_interval(items, level["confidence"])
        else:
            interval = run_interval(records["in_domain"].to_numpy(), **level)
            mean, low, high = interval.estimate, max(0.0, interval.low), min(100.0, interval.high)
        row = {"model": model, "method": label, "n_seeds": len(label_seeds)}
        row |= {"in_domain": mean, "in_domain_ci_low": low, "in_domain_ci_high": high}
        for key in ("ood_mean", "modularity", *RETENTION, *DRIFT):
            row[key] = float(records[key].mean())
        rows.append(row)
    columns = ["model", "method", "n_seeds", *RETENTION, "modularity", "in_domain"]
    columns += ["in_domain_ci_low", "in_domain_ci_high", "ood_mean", *DRIFT]
    table = pd.DataFrame(rows).reindex(columns=columns)
    soft_runs = runs[runs["method"].isin(soft)]
    correlation = []
    for retention in RETENTION:
        for accuracy in ACCURACY:
            pts = soft_runs[[retention, accuracy, "seed"]].dropna()
            # Within each seed across the methods: runs of a seed share the initial model and
            # data order, so pooled runs are not independent points (docs/claims.md).
            corr = within_cluster_spearman(
                pts[retention].to_numpy(),
                pts[accuracy].to_numpy(),
                pts["seed"].to_numpy(),
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
                    per_seed = runs.set_index(["method", "seed"])[metric]
                    a = np.array([per_seed[(h, s)] for s in seeds])
                    b = np.array([per_seed[(other, s)] for s in seeds])
                    if not (np.isfinite(a).all() and np.isfinite(b).all()):
                        continue  # NMI is undefined where the base has a single community
                    diff = paired_runs(a, b, **level)
                    sa, sb = float(a.mean()), float(b.mean())
                else:
                    sa, sb, diff = compare(results, spec, model, [corpus], h, other, metric, seeds)
                hard_rows.append(
                    {
                        "metric": metric,
                        "method": h,
                        "other": other,
                        "method_score": sa,
                        "other_score": sb,
                        **diff.as_dict("diff"),
                    }
                )
    return {
        "table": table,
        "runs": runs,
        "correlation": pd.DataFrame(correlation),
        "hard": pd.DataFrame(hard_rows),
        "base": base_nonuniformity(results, model, corpus),
    }


def build_table5(results: Path, spec: dict[str, Any], out_csv: Path) -> pd.DataFrame:
    """Table 5 (per method) with side tables `_correlation`, `_hard`, `_base`, `_runs`,
    Markdown of all, retention-vs-accuracy scatter plots and co-activation heatmaps."""
    from rpb.figures import plot_retention_vs_accuracy

    frames = table5_frames(results, spec)
    out_csv = Path(out_csv)
    _write_csv(frames["table"], out_csv)
    for part in ("correlation", "hard", "base", "runs"):
        _write_csv(frames[part], _side_csv(out_csv, part))
    note = (
        f"Model {spec['model']}, corpus {spec['corpus']}, seeds {list(spec['seeds'])} "
        f"({spec.get('scale')} scale). Retention: the live model's co-activation structure "
        "against the base's on the same probe set (community NMI / ARI of Louvain partitions, "
        "cosine of the co-activation matrices), mean over MoE layers; accuracy in percent. "
        f"Correlation: Spearman's rho across {list(spec['correlate'])} within each seed, the "
        f"mean over seeds with the {_level(spec)} t-interval over the per-seed rhos (an "
        "association; runs of a seed are not independent). Hard: paired per-run difference "
        "hard - other with its t-interval and MDE. Base: non-uniformity of the "
        "base router against uniformly random top-k routing with the same experts, k and tokens."
    )
    _write_md(
        out_csv.with_suffix(".md"),
        "Table 5",
        note,
        [
            ("Per method", frames["table"]),
            ("Does retention track accuracy?", frames["correlation"]),
            ("Hard routing vs the other methods", frames["hard"]),
            ("How non-uniform is the base router?", frames["base"]),
        ],
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
    plot_method_coactivation(
        results,
        spec["model"],
        spec["corpus"],
        spec["methods"],
        spec,
        figures / f"{out_csv.stem}_coactivation",
    )
    return frames["table"]


# --- softness sweep ----------------------------------------------------------------------------


def method_strength(entry: dict[str, Any]) -> float:
    """The x position of a method on a softness axis: 0 for plain fine-tuning (`none`), infinity
    for hard routing (the strength -> infinity limit), else the configured or default strength."""
    from rpb.methods import METHODS

    kind = entry.get("kind") or entry.get("name")
    if kind == "none":
        return 0.0
    if kind == "hard":
        return math.inf
    if kind not in METHODS:
        raise ValueError(f"unknown method kind {kind!r} in the sweep")
    strength = entry.get("strength")
    return float(METHODS[kind].default_strength if strength is None else strength)


# Evaluation protocols of a sweep point: the model routes with its own router, or keeps the
# method's steering at evaluation (`hard`, `keep_bias_at_eval`).
OWN_ROUTER, KEPT_AT_EVAL = "own_router", "kept_at_eval"


def eval_protocol(entry: dict[str, Any]) -> str:
    """OWN_ROUTER or KEPT_AT_EVAL: whether the method keeps steering routing at evaluation
    (its `keep_bias_at_eval` option, or the family's default for it)."""
    from rpb.methods import METHODS

    kind = entry.get("kind") or entry.get("name")
    if kind not in METHODS:
        raise ValueError(f"unknown method kind {kind!r} in the sweep")
    default = METHODS[kind].option_defaults.get("keep_bias_at_eval", False)
    keep = (entry.get("options") or {}).get("keep_bias_at_eval", default)
    return KEPT_AT_EVAL if keep else OWN_ROUTER


def build_sweep(results: Path, spec: dict[str, Any], out_csv: Path) -> pd.DataFrame:
    """Per curve and point: mean in-domain, OOD, retention and drift over the sweep's seeds
    (`sweep.csv`), every run (`sweep_runs.csv`), the curves figure `figures/sweep`, and table 4
    at matched strengths (`sweep_table4_matched*`, `build_table4_matched`). Each point carries
    its evaluation `protocol`: a curve is drawn through its own-router points only, and a point
    kept at evaluation (`hard`) is marked apart."""
    results = Path(results)
    model, corpus, seeds = spec["model"], spec["corpus"], list(spec["seeds"])
    records = []
    for curve, labels in spec["curves"].items():
        for label in labels:
            entry = spec["methods"].get(label)
            if entry is None:
                raise ValueError(f"sweep curve {curve!r}: label {label!r} is not a method")
            strength, protocol = method_strength(entry), eval_protocol(entry)
            for seed in seeds:
                rec = _run_record(results, spec, model, corpus, label, seed)
                records.append(
                    {"curve": curve, "label": label, "strength": strength, "protocol": protocol}
                    | rec
                )
    runs = pd.DataFrame(records)
    metrics = [*ACCURACY, *RETENTION, *DRIFT]
    table = (
        runs.groupby(["curve", "label", "strength", "protocol"], sort=False)[metrics]
        .mean()
        .reset_index()
        .sort_values(["curve", "strength"], kind="stable")
    )
    table.insert(4, "n_seeds", len(seeds))
    out_csv = Path(out_csv)
    stem = _write_with_runs(table, runs, out_csv)
    note = (
        f"Model {model}, corpus {corpus}, seeds {seeds} ({spec.get('scale')} scale); means over "
        "seeds. strength 0 is plain fine-tuning (`none`: rpb with lambda = 0 and every anchor "
        "at mu = 0 are exactly it); inf is the lambda -> infinity limit, trained with the base "
        f"router's selection. protocol `{OWN_ROUTER}`: evaluated with the model's own router "
        f"(every finite point, and rpb's infinite arm); `{KEPT_AT_EVAL}`: base routing kept at "
        "evaluation (`hard`, table 5's arm), not a point of the own-router curve."
    )
    _write_md(out_csv.with_suffix(".md"), "Softness sweep", note, [("", table)])
    from rpb.figures import plot_sweep

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
        frames = table4_frames(
            results, spec | {"methods": labels, "corpora": [spec["corpus"]], "seeds": spec["seeds"]}
        )
        for row in frames["summary"].to_dict("records"):
            entry = scores.setdefault((side, row["method"]), {})
            entry[f"{row['metric']}"] = row["score"]
            entry[f"rank_{row['metric']}"] = row["mean_rank"]
        consistency += [{"strengths": side} | r for r in frames["consistency"].to_dict("records")]
        pairs += [{"strengths": side} | r for r in frames["pairs"].to_dict("records")]
    table = selection.copy()
    for side in sides:
        for metric in ("in_domain", "ood_mean", "rank_in_domain", "rank_ood_mean"):
            table[f"{side}_{metric}"] = [
                scores.get((side, label), {}).get(metric, math.nan)
                for label in selection[f"{side}_label"]
            ]
    _write_csv(table, out_csv)
    _write_csv(pd.DataFrame(consistency), _side_csv(out_csv, "consistency"))
    _write_csv(pd.DataFrame(pairs), _side_csv(out_csv, "pairs"))
    note = (
        f"Model {spec['model']}, corpus {spec['corpus']}, seeds {list(spec['seeds'])} "
        f"({spec.get('scale')} scale), the softness sweep's runs. Matched: per curve, the trained "
        f"strength whose top-k overlap with the base (evaluation routing, seed mean) lies closest "
        f"to position {MATCH_POSITION} of the none -> hard gap (reached: within "
        f"{MATCH_TOLERANCE}); chosen on routing alone, by the rule fixed in docs/methods.md "
        "before results. Default: the curve's point at its configured strength. Scores in "
        "percent, ranks 1 = best within a seed block, table 4's statistics on each side."
    )
    _write_md(
        out_csv.with_suffix(".md"),
        "Table 4 at matched strengths",
        note,
        [
            ("Matched and default strengths", table),
            ("Is any ordering consistent?", pd.DataFrame(consistency)),
            ("Pairwise differences", pd.DataFrame(pairs)),
        ],
    )
    return table


# --- training-time routing drift ----------------------------------------------------------------


def build_drift(results: Path, spec: dict[str, Any], out_csv: Path) -> pd.DataFrame:
    """Training histories of each method and seed as one long table (`step`, losses and the
    layer-mean drift metrics) and the curves figure `figures/drift`."""
    results = Path(results)
    model, corpus = spec["model"], spec["corpus"]
    rows = []
    for label in spec["methods"]:
        for seed in spec["seeds"]:
            path = results / "runs" / model / corpus / label / f"seed{seed}" / "train_history.json"
            history = _read_json(path).get("history")
            if not history:
                raise ValueError(f"{path}: no 'history' entries")
            for entry in history:
                row = {"method": label, "seed": seed, "step": entry["step"]}
                for key in ("task_loss", "router_loss"):
                    row[key] = entry.get(key, math.nan)
                for key in (*DRIFT, "usage_entropy"):
                    row[key] = entry.get(f"mean/{key}", math.nan)
                rows.append(row)
    table = pd.DataFrame(rows)
    out_csv = Path(out_csv)
    _write_csv(table, out_csv)
    from rpb.figures import plot_curves

    ys = [y for y in ("task_loss", *DRIFT, "usage_entropy") if table[y].notna().any()]
    plot_curves(table, "step", ys, "method", out_csv.parent / "figures" / "drift")
    return table


# --- which RPB reading anchors (docs/methods.md, "Choosing the default RPB reading") -------------

ANCHOR_METRICS = ["topk_overlap_with_base", "community_nmi"]


def build_readings(results: Path, spec: dict[str, Any], out_csv: Path) -> pd.DataFrame:
    """The RPB readings side by side with their bounds `lower` (unanchored, `none`) and `upper`
    (`hard`), scored by the mechanistic rule fixed in docs/methods.md before any result: a reading
    anchors when, for every metric in ANCHOR_METRICS (seed means of the routing used at
    evaluation), it covers at least `min_gain` of the gap from `lower` to `upper`. The default is
    the first anchoring reading in the configured order. Accuracy is listed after the verdict and
    plays no part in it. Writes the CSV, Markdown, `<stem>_runs.csv` and `figures/<stem>`."""
    results = Path(results)
    model, corpus, seeds = spec["model"], spec["corpus"], list(spec["seeds"])
    lower, upper, min_gain = spec["lower"], spec["upper"], float(spec["min_gain"])
    labels = [lower, *spec["methods"], upper]
    runs = pd.DataFrame(
        [
            _run_record(results, spec, model, corpus, label, seed)
            for label in labels
            for seed in seeds
        ]
    )
    means = runs.groupby("method", sort=False)[
        [*ANCHOR_METRICS, *RETENTION[1:], "kl_to_base", *ACCURACY]
    ].mean()
    gaps = {m: means.at[upper, m] - means.at[lower, m] for m in ANCHOR_METRICS}
    rows = []
    for label in labels:
        role = {lower: "lower bound", upper: "upper bound"}.get(label, "reading")
        row: dict[str, Any] = {"method": label, "role": role, "n_seeds": len(seeds)}
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
        *ACCURACY,
    ]
    table = table[columns]
    out_csv, stem = Path(out_csv), _write_with_runs(table, runs, out_csv)
    verdict = (
        f"default by the rule: `{first[0]}`"
        if first
        else "no reading anchors, so the rule picks no default (the configured `rpb` stays; say so)"
    )
    note = (
        f"Model {model}, corpus {corpus}, seeds {seeds} ({spec.get('scale')} scale); seed means of "
        f"the routing each model uses at evaluation, on the analysis probe set. *_position: the "
        f"share of the {lower} -> {upper} gap a reading covers; it anchors when every position is "
        f">= {min_gain}. {verdict}. Accuracy columns are shown for information only: the rule "
        "does not read them (docs/methods.md)."
    )
    _write_md(out_csv.with_suffix(".md"), "RPB readings", note, [("", table)])
    from rpb.figures import plot_retention_vs_accuracy

    plot_retention_vs_accuracy(
        runs,
        out_csv.parent / "figures" / stem.name,
        x="topk_overlap_with_base",
        y="community_nmi",
        title=f"RPB readings between {lower} and {upper} (per seed)",
    )
    return table
