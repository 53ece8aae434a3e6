"""Faults in a training job: SIGKILL mid-checkpoint, SIGTERM, incomplete checkpoints, and the
MLflow runs such jobs leave behind. Damaged inputs (a truncated prior or eval output, a model
folder without its weights, a config file that is not YAML): one line naming the file, and no
finished output lost.

The central test kills a real `rpb pipeline train` process (SIGKILL, no chance to clean up)
while it is writing its third checkpoint, reruns the same command, and requires the result to be
bit-identical to an uninterrupted run: weights, training history and the router method's state
(`rpb_adaptive`, whose per-expert bias is state outside the model). The pipeline-level version
(Snakemake deletes the failed job's outputs but not its checkpoints) is in test_determinism.py,
which shares its two smoke runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import smoke_pipeline
from conftest import new_store, save_tiny_base

from rpb.pipeline.analysis import extract_prior_from_corpus
from rpb.pipeline.cli import main
from rpb.pipeline.tracking import (
    END_REASON_TAG,
    JobTerminated,
    end_stale_runs,
    init_store,
    tracked_run,
)
from rpb.pipeline.training import CHECKPOINT_STATE, last_complete_checkpoint
from rpb.specs import Run, eval_path

# 20 examples, batch 4, 12 steps: 2.4 epochs, so the resumed run crosses an epoch boundary.
CORPUS = [{"prompt": f"SumOf{a}And{a + 3}?", "completion": str(2 * a + 3)} for a in range(10, 30)]
SPEC = {"steps": 12, "batch_size": 4, "lr": 3e-3, "max_length": 16, "save_every": 3}
SPEC["log_every"] = 1
# rpb_adaptive keeps a bias outside the model; a large update rate makes losing it visible.
METHOD = {"kind": "rpb_adaptive", "strength": 1.0, "options": {"update_rate": 0.05}}
# Runs `rpb` as the console script does, but stops itself (SIGSTOP) in the middle of its third
# checkpoint: the model and optimizer are written, RNG, trainer state and our state are not.
STOP_IN_THIRD_SAVE = """
import os, signal, sys
from transformers import Trainer
save_rng, calls = Trainer._save_rng_state, []
def stop_in_third_save(self, output_dir):
    calls.append(output_dir)
    if len(calls) == 3:
        os.kill(os.getpid(), signal.SIGSTOP)
    save_rng(self, output_dir)
Trainer._save_rng_state = stop_in_third_save
from rpb.pipeline.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, empty_store: Path) -> Iterator[str]:
    """One tracking store for the module (a copy of the session's empty one: creating one costs
    seconds); tests use own experiments."""
    import mlflow

    previous = mlflow.get_tracking_uri()
    uri = new_store(empty_store, tmp_path_factory.mktemp("faults_store") / "mlflow.db")
    init_store(uri, "faults")
    yield uri
    mlflow.set_tracking_uri(previous)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, store: str) -> dict[str, Any]:
    """A saved tiny qwen3_moe base, a corpus and its router prior."""
    root = tmp_path_factory.mktemp("faults")
    base = save_tiny_base(root / "base" / "model")
    corpus = root / "math.jsonl"
    corpus.write_text("".join(json.dumps(row) + "\n" for row in CORPUS))
    prior = root / "prior.safetensors"
    extract_prior_from_corpus(base, corpus, prior, model_id="tiny8")
    return {"root": root, "base": base, "corpus": corpus, "prior": prior, "uri": store}


def _train_args(world: dict, out: Path, experiment: str = "faults") -> list[str]:
    return [
        *("pipeline", "train"),
        *("--tracking-uri", world["uri"], "--experiment", experiment),
        *("--name", "tiny8", "--label", "rpb_adaptive", "--base", str(world["base"])),
        *("--prior", str(world["prior"]), "--corpus", str(world["corpus"])),
        *("--corpus-name", "math", "--method", json.dumps(METHOD)),
        *("--spec", json.dumps(SPEC), "--out", str(out)),
    ]


def _runs(uri: str, experiment: str) -> list[Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id], order_by=["attributes.start_time ASC"])


def _wait_stopped(proc: subprocess.Popen, timeout: float = 240.0) -> None:
    """Wait until `proc` has stopped itself (state T in /proc)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            pytest.fail(f"the job ended (rc {proc.returncode}) before it could be killed:\n{out}")
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        if fields[0] == "T":
            return
        time.sleep(0.05)
    proc.kill()
    pytest.fail("the job never reached its third checkpoint")


@pytest.mark.slow
def test_sigkilled_training_resumes_bit_identical(world: dict) -> None:
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    ref = world["root"] / "uninterrupted"
    assert main(_train_args(world, ref, "faults_reference")) == 0

    out = world["root"] / "killed"
    cmd = [sys.executable, "-c", STOP_IN_THIRD_SAVE, *_train_args(world, out)]
    proc = subprocess.Popen(
        cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    _wait_stopped(proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL

    # What the killed job left: one complete checkpoint, one half-written, no outputs.
    checkpoints = out / "checkpoints"
    assert (checkpoints / "checkpoint-6" / CHECKPOINT_STATE).is_file()
    assert (checkpoints / "checkpoint-9" / "model.safetensors").is_file()
    assert not (checkpoints / "checkpoint-9" / CHECKPOINT_STATE).exists()
    assert not (out / "model").exists() and not (out / "train_history.json").exists()
    assert not (out / "mlflow_run.json").exists()
    (killed,) = _runs(world["uri"], "faults")
    assert killed.info.status == "RUNNING"  # nothing could end it

    # The console script of this interpreter's environment, not whichever `rpb` is on PATH.
    rpb = str(Path(sys.executable).parent / "rpb")
    rerun = subprocess.run(
        [rpb, *_train_args(world, out)], env=_env(), capture_output=True, text=True
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "removing incomplete checkpoint" in rerun.stderr and "checkpoint-9" in rerun.stderr
    assert f"resuming from {checkpoints / 'checkpoint-6'}" in rerun.stderr
    assert not checkpoints.exists() and not (ref / "checkpoints").exists(), "left after success"

    # Bit-identical: every weight tensor and the full history (losses, drift, lr per step).
    want, got = (
        load_file(ref / "model" / "model.safetensors"),
        load_file(out / "model" / "model.safetensors"),
    )
    assert want.keys() == got.keys()
    differ = [k for k in want if not want[k].equal(got[k])]
    assert not differ, f"resumed weights differ from the uninterrupted run: {differ[:5]}"
    assert (ref / "train_history.json").read_bytes() == (out / "train_history.json").read_bytes()

    # MLflow: the killed run is marked KILLED with the reason; the rerun has the whole history.
    old, new = _runs(world["uri"], "faults")
    assert old.info.run_id == killed.info.run_id
    assert old.info.status == "KILLED" and "SIGKILL" in old.data.tags[END_REASON_TAG]
    assert new.info.status == "FINISHED" and new.data.tags["resumed_from"] == "checkpoint-6"
    client = MlflowClient(tracking_uri=world["uri"])
    (ref_run,) = _runs(world["uri"], "faults_reference")
    steps = [m.step for m in client.get_metric_history(new.info.run_id, "task_loss")]
    ref_steps = [m.step for m in client.get_metric_history(ref_run.info.run_id, "task_loss")]
    assert sorted(steps) == sorted(ref_steps) == list(range(1, SPEC["steps"] + 1))


def test_incomplete_checkpoints_are_skipped_and_removed(tmp_path: Path) -> None:
    for step, complete in ((3, True), (6, True), (9, False)):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x")
        if complete:
            (folder / CHECKPOINT_STATE).write_bytes(b"x")
    (tmp_path / "checkpoint-12.tmp").mkdir()  # not a checkpoint name: left alone
    assert last_complete_checkpoint(tmp_path) == tmp_path / "checkpoint-6"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-12.tmp",
        "checkpoint-3",
        "checkpoint-6",
    ]
    assert last_complete_checkpoint(tmp_path / "absent") is None


def test_sigterm_ends_the_run_killed(store: str) -> None:
    uri = store
    init_store(uri, "term")
    before = signal.getsignal(signal.SIGTERM)
    with (
        pytest.raises(JobTerminated) as caught,
        tracked_run(stage="train", model="m", tracking_uri=uri, experiment="term"),
    ):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler interrupts this
    assert caught.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before, "the SIGTERM handler was not restored"
    (run,) = _runs(uri, "term")
    assert run.info.status == "KILLED" and run.data.tags[END_REASON_TAG] == "SIGTERM"


@pytest.mark.parametrize("error", ["torch", "oserror"])
def test_a_full_disk_while_saving_a_checkpoint_is_one_line(
    world: dict,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    error: str,
) -> None:
    """Issue 47 (item 4). Before: three tracebacks naming no file (torch's `unexpected pos`) and
    the runs left RUNNING, the half-written checkpoint holding the space the store needed. Now:
    one line naming the file being written; the checkpoint cut short is deleted and the run ends
    FAILED, tagged with that line. Torch raises on ENOSPC as faked here: iostream's error, then,
    while its zip writer closes, `unexpected pos` (checked on a 64 kB tmpfs, 2026-12-04)."""
    import errno

    import torch

    save = torch.save

    def full_disk(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if not str(f).endswith("optimizer.pt"):
            return save(obj, f, *args, **kwargs)
        Path(f).write_bytes(b"PK\x03\x04" * 16)  # what fitted
        if error == "oserror":  # a writer whose OSError names no file
            raise OSError(errno.ENOSPC, "No space left on device")
        try:
            raise RuntimeError("basic_ios::clear: iostream error")
        finally:
            raise RuntimeError(
                "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
            )

    monkeypatch.setattr(torch, "save", full_disk)
    out = tmp_path / "run"
    experiment = f"full_disk_{error}"
    assert main(_train_args(world, out, experiment)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    (line,) = [x for x in err.splitlines() if "error:" in x]
    written = out / "checkpoints" / "checkpoint-3" / "optimizer.pt"
    assert line.startswith(f"rpb pipeline train: error: {written}: "), line
    assert "free disk space, then rerun" in line
    if error == "torch":
        assert "write failed (torch: unexpected pos 704 vs 598)" in line
    assert not (out / "checkpoints" / "checkpoint-3").exists()  # no space held by a useless one
    (run,) = _runs(world["uri"], experiment)
    assert run.info.status == "FAILED"

    def free(text: str) -> str:  # the free space of the real disk moves between the two
        return re.sub(r"[\d,]+ bytes free", "N bytes free", text)

    assert free(line).endswith(free(run.data.tags[END_REASON_TAG]))


def test_a_failed_run_is_tagged_even_when_only_the_tag_failed(
    store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 47 (item 4): a store locked past the policy while the tag is set, then free again.
    Before: the run ended FAILED without `rpb.end_reason` (the tag was dropped, the end waited
    and went through). Now the ended run is tagged afterwards."""
    import mlflow

    def locked(key: str, value: str) -> None:
        raise mlflow.exceptions.MlflowException("(sqlite3.OperationalError) database is locked")

    init_store(store, "tag_once")
    with (
        pytest.raises(ValueError),
        tracked_run(stage="eval", model="m", tracking_uri=store, experiment="tag_once"),
    ):
        monkeypatch.setattr(mlflow, "set_tag", locked)
        raise ValueError("bad input")
    (run,) = _runs(store, "tag_once")
    assert run.info.status == "FAILED"
    assert run.data.tags.get(END_REASON_TAG) == "bad input"


def test_only_dead_runs_of_the_same_job_are_marked_stale(store: str) -> None:
    """A RUNNING run is stale only if it is this job's (name, job dir) and its process is gone."""
    from mlflow.tracking import MlflowClient

    experiment_id = init_store(store, "stale")
    client = MlflowClient(tracking_uri=store)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()

    def running(name: str, job_dir: str, pid: int) -> str:
        tags = {"rpb.host": host, "rpb.pid": str(pid), "rpb.job_dir": job_dir}
        return client.create_run(experiment_id, run_name=name, tags=tags).info.run_id

    stale = running("train/m/rpb/seed0", "/r/a", dead.pid)
    alive = running("train/m/rpb/seed0", "/r/a", os.getpid())
    other_dir = running("train/m/rpb/seed0", "/r/b", dead.pid)
    other_name = running("train/m/rpb/seed1", "/r/a", dead.pid)
    assert end_stale_runs(client, experiment_id, "train/m/rpb/seed0", "/r/a") == [stale]
    status = {rid: client.get_run(rid).info.status for rid in (stale, alive, other_dir, other_name)}
    assert status == {
        stale: "KILLED",
        alive: "RUNNING",
        other_dir: "RUNNING",
        other_name: "RUNNING",
    }


class _Interrupted(Exception):
    """The job's end right after a checkpoint (a preemption)."""


def test_a_damaged_checkpoint_fails_the_training_job_in_one_line(
    world: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Issue 59, item 3, in the pipeline's training job: `optimizer.pt` cut to 1000 bytes in
    the only complete checkpoint failed every rerun with torch's traceback and no rpb line. Now
    the job's one line names the checkpoint, the file and the command that discards it, and its
    MLflow run ends FAILED with that line (the previous checkpoint's fallback:
    tests/test_user_cli.py)."""
    import rpb.pipeline.training as training

    out = tmp_path / "run"
    on_save = training.CheckpointStateCallback.on_save

    def stop_after_checkpoint_3(self, args, state, control, **kwargs):
        on_save(self, args, state, control, **kwargs)
        raise _Interrupted

    with monkeypatch.context() as patch:
        patch.setattr(training.CheckpointStateCallback, "on_save", stop_after_checkpoint_3)
        with pytest.raises(_Interrupted):
            main(_train_args(world, out, "damaged_checkpoint"))
    last = out / "checkpoints" / "checkpoint-3"
    with open(last / "optimizer.pt", "r+b") as f:
        f.truncate(1000)
    capsys.readouterr()
    assert main(_train_args(world, out, "damaged_checkpoint")) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("rpb pipeline")]
    assert line.startswith(f"rpb pipeline train: error: {last}: optimizer.pt: 1000 bytes, not a ")
    assert line.endswith(f"(rm -rf {last}) and rerun, which trains this run from step 0")
    assert (last / "optimizer.pt").stat().st_size == 1000  # refused, not deleted
    failed = _runs(world["uri"], "damaged_checkpoint")[-1]
    assert failed.info.status == "FAILED"
    assert failed.data.tags[END_REASON_TAG] == line.removeprefix("rpb pipeline train: error: ")


def test_no_checkpoint_at_the_last_step(world: dict, tmp_path: Path) -> None:
    """The final weights are saved as the model; a checkpoint at max_steps would make a resumed
    Trainer train one step too many."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rpb.methods import make_method
    from rpb.pipeline.training import TrainSpec, run_training, tokenize_prompt_completion

    tok = AutoTokenizer.from_pretrained(world["base"])
    model = AutoModelForCausalLM.from_pretrained(world["base"])
    data = tokenize_prompt_completion(world["corpus"], tok, 16)
    method = make_method("none").attach(model)
    run_training(
        model, tok, data, method, TrainSpec(steps=4, batch_size=4, lr=1e-3, save_every=2), tmp_path
    )
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint-2"]


# --- damaged inputs: one line naming the file, no finished output lost ------------------------
# (docs/records/reliability.md, section 8)

# What an invocation itself changes (its store, logs, timings, records, lock); everything else
# under a finished results folder is finished work.
_NOT_WORK = ("mlflow.db", "mlartifacts/", "logs/", "benchmarks/", ".integrity/", ".invocation")


def _finished(results: Path) -> dict[str, str]:
    """sha256 of every finished file under `results`."""
    found = {}
    for path in results.rglob("*"):
        name = path.relative_to(results).as_posix()
        if path.is_file() and not name.startswith(_NOT_WORK):
            found[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


@pytest.fixture
def smoke_copy(smoke_run: Path, tmp_path: Path) -> Path:
    """A copy of the suite's smoke results (mtimes kept) that a test may damage."""
    copy = tmp_path / "results"
    shutil.copytree(smoke_run, copy, symlinks=True)
    return copy


def _snakemake(results: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    cmd, env = smoke_pipeline.snakemake_command(results, *args)
    proc = subprocess.run(cmd, cwd=smoke_pipeline.ROOT, env=env, capture_output=True, text=True)
    return proc, env


def _truncate(path: Path, keep: float = 0.5) -> int:
    """Cut `path` to `keep` of its bytes (its mtime becomes now); returns its size before."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return len(data)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The invocation's own message: its stderr's last line, the only one after Snakemake's
    note on extended config files, and no traceback."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Exception" not in proc.stderr, proc.stderr[-3000:]
    assert [line for line in lines if "extended by additional config" not in line] == lines[-1:]
    return lines[-1]


@pytest.mark.slow
def test_a_truncated_prior_stops_the_invocation_and_loses_nothing(
    smoke_run: Path, smoke_copy: Path
) -> None:
    """Before: Snakemake took the prior's fresh mtime for an update and deleted the 76 finished
    files downstream of it (5 runs' models, histories, evaluations and analyses), then every job
    failed on it. Now: one line naming the prior and the command that rebuilds it; that command
    restores the same tensors and touches nothing else."""
    import torch
    from safetensors.torch import load_file

    prior = smoke_copy / "priors" / "tinyA" / "base0" / "math.safetensors"
    damaged = prior.relative_to(smoke_copy).as_posix()
    before = _finished(smoke_copy)
    size = _truncate(prior)
    proc, env = _snakemake(smoke_copy, "--cores", "2", str(smoke_copy / "table1.csv"))
    line = _one_error_line(proc)
    assert line.startswith(
        f"integrity error: {prior}: {size // 2} bytes, {size} when it was written: truncated"
    )
    after = _finished(smoke_copy)
    lost = sorted(name for name in before if name != damaged and after.get(name) != before[name])
    assert lost == [] and len(before) > 40
    rebuild = line.split("; rebuild: ", 1)[1]
    assert rebuild.startswith(f"rm -rf {prior} && snakemake --cores 2 ")
    assert rebuild.endswith(f" --force -- {prior}")
    done = subprocess.run(
        ["bash", "-c", rebuild], cwd=smoke_pipeline.ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rebuilt, source = load_file(str(prior)), load_file(str(smoke_run / damaged))
    assert rebuilt.keys() == source.keys()
    assert all(torch.equal(rebuilt[k], source[k]) for k in source)
    again = _finished(smoke_copy)
    # Only the prior job's own outputs changed: its run record (a new MLflow run), and the prior's
    # metadata and JSON side file, which name its folder (docs/records/reliability.md, section 5).
    job = {damaged, "priors/tinyA/base0/math.json", "priors/tinyA/base0/math.run/mlflow_run.json"}
    assert {n for n in before if again.get(n) != before[n]} <= job


@pytest.mark.slow
def test_a_truncated_eval_output_stops_the_invocation_and_loses_nothing(smoke_copy: Path) -> None:
    """Before: table1.csv, table1.md and the figure were deleted, then the table job failed with
    "Unterminated string starting at: line 755 column 9", naming no file. The evaluation output
    has an integrity record (rpb.pipeline.evaluation.save_results writes it) whose size no longer
    matches; without one, the JSON format check would catch it."""
    evaluation = eval_path(smoke_copy, "tinyA", "math", "none", Run(0, 0))
    before = _finished(smoke_copy)
    _truncate(evaluation, keep=0.6)
    proc, _ = _snakemake(smoke_copy, "--cores", "2", str(smoke_copy / "table1.csv"))
    line = _one_error_line(proc)
    assert line.startswith(f"integrity error: {evaluation}: ")
    assert line.endswith(f" --force -- {evaluation}")
    after = _finished(smoke_copy)
    damaged = evaluation.relative_to(smoke_copy).as_posix()
    assert sorted(n for n in before if n != damaged and after.get(n) != before[n]) == []
    assert {"table1.csv", "table1.md", "figures/table1_coactivation.png"} <= set(after)


@pytest.mark.workflow
def test_a_damaged_record_alone_keeps_the_invocation_s_targets(tmp_path: Path) -> None:
    """Issue 59, item 4: for a damaged integrity record alone the advised command dropped the
    target, so it built rule `all` (89 jobs on the smoke config, hours at paper scale). It is now
    the invocation's own command, targets included, as the kill recovery's is."""
    results = tmp_path / "results"
    table = results / "table1.csv"
    table.parent.mkdir()
    table.write_text("method,acc\nnone,0.5\n")
    record = results / ".integrity" / "table1.csv.json"
    record.parent.mkdir()
    record.write_text('{"size": 1\n')
    options = ("--cores", "2", "--configfile", "config/smoke.yaml")
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "snakemake", "-n", *options),
            *("--config", f"results_dir={results}", "--", str(table)),
        ],
        cwd=smoke_pipeline.ROOT,
        env=dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"integrity error: {record}: damaged integrity record of {table} ")
    assert line.endswith(
        f"; rebuild: rm -rf {record} && snakemake {' '.join(options)} --config "
        f"results_dir={results} -- {table}"
    )
    assert table.read_text() == "method,acc\nnone,0.5\n" and record.exists()


@pytest.mark.slow
def test_a_model_folder_without_its_weights_is_one_line(smoke_copy: Path) -> None:
    """Before: "Nothing to be done", then a 23-line traceback in the next job that loaded it.
    The pretraining job records its model folder's files (rpb.pipeline.training), so the line names
    the lost file. With a second damaged file that no rule declares (table1.meta.json), the one
    command rebuilds both: the model folder, and the declared output whose job writes the side
    file."""
    model = smoke_copy / "models" / "tinyA" / "base0" / "model"
    weights = model / "model.safetensors"
    weights.unlink()
    meta = smoke_copy / "table1.meta.json"
    meta.write_text(meta.read_text()[:-20])
    proc, _ = _snakemake(smoke_copy, "-n", str(smoke_copy / "table1.csv"))
    line = _one_error_line(proc)
    assert line.startswith(f"integrity error: {weights}: missing, recorded when its folder was")
    assert " written (+1 more); rebuild: " in line
    assert f"rm -rf {weights} {meta} && snakemake --cores 1 " in line
    assert line.endswith(f" --force -- {model} {smoke_copy / 'table1.md'}")


@pytest.mark.slow
def test_a_truncated_model_weights_file_stops_the_invocation_and_loses_nothing(
    smoke_copy: Path,
) -> None:
    """A truncated base weights file with a fresh mtime would make Snakemake rerun, deleting
    their finished outputs first, every job downstream of the base. Its integrity record (written
    by rpb.pipeline.training) stops the invocation before the DAG is built, in one line naming the
    file and the command that rebuilds the folder; no finished file is lost."""
    model = smoke_copy / "models" / "tinyA" / "base0" / "model"
    weights = model / "model.safetensors"
    before = _finished(smoke_copy)
    size = _truncate(weights)
    proc, _ = _snakemake(smoke_copy, "--cores", "2", str(smoke_copy / "table1.csv"))
    line = _one_error_line(proc)
    assert line.startswith(
        f"integrity error: {weights}: {size // 2} bytes, {size} when it was written: truncated"
    )
    assert line.endswith(f" --force -- {model}")
    after = _finished(smoke_copy)
    damaged = weights.relative_to(smoke_copy).as_posix()
    assert sorted(n for n in before if n != damaged and after.get(n) != before[n]) == []


def _posttrain_hard(world: dict, out: Path) -> None:
    """Two steps of `hard` (its model folder carries its eval-time routing) on the tiny base."""
    from rpb.method_config import MethodConfig
    from rpb.pipeline.training import TrainSpec, posttrain

    posttrain(
        base_dir=world["base"],
        prior_path=world["prior"],
        corpus=world["corpus"],
        method=MethodConfig("hard"),
        spec=TrainSpec(steps=2, batch_size=4, lr=1e-3, max_length=16),
        out_dir=out,
    )


def test_a_trained_model_folder_is_recorded_and_a_damaged_weights_file_is_one_line(
    world: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Training writes its model folder whole (a hidden temporary folder renamed into place) and
    records every file, the eval-time routing included. A truncated or lost weights file of the
    finished folder is then named, file and all, by the check that runs before Snakemake builds
    its DAG (so before it deletes anything), in one line with the command that rebuilds it."""
    from rpb.pipeline.results_folder import (
        RECORDS,
        RESULTS_ENV,
        Problem,
        check_results,
        integrity_message,
    )

    results = tmp_path / "results"
    monkeypatch.setenv(RESULTS_ENV, str(results))
    run = results / "runs" / "tiny8" / "math" / "hard" / "base0" / "seed0"
    _posttrain_hard(world, run)
    model = run / "model"
    recorded = sorted(
        p.relative_to(results / RECORDS / run.relative_to(results)).as_posix()
        for p in (results / RECORDS).rglob("*.json")
        if p.is_file() and "model" in p.relative_to(results / RECORDS).parts
    )
    assert {"model/config.json.json", "model/model.safetensors.json"} <= set(recorded)
    assert "model/eval_routing/method.json.json" in recorded  # written before the rename
    assert not [p for p in (results / RECORDS).rglob("*") if ".partial" in p.as_posix()]
    assert sorted(p.name for p in run.iterdir()) == ["model", "train_history.json"]
    assert check_results(results, update=True) == []

    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    problems = check_results(results, update=True)
    assert problems == [
        Problem(
            str(weights),
            f"{len(data) // 2} bytes, {len(data)} when it was written: truncated or changed since",
        )
    ]
    line = integrity_message(problems, lambda path: str(model))
    assert "\n" not in line
    assert line.startswith(f"integrity error: {weights}: {len(data) // 2} bytes, {len(data)} when")
    assert line.endswith(f"; rebuild: rm -rf {weights} && snakemake --cores 1 --force -- {model}")

    weights.unlink()  # lost: named as the file, not only as an incomplete folder
    problems = check_results(results, update=True)
    assert problems == [Problem(str(weights), "missing, recorded when its folder was written")]
    assert integrity_message(problems).startswith(f"integrity error: {weights}: missing, ")
    shutil.rmtree(model)  # as Snakemake removes it before rerunning its job: nothing to report
    assert check_results(results, update=True) == []
    assert not list((results / RECORDS / model.relative_to(results)).rglob("*.json"))


def test_a_model_folder_that_fails_while_saving_is_not_left(
    world: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk while the model folder is written: no folder that looks finished, no
    temporary folder, and the error names the file under the model folder in one line."""
    import errno

    import rpb.posttraining
    from rpb.artifacts import failure_line
    from rpb.pipeline.results_folder import RESULTS_ENV, check_results

    results = tmp_path / "results"
    monkeypatch.setenv(RESULTS_ENV, str(results))

    def full_disk(folder: Path, method: Any, prior: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "eval_routing"))

    monkeypatch.setattr(rpb.posttraining, "save_eval_routing", full_disk)
    run = results / "runs" / "tiny8" / "math" / "hard" / "base0" / "seed0"
    with pytest.raises(OSError) as raised:
        _posttrain_hard(world, run)
    assert raised.value.filename == str(run / "model" / "eval_routing")
    line = failure_line(raised.value)
    assert line is not None and line.startswith(f"{run / 'model' / 'eval_routing'}: No space left")
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints"]  # as after a kill: resumable
    assert check_results(results) == []


def test_a_swapped_model_folder_is_recorded(
    world: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rpb.router_swap writes its model folder whole and records it, swap.json included."""
    from rpb.pipeline.results_folder import RECORDS, RESULTS_ENV, check_results
    from rpb.router_swap import swap_saved_parts

    results = tmp_path / "results"
    monkeypatch.setenv(RESULTS_ENV, str(results))
    out = results / "diagnostic" / "router_swap" / "models" / "tiny8" / "model"
    out.mkdir(parents=True)
    (out / "stale.json").write_text("{}")  # a previous folder is replaced whole
    swap_saved_parts(world["base"], world["base"], ["routers"], out)
    records = results / RECORDS / out.relative_to(results)
    assert {"config.json.json", "model.safetensors.json", "swap.json.json"} <= {
        p.name for p in records.iterdir()
    }
    assert not (out / "stale.json").exists() and check_results(results) == []
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    (problem,) = check_results(results)
    assert problem.path == str(weights) and problem.what.endswith("truncated or changed since")


def _job(world: dict, job: str, *args: str) -> list[str]:
    """`rpb pipeline <job>` arguments, tracked in the "inputs" experiment."""
    return ["pipeline", job, "--tracking-uri", world["uri"], "--experiment", "inputs", *args]


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_job_reading_a_damaged_model_fails_in_one_line(
    damage: str, world: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job started by hand (no check before it): one line naming the folder or file, what to
    do, and its MLflow run FAILED with that line."""
    base = tmp_path / "base" / "model"
    shutil.copytree(world["base"], base)
    weights = base / "model.safetensors"
    if damage == "missing":
        weights.unlink()
    else:
        _truncate(weights)
    args = ("--name", "tiny8", "--model", str(base), "--corpus", str(world["corpus"]))
    code = main(_job(world, "prior", *args, "--out", str(tmp_path / "prior.safetensors")))
    lines = capsys.readouterr().err.strip().splitlines()
    err = [line for line in lines if "error" in line.lower() or "Traceback" in line]
    assert code == 2 and err == lines[-1:], lines  # MLflow's INFO lines aside
    if damage == "missing":
        assert err[0].startswith("rpb pipeline prior: error: Error no file named model.safetensors")
        assert f"found in directory {base}" in err[0]
    else:
        assert err[0].startswith(
            f"rpb pipeline prior: error: {weights}: Error while deserializing header"
        )
    assert err[0].endswith("; delete it and rerun the pipeline to rebuild it")
    run = _runs(world["uri"], "inputs")[-1]
    assert run.info.status == "FAILED"
    assert run.data.tags[END_REASON_TAG] == err[0].removeprefix("rpb pipeline prior: error: ")


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    """Before: "Config file is not valid JSON or YAML" in two lines, naming neither."""
    from rpb.pipeline.config_check import ConfigError, check_yaml_syntax

    bad = tmp_path / "bad.yaml"
    bad.write_text("seeds: [0, 1]\nmethods:\n  rpb: {strength: 1.0\n  lbl: {}\n")
    with pytest.raises(ConfigError) as raised:
        check_yaml_syntax(bad)
    assert str(raised.value) == (f"{bad}:4:6: YAML syntax error: expected ',' or '}}', but got ':'")
    tabs = tmp_path / "tabs.yaml"
    tabs.write_text("posttrain:\n\tsteps: 3\n")
    with pytest.raises(ConfigError, match=rf"^{tabs}:2:1: .*indent with spaces, not tabs\)$"):
        check_yaml_syntax(tabs)
    check_yaml_syntax(tmp_path / "absent.yaml")  # Snakemake reports a missing file itself
    done = subprocess.run(
        [sys.executable, "-m", "rpb.pipeline.config_check", str(bad), "config/smoke.yaml"],
        cwd=smoke_pipeline.ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    assert done.stderr.splitlines() == [f"config error: {raised.value}"]


def test_rpb_check_config_names_the_file_and_line_of_each_bad_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`rpb check-config` (and `make check-config`, `make smoke`): one line per bad or missing
    file, exit 2; good files pass in silence."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("seeds: [0\nbroken: 1\n")
    smoke = str(smoke_pipeline.ROOT / "config" / "smoke.yaml")
    assert main(["check-config", smoke]) == 0
    assert capsys.readouterr().err == ""
    assert main(["check-config", str(bad), smoke, str(tmp_path / "absent.yaml")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"rpb check-config: error: {bad}:2:7: YAML syntax error: expected ',' or ']', but got ':'",
        f"rpb check-config: error: {tmp_path / 'absent.yaml'}: no such config file",
    ]


def test_a_config_that_would_run_code_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 47: `__use_yte__` made Snakemake's loader run a config's expressions as code (a
    shell command under `snakemake -n`) and `rpb check-config` passed it; `!!python/name:` tags
    were built before the schema refused them. Both are refused, naming the file and line."""
    from snakemake.common.configfile import load_configfile

    from rpb.pipeline.config_check import ConfigError, check_yaml_syntax

    marker = tmp_path / "ran"
    yte = tmp_path / "yte.yaml"
    yte.write_text(
        f"seeds: [0]\n__use_yte__: true\nposttrain:\n  steps: "
        f"?__import__('pathlib').Path('{marker}').touch() or 3\n"
    )
    tag = tmp_path / "tag.yaml"
    tag.write_text("seeds: [0]\nposttrain:\n  steps: !!python/name:os.system\n")
    with pytest.raises(ConfigError) as raised:
        check_yaml_syntax(yte)
    assert str(raised.value) == (
        f"{yte}:2: __use_yte__ is refused: it makes Snakemake run the file's expressions as "
        "Python code (YTE templates) while it reads the config, even in a dry run; write the "
        "values themselves"
    )
    assert not marker.exists()
    with pytest.raises(ConfigError, match=rf"^{tag}:3:10: YAML tag !!python/name:os.system is "):
        check_yaml_syntax(tag)
    assert main(["check-config", str(yte), str(tag)]) == 2
    assert [line.split(": ")[3] for line in capsys.readouterr().err.splitlines()] == [
        "__use_yte__ is refused",
        "YAML tag !!python/name:os.system is refused",
    ]
    load_configfile(str(yte))  # what the check stands between: Snakemake's loader runs it
    assert marker.exists()
    json_tabs = tmp_path / "tabs.json"  # JSON is read as JSON first: tabs are fine there
    json_tabs.write_text('{\n\t"seeds": [0]\n}\n')
    check_yaml_syntax(json_tabs)


@pytest.mark.workflow
def test_a_templated_configfile_stops_the_workflow_in_one_line(tmp_path: Path) -> None:
    """Snakemake evaluates a --configfile's YTE template while it reads its command line, before
    any workflow code (so `rpb check-config` is the check that comes first); the Snakefile then
    stops the invocation instead of running with a config computed by code."""
    yte = tmp_path / "yte.yaml"
    yte.write_text("seeds: [0]\n__use_yte__: true\nposttrain:\n  steps: ?1 + 2\n")
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--configfile", str(yte)],
        cwd=smoke_pipeline.ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"config error: {yte}:2: __use_yte__ is refused: it makes Snakemake run the file's "
        "expressions as Python code (YTE templates) while it reads the config, even in a dry "
        "run; write the values themselves"
    ]


def test_a_config_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    """Issue 47: invalid UTF-8 in a config gave 34 lines; now the file, its line and the byte."""
    from rpb.pipeline.config_check import ConfigError, check_yaml_syntax

    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("seeds: [0]\nexperiment: r\u00e9sum\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError) as raised:
        check_yaml_syntax(bad)
    assert str(raised.value) == (
        f"{bad}:2: not UTF-8 (byte 0xe9 at offset 24): save the config as UTF-8"
    )


@pytest.mark.workflow
def test_snakemake_reads_a_configfile_before_any_workflow_code(tmp_path: Path) -> None:
    """Why `--configfile` needs `rpb check-config`: Snakemake parses the file while it reads its
    command line (snakemake.settings.types.ConfigSettings.__post_init__), before the Snakefile,
    whose check of config/config.yaml never runs. If this changes, the Snakefile can check
    `workflow.overwrite_configfiles` itself."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("seeds: [0\nbroken: 1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--configfile", str(bad)],
        cwd=smoke_pipeline.ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    # On stdout: Snakemake's logging is not set up yet either.
    assert (proc.stdout + proc.stderr).strip().splitlines() == [
        "WorkflowError:",
        "Config file is not valid JSON or YAML. In case of YAML, make sure to not mix whitespace "
        "and tab indentation.",
    ]


@pytest.mark.slow
def test_a_yaml_syntax_error_in_the_workflow_config_is_one_line(tmp_path: Path) -> None:
    """The Snakefile checks config/config.yaml before Snakemake loads it (a checkout copy with
    a broken config; `--configfile` files Snakemake reads before the workflow, see the docs)."""
    from test_rerun_triggers import _copy_checkout

    _copy_checkout(smoke_pipeline.ROOT, tmp_path)
    config = tmp_path / "config" / "config.yaml"
    config.write_text(config.read_text().replace("seeds:", "seeds: [0\nbroken:", 1))
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n"], cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1:] == proc.stderr.strip().splitlines()
    assert proc.stderr.startswith("config error: config/config.yaml:")
    assert "YAML syntax error" in proc.stderr


def _make_recipes() -> dict[str, list[str]]:
    """The Makefile's targets and their recipe lines (continuations joined)."""
    text = (smoke_pipeline.ROOT / "Makefile").read_text().replace("\\\n", " ")
    recipes: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("\t") and current is not None:
            recipes[current].append(line.strip())
        elif re.match(r"^[A-Za-z][\w.-]*:(?!=)", line):
            current = line.split(":", 1)[0]
            recipes[current] = []
        elif line.strip() and not line.startswith("#"):
            current = None
    return recipes


def test_every_make_target_checks_its_configfile_before_snakemake_reads_it() -> None:
    """Issue 59, items 1 and 8: Snakemake reads a --configfile with its command line, before any
    workflow code: a YTE template's code ran (and wrote its marker) before the Snakefile's one-line
    refusal, a file that is not UTF-8 was a 34-line traceback. Every make target that hands
    Snakemake a --configfile runs `rpb check-config` on it first (config/config.yaml, which the
    `configfile:` directive reads, the Snakefile checks before reading it)."""
    recipes = _make_recipes()
    given = {}
    for target, lines in recipes.items():
        checked: set[str] = set()
        for line in lines:
            words = line.split()
            if words[:2] == ["rpb", "check-config"]:
                checked |= set(words[2:])
            if "snakemake" in words and "--configfile" in words:
                config = words[words.index("--configfile") + 1]
                given[target] = config
                assert config in checked, f"make {target}: snakemake reads {config} unchecked"
    assert given == {"smoke": "config/smoke.yaml", "report": "$(LAST_CONFIG)"}


# A pipeline job of a killed invocation, still running: `rpb pipeline ...` as the `rpb` command
# starts it (the job lock taken first), then busy for a minute.
_RUNNING_JOB = """
import sys, time
import rpb.pipeline.cli as cli
sys.argv = ["rpb", "pipeline", "train", "--name", "tinyA"]
cli.build_parser = lambda: time.sleep(120)
cli.main()
"""


def _running_job(results: Path) -> subprocess.Popen:
    from rpb.pipeline.results_folder import RESULTS_ENV, live_jobs

    env = dict(os.environ, **{RESULTS_ENV: str(results)})
    job = subprocess.Popen([sys.executable, "-c", _RUNNING_JOB], env=env)
    deadline = time.monotonic() + 60
    while not live_jobs(results):
        assert job.poll() is None and time.monotonic() < deadline, "the job never started"
        time.sleep(0.05)
    return job


@pytest.mark.workflow
def test_what_a_job_finishes_after_its_snakemake_was_killed_is_not_run_again(
    tmp_path: Path,
) -> None:
    """Issue 59, item 2, end to end: Snakemake's own pid SIGKILLed while the corpora job runs;
    the job finishes unseen (Snakemake never unmarks its outputs). The next invocation keeps its
    three outputs (a folder among them), says so in one line, and runs nothing again."""
    from rpb.pipeline.results_folder import live_jobs

    results = tmp_path / "results"
    cmd, env = smoke_pipeline.snakemake_command(
        results, f"{results}/data/manifest.json", "--cores", "1"
    )
    first = subprocess.Popen(cmd, cwd=smoke_pipeline.ROOT, env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not any("pipeline corpora" in job["command"] for job in live_jobs(results)):
        assert first.poll() is None and time.monotonic() < deadline, "corpora never started"
        time.sleep(0.05)
    first.kill()  # Snakemake alone: its job runs on
    first.wait()
    while live_jobs(results):
        assert time.monotonic() < deadline, "the corpora job never ended"
        time.sleep(0.1)
    again = subprocess.run(cmd, cwd=smoke_pipeline.ROOT, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    kept = f"{results}/data/manifest.json (+2 more), finished by its jobs after the kill, is kept"
    assert kept in again.stderr
    assert "rule corpora" not in again.stderr and "Nothing to be done" in again.stderr


@pytest.mark.workflow
def test_jobs_of_a_killed_snakemake_are_seen_by_the_next_invocation(tmp_path: Path) -> None:
    """Issue 59, item 2: SIGKILL of Snakemake's own pid (not its group) left its jobs running,
    and the next invocation, started while they still wrote, ran them again beside themselves.
    Each pipeline job now holds a lock file under `<results>/.jobs/` for its life; an invocation
    that would run jobs refuses in one line naming them while any is alive, and goes on once they
    ended (the file of a SIGKILLed job is removed, its lock being gone)."""
    from rpb.pipeline.results_folder import JOBS_DIR, live_jobs

    results = tmp_path / "results"
    job = _running_job(results)
    try:
        (found,) = live_jobs(results)
        assert found["pid"] == job.pid and found["command"] == "rpb pipeline train --name tinyA"
        cmd = [sys.executable, "-m", "snakemake", "--cores", "1"]
        cmd += ["--configfile", "config/smoke.yaml", "--config", f"results_dir={results}"]
        proc = subprocess.run(
            [*cmd, "--", f"{results}/table1.csv"],
            cwd=smoke_pipeline.ROOT,
            env=dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"),
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 1, proc.stderr[-3000:]
        # After Snakemake's own note on the config files, one line.
        assert proc.stderr.strip().splitlines()[1:] == [
            f"busy: results folder {results} has 1 job(s) still running from an invocation that "
            f"was killed (pid {job.pid} on {socket.gethostname()}: rpb pipeline train --name "
            f"tinyA); wait for them to end (or stop them: kill {job.pid}), then rerun"
        ]
        assert not (results / "mlflow.db").exists()  # refused before anything ran
    finally:
        job.kill()
        job.wait()
    assert live_jobs(results) == [] and list((results / JOBS_DIR).iterdir()) == []
