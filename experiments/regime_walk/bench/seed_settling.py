"""Whether `none`'s seeds have settled item by item: for each calibration candidate whose 2S runs
exist, each seed's final dev accuracy at S and at 2S steps and the dev items it gains and loses
between them, and what happens to the items that vary between seeds at S (docs/regime.md, "After
rule 4"). Reads only cached calibration runs of `none` (it trains nothing):

    .venv/bin/python bench/seed_settling.py   # = --runs results/calibration/runs
                                              #   --out bench/results/seed_settling

Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def _outcomes(step_dir: Path) -> dict[int, np.ndarray]:
    runs = {}
    for path in sorted(step_dir.glob("seed*.json")):
        record = json.loads(path.read_text())
        if record.get("final_correct"):
            runs[int(path.stem.removeprefix("seed"))] = np.array(record["final_correct"], bool)
    return runs


def settling(at_s: dict[int, np.ndarray], at_2s: dict[int, np.ndarray]) -> dict:
    """Per-seed and per-item movement from S to 2S over the seeds present at both."""
    seeds = sorted(set(at_s) & set(at_2s))
    a = np.stack([at_s[s] for s in seeds])
    b = np.stack([at_2s[s] for s in seeds])
    n = len(seeds)
    varying_s = (a.sum(0) > 0) & (a.sum(0) < n)
    varying_2s = (b.sum(0) > 0) & (b.sum(0) < n)
    return {
        "seeds": seeds,
        "final_s": a.mean(1).round(4).tolist(),
        "final_2s": b.mean(1).round(4).tolist(),
        "gained": ((~a) & b).sum(1).tolist(),
        "lost": (a & ~b).sum(1).tolist(),
        "varying_s": int(varying_s.sum()),
        "varying_2s": int(varying_2s.sum()),
        "varying_both": int((varying_s & varying_2s).sum()),
        "varying_s_solved_by_all_2s": int((varying_s & (b.sum(0) == n)).sum()),
        "varying_s_solved_by_none_2s": int((varying_s & (b.sum(0) == 0)).sum()),
        "items": int(a.shape[1]),
    }


def collect(runs_root: Path) -> list[dict]:
    rows = []
    for lr_dir in sorted(runs_root.glob("*/*/lr*")):
        steps = {int(d.name[1:]): d for d in lr_dir.glob("S*") if d.name[1:].isdigit()}
        for s in sorted(steps):
            if 2 * s not in steps:
                continue
            at_s, at_2s = _outcomes(steps[s]), _outcomes(steps[2 * s])
            if len(set(at_s) & set(at_2s)) < 2:
                continue
            rows.append(
                {
                    "model": lr_dir.parent.parent.name,
                    "task": lr_dir.parent.name,
                    "lr": lr_dir.name,
                    "S": s,
                    **settling(at_s, at_2s),
                }
            )
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "# Seed settling: `none` at S against 2S, item by item",
        "",
        "Per seed: final dev accuracy at S -> 2S, and items gained / lost. Items varying between "
        "seeds (some but not all solve them) at S and at 2S; of those varying at S, how many "
        "every seed solves at 2S.",
        "",
        "| model | task | lr | S | per seed: S -> 2S (gained/lost) | max moved (points) "
        "| varying at S | at 2S | in both | varying at S, solved by all at 2S |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per_seed = "; ".join(
            f"{x:.3f} -> {y:.3f} (+{g}/-{lo})"
            for x, y, g, lo in zip(r["final_s"], r["final_2s"], r["gained"], r["lost"], strict=True)
        )
        moved = max(abs(y - x) for x, y in zip(r["final_s"], r["final_2s"], strict=True))
        lines.append(
            f"| {r['model']} | {r['task']} | {r['lr']} | {r['S']} | {per_seed} | {100 * moved:.1f} "
            f"| {r['varying_s']} | {r['varying_2s']} | {r['varying_both']} "
            f"| {r['varying_s_solved_by_all_2s']} |"
        )
    lines.append("")
    lines.append(f"Items per run: {rows[0]['items'] if rows else '-'}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=Path("results/calibration/runs"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/seed_settling"))
    args = parser.parse_args()
    rows = collect(args.runs)
    if not rows:
        raise SystemExit(f"{args.runs}: no calibration candidate with runs at both S and 2S")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
