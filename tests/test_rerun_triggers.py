"""A finished smoke run stays finished when nothing it computes changes: moving the checkout,
pointing MLFLOW_TRACKING_URI at another store and changing threads_per_job leave Snakemake nothing
to do. Each of them used to change every job's params (the store's path and the thread count were
on the command lines), Snakemake's default rerun trigger, and rerun the whole DAG."""

from __future__ import annotations

import base64
import shutil
import subprocess
from pathlib import Path

import pytest
import smoke_pipeline


def _copy_checkout(root: Path, dest: Path) -> None:
    """The files git tracks or would track (no results, no venv), as a moved checkout has."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    for name in filter(None, listed.decode().split("\0")):
        src = root / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def _copy_metadata(root: Path, dest: Path, results: Path) -> int:
    """Snakemake's records (params, code, inputs per output) of the files under `results`.

    Records are files named by the urlsafe base64 of the output's path, cut into folder names
    (continuations start with '@'); the others' records stay behind."""
    source = root / ".snakemake" / "metadata"
    copied = 0
    for record in source.rglob("*"):
        if not record.is_file():
            continue
        encoded = "".join(part.removeprefix("@") for part in record.relative_to(source).parts)
        path = base64.urlsafe_b64decode(encoded).decode()
        if path.startswith(str(results)):
            target = dest / ".snakemake" / "metadata" / record.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(record, target)
            copied += 1
    return copied


@pytest.mark.slow
def test_moved_checkout_other_store_more_threads_rerun_nothing(
    smoke_run: Path, tmp_path: Path
) -> None:
    moved = tmp_path / "moved checkout"
    _copy_checkout(smoke_pipeline.ROOT, moved)
    assert (moved / "Snakefile").is_file()
    assert _copy_metadata(smoke_pipeline.ROOT, moved, smoke_run) >= 10
    cmd, env = smoke_pipeline.snakemake_command(
        smoke_run,
        f"{smoke_run}/table1.csv",
        "--dry-run",
        # more threads leave the pinned numeric path (rpb.numerics), which sets no rule's params
        config={"threads_per_job": 2, "cpu_numerics": "free"},
    )
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'elsewhere' / 'mlflow.db'}"
    proc = subprocess.run(cmd, cwd=moved, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "Nothing to be done" in out, out[-3000:]


def _training_commands(tmp_path: Path, *configfiles: str) -> list[str]:
    """The shell commands of the smoke table 1's training jobs, dry-run on a fresh folder."""
    results = tmp_path / "results"
    proc = smoke_pipeline.snakemake_in_repo(
        *("-n", "-p", "--cores", "1", "--configfile", "config/smoke.yaml", *configfiles),
        *("--config", f"results_dir={results}", "--", f"{results}/table1.csv"),
    )
    return sorted(line for line in proc.stdout.splitlines() if "rpb pipeline run " in line)


@pytest.mark.workflow
def test_checkpoint_settings_are_no_rerun_trigger(tmp_path: Path) -> None:
    """Issue 59, item 5: adding `posttrain.save_every` to a finished folder reran every training
    job ("Params have changed"), though a checkpoint changes nothing a job computes. The setting
    now reaches the jobs in their environment (rpb.pipeline.plan.CHECKPOINTS_ENV): every job's
    command line, which carries all its params, is the same with and without it."""
    overlay = tmp_path / "checkpoints.yaml"
    overlay.write_text("posttrain:\n  save_every: 5\n")
    plain = _training_commands(tmp_path)
    assert len(plain) == 14
    assert _training_commands(tmp_path, str(overlay)) == plain
