"""Testbed calibration report: is each tiny base a fair miniature of the paper's setting?

Three conditions (docs/testbed.md; docs/design.md sections 4-6 and 10): the base routes
non-uniformly enough for co-activation communities to form and be stable (measured on the in-domain
corpus against uniform routing with the same experts, top-k and token count); the base has learned
its pretraining domains but not the post-training task; plain fine-tuning lifts in-domain accuracy
well above the base while OOD skills are measurably retained, neither untouched nor wiped out.
Everything here is read from this run's outputs or measured by this module; nothing is typed in.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rpb.artifacts import write_text
from rpb.coactivation import (
    communities,
    modularity,
    split_half_stability,
    uniform_baseline,
    usage_entropy,
)
from rpb.pipeline.analysis import corpus_texts, routing_pass, text_batches
from rpb.prior import RouterPrior
from rpb.specs import Run, eval_path, results_path


def base_structure(model_dir: Path, corpus: Path, prior_path: Path, seed: int = 0) -> dict:
    """Per-layer usage entropy, modularity and split-half community stability of a base on a
    corpus, beside a uniform-routing baseline with the same E, k and token count per half."""
    prior = RouterPrior.load(prior_path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    texts = corpus_texts(corpus)
    # Alternate lines between halves: corpora may be ordered, halves must be alike.
    halves = [
        routing_pass(model, text_batches(tokenizer, texts[i::2], 256), None, desc=f"half {i}")
        for i in (0, 1)
    ]
    counts = prior.coactivation.numpy()
    layers = []
    for layer in range(prior.num_layers):
        c = counts[layer]
        labels = communities(c, seed)
        layers.append(
            {
                "layer": layer,
                "usage_entropy": float(usage_entropy(np.diag(c))),
                "modularity": float(modularity(c, labels)),
                "n_communities": int(labels.max() + 1),
                "split_half_nmi": float(
                    split_half_stability(
                        halves[0]["counter"].counts[layer].numpy(),
                        halves[1]["counter"].counts[layer].numpy(),
                        seed,
                    )
                ),
            }
        )
    # uniform_baseline splits its token count into two halves: give it both halves' tokens.
    split_tokens = halves[0]["tokens"] + halves[1]["tokens"]
    baseline = uniform_baseline(prior.num_experts, prior.top_k, split_tokens, seed=seed)
    return {"layers": layers, "uniform": baseline, "tokens": prior.n_tokens}


def stage_durations(tracking_uri: str, experiment: str = "rpb") -> dict[str, list[float]]:
    """Wall seconds of every finished MLflow run, by `stage/model` (job cost on this machine)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return {}
    durations: dict[str, list[float]] = {}
    for run in client.search_runs([found.experiment_id], max_results=5000):
        if run.info.status != "FINISHED" or not run.info.end_time:
            continue
        # `model` is a tag (rpb.pipeline.tracking.SCHEMA_TAGS); runs logged before it a param.
        model = run.data.tags.get("model") or run.data.params.get("model")
        key = f"{run.data.tags.get('stage')}/{model}"
        durations.setdefault(key, []).append((run.info.end_time - run.info.start_time) / 1000)
    return durations


def _task_scores(path: Path) -> dict[str, float]:
    tasks = json.loads(path.read_text())["tasks"]
    return {name.removeprefix("rpb_"): float(entry["score"]) for name, entry in tasks.items()}


def _fmt(value: float, digits: int = 3) -> str:
    return "nan" if value != value else f"{value:.{digits}f}"


def testbed_report(
    *,
    results: Path,
    models: Sequence[str],
    corpus: str,
    seeds: Sequence[int],
    tasks: Sequence[str],
    out: Path,
    tracking_uri: str | None = None,
) -> dict[str, Any]:
    """Write the calibration report (Markdown + JSON) for each pretrained base."""
    report: dict[str, Any] = {}
    lines = [
        "# Testbed calibration (measured by `snakemake --cores all results/testbed.md`)",
        "",
    ]
    for model in models:
        # The model's own base (base 0), as table 1 names it.
        base_dir = results / results_path("base_model", model=model, base=0)
        structure = base_structure(
            base_dir,
            results / "data" / "post" / f"{corpus}.jsonl",
            results / results_path("prior", model=model, base=0, corpus=corpus),
        )
        base_eval = _task_scores(eval_path(results, model, corpus, "base", Run(0, 0)))
        tuned = [_task_scores(eval_path(results, model, corpus, "none", Run(0, s))) for s in seeds]
        tuned_mean = {t: float(np.mean([r[t] for r in tuned])) for t in tuned[0]}
        history = json.loads((base_dir.parent / "train_history.json").read_text())
        report[model] = {
            "structure": structure,
            "base": base_eval,
            "none": tuned_mean,
            "pretrain_final": history.get("final", {}),
        }
        u = structure["uniform"]
        lines += [
            f"## {model}",
            "",
            f"Routing structure of the base on the `{corpus}` corpus ({structure['tokens']} tokens;"
            " usage entropy normalised to [0, 1]; modularity of the Louvain partition of the"
            " co-activation graph; split-half NMI: agreement of the partitions found on two"
            " disjoint halves of the corpus).",
            "",
            "| layer | usage entropy | modularity | communities | split-half NMI |",
            "|---|---|---|---|---|",
        ]
        for row in structure["layers"]:
            lines.append(
                f"| {row['layer']} | {_fmt(row['usage_entropy'])} | {_fmt(row['modularity'])} | "
                f"{row['n_communities']} | {_fmt(row['split_half_nmi'])} |"
            )
        lines += [
            f"| uniform routing | {_fmt(u['usage_entropy'])} | {_fmt(u['modularity'])} | – | "
            f"{_fmt(u['split_half_nmi'])} |",
            "",
            f"Accuracy (exact match; `_ll`: mean per-token log-likelihood of the target), base vs"
            f" plain fine-tuning (`none`, mean of seeds {list(seeds)}):",
            "",
            "| task | base | none |",
            "|---|---|---|",
        ]
        for task in tasks:
            for name in (task, f"{task}_ll"):
                if name in base_eval:
                    tuned_score = tuned_mean.get(name, float("nan"))
                    lines.append(f"| {name} | {_fmt(base_eval[name])} | {_fmt(tuned_score)} |")
        lines.append("")
    if tracking_uri:
        durations = stage_durations(tracking_uri)
        report["durations_s"] = durations
        lines += [
            "## Cost on this machine",
            "",
            "Wall seconds per job (MLflow run start to end; jobs may have shared the 2 cores):",
            "",
            "| job | runs | median s | max s |",
            "|---|---|---|---|",
        ]
        for key in sorted(durations):
            values = durations[key]
            lines.append(f"| {key} | {len(values)} | {np.median(values):.1f} | {max(values):.1f} |")
        lines.append("")
    write_text(out, "\n".join(lines) + "\n")
    write_text(out.with_suffix(".json"), json.dumps(report, indent=2, default=float) + "\n")
    return report
