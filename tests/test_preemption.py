"""Preemption (issue 57, item 3): a training job signalled mid-training (Slurm's SIGUSR1 before
the time limit, or SIGTERM) saves a checkpoint at the end of that step, asks Slurm to requeue it
and exits 75; the rerun resumes from that checkpoint and ends with the uninterrupted run's weights
and history, bit for bit. test_faults.py's world (a tiny qwen3_moe base, rpb_adaptive with its
bias outside the model, 12 steps with checkpoints every 3) is reused.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import test_faults
from test_faults import _env, _runs, _train_args

from rpb.pipeline.cli import main
from rpb.pipeline.preemption import PREEMPTED_EXIT, PreemptionCallback, requeue_slurm_job
from rpb.pipeline.tracking import END_REASON_TAG
from rpb.pipeline.training import CHECKPOINT_STATE

SIGNALLED_STEP = 5  # between the checkpoints at 3 and 6: the signal's own checkpoint is step 5
# `rpb` as the console script runs it, sending itself the signal while step 5 computes.
SIGNAL_IN_STEP = """
import os, signal, sys
from transformers import Trainer
training_step, calls = Trainer.training_step, []
def signal_in_step(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == {step}:
        os.kill(os.getpid(), signal.{name})
    return training_step(self, *args, **kwargs)
Trainer.training_step = signal_in_step
from rpb.pipeline.cli import main
sys.exit(main(sys.argv[1:]))
"""
# test_faults.py's fixtures, shared: a saved tiny base, its corpus and prior, an MLflow store.
store, world = test_faults.store, test_faults.world
# A stand-in for Slurm's scontrol: records its arguments.
FAKE_SCONTROL = '#!/bin/sh\necho "$@" >> "$(dirname "$0")/calls"\n'


@pytest.fixture(scope="module")
def reference(world: dict) -> Path:
    out = world["root"] / "preemption_reference"
    assert main(_train_args(world, out, "preemption_reference")) == 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["SIGUSR1", "SIGTERM"])
def test_signalled_training_saves_requeues_and_resumes_bit_identical(
    world: dict, reference: Path, tmp_path: Path, name: str
) -> None:
    from safetensors.torch import load_file

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
    (bin_dir / "scontrol").chmod(0o755)
    env = dict(_env(), SLURM_JOB_ID="4242", PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "run"
    experiment = f"preempted_{name}"
    script = SIGNAL_IN_STEP.format(step=SIGNALLED_STEP, name=name)
    proc = subprocess.run(
        [sys.executable, "-c", script, *_train_args(world, out, experiment)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == PREEMPTED_EXIT, proc.stderr[-3000:]
    assert f"{name}: saving a checkpoint at step {SIGNALLED_STEP} and stopping" in proc.stderr
    # One checkpoint, complete, at the signalled step (the one at 3 rotated away); no outputs.
    checkpoints = out / "checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == [f"checkpoint-{SIGNALLED_STEP}"]
    assert (checkpoints / f"checkpoint-{SIGNALLED_STEP}" / CHECKPOINT_STATE).is_file()
    assert not (out / "model").exists() and not (out / "train_history.json").exists()
    assert (bin_dir / "calls").read_text() == "requeue 4242\n"
    (killed,) = _runs(world["uri"], experiment)
    assert killed.info.status == "KILLED" and killed.data.tags[END_REASON_TAG] == "SIGTERM"

    # The requeued job: the same command resumes and finishes as if never stopped.
    assert main(_train_args(world, out, experiment)) == 0
    want = load_file(reference / "model" / "model.safetensors")
    got = load_file(out / "model" / "model.safetensors")
    assert want.keys() == got.keys()
    differ = [k for k in want if not want[k].equal(got[k])]
    assert not differ, f"resumed weights differ from the uninterrupted run: {differ[:5]}"
    history = (out / "train_history.json").read_bytes()
    assert history == (reference / "train_history.json").read_bytes()
    _, resumed = _runs(world["uri"], experiment)
    assert resumed.data.tags["resumed_from"] == f"checkpoint-{SIGNALLED_STEP}"
    assert not checkpoints.exists()


class _Control:
    should_save = False
    should_training_stop = False


class _State:
    def __init__(self, step: int, max_steps: int = 10):
        self.global_step, self.max_steps, self.is_world_process_zero = step, max_steps, True


def test_no_signal_no_stop_and_handlers_restored() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    callback, control = PreemptionCallback(), _Control()
    callback.on_train_begin(None, _State(0), control)
    assert signal.getsignal(signal.SIGUSR1) == callback._record
    callback.on_step_end(None, _State(1), control)
    assert not control.should_save and not control.should_training_stop
    callback.on_train_end(None, _State(10), control)  # no signal: returns
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_signal_at_the_last_step_lets_the_job_finish() -> None:
    """At max_steps the job saves its model next: a checkpoint there would make a resume train
    one step too many (tests/test_faults.py::test_no_checkpoint_at_the_last_step)."""
    callback, control = PreemptionCallback(), _Control()
    callback.on_train_begin(None, _State(9), control)
    os.kill(os.getpid(), signal.SIGUSR1)
    callback.on_step_end(None, _State(10), control)
    assert not control.should_save and not control.should_training_stop
    callback.on_train_end(None, _State(10), control)


def test_requeue_outside_slurm_or_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert requeue_slurm_job() is False
    refusing = tmp_path / "scontrol"
    refusing.write_text("#!/bin/sh\necho 'Requeue of job not allowed' >&2\nexit 1\n")
    refusing.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert requeue_slurm_job() is False  # the exit status leaves the retry to Snakemake
