"""The GPU budget of a paper-scale target, from the plan itself: `snakemake -n` of the target
through a profile (default: config/paper.yaml, profiles/slurm, against a fresh results folder),
and for every planned job its `gpu` and `runtime` resources as the dry run prints them
(`resources: ...`, the profile's `set-resources` / `default-resources` merged over the rule's
own). GPU-hours are gpu x runtime summed over the jobs.

The runtimes are the profile's Slurm time limits (`runtime`, minutes), not measured durations: the
sum is what the plan may bill at most, each job running to its limit. A rule without a `gpu`
resource counts 0 GPUs (a CPU job).

    python bench/gpu_hours.py                          # results/table1.csv and all
    python bench/gpu_hours.py --target all --json      # one target, as JSON
    python bench/gpu_hours.py --markdown               # the table in docs/paper_scale.md
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("table1.csv", "all")  # a file target is relative to the results folder
_RULE = re.compile(r"^(?:local)?rule (\w+):$")
_RESOURCE = re.compile(r"(\w+)=([^,]*)")


def dry_run(
    targets: str | list[str], configfile: str = "config/paper.yaml", profile: str = "profiles/slurm"
) -> str:
    """The stdout of `snakemake -n` of `targets` (rule names, or paths under a fresh results
    folder) through `profile`, from the repository root."""
    with tempfile.TemporaryDirectory(prefix="gpu_hours_") as tmp:
        results = os.path.join(tmp, "results")
        names = [targets] if isinstance(targets, str) else targets
        goals = [t if "." not in t else os.path.join(results, t) for t in names]
        cmd = [sys.executable, "-m", "snakemake", "-n", "--configfile", configfile]
        cmd += ["--profile", profile, "--config", f"results_dir={results}", "--", *goals]
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
        return proc.stdout


def planned_jobs(stdout: str) -> list[tuple[str, dict[str, str]]]:
    """Each job of a dry run's output: its rule and its resources (name -> value as printed)."""
    jobs: list[tuple[str, dict[str, str]]] = []
    for line in stdout.splitlines():
        match = _RULE.match(line.strip())
        if match:
            jobs.append((match.group(1), {}))
        elif line.strip().startswith("resources:") and jobs:
            jobs[-1][1].update(_RESOURCE.findall(line.split(":", 1)[1]))
    return jobs


def budget(jobs: list[tuple[str, dict[str, str]]]) -> dict:
    """Jobs and GPU-hours (gpu x runtime) per rule and in all."""
    counts: Counter[str] = Counter()
    hours: Counter[str] = Counter()
    gpus: dict[str, set[int]] = {}
    for rule, res in jobs:
        counts[rule] += 1
        gpu = int(res.get("gpu", 0))
        gpus.setdefault(rule, set()).add(gpu)
        if gpu:
            if "runtime" not in res:
                raise ValueError(f"rule {rule}: a GPU job without a runtime resource")
            hours[rule] += gpu * int(res["runtime"]) / 60
    return {
        "jobs": sum(counts.values()),
        "rules": dict(sorted(counts.items())),
        "gpu_jobs": {r: counts[r] for r in sorted(hours)},
        "gpus_per_job": {r: sorted(gpus[r]) for r in sorted(hours)},
        "gpu_hours": {r: round(hours[r], 1) for r in sorted(hours)},
        "total_gpu_hours": round(sum(hours.values()), 1),
    }


def target_budget(
    target: str, configfile: str = "config/paper.yaml", profile: str = "profiles/slurm"
) -> dict:
    return budget(planned_jobs(dry_run(target, configfile, profile)))


def markdown(budgets: dict[str, dict]) -> str:
    """The table docs/paper_scale.md shows (tests/test_paper_path.py checks it against the plan):
    per target, its jobs, and per GPU rule its jobs, GPUs per job and GPU-hours."""
    lines = [
        "| target | jobs | GPU rule | its jobs | GPUs per job | GPU-hours |",
        "|---|---|---|---|---|---|",
    ]
    for target, b in budgets.items():
        name = f"`{target}`"
        for rule, hours in b["gpu_hours"].items():
            gpus = "/".join(map(str, b["gpus_per_job"][rule]))
            row = f"`{rule}` | {b['gpu_jobs'][rule]} | {gpus} | {hours:,.0f}"
            lines.append(f"| {name} | {b['jobs']} | {row} |")
        lines.append(f"| {name} | {b['jobs']} | all | | | **{b['total_gpu_hours']:,.0f}** |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", help="default: table1.csv and all")
    parser.add_argument("--configfile", default="config/paper.yaml")
    parser.add_argument("--profile", default="profiles/slurm")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--markdown", action="store_true", help="docs/paper_scale.md's table")
    args = parser.parse_args(argv)
    out = {t: target_budget(t, args.configfile, args.profile) for t in args.target or TARGETS}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    if args.markdown:
        print(markdown(out))
        return 0
    for target, b in out.items():
        print(f"{target}: {b['jobs']} jobs, {b['total_gpu_hours']:,.0f} GPU-hours at the limits")
        for rule, h in b["gpu_hours"].items():
            n, g = b["gpu_jobs"][rule], b["gpus_per_job"][rule]
            print(f"  {rule:14s} {n:4d} jobs x {'/'.join(map(str, g))} GPUs: {h:10,.1f} GPU-h")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
