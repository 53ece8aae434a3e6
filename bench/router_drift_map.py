"""How far plain fine-tuning moves the router, per learning rate (docs/regime.md, "After the
confirmation: cost, and whether routing moves at all").

`none` only, on the seed-0 base of each family, three seeds, at the settings that section fixed
(M0's, and 1/30, 1/10 and 1/3 of the pretraining peak at 800 steps on rule 3's `below50` task).
Each trained run is analysed as the pipeline analyses a run (`rpb.analysis.analyze_model`: the
probe set, top-k overlap with the base router and community NMI against the base's partition);
the training-batch top-k overlap every 100 steps is kept for the curves. The verdict per family
and setting is the section's: the routing *moves* when both seed means reach the M0 row's.

    .venv/bin/python bench/router_drift_map.py   # -> bench/results/router_drift_map.{json,md}
    .venv/bin/python bench/router_drift_map.py --summary   # the .md from the .json alone

Needs the bases and priors of the regime's config and the default corpus beside them:
`snakemake --cores 2 --configfile config/config.yaml config/regime_rule3.yaml --
results/priors/tinyA/math.safetensors results/priors/tinyB/math.safetensors`, then
`snakemake --cores 2 --config results_dir=results_m0 -- results_m0/data/manifest.json` and
`results_m0/data/post/math.jsonl` copied to `results/data_m0/post/math.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("tinyA", "tinyB")
SEEDS = (300, 301, 302)
PROBE_TASKS = ("math", "addition", "facts", "reverse", "sort", "grammar")  # analysis.probe_tasks
PROBE_LIMIT = 200
# (row, lr, steps, warm-up ratio, corpus: "default" or "below50"); the section's table.
ROWS = (
    ("M0", 1e-3, 200, 0.0, "default"),
    ("M0 on below50", 1e-3, 200, 0.0, "below50"),
    ("1/30", 1e-4, 800, 0.02, "below50"),
    ("1/10", 3e-4, 800, 0.02, "below50"),
    ("1/3 (context)", 1e-3, 800, 0.02, "below50"),
)
REFERENCE = "M0"
DECIDING = ("1/30", "1/10")  # the lrs R0 admits


def run_one(job: dict) -> dict:
    """Post-train `none` at one setting and analyse the result as the pipeline does."""
    import torch

    from rpb.analysis import analyze_model
    from rpb.training import MethodSpec, TrainSpec, posttrain

    torch.set_num_threads(1)
    results = Path(job["results"])
    base = results / "models" / job["model"] / "base" / "model"
    prior = results / "priors" / job["model"] / "math.safetensors"
    corpus = (
        Path(job["task_corpus"])
        if job["corpus"] != "default" and job.get("task_corpus")
        else results / ("data_m0" if job["corpus"] == "default" else "data") / "post" / "math.jsonl"
    )
    spec = TrainSpec(
        steps=job["steps"],
        batch_size=64,
        lr=job["lr"],
        max_length=48,
        seed=job["seed"],
        warmup_ratio=job["warmup"],
        log_every=100,
    )
    with tempfile.TemporaryDirectory(prefix="rpb-drift-") as tmp:
        out = Path(tmp)
        start = time.perf_counter()
        posttrain(
            base_dir=base,
            prior_path=prior,
            corpus=corpus,
            method_spec=MethodSpec("none"),
            spec=spec,
            out_dir=out,
        )
        posttrain_s = time.perf_counter() - start
        history = json.loads((out / "train_history.json").read_text())["history"]
        summary = analyze_model(
            model_dir=out / "model",
            base_dir=base,
            prior_path=prior,
            eval_dir=results / "data" / "eval",
            tasks=PROBE_TASKS,
            limit=PROBE_LIMIT,
            out_json=out / "analysis.json",
        )
    mean = summary["mean"]
    return job | {
        "topk_overlap_with_base": mean["topk_overlap_with_base"],
        "community_nmi": mean["community_nmi"],
        "posttrain_s": posttrain_s,
        "train_curve": [
            (h["step"], h["mean/topk_overlap_with_base"])
            for h in history
            if "mean/topk_overlap_with_base" in h
        ],
    }


def verdicts(runs: list[dict], models: list[str], rows: list[str]) -> dict:
    """Seed means per (model, row), and whether each R0 row's routing moves as far as M0's."""
    table: dict[str, dict[str, dict]] = {}
    for model in models:
        table[model] = {}
        for row in rows:
            mine = [r for r in runs if r["model"] == model and r["row"] == row]
            table[model][row] = {
                stat: statistics.mean(r[stat] for r in mine)
                for stat in ("topk_overlap_with_base", "community_nmi")
            } | {"n": len(mine)}
        ref = table[model][REFERENCE]
        for row in rows:
            cell = table[model][row]
            cell["moves"] = all(
                cell[s] <= ref[s] for s in ("topk_overlap_with_base", "community_nmi")
            )
    return {
        "table": table,
        "routing_moves_within_R0": {
            model: [row for row in DECIDING if row in rows and table[model][row]["moves"]]
            for model in models
        },
    }


def markdown(report: dict) -> str:
    lines = [
        "`none`'s routing after post-training, seed means over seeds "
        f"{', '.join(map(str, report['seeds']))} (probe set; `bench/router_drift_map.py`). "
        "moves: both statistics at or below the M0 row's of the same family.",
        "",
        "| model | row | lr | S | corpus | top-k overlap with base | community NMI | moves |",
        "|---|---|---|---|---|---|---|---|",
    ]
    models = list(report["verdicts"]["table"])
    for model in models:
        for row, *_ in ROWS:
            if row not in report["verdicts"]["table"][model]:
                continue
            cell = report["verdicts"]["table"][model][row]
            run = next(r for r in report["runs"] if r["model"] == model and r["row"] == row)
            lr, steps, corpus = run["lr"], run["steps"], run["corpus"]
            moves = "reference" if row == REFERENCE else ("yes" if cell["moves"] else "no")
            lines.append(
                f"| {model} | {row} | {lr:g} | {steps} | {corpus} | "
                f"{cell['topk_overlap_with_base']:.3f} | {cell['community_nmi']:.3f} | {moves} |"
            )
    found = report["verdicts"]["routing_moves_within_R0"]
    lines += [
        "",
        "Routing moves at an lr R0 admits: "
        + "; ".join(f"{m}: {', '.join(found[m]) or 'none'}" for m in models),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=ROOT / "results")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/router_drift_map.json")
    parser.add_argument("--summary", action="store_true", help="rewrite the .md from the .json")
    parser.add_argument("--models", default=",".join(MODELS), help="bases under --results")
    parser.add_argument("--rows", default=",".join(r[0] for r in ROWS), help="rows of ROWS")
    parser.add_argument(
        "--task",
        default="below50",
        help="the hold-out task of the non-M0 rows (its name in the report); with --task-corpus",
    )
    parser.add_argument(
        "--task-corpus",
        type=Path,
        default=None,
        help="that task's post-training corpus (default results/data/post/math.jsonl), e.g. "
        "results/calibration/data/L1-corner50/post/math.jsonl for R5 at a regime rule's choice",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="S of the non-M0 rows (default: ROWS' 800)"
    )
    args = parser.parse_args(argv)
    if args.summary:
        report = json.loads(args.out.read_text())
    else:
        models, rows = args.models.split(","), args.rows.split(",")
        unknown = sorted(set(rows) - {r[0] for r in ROWS})
        if unknown:
            parser.error(f"--rows: unknown row(s) {unknown}; known: {[r[0] for r in ROWS]}")
        jobs = [
            {
                "results": str(args.results),
                "model": model,
                "row": row,
                "lr": lr,
                "steps": steps if corpus == "default" or args.steps is None else args.steps,
                "warmup": warmup,
                "corpus": corpus if corpus == "default" else args.task,
                "task_corpus": str(args.task_corpus) if args.task_corpus else None,
                "seed": seed,
            }
            for row, lr, steps, warmup, corpus in ROWS
            if row in rows
            for seed in SEEDS
            for model in models
        ]
        with ProcessPoolExecutor(2, mp_context=get_context("spawn")) as pool:
            runs = list(pool.map(run_one, jobs))
        report = {"seeds": list(SEEDS), "runs": runs, "verdicts": verdicts(runs, models, rows)}
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
