"""Compare two results folders of the same config, built by two commits, for a change that must
not change behaviour (issue 33): same files, and every table, claim, figure and model output equal.

    python bench/compare_results.py BEFORE/results/smoke AFTER/results/smoke

Compared: every CSV, Markdown, HTML, PNG, PDF, JSON and safetensors file outside MLflow's store,
the logs, the benchmarks and the integrity records. Byte for byte, except what records when and
where a run happened: evaluation outputs' `provenance.date`, `provenance.git_hash` and
`timing_s`, the checkout's path in them, a PDF's CreationDate, and the testbed report's job
durations (its JSON `durations_s`, its Markdown's "Cost on this machine"). Prints one line per
differing file and a summary; exits 1 if any file differs or the file lists do.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

KINDS = {".csv", ".md", ".html", ".png", ".pdf", ".json", ".safetensors"}
SKIPPED = re.compile(
    r"(^|/)(mlflow[^/]*|mlartifacts|logs|benchmarks|\.integrity|\.snakemake)(/|$)|\.run/"
)
VOLATILE_KEYS = {"date", "git_hash", "timing_s", "durations_s"}


def outputs(root: Path) -> list[str]:
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and p.suffix in KINDS and not SKIPPED.search(str(p.relative_to(root)))
    )


def _without_volatile(value: Any, checkout: str) -> Any:
    if isinstance(value, dict):
        return {
            k: _without_volatile(v, checkout) for k, v in value.items() if k not in VOLATILE_KEYS
        }
    if isinstance(value, list):
        return [_without_volatile(v, checkout) for v in value]
    return value.replace(checkout, "<checkout>") if isinstance(value, str) else value


def _checkout(results: Path) -> str:
    """The checkout a results folder lies in (its path appears in evaluation outputs)."""
    parts = results.resolve().parts
    return str(Path(*parts[: parts.index("results")])) if "results" in parts else str(results)


def same(a: Path, b: Path, relative: str) -> str | None:
    """How two outputs agree: "bytes", "normalised" (once what records when and where a run
    happened is left out), or None."""
    data_a, data_b = (a / relative).read_bytes(), (b / relative).read_bytes()
    if data_a == data_b:
        return "bytes"
    return "normalised" if _same_normalised(a, b, relative, data_a, data_b) else None


def _same_normalised(a: Path, b: Path, relative: str, data_a: bytes, data_b: bytes) -> bool:
    if relative.endswith(".pdf"):
        date = re.compile(rb"/CreationDate \([^)]*\)")
        return date.sub(b"", data_a) == date.sub(b"", data_b)
    if relative.endswith(".json"):
        return _without_volatile(json.loads(data_a), _checkout(a)) == _without_volatile(
            json.loads(data_b), _checkout(b)
        )
    if relative == "testbed.md":
        cut = "## Cost on this machine"
        return data_a.decode().split(cut)[0] == data_b.decode().split(cut)[0]
    return False


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    a, b = Path(argv[0]), Path(argv[1])
    files_a, files_b = outputs(a), outputs(b)
    status = 0
    for name in sorted(set(files_a) ^ set(files_b)):
        print(f"only in {a if name in files_a else b}: {name}")
        status = 1
    shared = sorted(set(files_a) & set(files_b))
    agreement = {name: same(a, b, name) for name in shared}
    differ = [name for name, how in agreement.items() if how is None]
    for name in differ:
        print(f"differs: {name}")
    identical = sum(how == "bytes" for how in agreement.values())
    print(
        f"{len(shared)} files in both: {identical} byte-identical, "
        f"{len(shared) - identical - len(differ)} equal but for run dates, paths and timings, "
        f"{len(differ)} differ"
    )
    return 1 if differ or status else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
