"""How far plain fine-tuning moves the router, per learning rate (docs/regime.md, "After the
confirmation: cost, and whether routing moves at all").

`none` only, on the seed-0 base of each family, three seeds, at the settings that section fixed
(M0's, and 1/30, 1/10 and 1/3 of the pretraining peak at 800 steps on rule 3's `below50` task).
Each trained run is analysed as the pipeline analyses a run (`rpb.pipeline.analysis.analyze_model`:
the probe set, top-k overlap with the base router and community NMI against the base's partition);
the training-batch top-k overlap every 100 steps is kept for the curves. The verdict per family
and setting is the section's: the routing *moves* when both seed means reach the M0 row's; the
bases screens' criterion (top-k overlap at most SCREEN_OVERLAP at 1/10 or 1/30) is reported
beside it. Batch, length and probe set are the default config's.

    .venv/bin/python bench/router_drift_map.py   # -> bench/results/router_drift_map.{json,md}
    .venv/bin/python bench/router_drift_map.py --summary   # verdicts and .md from the runs

Needs the bases and priors of the regime's config and the default corpus beside them:
`snakemake --cores 2 --configfile config/config.yaml config/regime_rule3.yaml --
results/priors/tinyA/base0/math.safetensors results/priors/tinyB/base0/math.safetensors`, then
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
STATS = ("topk_overlap_with_base", "community_nmi")
# The bases screens' criterion (docs/regime.md, "The bases screen"): the default tinyA's top-k
# overlap at M0 in this bench's first map, where the readings rule found an anchoring reading.
SCREEN_OVERLAP = 0.795


def pipeline_settings() -> dict:
    """The default config's post-training batch and length and its analysis probe set, so the
    bench trains and analyses as the pipeline does."""
    import yaml

    config = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    return {
        "batch_size": config["posttrain"]["batch_size"],
        "max_length": config["posttrain"]["max_length"],
        "probe_tasks": list(config["analysis"]["probe_tasks"]),
        "probe_limit": config["analysis"]["probe_limit"],
    }


def run_one(job: dict) -> dict:
    """Post-train `none` at one setting and analyse the result as the pipeline does."""
    import torch

    from rpb.method_config import MethodConfig
    from rpb.pipeline.analysis import analyze_model
    from rpb.pipeline.training import TrainSpec, posttrain

    torch.set_num_threads(1)
    results = Path(job["results"])
    base = results / "models" / job["model"] / "base0" / "model"
    prior = results / "priors" / job["model"] / "base0" / "math.safetensors"
    corpus = (
        Path(job["task_corpus"])
        if job["corpus"] != "default" and job.get("task_corpus")
        else results / ("data_m0" if job["corpus"] == "default" else "data") / "post" / "math.jsonl"
    )
    spec = TrainSpec(
        steps=job["steps"],
        batch_size=job["settings"]["batch_size"],
        lr=job["lr"],
        max_length=job["settings"]["max_length"],
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
            method=MethodConfig("none"),
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
            tasks=job["settings"]["probe_tasks"],
            limit=job["settings"]["probe_limit"],
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


def verdicts(runs: list[dict]) -> dict:
    """From the runs alone: seed means and sds per (model, row); whether each row's routing
    moves as far as the same base's M0 row (the first map's verdict); and whether the base
    passes the screens' criterion (top-k overlap at most SCREEN_OVERLAP at an lr R0 admits)."""
    models = list(dict.fromkeys(r["model"] for r in runs))
    rows = [row for row, *_ in ROWS if any(r["row"] == row for r in runs)]
    table: dict[str, dict[str, dict]] = {}
    for model in models:
        table[model] = {}
        for row in rows:
            mine = [r for r in runs if r["model"] == model and r["row"] == row]
            cell: dict = {"n": len(mine)}
            for stat in STATS:
                cell[stat] = statistics.mean(r[stat] for r in mine)
                cell[f"{stat}_sd"] = statistics.stdev(r[stat] for r in mine)
            table[model][row] = cell
        ref = table[model].get(REFERENCE)
        for cell in table[model].values():
            cell["moves"] = ref is not None and all(cell[s] <= ref[s] for s in STATS)
    deciding = [row for row in DECIDING if row in rows]
    return {
        "table": table,
        "routing_moves_within_R0": {
            m: [row for row in deciding if table[m][row]["moves"]] for m in models
        },
        "passes_screen": {
            m: [
                row for row in deciding if table[m][row]["topk_overlap_with_base"] <= SCREEN_OVERLAP
            ]
            for m in models
        },
    }


def markdown(report: dict) -> str:
    lines = [
        "`none`'s routing after post-training, seed means over seeds "
        f"{', '.join(map(str, report['seeds']))} (probe set; `bench/router_drift_map.py`). "
        "sd: between seeds. moves: both statistics at or below the same base's M0 row's (the "
        f"first map's verdict); screen: top-k overlap at most {SCREEN_OVERLAP} (the bases "
        "screens' criterion, at an lr R0 admits).",
        "",
        "| model | row | lr | S | corpus | top-k overlap with base (sd) | community NMI (sd) "
        "| moves | screen |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    found = verdicts(report["runs"])
    models = list(found["table"])
    for model in models:
        for row, cell in found["table"][model].items():
            run = next(r for r in report["runs"] if r["model"] == model and r["row"] == row)
            lr, steps, corpus = run["lr"], run["steps"], run["corpus"]
            moves = "reference" if row == REFERENCE else ("yes" if cell["moves"] else "no")
            screen = (
                ("pass" if row in found["passes_screen"][model] else "no")
                if row in DECIDING
                else ""
            )
            overlap, nmi = STATS
            lines.append(
                f"| {model} | {row} | {lr:g} | {steps} | {corpus} | "
                f"{cell[overlap]:.3f} ({cell[overlap + '_sd']:.3f}) | "
                f"{cell[nmi]:.3f} ({cell[nmi + '_sd']:.3f}) | {moves} | {screen} |"
            )
    moves, passes = found["routing_moves_within_R0"], found["passes_screen"]
    lines += [
        "",
        "Routing moves as far as M0 at an lr R0 admits: "
        + "; ".join(f"{m}: {', '.join(moves[m]) or 'none'}" for m in models),
        "",
        "Passes the screens' criterion: "
        + "; ".join(f"{m}: {', '.join(passes[m]) or 'no'}" for m in models),
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
    if args.summary:  # the verdicts are derived from the runs again
        report = json.loads(args.out.read_text())
        report["verdicts"] = verdicts(report["runs"])
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    else:
        models, rows = args.models.split(","), args.rows.split(",")
        unknown = sorted(set(rows) - {r[0] for r in ROWS})
        if unknown:
            parser.error(f"--rows: unknown row(s) {unknown}; known: {[r[0] for r in ROWS]}")
        settings = pipeline_settings()
        jobs = [
            {
                "results": str(args.results),
                "settings": settings,
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
        report = {"seeds": list(SEEDS), "runs": runs, "verdicts": verdicts(runs)}
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
