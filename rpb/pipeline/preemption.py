"""Preemption: a training job that is told to stop saves a checkpoint first, then exits, and the
requeued job resumes from that checkpoint.

Slurm warns a job before its time limit with the signal `--signal=USR1@600` asks for (the slurm
profile sets it for training jobs: ten minutes, time to write a 30B model's checkpoint), and
cancels or preempts it with SIGTERM. `PreemptionCallback` turns either signal, while the Trainer
runs, into a checkpoint at the end of the step in progress (every rank agrees on the step) and a
stop. The job then exits with `PREEMPTED_EXIT` (75, EX_TEMPFAIL) after asking Slurm to requeue it
(`scontrol requeue $SLURM_JOB_ID`: the same job id goes back to the queue, and Snakemake's slurm
plugin keeps waiting for it). Off Slurm, or where the requeue is refused, the exit status fails the
job and Snakemake's `retries` resubmits it; either way the next start resumes from the checkpoint
(rpb.pipeline.training.resumable_checkpoint), bit for bit the uninterrupted run.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from collections.abc import Sequence
from typing import Any

import torch
from transformers import TrainerCallback

from rpb.pipeline.tracking import JobTerminated

log = logging.getLogger(__name__)

# SIGUSR1: Slurm's warning before the time limit (`--signal=USR1@<seconds>`); SIGTERM: a cancel,
# a preemption, or the time limit itself.
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTED_EXIT = 75  # EX_TEMPFAIL: a temporary failure, retrying resumes the job


class Preempted(JobTerminated):
    """Training stopped at a signal after a complete checkpoint; the job exits PREEMPTED_EXIT
    (a JobTerminated, so its MLflow run ends KILLED)."""


class PreemptionCallback(TrainerCallback):
    """On any of `signals` during training: save a checkpoint at the end of the current step, stop
    training, request a Slurm requeue (main process) and raise `Preempted`.

    The handlers only record the signal; the step in progress finishes. Under a multi-process
    launch the ranks agree at each step end (a max over the ranks' flags), so every rank saves the
    same step even when the signal reaches them at different times. At the last step the signal
    is ignored: the job saves its model right after.
    """

    def __init__(self, signals: Sequence[int] = PREEMPT_SIGNALS):
        self.signals = tuple(signals)
        self.received: int | None = None
        self.stopped_at: int | None = None
        self._previous: dict[int, Any] = {}

    def _record(self, signum: int, frame: Any) -> None:
        self.received = signum

    def on_train_begin(self, args, state, control, **kwargs):
        if threading.current_thread() is threading.main_thread():  # only it can set handlers
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._record)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps or not self._any_rank_signalled():
            return
        control.should_save = True
        control.should_training_stop = True
        self.stopped_at = state.global_step
        name = signal.Signals(self.received).name if self.received else "another rank's signal"
        log.warning("%s: saving a checkpoint at step %d and stopping", name, state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        if self.stopped_at is None:
            return
        if state.is_world_process_zero:
            requeue_slurm_job()
        raise Preempted(PREEMPTED_EXIT)

    def _any_rank_signalled(self) -> bool:
        flag = self.received is not None
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return flag
        from accelerate import PartialState

        # On the process's device: NCCL reduces GPU tensors only.
        votes = torch.tensor([int(flag)], device=PartialState().device)
        dist.all_reduce(votes, op=dist.ReduceOp.MAX)
        return bool(votes.item())


def requeue_slurm_job() -> bool:
    """Put this Slurm job back into the queue (`scontrol requeue $SLURM_JOB_ID`); False outside
    Slurm or when the requeue fails (then the exit status leaves the retry to Snakemake)."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return False
    command = ["scontrol", "requeue", job]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", None) or err
        shown = " ".join(command)
        log.warning("%s failed (%s): Snakemake's retries resubmit the job", shown, detail)
        return False
    log.warning("requeued Slurm job %s: it resumes from the checkpoint just saved", job)
    return True
