"""Tables: the paper's reported numbers beside the ones this run measured.

Every number in a table is read from an evaluation or analysis output of this run; the only
constants are the paper's own reported scores (`PAPER_TABLE1`), shown in their own column.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rpb.stats import two_way_bootstrap_ci

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


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"missing input for the table: {path}")
    return json.loads(path.read_text())


def exact_match_items(eval_result: dict[str, Any], task: str, path: Path) -> np.ndarray:
    """Per-item exact match (0/1) of one generation task in an evaluation output."""
    key = f"rpb_{task}"
    try:
        entry = eval_result["tasks"][key]
    except KeyError:
        raise ValueError(f"{path}: no task '{key}' in the evaluation output") from None
    return np.asarray(entry["items"], dtype=float)


def _row(results: Path, spec: dict[str, Any], label: str, seeds: list[int]) -> dict[str, Any]:
    model, corpus = spec["model"], spec["corpus"]
    per_seed_items = []
    ood: dict[str, list[float]] = {task: [] for task in spec["ood"]}
    analysis: dict[str, list[float]] = {"modularity": [], "community_nmi": [], "coact_cosine": []}
    for seed in seeds:
        eval_path = results / "eval" / model / corpus / label / f"seed{seed}.json"
        result = _read_json(eval_path)
        per_seed_items.append(exact_match_items(result, corpus, eval_path))
        for task in spec["ood"]:
            ood[task].append(exact_match_items(result, task, eval_path).mean())
        summary = _read_json(results / "analysis" / model / corpus / label / f"seed{seed}.json")
        for key in analysis:
            analysis[key].append(float(summary["mean"][key]))
    mean, low, high = two_way_bootstrap_ci(np.stack(per_seed_items))
    row: dict[str, Any] = {
        "model": model,
        "method": label,
        "n_seeds": len(seeds),
        "in_domain": 100 * mean,
        "in_domain_ci_low": 100 * low,
        "in_domain_ci_high": 100 * high,
    }
    for task, values in ood.items():
        row[f"ood_{task}"] = 100 * float(np.mean(values))
    row["ood_mean"] = float(np.mean([row[f"ood_{task}"] for task in spec["ood"]]))
    for key, values in analysis.items():
        row[key] = float(np.mean(values))
    paper = PAPER_TABLE1.get(label) if spec.get("family", PAPER_FAMILY) == PAPER_FAMILY else None
    row["paper_in_domain"] = paper if paper is not None else math.nan
    return row


def build_table1(results: Path, spec: dict[str, Any], out_csv: Path) -> pd.DataFrame:
    """Write table1 (CSV, Markdown, and a provenance side file) from this run's outputs."""
    results = Path(results)
    rows = [_row(results, spec, "base", [0])]
    rows += [_row(results, spec, label, list(spec["seeds"])) for label in spec["methods"]]
    columns = TABLE1_COLUMNS_HEAD + [f"ood_{t}" for t in spec["ood"]] + TABLE1_COLUMNS_TAIL
    table = pd.DataFrame(rows)[columns]
    out_csv = Path(out_csv)
    table.to_csv(out_csv, index=False, float_format="%.4f")
    provenance = {
        "scale": spec.get("scale"),
        "model": spec["model"],
        "corpus": spec["corpus"],
        "seeds": spec["seeds"],
        "note": (
            "Scores in percent. in_domain: exact match on the held-out in-domain set, 95% CI by a "
            "bootstrap over seeds and items. paper_in_domain: Moonlight-16B-A3B numbers reported "
            "by arXiv:2609.08115 (family A only); all other columns measured by this run."
        ),
    }
    out_csv.with_suffix(".meta.json").write_text(json.dumps(provenance, indent=2) + "\n")
    header = (
        f"Table 1 ({spec.get('scale')} scale, model {spec['model']}, corpus {spec['corpus']}, "
        f"seeds {spec['seeds']}). {provenance['note']}\n\n"
    )
    out_csv.with_suffix(".md").write_text(
        header + table.to_markdown(index=False, floatfmt=".2f") + "\n"
    )
    plot_table1_coactivation(results, spec, out_csv.parent / "figures" / "table1_coactivation")
    return table


def plot_table1_coactivation(results: Path, spec: dict[str, Any], path_stem: Path) -> list[Path]:
    """Co-activation heatmaps of the base and each method (first seed) on the same probe set."""
    from safetensors.torch import load_file

    from rpb.figures import plot_coactivation_heatmaps

    model, corpus, seed = spec["model"], spec["corpus"], spec["seeds"][0]
    analysis = Path(results) / "analysis" / model / corpus
    named = {"base": load_file(analysis / "base" / "seed0.safetensors")["counts"].numpy()}
    for label in spec["methods"]:
        path = analysis / label / f"seed{seed}.safetensors"
        named[f"{label} (seed {seed})"] = load_file(path)["counts"].numpy()
    path_stem.parent.mkdir(parents=True, exist_ok=True)
    return plot_coactivation_heatmaps(named, path_stem, base="base")
