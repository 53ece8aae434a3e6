"""The CPU cost of table 1 from a results folder's Snakemake benchmark files: the seconds each of
table 1's post-training jobs took (`<results>/benchmarks/posttrain_run/*.tsv`, the jobs of the
committed plan snapshot `tests/data/plan_snapshot/default-table1.json`), their sum, and that sum
over the cores (`--cores`, default 2) as the wall time a fresh `make table1` would spend on them.

    python bench/table1_cost.py [--results results] [--cores 2]

The files record wall time per job, so jobs that ran beside others read longer than idle: the
result is an upper bound of the idle cost, not a timing of `make table1` itself.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = ROOT / "tests" / "data" / "plan_snapshot" / "default-table1.json"


def posttrain_seconds(results: Path) -> dict[str, float]:
    """Each of table 1's planned post-training jobs' benchmarked seconds, by its file's name; a
    job without a benchmark file is an error naming it."""
    jobs = [j for j in json.loads(SNAPSHOT.read_text())["jobs"] if j["rule"] == "posttrain_run"]
    seconds = {}
    for job in jobs:
        w = job["wildcards"]
        name = f"{w['model']}_{w['corpus']}_{w['method']}_base{w['base']}_seed{w['seed']}.tsv"
        path = results / "benchmarks" / "posttrain_run" / name
        if not path.is_file():
            raise SystemExit(f"{path}: no benchmark of table 1's job (run make table1 first)")
        seconds[name] = float(path.read_text().splitlines()[-1].split()[0])
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=ROOT / "results")
    parser.add_argument("--cores", type=int, default=2)
    args = parser.parse_args()
    seconds = posttrain_seconds(args.results)
    total = sum(seconds.values())
    wall = total / args.cores / 60
    print(
        f"{len(seconds)} post-training jobs of table 1: {total:.0f} s of one core, "
        f"{total / len(seconds):.0f} s each; over {args.cores} cores {wall:.1f} min"
    )


if __name__ == "__main__":
    main()
