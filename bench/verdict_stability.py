"""Do the claims' verdicts survive a change of machine?

Compares two claims.csv files written by clean runs of `all` that differ in one thing (float
reduction order: threads_per_job 1 vs 2, as another CPU would differ; see bench/float_order.py),
part by part: the verdicts, the verdicts with the checks waived (what each part's rule says of
its numbers were every premise met; the only comparison left where a premise fails on both),
and the estimates' shifts in units of the larger MDE. Each file's per-base columns give the
other comparison of docs/claims.md, runs that differ only in the bases' pretraining seed.

    python bench/verdict_stability.py --a results/claims.csv --label-a "threads 1" \
        --b ../other/results/claims.csv --label-b "threads 2"
        # -> bench/results/verdict_stability.{json,md}
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from rpb.report.claims import compare_claims

RESULTS = Path(__file__).parent / "results"


def base_dependence(table: pd.DataFrame) -> dict[str, list[str]]:
    """The parts whose verdict (and whose checks-waived verdict) differs between the bases."""
    out = {}
    for column in ("verdict", "verdict_checks_waived"):
        cells = table.filter(regex=rf"^{column}_base\d+$")  # empty with one base
        out[column] = table.loc[cells.nunique(axis=1) > 1, "part"].tolist()
    return out


def _fmt(x: float) -> str:
    return "" if pd.isna(x) else f"{x:+.2f}"


def markdown(rows: pd.DataFrame, label_a: str, label_b: str, summary: dict) -> str:
    lines = [
        f"# Verdict stability: {label_a} vs {label_b}",
        "",
        f"Same verdict: {summary['same_verdict']} of {summary['parts']} parts; same verdict with "
        f"the checks waived: {summary['same_verdict_checks_waived']} of {summary['parts']}; "
        f"largest estimate shift {summary['max_shift_in_mde']:.2f} MDE.",
        "",
        f"| part | verdict ({label_a}) | verdict ({label_b}) | checks waived ({label_a}) | "
        f"checks waived ({label_b}) | estimate ({label_a}) | estimate ({label_b}) | "
        "shift / MDE |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for _, r in rows.iterrows():
        flag = "" if r.same_verdict and r.same_verdict_checks_waived else " (differs)"
        lines.append(
            f"| {r.part}{flag} | {r.verdict_a} | {r.verdict_b} | {r.verdict_checks_waived_a} | "
            f"{r.verdict_checks_waived_b} | {_fmt(r.estimate_a)} | {_fmt(r.estimate_b)} | "
            f"{'' if pd.isna(r.shift_in_mde) else f'{r.shift_in_mde:.2f}'} |"
        )
    for label, dependence in summary["base_dependence"].items():
        lines += [
            "",
            f"Parts that depend on the base ({label}): verdict "
            f"{', '.join(dependence['verdict']) or 'none'}; with the checks waived "
            f"{', '.join(dependence['verdict_checks_waived']) or 'none'}.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--a", type=Path, required=True, help="claims.csv of the first run")
    p.add_argument("--b", type=Path, required=True, help="claims.csv of the second run")
    p.add_argument("--label-a", default="a")
    p.add_argument("--label-b", default="b")
    p.add_argument("--out", type=Path, default=RESULTS / "verdict_stability.json")
    args = p.parse_args(argv)
    tables = {
        label: pd.read_csv(path, keep_default_na=False, na_values=[""])
        for label, path in ((args.label_a, args.a), (args.label_b, args.b))
    }
    rows = compare_claims(*tables.values())
    summary = {
        "a": args.label_a,
        "b": args.label_b,
        "parts": len(rows),
        "same_verdict": int(rows["same_verdict"].sum()),
        "same_verdict_checks_waived": int(rows["same_verdict_checks_waived"].sum()),
        "max_shift_in_mde": float(rows["shift_in_mde"].max()),
        "differ": rows.loc[~rows["same_verdict"], "part"].tolist(),
        "differ_checks_waived": rows.loc[~rows["same_verdict_checks_waived"], "part"].tolist(),
        "base_dependence": {label: base_dependence(t) for label, t in tables.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"summary": summary, "parts": json.loads(rows.to_json(orient="records"))}
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(rows, args.label_a, args.label_b, summary))
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
