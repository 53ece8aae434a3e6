"""What R3's budget admits on this machine: table 1's and `all`'s wall time as a function of the
post-training steps S and the runs per method n (docs/regime.md, "What the budget admits").

Measured in one invocation, the way the regime rule's R3 estimates (`rpb.regime.table1_seconds`,
`rpb.regime.all_seconds`):

- the training seconds of a `none` run on each base of `calibration.models` at S1 and S2 steps
  (the default corpus at 1/30 of the pretraining lr), the bases side by side as `all` runs them;
  a line a + b * S per base, and a run costs the slower base's line plus R3's 4.5 s overhead;
- the bases' pretraining seconds from the tracking store (as `rpb regime` reads them);
- the post-training runs `all`, `all` with its exploratory sections (sweep, RPB readings, drift
  curves, diagnostics) at 1 seed per base, and tables 1-5 alone (the confirmatory tables)
  schedule at k seeds per base: counted by Snakemake dry runs of the workflow with `seeds` set to
  k seeds (the sweep keeps its own seeds but in the second count) and an empty results folder.

For every S of the rule and every n = b * k (b bases per family) it reports both estimates and
the largest between-seed sd of `none` (points) for which R4 asks for no more than n runs. Needs
the pretrained bases: `snakemake --cores 2 results/models/tinyA/base0/model
results/models/tinyB/base0/model`.

    .venv/bin/python bench/regime_budget.py          # -> bench/results/regime_budget.{json,md}
                                                     #    and docs/img/regime_budget.png (~3 min)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the archived regime.py
from regime import RegimeRule, calibration_run, seeds_for_margin, table1_seconds

ROOT = Path(__file__).resolve().parents[1]
CONFIRMATORY = ("table1", "table2", "table3", "table4", "table5")
TRAINED = ("posttrain_run", "diagnostic_posttrain")


def _train(kwargs: dict) -> float:
    return calibration_run(**kwargs)["train_s"]


def step_costs(config: dict, results: Path, steps: tuple[int, int], rule: RegimeRule) -> dict:
    """Per base: training seconds at each of `steps`, and the line through them."""
    models = config["calibration"]["models"]
    measured: dict[str, dict[int, float]] = {m: {} for m in models}
    with tempfile.TemporaryDirectory(prefix="rpb-budget-") as tmp:
        for s in steps:  # the bases side by side, one thread each, as `all` runs them
            jobs = [
                dict(
                    base_dir=results / "models" / m / "base0" / "model",
                    data_dir=results / "data",
                    corpus=config["table1"]["corpus"],
                    lr=config["models"][m]["pretrain"]["lr"] / 30,
                    steps=s,
                    seed=rule.seeds[0],
                    posttrain=config["posttrain"],
                    rule=dataclasses.replace(rule, readings=1),
                    out=Path(tmp) / f"{m}-{s}.json",
                    inputs="budget",
                )
                for m in models
            ]
            with ProcessPoolExecutor(len(jobs), mp_context=get_context("spawn")) as pool:
                for m, seconds in zip(models, pool.map(_train, jobs), strict=True):
                    measured[m][s] = seconds
                    print(f"{m}: {s} steps trained in {seconds:.1f} s", flush=True)
    lines = {}
    for m, by_steps in measured.items():
        (s1, t1), (s2, t2) = sorted(by_steps.items())
        slope = (t2 - t1) / (s2 - s1)
        lines[m] = {"measured_s": by_steps, "per_step_s": slope, "fixed_s": t1 - slope * s1}
    return lines


def pretrain_seconds(config: dict, results: Path) -> float:
    """The slowest of table 1's bases' pretraining, as `rpb regime` reads it."""
    from rpb.pipeline.testbed import stage_durations

    uri = (
        os.environ.get("MLFLOW_TRACKING_URI")
        or config["tracking"].get("uri")
        or f"sqlite:///{results.resolve() / 'mlflow.db'}"
    )
    durations = stage_durations(uri, config["tracking"]["experiment"])
    model = config["table1"]["model"]
    found = durations.get(f"pretrain/{model}")
    if not found:
        sys.exit(f"regime_budget: no finished pretrain/{model} run in {uri}; pretrain the bases")
    return max(found)


def scheduled_runs(
    config: dict, seeds_per_base: int, targets: list[str], exploratory_seeds: int | None = None
) -> dict[str, int]:
    """Jobs a dry run of `targets` schedules from nothing at `seeds_per_base` seeds; with
    `exploratory_seeds`, the exploratory sections (sweep, RPB readings, drift curves,
    diagnostics) run that many seeds per base instead."""
    with tempfile.TemporaryDirectory(prefix="rpb-budget-dag-") as tmp:
        cfg = dict(config, seeds=list(range(seeds_per_base)), results_dir=tmp)
        cfg["tables"] = dict(cfg["tables"], seeds=None)
        if exploratory_seeds is not None:
            fewer = list(range(exploratory_seeds))
            for name in ("readings", "drift"):
                cfg["tables"][name] = dict(cfg["tables"][name], seeds=fewer)
            cfg["sweep"] = dict(cfg["sweep"], seeds=fewer)
            cfg["diagnostics"] = {k: dict(v, seeds=fewer) for k, v in cfg["diagnostics"].items()}
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(cfg))
        paths = [f"{tmp}/{t}" if t != "all" else t for t in targets]
        command = [sys.executable, "-m", "snakemake", "-n", "--quiet", "rules"]
        out = subprocess.run(
            [*command, "--configfile", str(path), "--", *paths],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    counts = dict(re.findall(r"^(\w+)\s+(\d+)$", out, flags=re.M))
    return {k: int(v) for k, v in counts.items()}


def largest_sigma(n: int, rule: RegimeRule, step: float = 0.05) -> float:
    """The largest sd of `none` (points, on a `step` grid) for which R4 asks for at most n runs."""
    sigma = 0.0
    while seeds_for_margin(sigma + step, rule) <= n:
        sigma += step
    return round(sigma, 2)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path, default=ROOT / "config" / "config.yaml")
    p.add_argument("--steps", default="100,300", help="the two measured step counts")
    p.add_argument("--max-seeds", type=int, default=8, help="seeds per base, 1 to this")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/regime_budget.json")
    p.add_argument("--figure", type=Path, default=ROOT / "docs/img/regime_budget.png")
    args = p.parse_args(argv)
    config = yaml.safe_load(args.config.read_text())
    results = ROOT / config["results_dir"]
    rule = RegimeRule.from_dict(config["calibration"].get("rule") or {})
    cores = 2
    s1, s2 = (int(s) for s in args.steps.split(","))

    pretrain_s = pretrain_seconds(config, results)
    lines = step_costs(config, results, (s1, s2), rule)
    bases_per_family = 1 + len(config["models"][config["table1"]["model"]].get("replicates", []))
    workload = {}
    for k in range(1, args.max_seeds + 1):
        every = scheduled_runs(config, k, ["all"])
        tables = scheduled_runs(config, k, [f"{t}.csv" for t in CONFIRMATORY])
        fewer = scheduled_runs(config, k, ["all"], exploratory_seeds=1)
        workload[k] = {
            "all": sum(every.get(r, 0) for r in TRAINED),
            "all_exploratory_1": sum(fewer.get(r, 0) for r in TRAINED),
            "tables_1_5": sum(tables.get(r, 0) for r in TRAINED),
            "bases": every.get("pretrain_base", 0),
        }
        print(f"{k} seeds per base: {workload[k]}", flush=True)

    rows = []
    for steps in rule.steps:
        run_s = (
            max(line["fixed_s"] + line["per_step_s"] * steps for line in lines.values())
            + rule.run_overhead_s
        )
        for k, w in workload.items():
            n = bases_per_family * k
            rounds = math.ceil(w["bases"] / cores)
            rows.append(
                {
                    "steps": steps,
                    "seeds_per_base": k,
                    "runs_per_method": n,
                    "run_s": round(run_s, 1),
                    "table1_s": round(table1_seconds(run_s, n, 3, pretrain_s, cores)),
                    "all_s": round(rounds * pretrain_s + w["all"] * run_s / cores),
                    "tables_1_5_s": round(rounds * pretrain_s + w["tables_1_5"] * run_s / cores),
                    "all_exploratory_1_s": round(
                        rounds * pretrain_s + w["all_exploratory_1"] * run_s / cores
                    ),
                    "largest_sigma_points": largest_sigma(n, rule),
                }
            )
    for r in rows:
        r["fits"] = r["table1_s"] <= rule.table1_budget_s and r["all_s"] <= rule.all_budget_s
    report = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "load_average": os.getloadavg(),
        "pretrain_s": round(pretrain_s, 1),
        "bases_per_family": bases_per_family,
        "train_lines": lines,
        "workload": workload,
        "budget_s": {"table1": rule.table1_budget_s, "all": rule.all_budget_s},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    plot(report, args.figure)
    print(markdown(report))
    return report


def markdown(report: dict) -> str:
    lines = [
        f"Pretraining {report['pretrain_s']:.0f} s; training per step "
        + ", ".join(
            f"{m} {v['per_step_s'] * 1000:.0f} ms (+{v['fixed_s']:.1f} s)"
            for m, v in report["train_lines"].items()
        )
        + f"; load average at the end {report['load_average'][0]:.2f}.",
        "",
        "| S | seeds per base | n | run s | table 1 min | tables 1-5 min | `all` min"
        " | `all`, exploratory at 1 seed min | largest sd R4 admits (points)"
        " | within 15 / 90 min |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['steps']} | {r['seeds_per_base']} | {r['runs_per_method']} | {r['run_s']}"
            f" | {r['table1_s'] / 60:.1f} | {r['tables_1_5_s'] / 60:.1f} | {r['all_s'] / 60:.1f}"
            f" | {r['all_exploratory_1_s'] / 60:.1f}"
            f" | {r['largest_sigma_points']:.2f} | {'yes' if r['fits'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    axes = fig.subplots(1, 2, sharex=True)
    budgets = report["budget_s"]
    for ax, key, budget, title in (
        (axes[0], "table1_s", budgets["table1"], "table 1"),
        (axes[1], "all_s", budgets["all"], "`all`"),
    ):
        for steps in sorted({r["steps"] for r in report["rows"]}):
            rows = [r for r in report["rows"] if r["steps"] == steps]
            ax.plot(
                [r["runs_per_method"] for r in rows],
                [r[key] / 60 for r in rows],
                marker="o",
                label=f"S = {steps}",
            )
        ax.axhline(budget / 60, color="black", linestyle="--", linewidth=1, label="budget")
        ax.set_title(f"{title}: estimated wall time")
        ax.set_xlabel("runs per method n (largest sd R4 admits, points)")
        ax.set_ylabel("minutes")
        rows = [r for r in report["rows"] if r["steps"] == report["rows"][0]["steps"]]
        ax.set_xticks([r["runs_per_method"] for r in rows])
        ax.set_xticklabels(
            [f"{r['runs_per_method']}\n({r['largest_sigma_points']:.1f})" for r in rows]
        )
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
