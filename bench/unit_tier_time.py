"""Wall time of the unit tier (`make test-fast`'s pytest command) at two commits, interleaved.

This machine's speed drifts by a fifth within minutes, so the commits alternate in one session
(A B A B ...) and the ratio of their medians is the result, never a single time. Each commit runs
from its own git worktree on this checkout's venv (`PYTHONPATH` makes its `rpb` the one
imported). Writes bench/results/unit_tier_time.json.

    python bench/unit_tier_time.py 86a0121 HEAD --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNIT_TIER = ["-m", "not slow and not workflow", "-n", "auto", "--dist", "loadfile", "-q"]


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def run_tier(tree: Path) -> dict[str, float | int]:
    env = os.environ | {
        "PYTHONPATH": str(tree),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    command = [sys.executable, "-m", "pytest", *UNIT_TIER, "-p", "no:cacheprovider"]
    start = time.monotonic()
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    wall = time.monotonic() - start
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    passed = re.search(r"(\d+) passed", summary)
    if done.returncode != 0 or passed is None:
        sys.exit(f"unit tier failed in {tree}: {summary or done.stderr[-500:]}")
    return {"wall_s": round(wall, 1), "passed": int(passed.group(1))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", help="a commit")
    parser.add_argument("after", help="a commit")
    parser.add_argument("--reps", type=int, default=3, help="runs of each commit (default 3)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/unit_tier_time.json")
    args = parser.parse_args(argv)

    commits = {}
    for name in ("before", "after"):
        rev = getattr(args, name)
        sha = subprocess.run(
            ["git", "rev-parse", "--short", rev],
            cwd=ROOT,
            text=True,
            capture_output=True,
            check=True,
        ).stdout.strip()
        commits[name] = sha
    runs: dict[str, list[dict[str, float | int]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="unit_tier_") as tmp:
        trees = {}
        for name, sha in commits.items():
            trees[name] = Path(tmp) / name
            subprocess.run(
                ["git", "worktree", "add", "-q", "--detach", str(trees[name]), sha],
                cwd=ROOT,
                check=True,
            )
        try:
            for rep in range(args.reps):
                for name in ("before", "after"):
                    runs[name].append(run_tier(trees[name]))
                    print(f"rep {rep + 1}/{args.reps} {name} {commits[name]}: {runs[name][-1]}")
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)
    medians = {name: statistics.median(r["wall_s"] for r in rs) for name, rs in runs.items()}
    result = {
        "commits": commits,
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
        "runs": runs,
        "median_wall_s": medians,
        "ratio_after_to_before": round(medians["after"] / medians["before"], 3),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("median_wall_s", "ratio_after_to_before")}))


if __name__ == "__main__":
    main()
