"""Compare two results folders of the same config, built by two commits, for a change that must
not change behaviour (issue 33): same files, and every table, claim, figure and model output equal.

    python bench/compare_results.py BEFORE/results/smoke AFTER/results/smoke
    python bench/compare_results.py --relayout config/smoke.yaml BEFORE/results/smoke AFTER/...
    python bench/compare_results.py --record RECORD.json results   # digests of every output
    python bench/compare_results.py --record RECORD.json results --plan PLAN.json   # of a target's
    python bench/compare_results.py --against RECORD.json results  # a folder against them

Compared: every CSV, Markdown, HTML, PNG, PDF, JSON and safetensors file outside MLflow's store,
the logs, the benchmarks and the integrity records. Byte for byte, except what records when and
where a run happened: evaluation outputs' `provenance.date`, `provenance.git_hash` and
`timing_s`, the checkout's path in them, a PDF's CreationDate, and the testbed report's job
durations (its JSON `durations_s`, its Markdown's "Cost on this machine"). Prints one line per
differing file and a summary; exits 1 if any file differs or the file lists do.

`--relayout CONFIGFILE` compares a BEFORE folder of the first results layout (run ids in paths,
replicate bases as models `tinyA_p1`; moved first with `rpb relayout --apply`) with an AFTER folder
of the current one (`base<b>/seed<s>`, replicates `tinyA_base1`): the first layout's paths and
names inside BEFORE's JSON and safetensors metadata are read as their current names
(rpb.pipeline.relayout), its per-run CSVs get the `base` column the current tables show
(rpb.pipeline.relayout.legacy_named_runs), and safetensors files are compared tensor by tensor.
Markdown, HTML and figures name runs in their text and labels: they are listed as renamed, not
compared.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

KINDS = {".csv", ".md", ".html", ".png", ".pdf", ".json", ".safetensors"}
# Never compared: tracking stores, logs, timings, integrity records, finished jobs' notes, and
# scratch (`.work/`: a job's `temp()` folder, which Snakemake deletes after the job, except where a
# run is left behind by `--forcerun` or a kill: a record made from such a folder would fail every
# fresh run).
SKIPPED = re.compile(
    r"(^|/)(mlflow[^/]*|mlartifacts|logs|benchmarks|\.integrity|\.jobs_finished|\.snakemake)(/|$)"
    r"|\.run/|\.work/"
)
# When and where a run happened: dates, commits, timings, and the CPU numeric path (the CPU's
# model is recorded with every training: rpb.numerics), which two CPUs must differ in.
VOLATILE_KEYS = {"date", "git_hash", "timing_s", "durations_s", "numeric_path", "numeric_paths"}
CHECKOUT = re.compile(r"(?:/[^/\s\"']+)+?/results/(?=[^/]+/)")


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
    if not isinstance(value, str):
        return value
    # The checkout's path, also where a folder was copied from another checkout.
    return CHECKOUT.sub("<checkout>/results/", value.replace(checkout, "<checkout>"))


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


def digest(root: Path, relative: str) -> str:
    """A sha256 of one output that two machines agree on when `same` would say they agree: of its
    bytes, or of its normalised content where `same` normalises (JSON, PDF, testbed.md)."""
    data = (root / relative).read_bytes()
    if relative.endswith(".pdf"):
        data = re.sub(rb"/CreationDate \([^)]*\)", b"", data)
    elif relative.endswith(".json"):
        value = _without_volatile(json.loads(data), _checkout(root))
        data = json.dumps(value, sort_keys=True).encode()
    elif relative == "testbed.md":
        data = data.decode().split("## Cost on this machine")[0].encode()
    return hashlib.sha256(data).hexdigest()


def planned(names: list[str], plan: Path) -> list[str]:
    """`names` that one target's jobs write: at or under an output of a plan snapshot
    (tests/data/plan_snapshot/<case>.json), so a folder that also holds other targets' outputs
    records only what a fresh run of that target makes."""
    declared = {
        path.removeprefix("<results>/")
        for job in json.loads(plan.read_text())["jobs"]
        for path in job["output"]
    }
    return [n for n in names if any(n == d or n.startswith(d.rstrip("/") + "/") for d in declared)]


def record_digests(
    results: Path, out: Path, about: dict[str, Any], plan: Path | None = None
) -> int:
    """Write every output's digest (and `about`: where and how it was made) to `out`; with
    `plan`, only the outputs of that plan's jobs."""
    names = outputs(results) if plan is None else planned(outputs(results), plan)
    record = {**about, "files": {name: digest(results, name) for name in names}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"{out}: {len(record['files'])} outputs of {results}")
    return 0


def check_digests(recorded: Path, results: Path) -> int:
    """Compare a results folder with recorded digests; one line per file that differs."""
    record = json.loads(recorded.read_text())
    expected, present = record["files"], set(outputs(results))
    status = 0
    for name in sorted(set(expected) - present):
        print(f"missing here: {name}")
        status = 1
    differ = [n for n in sorted(set(expected) & present) if digest(results, n) != expected[n]]
    for name in differ:
        print(f"differs: {name}")
    extra = len(present - set(expected))
    print(
        f"{len(expected)} recorded outputs ({record.get('cpu')}, commit {record.get('commit')}):"
        f" {len(set(expected) & present) - len(differ)} the same, {len(differ)} differ, "
        f"{len(set(expected) - present)} missing here; {extra} outputs here not recorded"
    )
    return 1 if differ or status else 0


class Relaid:
    """Reads BEFORE's contents under the current layout's names (`--relayout`)."""

    PATH = re.compile(
        r"(?:diagnostic/(?:router_swap/)?)?(?:models|priors|runs|eval|analysis)/[^\s\"'|,]+"
    )

    def __init__(self, configfile: str) -> None:
        from rpb.pipeline.relayout import legacy_bases, read_config
        from rpb.specs import replicate_name

        self.bases = legacy_bases(read_config([configfile]).get("models") or {})
        # Replicate bases' names: tinyA_p1 -> tinyA_base1.
        self.names = {
            old: replicate_name(model, k) for old, (model, k) in self.bases.items() if old != model
        }

    def text(self, value: str) -> str:
        from rpb.pipeline.relayout import current_path

        value = self.PATH.sub(lambda m: current_path(m[0], self.bases) or m[0], value)
        for old, new in self.names.items():
            value = re.sub(rf"\b{re.escape(old)}\b", new, value)
        return value

    def value(self, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: self.value(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.value(v) for v in value]
        return self.text(value) if isinstance(value, str) else value

    def same(self, a: Path, b: Path, relative: str) -> str | None:
        """ "bytes", "normalised", "renamed" (text or figure naming runs: not compared) or None."""
        how = same(a, b, relative)
        if how is not None:
            return how
        data_a, data_b = (a / relative).read_bytes(), (b / relative).read_bytes()
        if relative.endswith(".json"):
            before = self.value(_without_volatile(json.loads(data_a), _checkout(a)))
            return (
                "normalised"
                if before == _without_volatile(json.loads(data_b), _checkout(b))
                else None
            )
        if relative.endswith(".safetensors"):
            return "normalised" if self._same_tensors(a / relative, b / relative) else None
        if relative.endswith(".csv"):
            return "normalised" if self._same_csv(a / relative, b / relative) else None
        return "renamed"

    def _same_tensors(self, a: Path, b: Path) -> bool:
        import torch
        from safetensors import safe_open

        with safe_open(str(a), "pt") as fa, safe_open(str(b), "pt") as fb:
            meta_a = {k: self.text(v) for k, v in (fa.metadata() or {}).items()}
            names = fa.keys()  # a safetensors handle, not a mapping
            if meta_a != (fb.metadata() or {}) or set(names) != set(fb.keys()):
                return False
            return all(torch.equal(fa.get_tensor(k), fb.get_tensor(k)) for k in names)

    def _same_csv(self, a: Path, b: Path) -> bool:
        import pandas as pd

        from rpb.pipeline.relayout import legacy_named_runs

        before, after = legacy_named_runs(pd.read_csv(a)), pd.read_csv(b)
        try:
            pd.testing.assert_frame_equal(before, after, check_dtype=False)
        except AssertionError:
            return False
        return True


def main(argv: list[str]) -> int:
    if argv[:1] == ["--against"] and len(argv) == 3:
        return check_digests(Path(argv[1]), Path(argv[2]))
    plan = None
    if argv[:1] == ["--record"] and len(argv) == 5 and argv[3] == "--plan":
        plan, argv = Path(argv[4]), argv[:3]
    if argv[:1] == ["--record"] and len(argv) == 3:
        from rpb.numerics import cpu_model
        from rpb.pipeline.tracking import git_commit

        about = {"cpu": cpu_model(), "commit": git_commit()}
        lock = Path(__file__).resolve().parents[1] / "requirements" / "lock.txt"
        if lock.exists():
            about["lock_sha256"] = hashlib.sha256(lock.read_bytes()).hexdigest()
        return record_digests(Path(argv[2]), Path(argv[1]), about, plan)
    relaid = None
    if argv[:1] == ["--relayout"] and len(argv) > 1:
        relaid, argv = Relaid(argv[1]), argv[2:]
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
    compare = relaid.same if relaid is not None else same
    agreement = {name: compare(a, b, name) for name in shared}
    differ = [name for name, how in agreement.items() if how is None]
    for name in differ:
        print(f"differs: {name}")
    renamed = [name for name, how in agreement.items() if how == "renamed"]
    for name in renamed:
        print(f"renamed (names runs in its text or labels; not compared): {name}")
    identical = sum(how == "bytes" for how in agreement.values())
    print(
        f"{len(shared)} files in both: {identical} byte-identical, "
        f"{len(shared) - identical - len(differ) - len(renamed)} equal but for run dates, paths, "
        f"timings{' and run names' if relaid else ''}, {len(renamed)} renamed, "
        f"{len(differ)} differ"
    )
    return 1 if differ or status else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
