"""Reading this run's outputs: what the tables, the claims audit and the router-swap table know
about one trained model (model, corpus, method label and its run: a base and a seed,
`rpb.specs.Run`).

Paths come from the results layout in `rpb.specs.PATHS`; everything here reads, nothing writes.
A run's score (`run_score`) is the mean over its benchmarks of each benchmark's item mean in
percent, so every benchmark weighs the same whatever its size (docs/claims.md); its structure and
drift metrics are the layer means of its analysis output (`analysis_mean`). A missing file or
task is an error naming the file.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rpb.specs import (
    Run,
    analysis_path,
    eval_path,
    results_path,
    run_path,
    runs_on,
    spec_runs,
)

__all__ = [
    "ACCURACY",
    "DRIFT",
    "RETENTION",
    "analysis_mean",
    "base_analysis",
    "coactivation_counts",
    "exact_match_items",
    "in_domain_items",
    "in_domain_tasks",
    "metric_tasks",
    "numeric_paths",
    "read_json",
    "run_record",
    "run_score",
    "run_scores",
    "runs_text",
    "training_history",
]

# Structure metrics of an analysis output ("mean" over MoE layers): how much of the base's
# co-activation structure a run retains, and how far its routing drifted from the base's.
RETENTION = ["community_nmi", "community_ari", "coact_cosine"]
DRIFT = ["kl_to_base", "topk_overlap_with_base"]
# A run record's accuracy columns (percent): in-domain, and the mean over the OOD tasks.
ACCURACY = ["in_domain", "ood_mean"]


def base_runs(runs: Sequence[Run]) -> list[Run]:
    """The runs under which the bases of `runs` were evaluated (label `base`): `base<b>/seed0`,
    one per base, so a table's base row pools every base its runs start from."""
    return sorted({Run(run.base, 0) for run in runs}) or [Run(0, 0)]


def runs_text(runs: Sequence[Run]) -> str:
    """Runs as a note names them: `seeds [0, 1] on bases [0, 1]` for a full grid, else each
    run's `base<b>/seed<s>`."""
    bases = sorted({run.base for run in runs})
    seeds = sorted({run.seed for run in runs})
    if sorted(runs) == runs_on(len(bases), seeds) and bases == list(range(len(bases))):
        return f"seeds {seeds} on bases {bases}"
    return "runs " + ", ".join(run.name for run in runs)


def read_json(path: Path, what: str = "the table") -> dict[str, Any]:
    """One JSON output; a missing file is a FileNotFoundError naming it and `what` needs it.

    Each content is parsed once (the claims audit reads every evaluation output dozens of
    times): the result is shared, so callers only read it."""
    if not path.is_file():
        raise FileNotFoundError(f"missing input for {what}: {path}")
    return _parsed_json(path.read_bytes())


# Keyed by the bytes themselves, not by path and time: a file rewritten within the clock's tick
# keeps its mtime. 64 covers an audit's working set at tiny scale (paper-scale files are MBs).
@functools.lru_cache(maxsize=64)
def _parsed_json(data: bytes) -> Any:
    return json.loads(data)


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


def metric_tasks(spec: dict[str, Any], corpus: str, metric: str) -> list[str]:
    """The tasks of a comparison metric: "in_domain" (the corpus's in-domain tasks) or "ood"."""
    if metric not in ("in_domain", "ood"):
        raise ValueError(f"unknown comparison metric {metric!r} (in_domain or ood)")
    return in_domain_tasks(spec, corpus) if metric == "in_domain" else list(spec["ood"])


def in_domain_items(
    eval_result: dict[str, Any], spec: dict[str, Any], corpus: str, path: Path
) -> np.ndarray:
    """The in-domain items of `corpus`: every in-domain task's items, side by side."""
    tasks = in_domain_tasks(spec, corpus)
    return np.concatenate([exact_match_items(eval_result, t, path) for t in tasks])


def analysis_mean(results: Path, model: str, corpus: str, label: str, run: Run) -> dict:
    """The layer-mean structure and drift metrics of one analysis output."""
    path = analysis_path(results, model, corpus, label, run)
    summary = read_json(path)
    if "mean" not in summary:
        raise ValueError(f"{path}: no 'mean' entry in the analysis output")
    return {k: float(v) for k, v in summary["mean"].items()}


def _pct(x: float) -> float:
    return 100.0 * float(x)


def run_score(
    result: dict[str, Any],
    tasks: Sequence[str],
    path: Path,
    items: Callable[[dict[str, Any], str, Path], np.ndarray] | None = None,
) -> tuple[float, dict[str, float], int]:
    """One run's score (%) over `tasks`: the mean of each task's item mean, so every benchmark
    weighs the same whatever its size; also each task's mean and the item count. `items` reads
    a task's per-item scores (default: exact match; rpb.report.tables passes p(target)'s)."""
    items = exact_match_items if items is None else items
    per_task = {t: items(result, t, path) for t in tasks}
    for task, values in per_task.items():
        if not np.isfinite(values).all():  # else a NaN mean stops the table naming no file
            bad = int((~np.isfinite(values)).sum())
            raise ValueError(
                f"{path}: task {task}: {bad} of {values.size} item scores are not finite (NaN or "
                "inf); delete the file and rerun the pipeline to evaluate the run again"
            )
    means = {t: _pct(items.mean()) for t, items in per_task.items()}
    return float(np.mean(list(means.values()))), means, sum(v.size for v in per_task.values())


def run_scores(
    results: Path,
    spec: dict[str, Any],
    model: str,
    corpus: str,
    label: str,
    runs: Sequence[Run],
    metric: str,
    items: Callable[[dict[str, Any], str, Path], np.ndarray] | None = None,
) -> tuple[np.ndarray, int]:
    """Per-run scores (%) of `label` on `metric` ("in_domain": the corpus's in-domain tasks;
    "ood": the OOD tasks), one per run in order, and the items per run. A run whose item count
    differs from the first run's is an error naming its file (runs must be paired item by item).
    `items` as in `run_score`."""
    tasks = metric_tasks(spec, corpus, metric)
    scores, n_items = [], None
    for run in runs:
        path = eval_path(results, model, corpus, label, run)
        score, _, n = run_score(read_json(path), tasks, path, items)
        if n_items is not None and n != n_items:
            raise ValueError(f"{path}: {n} items, but run {runs[0]} has {n_items}")
        scores.append(score)
        n_items = n
    return np.array(scores), int(n_items or 0)


def run_record(
    results: Path, spec: dict[str, Any], model: str, corpus: str, label: str, run: Run
) -> dict[str, Any]:
    """One trained model: its run's `base` and `seed`, in-domain and mean OOD accuracy (%) and
    its analysis metrics (NaN where its analysis output lacks one)."""
    path = eval_path(results, model, corpus, label, run)
    result = read_json(path)
    record: dict[str, Any] = {"model": model, "corpus": corpus, "method": label}
    record |= {"base": run.base, "seed": run.seed}
    record["in_domain"] = run_score(result, in_domain_tasks(spec, corpus), path)[0]
    record["ood_mean"] = run_score(result, spec["ood"], path)[0]
    mean = analysis_mean(results, model, corpus, label, run)
    for key in ("modularity", *RETENTION, *DRIFT, "usage_entropy"):
        record[key] = mean.get(key, math.nan)
    return record


def training_history(
    results: Path, model: str, corpus: str, label: str, run: Run
) -> list[dict[str, Any]]:
    """The logged training steps of one post-training run (`train_history.json`)."""
    path = run_path("train_history", results, model, corpus, label, run)
    history = read_json(path).get("history")
    if not history:
        raise ValueError(f"{path}: no 'history' entries")
    return history


def numeric_paths(results: Path, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The distinct CPU numeric paths (rpb.numerics) that trained a table's runs and their
    pretrained bases, read from their `train_history.json` (a run without one, or written before
    paths were recorded, counts as "unrecorded"; a hub base has none), each with how many
    trainings used it: one entry when the table is of one path."""
    histories: list[Path] = []
    for run in spec_runs(spec):
        model = Path(results) / results_path("base_model", model=spec["model"], base=run.base)
        if (model.parent / "train_history.json").exists():
            histories.append(model.parent / "train_history.json")
        for label in spec["methods"]:
            histories.append(
                run_path("train_history", results, spec["model"], spec["corpus"], label, run)
            )
    found: dict[str, dict[str, Any]] = {}
    for path in dict.fromkeys(histories):
        # A run made before paths were recorded, or outside the pipeline, may have no history.
        record = (read_json(path).get("numeric_path") if path.exists() else None) or "unrecorded"
        key = json.dumps(record, sort_keys=True)
        entry = found.setdefault(key, {"path": record, "trainings": 0})
        entry["trainings"] += 1
    return list(found.values())


def _load_counts(path: Path, key: str = "counts") -> np.ndarray:
    from safetensors.torch import load_file  # torch: only where counts are read

    return load_file(path)[key].numpy()


def coactivation_counts(
    results: Path, model: str, corpus: str, methods: Sequence[str], run: Run
) -> dict[str, np.ndarray]:
    """Co-activation counts [layers, experts, experts] of the base and of each method's run
    `run`, named for a figure (`base`, `<label> (base<b>/seed<s>)`)."""
    # The base analysis is per (model, corpus) and base (run `run` starts from base `run.base`,
    # evaluated as run base<b>/seed0); a corpus without one (math2) uses the base counts that
    # every analysis stores beside its own (the same base, the same probe set).
    base_file = run_path("analysis_counts", results, model, corpus, "base", base_runs([run])[0])
    if base_file.is_file():
        base = _load_counts(base_file)
    else:
        first = run_path("analysis_counts", results, model, corpus, methods[0], run)
        base = _load_counts(first, "base_counts")
    named = {"base": base}
    for label in methods:
        path = run_path("analysis_counts", results, model, corpus, label, run)
        if not path.is_file():
            raise FileNotFoundError(f"missing input for the figure: {path}")
        named[f"{label} ({run.name})"] = _load_counts(path)
    return named


def base_analysis(results: Path, model: str, corpus: str) -> tuple[dict[str, Any], np.ndarray]:
    """The base's analysis output on `corpus` (per-layer rows, probe size) and its counts."""
    path = analysis_path(results, model, corpus, "base", Run(0, 0))
    summary = read_json(path)
    counts = run_path("analysis_counts", results, model, corpus, "base", Run(0, 0))
    return summary, _load_counts(counts)
