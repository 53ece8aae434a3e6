"""The CPU cost of a target from a results folder's Snakemake benchmark files: the seconds each of
the target's planned jobs took (`<results>/benchmarks/<rule>/<wildcards>.tsv`, the jobs of a
committed plan snapshot `tests/data/plan_snapshot/<case>.json`), per rule and in all, and that sum
over the cores (`--cores`, default 2) as the wall time a fresh run would spend on them.

    python bench/plan_cost.py [--case default-table1] [--results results] [--cores 2]
    python bench/plan_cost.py --case default-all --results /tmp/fresh/results   # an estimate

A job of the plan without a benchmark file in the folder (`all` when only table 1 ran there) is
estimated by the median of its rule's measured jobs, pooled with the rules that do the same work
(`POOLS`: the post-training rules run the same 1,600-step training, the evaluation rules evaluate
one model on the same tasks, the analysis rules analyse one). A rule with no measured job in its
pool is counted as 0 s and named. Snakemake's files record wall time per job, so jobs that
ran beside other work read longer than idle: from a folder that ran alone on an idle machine the
sum is that run's cost; otherwise it is an upper bound. Jobs without a benchmark (tables, figures:
seconds each) are not counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOTS = ROOT / "tests" / "data" / "plan_snapshot"
# Rules whose jobs do the same work: a job not measured is estimated at its pool's median.
POOLS = (
    ("posttrain_run", "diagnostic_posttrain"),
    ("evaluate", "diagnostic_evaluate", "router_swap_evaluate"),
    ("analyze", "diagnostic_analyze"),
)
# The benchmark folder of each rule that writes one, and how its file is named from wildcards
# (workflow/rules/*.smk, `benchmark:`).
BENCHMARK_DIRS = {
    "posttrain_run": "posttrain_run",
    "diagnostic_posttrain": "diagnostic_posttrain",
    "evaluate": "eval",
    "diagnostic_evaluate": "diagnostic_eval",
    "analyze": "analysis",
    "diagnostic_analyze": "diagnostic_analysis",
    "extract_prior": "prior",
    "pretrain_base": "pretrain",
    "router_swap": "router_swap",
    "router_swap_evaluate": "router_swap_eval",
}


def benchmark_name(rule: str, wildcards: dict[str, str]) -> str:
    """The file name a job of `rule` benchmarks into (without its folder)."""
    w = wildcards
    if rule == "extract_prior":
        return f"{w['model']}_base{w['base']}_{w['corpus']}.tsv"
    if rule == "pretrain_base":
        return f"{w['model']}_base{w['base']}.tsv"
    if rule == "router_swap":
        return f"{w['model']}_{w['corpus']}_{w['label']}_base{w['base']}_seed{w['seed']}.tsv"
    return f"{w['model']}_{w['corpus']}_{w['method']}_base{w['base']}_seed{w['seed']}.tsv"


def read_seconds(path: Path) -> float:
    """The wall seconds of one Snakemake benchmark file (its last line's first column)."""
    return float(path.read_text().splitlines()[-1].split()[0])


def plan_cost(case: str, results: Path) -> dict[str, dict[str, float]]:
    """Per rule of `case`'s plan: jobs planned, jobs measured in `results`, their seconds, and the
    estimated seconds of the jobs not measured."""
    jobs = json.loads((SNAPSHOTS / f"{case}.json").read_text())["jobs"]
    measured: dict[str, list[float]] = defaultdict(list)
    missing: dict[str, int] = defaultdict(int)
    planned: dict[str, int] = defaultdict(int)
    for job in jobs:
        rule = job["rule"]
        if rule not in BENCHMARK_DIRS:
            continue
        planned[rule] += 1
        name = benchmark_name(rule, job["wildcards"])
        path = results / "benchmarks" / BENCHMARK_DIRS[rule] / name
        if path.is_file():
            measured[rule].append(read_seconds(path))
        else:
            missing[rule] += 1
    pool_of = {rule: pool for pool in POOLS for rule in pool}
    cost = {}
    for rule, n in planned.items():
        pool = [s for r in pool_of.get(rule, (rule,)) for s in measured[r]]
        median = statistics.median(pool) if pool else 0.0
        cost[rule] = {
            "planned": n,
            "measured": len(measured[rule]),
            "measured_s": sum(measured[rule]),
            "estimated_s": missing[rule] * median,
            "median_s": median,
        }
    return cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", default="default-table1", help="a plan snapshot's name")
    parser.add_argument("--results", type=Path, default=ROOT / "results")
    parser.add_argument("--cores", type=int, default=2)
    args = parser.parse_args()
    cost = plan_cost(args.case, args.results)
    total = 0.0
    for rule, c in sorted(cost.items()):
        seconds = c["measured_s"] + c["estimated_s"]
        total += seconds
        unmeasured = "" if c["median_s"] or not c["planned"] else " (no job measured: 0 s)"
        print(
            f"{rule:22s} {c['planned']:4d} jobs, {c['measured']:4d} measured "
            f"({c['measured_s']:7.0f} s), {c['planned'] - c['measured']:4d} estimated at "
            f"{c['median_s']:5.0f} s ({c['estimated_s']:7.0f} s){unmeasured}"
        )
    estimated = any(c["estimated_s"] for c in cost.values())
    print(
        f"{args.case}: {total:.0f} s of one core; over {args.cores} cores "
        f"{total / args.cores / 60:.1f} min{' (part estimated)' if estimated else ''}"
    )


if __name__ == "__main__":
    main()
