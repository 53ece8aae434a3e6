"""The workflow's plan, pinned: `snakemake -n` of every default target, under every shipped config,
lists the same jobs as the committed snapshot in tests/data/plan_snapshot/<case>.json.

Guards the planning logic (rpb.pipeline.plan and workflow/rules/common.smk, issue 33): the rewrite
must leave every job list unchanged. Each case is one (configfile, target) pair that the docs or
the Makefile tell users to build (CASES below), dry-run against an empty, fresh results folder
(`--config results_dir=<tmp>`), so the answer never depends on what was built, on timestamps or on
absolute paths. A job is recorded as its rule, its wildcards, the sorted sets of its output and
input paths, a digest of its shell command (which carries every spec and option the job gets)
and how the Snakemake report shows its outputs (their `report()` flags),
with the results folder written `<results>` and the repository root `<repo>`; jobs are sorted by
rule, wildcards and outputs.

Method: each case runs Snakemake's own command line (`snakemake -n --cores 1 ...`) in a
subprocess (this file, `--dry-run-jobs`), with the dry-run executor's `run_job` wrapped to record
every job the scheduler would run; the Snakefile sees an ordinary dry run (sys.argv included).

Regenerate (all cases, or the named ones):

    .venv/bin/python tests/test_plan_snapshot.py --update [CASE ...]

Regeneration is legitimate only when a change of the job list is intended (a new rule, target or
config value that plans other jobs) and reviewed as such, never to make a refactoring pass: a
refactoring of the planner must keep every snapshot as it is. `--list` prints the cases.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOTS = ROOT / "tests" / "data" / "plan_snapshot"
RESULTS_TOKEN = "<results>"
REPO_TOKEN = "<repo>"
# Lines of each section of a failure's diff before "... and N more".
DIFF_LINES = 40

# Each case is a Snakemake dry run in a subprocess (seconds): not in the unit tier.
pytestmark = pytest.mark.workflow


@dataclass(frozen=True)
class Case:
    """One dry run: `snakemake -n [--configfile CONFIGFILE] -- TARGET`, TARGET's `<results>`
    standing for the (fresh) results folder."""

    name: str
    configfile: str | None  # None: the Snakefile's own config/config.yaml alone
    target: str
    slow: bool = False

    def command(self, results: str) -> list[str]:
        args = ["-n", "--cores", "1"]
        if self.configfile:
            args += ["--configfile", self.configfile]
        args += ["--config", f"results_dir={results}", "--"]
        return [*args, self.target.replace(RESULTS_TOKEN, results)]

    def describe(self) -> str:
        config = f" --configfile {self.configfile}" if self.configfile else ""
        return f"snakemake -n{config} -- {self.target}"


# The targets docs/pipeline.md and the Makefile name, under each shipped config: `all` (the
# default target), `make table1`, the two one-stage examples, `make smoke` and the smoke `all`,
# and the paper-scale table 1 (docs/pipeline.md) and `all` (docs/paper_scale.md).
# The unit tier keeps one dry run per config (its table 1); the whole-DAG cases run in the full
# suite (`make test`, CI), where a planning change shows before it lands.
CASES = [
    Case("default-all", None, "all", slow=True),
    Case("default-table1", None, f"{RESULTS_TOKEN}/table1.csv"),
    Case("default-prior", None, f"{RESULTS_TOKEN}/priors/tinyA/base0/math.safetensors", slow=True),
    Case("default-eval", None, f"{RESULTS_TOKEN}/eval/tinyA/math/rpb/base0/seed0.json", slow=True),
    Case("smoke-all", "config/smoke.yaml", "all", slow=True),
    Case("smoke-table1", "config/smoke.yaml", f"{RESULTS_TOKEN}/table1.csv"),
    Case("paper-all", "config/paper.yaml", "all", slow=True),
    Case("paper-table1", "config/paper.yaml", f"{RESULTS_TOKEN}/table1.csv"),
]


def _normalise(value: str, results: str, root: str) -> str:
    for path, token in ((results, RESULTS_TOKEN), (root, REPO_TOKEN)):
        value = value.replace(path, token)
    return value


def _dry_run_jobs(argv: list[str], out: str) -> int:
    """Subprocess side: run `snakemake *argv` (a dry run) and write its jobs to `out` as JSON."""
    import snakemake.cli
    from snakemake.executors import dryrun
    from snakemake.io import is_flagged

    jobs: list[dict] = []
    run_job = dryrun.Executor.run_job

    def recording_run_job(self, job):
        for single in job.jobs if job.is_group() else [job]:
            jobs.append(
                {
                    "rule": single.rule.name,
                    "wildcards": {k: str(v) for k, v in single.wildcards_dict.items()},
                    "output": [str(f) for f in single.output],
                    "input": [str(f) for f in single.input],
                    "shell": single.shellcmd,  # None for a `script:` rule
                    "report": {
                        str(f): _report_item(f.flags["report"])
                        for f in single.output
                        if is_flagged(f, "report")
                    },
                }
            )
        return run_job(self, job)

    dryrun.Executor.run_job = recording_run_job
    sys.argv = ["snakemake", *argv]  # what the Snakefile's parse_invocation reads
    try:
        snakemake.cli.main(argv)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    if code == 0:
        Path(out).write_text(json.dumps(jobs))
    return code


def _report_item(flag) -> dict:
    """How the Snakemake report shows an output (its `report()` flag): caption file, category,
    subcategory, and for a folder its patterns and labels."""
    caption = flag.caption  # a Snakemake source file once the rule is defined
    if hasattr(caption, "get_path_or_uri"):
        caption = caption.get_path_or_uri(secret_free=True)
    item = {"caption": str(caption), "category": flag.category, "subcategory": flag.subcategory}
    if flag.patterns:
        item |= {"patterns": list(flag.patterns), "labels": dict(flag.labels or {})}
    return item


def plan(case: Case, root: Path = ROOT) -> dict:
    """The normalised job list of `case`, dry-run from `root` against a fresh results folder."""
    with tempfile.TemporaryDirectory(prefix="plan_snapshot_") as tmp:
        results = os.path.join(tmp, "results")  # never created: a dry run writes nothing there
        out = os.path.join(tmp, "jobs.json")
        env = {k: v for k, v in os.environ.items() if not k.startswith("SNAKEMAKE_")}
        env.update(
            HF_HUB_OFFLINE="1",
            HF_DATASETS_OFFLINE="1",
            # The tree's own rpb, also when `root` is a copy of the checkout.
            PYTHONPATH=os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")])),
        )
        command = [sys.executable, str(Path(__file__).resolve()), "--dry-run-jobs", out]
        proc = subprocess.run(
            [*command, *case.command(results)],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stdout + proc.stderr)[-4000:]
            raise RuntimeError(f"{case.describe()} failed ({proc.returncode}):\n{tail}")
        raw = json.loads(Path(out).read_text())
        real_results, real_root = os.path.realpath(results), os.path.realpath(root)

    def norm(value: str) -> str:
        value = _normalise(value, results, str(root))
        return _normalise(value, real_results, real_root)

    jobs = [
        {
            "rule": job["rule"],
            "wildcards": {k: norm(v) for k, v in sorted(job["wildcards"].items())},
            "output": sorted({norm(f) for f in job["output"]}),
            "input": sorted({norm(f) for f in job["input"]}),
            "command": _digest(norm(job["shell"])) if job["shell"] else None,
            "report": {
                norm(f): {k: norm(v) if k == "caption" else v for k, v in item.items()}
                for f, item in sorted(job["report"].items())
            },
        }
        for job in raw
    ]
    jobs.sort(key=lambda j: (j["rule"], sorted(j["wildcards"].items()), j["output"]))
    keys = [_key(j) for j in jobs]
    assert len(keys) == len(set(keys)), f"{case.name}: two jobs of one rule with equal wildcards"
    counts: dict[str, int] = {}
    for job in jobs:
        counts[job["rule"]] = counts.get(job["rule"], 0) + 1
    return {
        "command": case.describe(),
        "n_jobs": len(jobs),
        "rules": dict(sorted(counts.items())),
        "jobs": jobs,
    }


def _digest(command: str) -> str:
    """A short digest of a normalised shell command (the snapshot stays small; a changed
    command shows as a changed job)."""
    return hashlib.sha256(" ".join(command.split()).encode()).hexdigest()[:16]


def snapshot_path(case: Case) -> Path:
    return SNAPSHOTS / f"{case.name}.json"


def write_snapshot(case: Case, snapshot: dict) -> None:
    SNAPSHOTS.mkdir(parents=True, exist_ok=True)
    snapshot_path(case).write_text(json.dumps(snapshot, indent=1) + "\n")


def _key(job: dict) -> tuple:
    return job["rule"], tuple(sorted(job["wildcards"].items()))


def _label(key: tuple) -> str:
    rule, wildcards = key
    return f"rule {rule}" + (
        " {" + ", ".join(f"{k}={v}" for k, v in wildcards) + "}" if wildcards else ""
    )


def _capped(lines: list[str]) -> list[str]:
    if len(lines) <= DIFF_LINES:
        return lines
    return [*lines[:DIFF_LINES], f"    ... and {len(lines) - DIFF_LINES} more"]


def diff_plans(expected: dict, actual: dict) -> str:
    """A readable difference of two snapshots: jobs added, removed and changed (by rule and
    wildcards), and the changed jobs' added and removed paths; "" when equal."""
    old = {_key(j): j for j in expected["jobs"]}
    new = {_key(j): j for j in actual["jobs"]}
    added = [k for k in new if k not in old]
    removed = [k for k in old if k not in new]
    changed = [k for k in new if k in old and new[k] != old[k]]
    out: list[str] = []
    for what, sign, keys, jobs in (("added", "+", added, new), ("removed", "-", removed, old)):
        if keys:
            out.append(f"  jobs {what} ({len(keys)}):")
            lines = []
            for key in keys:
                lines.append(f"    {sign} {_label(key)}")
                lines += [f"        output {f}" for f in jobs[key]["output"]]
            out += _capped(lines)
    if changed:
        out.append(f"  jobs changed ({len(changed)}):")
        lines = []
        for key in changed:
            lines.append(f"    ~ {_label(key)}")
            shown = len(lines)
            for field in ("output", "input"):
                before, after = old[key][field], new[key][field]
                lines += [f"        {field} + {f}" for f in after if f not in before]
                lines += [f"        {field} - {f}" for f in before if f not in after]
            if old[key].get("command") != new[key].get("command"):
                lines.append("        its shell command (a spec, option or flag) changed")
            if old[key].get("report") != new[key].get("report"):
                lines.append("        how the Snakemake report shows its outputs changed")
            if len(lines) == shown:
                lines.append("        the same paths, listed in another order or multiplicity")
        out += _capped(lines)
    if not out and expected != actual:
        out.append("  same jobs; the header differs (command, n_jobs or rules)")
    if out:
        before = expected.get("rules", {})
        after = actual.get("rules", {})
        counts = [
            f"    {rule}: {before.get(rule, 0)} -> {after.get(rule, 0)}"
            for rule in sorted(set(before) | set(after))
            if before.get(rule, 0) != after.get(rule, 0)
        ]
        if counts:
            out += ["  jobs per rule (snapshot -> now):", *counts]
    return "\n".join(out)


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow else []) for c in CASES],
)
def test_plan_matches_snapshot(case: Case) -> None:
    path = snapshot_path(case)
    assert path.exists(), (
        f"no snapshot {path.relative_to(ROOT)}: "
        f".venv/bin/python tests/test_plan_snapshot.py --update {case.name}"
    )
    expected = json.loads(path.read_text())
    actual = plan(case)
    if actual != expected:
        pytest.fail(
            f"the plan of `{case.describe()}` differs from {path.relative_to(ROOT)}:\n"
            f"{diff_plans(expected, actual)}\n"
            "Only if this change of the job list is intended: "
            f".venv/bin/python tests/test_plan_snapshot.py --update {case.name}",
            pytrace=False,
        )


def test_diff_names_added_removed_and_changed_jobs() -> None:
    job = {"rule": "r", "wildcards": {"seed": "0"}, "output": ["<results>/a"], "input": []}
    other = {**job, "wildcards": {"seed": "1"}}
    moved = {**job, "output": ["<results>/b"]}
    text = diff_plans({"jobs": [job, other]}, {"jobs": [moved]})
    assert "jobs removed (1):" in text and "- rule r {seed=1}" in text
    assert "jobs changed (1):" in text and "output + <results>/b" in text
    assert "output - <results>/a" in text and "jobs added" not in text
    assert diff_plans({"jobs": [job]}, {"jobs": [job]}) == ""
    respecified = {**job, "command": "0123456789abcdef"}
    assert "its shell command (a spec, option or flag) changed" in diff_plans(
        {"jobs": [job]}, {"jobs": [respecified]}
    )


def main(argv: list[str]) -> int:
    if argv[:1] == ["--dry-run-jobs"]:
        return _dry_run_jobs(argv[2:], argv[1])
    if argv[:1] == ["--list"]:
        for case in CASES:
            print(f"{case.name:16} {case.describe()}")
        return 0
    if argv[:1] != ["--update"]:
        print("usage: tests/test_plan_snapshot.py --update [CASE ...] | --list", file=sys.stderr)
        return 2
    names = argv[1:]
    unknown = set(names) - {c.name for c in CASES}
    if unknown:
        print(f"unknown case(s): {', '.join(sorted(unknown))} (--list)", file=sys.stderr)
        return 2
    for case in CASES:
        if names and case.name not in names:
            continue
        snapshot = plan(case)
        old = json.loads(snapshot_path(case).read_text()) if snapshot_path(case).exists() else None
        write_snapshot(case, snapshot)
        state = "new" if old is None else "unchanged" if old == snapshot else "CHANGED"
        print(f"{case.name}: {snapshot['n_jobs']} jobs, {state}")
        if old is not None and old != snapshot:
            print(diff_plans(old, snapshot))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
