"""Do table 1's verdicts survive another numeric path (or another CPU model)?

Judges C1 and C2 from two results folders that `make table1` built on one commit and config but
a different float path (`--config cpu_numerics=compatible`, or `cpu_numerics=free
threads_per_job=2`, or another CPU model), by the same rules as table 1's caption
(`rpb.report.claims.judge_table`), and prints per part: each folder's verdict, estimate and MDE,
and the estimate's shift in units of the larger MDE. The claims spec is the planner's for the
config given (the default: config/config.yaml, as `make table1` runs it).

    snakemake --cores 2 results/table1.csv --config cpu_numerics=compatible results_dir=other
    python bench/table1_stability.py --a results --label-a native --b other --label-b compatible
        # -> bench/results/table1_stability.{json,md}
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from any folder

from rpb.pipeline.config_check import check_config  # noqa: E402
from rpb.pipeline.plan import PipelineConfig, Plan  # noqa: E402
from rpb.report.claims import judge_table  # noqa: E402

SCHEMA = ROOT / "workflow" / "schemas" / "config.schema.yaml"
OUT = ROOT / "bench" / "results" / "table1_stability"


def claims_spec(configfiles: list[Path], results: Path) -> dict[str, Any]:
    """The claims spec table 1's job gets for `configfiles` (merged as Snakemake merges them)."""
    from snakemake.utils import update_config

    config: dict[str, Any] = {}
    for path in configfiles:
        update_config(config, yaml.safe_load(path.read_text()))
    update_config(config, {"results_dir": str(results)})
    check_config(config, SCHEMA)
    return Plan(PipelineConfig.parse(copy.deepcopy(config))).claims_spec()


def compare(a: Path, b: Path, configfiles: list[Path]) -> list[dict[str, Any]]:
    """One row per C1/C2 part: both folders' verdicts and numbers, and the estimate's shift over
    the larger of the two MDEs."""
    judged = [judge_table(r, claims_spec(configfiles, r)) for r in (a, b)]
    rows = []
    for claim, parts in judged[0].parts.items():
        for pa, pb in zip(parts, judged[1].parts[claim], strict=True):
            mde = max(pa.mde, pb.mde)
            shift = abs(pa.estimate - pb.estimate) / mde if mde > 0 else math.nan
            rows.append(
                {
                    "claim": claim,
                    "part": pa.name,
                    "claim_verdict_a": judged[0].verdict(claim),
                    "claim_verdict_b": judged[1].verdict(claim),
                    "verdict_a": pa.verdict,
                    "verdict_b": pb.verdict,
                    "estimate_a": pa.estimate,
                    "estimate_b": pb.estimate,
                    "mde_a": pa.mde,
                    "mde_b": pb.mde,
                    "shift_in_mde": shift,
                }
            )
    return rows


def markdown(rows: list[dict[str, Any]], label_a: str, label_b: str) -> str:
    lines = [
        f"| part | verdict ({label_a}) | verdict ({label_b}) | estimate | MDE | shift / MDE |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['claim']} {r['part']} | {r['verdict_a']} | {r['verdict_b']} | "
            f"{r['estimate_a']:+.2f} -> {r['estimate_b']:+.2f} | {r['mde_a']:.2f} / "
            f"{r['mde_b']:.2f} | {r['shift_in_mde']:.2f} |"
        )
    same = all(r["verdict_a"] == r["verdict_b"] for r in rows)
    largest = max((r["shift_in_mde"] for r in rows), default=math.nan)
    lines += [
        "",
        f"Every part's verdict the same: {'yes' if same else 'no'}; largest shift "
        f"{largest:.2f} MDE.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, required=True, help="a table-1 results folder")
    parser.add_argument("--b", type=Path, required=True, help="the other one")
    parser.add_argument("--label-a", default="a")
    parser.add_argument("--label-b", default="b")
    parser.add_argument(
        "--configfile",
        type=Path,
        action="append",
        default=None,
        help="config files as given to snakemake (default: config/config.yaml)",
    )
    parser.add_argument("--out", type=Path, default=OUT, help="writes OUT.json and OUT.md")
    args = parser.parse_args(argv)
    configfiles = args.configfile or [ROOT / "config" / "config.yaml"]
    rows = compare(args.a, args.b, configfiles)
    text = markdown(rows, args.label_a, args.label_b)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"a": args.label_a, "b": args.label_b, "parts": rows}
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
