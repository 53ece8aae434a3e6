"""Two independent runs of the smoke pipeline give byte-identical results, and one of them survives
a SIGKILLed training job.

Cost is the constraint: a smoke run is minutes on the 2-core machine. Run A is the suite's shared
smoke run (conftest.smoke_run: config/smoke.yaml narrowed to one seed, checkpoints every 3 of the
10 post-training steps, 16 jobs; every rule of table 1 runs for the base and each method). Run B
is made here:

- it starts from an empty folder, so every job is recomputed, but its `rpb` training job is
  SIGKILLed in the middle of its second checkpoint (stopped there by the launcher in
  tests/smoke_pipeline.py, then killed from here). Snakemake (`--keep-going`) finishes the other
  jobs, deletes the failed job's declared outputs and keeps its `checkpoints/` (not an output); a
  second invocation reruns that job, which resumes from the complete checkpoint.

A == B byte for byte (table1.csv, every model, prior and co-activation tensor, every training
history) therefore shows both determinism and an exact resume; when it fails, the list of
differing files tells which: only the killed job's chain, or everything. Both runs run under
the offline guard (tests/offline_guard.py) with a fake HF_TOKEN in the environment, which must
appear in no file they write.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import smoke_pipeline

KILLED = Path("runs/tinyA/math/rpb/base0/seed0")


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def _mlflow_runs(results: Path, name: str) -> list[Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("rpb")
    return client.search_runs(
        [experiment.experiment_id],
        filter_string=f"attributes.run_name = '{name}'",
        order_by=["attributes.start_time ASC"],
    )


@pytest.fixture(scope="module")
def runs(smoke_run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("determinism")
    b = root / "results"
    target = (str(b / "table1.csv"), "--cores", "2")
    cmd, env = smoke_pipeline.snakemake_command(b, *target, "--keep-going")
    flag = root / "stopped.pid"
    env["RPB_TEST_STOP"] = str(flag)
    proc = subprocess.Popen(
        cmd, cwd=smoke_pipeline.ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 600
    while not (flag.exists() and flag.read_text() and _stopped(int(flag.read_text()))):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the rpb training job never stopped:\n{proc.communicate()[1][-3000:]}")
        time.sleep(0.1)
    os.kill(int(flag.read_text()), signal.SIGKILL)
    _, err = proc.communicate(timeout=900)
    job = b / KILLED
    after_kill = {
        "returncode": proc.returncode,
        "stderr": err.decode(errors="replace"),
        "outputs": sorted(p.name for p in job.iterdir()),
        "checkpoints": {
            p.name: sorted(f.name for f in p.iterdir()) for p in (job / "checkpoints").iterdir()
        },
        "statuses": [r.info.status for r in _mlflow_runs(b, "train/tinyA/math/rpb/base0/seed0")],
        "table1": (b / "table1.csv").exists(),
    }
    # The same command, without the fault.
    smoke_pipeline.run_or_fail(b, *target)
    return {"a": smoke_run, "b": b, "after_kill": after_kill}


# Compared outputs (JSON files with timings or absolute paths are left out).
COMPARED = ("table1.csv", "table1.md", "**/*.safetensors", "**/train_history.json")


def _outputs(results: Path) -> list[Path]:
    found = {p.relative_to(results) for pattern in COMPARED for p in results.glob(pattern)}
    # MLflow's artifact copies sit under random run ids; the files they copy are compared directly.
    return sorted(f for f in found if not {"checkpoints", "mlartifacts"} & set(f.parts))


def _same(a: Path, b: Path, name: Path) -> bool:
    """Byte-identical; for safetensors, identical tensors and identical metadata up to the
    results folder (a prior records the path of the base it was taken from)."""
    if name.suffix != ".safetensors":
        return (a / name).read_bytes() == (b / name).read_bytes()
    from safetensors import safe_open

    with safe_open(a / name, "pt") as fa, safe_open(b / name, "pt") as fb:
        meta = [
            json.dumps(f.metadata(), sort_keys=True).replace(str(root), "<results>")
            for f, root in ((fa, a), (fb, b))
        ]
        names = fa.keys()
        return (
            meta[0] == meta[1]
            and names == fb.keys()
            and all(fa.get_tensor(k).equal(fb.get_tensor(k)) for k in names)
        )


@pytest.mark.slow
def test_two_runs_are_byte_identical(runs: dict[str, Any]) -> None:
    a, b = runs["a"], runs["b"]
    files = _outputs(b)
    assert Path("table1.csv") in files and len(files) >= 10, files
    # A may hold more: test_report.py extends the shared run to `all`.
    assert set(files) <= set(_outputs(a))
    differ = [str(f) for f in files if not _same(a, b, f)]
    assert not differ, f"runs A and B differ in {differ}"
    assert (a / "table1.csv").read_bytes() == (b / "table1.csv").read_bytes()


@pytest.mark.slow
def test_killed_training_job_resumes_in_the_pipeline(runs: dict[str, Any]) -> None:
    after = runs["after_kill"]
    # The failed job: Snakemake reported it, deleted its outputs, kept its checkpoints.
    assert after["returncode"] != 0 and "posttrain" in after["stderr"]
    assert not after["table1"]
    assert "model" not in after["outputs"] and "train_history.json" not in after["outputs"]
    assert "mlflow_run.json" not in after["outputs"] and "checkpoints" in after["outputs"]
    assert "rpb_state.pt" in after["checkpoints"]["checkpoint-3"]
    assert "rpb_state.pt" not in after["checkpoints"]["checkpoint-6"]
    assert after["statuses"] == ["RUNNING"]
    # The rerun resumed from the complete checkpoint and ended the dead run.
    log = (runs["b"] / "logs" / "posttrain" / "tinyA_math_rpb_base0_seed0.log").read_text()
    assert "removing incomplete checkpoint" in log
    assert f"resuming from {runs['b'] / KILLED / 'checkpoints' / 'checkpoint-3'}" in log
    old, new = _mlflow_runs(runs["b"], "train/tinyA/math/rpb/base0/seed0")
    assert (old.info.status, new.info.status) == ("KILLED", "FINISHED")
    assert new.data.tags["resumed_from"] == "checkpoint-3"
    # Finished jobs delete their checkpoints.
    assert not [*runs["a"].glob("**/checkpoints"), *runs["b"].glob("**/checkpoints")]


@pytest.mark.slow
def test_no_secret_in_any_output(runs: dict[str, Any]) -> None:
    """HF_TOKEN was set for every job; it appears in no log, MLflow store or artifact."""
    for results in (runs["a"], runs["b"]):
        leaks = [
            str(p)
            for p in results.rglob("*")
            if p.is_file() and smoke_pipeline.FAKE_TOKEN.encode() in p.read_bytes()
        ]
        assert not leaks, leaks
