"""How settled a base's router is, and whether that predicts how far plain fine-tuning moves it
(docs/regime.md, "What the screens say about why").

Per base, on the analysis probe set: for every non-pad token and MoE layer, the gap between the
k-th and (k+1)-th selection score (what the router ranks experts by: logits for softmax routers,
sigmoid score plus correction bias for deepseek_v3), in units of that token's score spread over
the experts (sd), so that families and expert counts compare. Reported: the median gap and the
share of near-ties (gap under 0.1 sd), means over layers; beside them each base's `none` drift at
1/10 of the pretraining lr (1 - top-k overlap, from the drift maps' JSON) and, per family, the
Spearman correlation between the two over the bases.

    .venv/bin/python bench/router_margins.py   # -> bench/results/router_margins.{json,md} (~1 min)

Needs the bases of `bench/results/router_drift_map.json` and the screens' JSONs under results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from router_drift_map import pipeline_settings  # bench/, beside this script
from scipy.stats import spearmanr

from rpb.pipeline.analysis import load_for_inference, probe_texts, text_batches
from rpb.routing import RouterControl, handle_selection_scores

ROOT = Path(__file__).resolve().parents[1]
MAPS = ("router_drift_map.json", "bases_screen.json", "bases_screen2.json")
NEAR_TIE = 0.1  # sd units


def margins(model_dir: Path, eval_dir: Path, tasks: list[str], limit: int) -> dict[str, float]:
    tokenizer, model = load_for_inference(model_dir)
    batches = text_batches(tokenizer, probe_texts(eval_dir, tasks, limit), batch_size=64)
    control = RouterControl(model)
    gaps: list[list[torch.Tensor]] = [[] for _ in range(control.num_layers)]
    with control, torch.no_grad():
        for batch in batches:
            control.clear_records()
            model(**batch)
            mask = batch["attention_mask"].reshape(-1).bool()
            for i, rec in enumerate(control.records):
                handle = control.handles[i]
                scores = handle_selection_scores(handle, rec.logits, handle.correction_bias)[mask]
                ranked = scores.sort(dim=-1, descending=True).values
                k = handle.top_k
                gaps[i].append((ranked[:, k - 1] - ranked[:, k]) / scores.std(dim=-1))
    per_layer = [torch.cat(g) for g in gaps]
    return {
        "median_gap_sd": statistics.mean(float(g.median()) for g in per_layer),
        "near_tie_share": statistics.mean(float((g < NEAR_TIE).float().mean()) for g in per_layer),
    }


def drift_at_tenth() -> dict[str, float]:
    """Each base's mean `none` drift (1 - top-k overlap) at 1/10, from the drift maps' JSON."""
    drift: dict[str, float] = {}
    for name in MAPS:
        path = ROOT / "bench" / "results" / name
        if not path.exists():
            continue
        table = json.loads(path.read_text())["verdicts"]["table"]
        for model, rows in table.items():
            if "1/10" in rows:
                drift[model] = 1 - rows["1/10"]["topk_overlap_with_base"]
    return drift


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=ROOT / "results")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/router_margins.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    drift = drift_at_tenth()
    probe = pipeline_settings()
    eval_dir = args.results / "data" / "eval"
    bases = {
        m: margins(
            args.results / "models" / m / "base0" / "model",
            eval_dir,
            probe["probe_tasks"],
            probe["probe_limit"],
        )
        | {"drift_at_tenth": d}
        for m, d in sorted(drift.items())
    }
    families = {"A": [m for m in bases if m.startswith("tinyA")]}
    families["B"] = [m for m in bases if m.startswith("tinyB")]
    correlation = {}
    for family, names in families.items():
        for stat in ("median_gap_sd", "near_tie_share"):
            rho = spearmanr(
                [bases[m][stat] for m in names], [bases[m]["drift_at_tenth"] for m in names]
            )
            correlation[f"{family}/{stat}"] = {"rho": float(rho.statistic), "n": len(names)}
    report = {"bases": bases, "spearman_with_drift": correlation}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "| base | median k-th vs (k+1)-th gap (sd) | near-ties (< 0.1 sd) | drift at 1/10 |",
        "|---|---|---|---|",
        *(
            f"| {m} | {b['median_gap_sd']:.3f} | {b['near_tie_share']:.3f}"
            f" | {b['drift_at_tenth']:.3f} |"
            for m, b in bases.items()
        ),
        "",
        "Spearman with drift over each family's bases: "
        + "; ".join(f"{k} {v['rho']:+.2f} (n {v['n']})" for k, v in correlation.items()),
    ]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return report


if __name__ == "__main__":
    main()
