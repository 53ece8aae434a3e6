"""Post-training with a router method on transformers' Trainer: the one setup that the pipeline's
jobs (rpb.pipeline.training) and `rpb finetune` (rpb.user_cli) share.

A job's settings are a `TrainSpec` (rpb.train_spec). `posttrain_model` is the one post-training
setup (the parameters it updates, the router method attached with its prior, the saved folder's
routing) and `run_training` the loop both stages run: a `RouterMethodTrainer` whose `compute_loss`
adds the attached method's term to the task loss, with checkpoints that resume to the weights of an
unbroken run, an atomic model folder, and each log sent to the active MLflow run if any. Seeds fix
the data order, so every method sees the same batches for a given seed (docs/design.md, section
10).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shlex
import shutil
import sys
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from torch.utils.data import Dataset
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer import TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from rpb.artifacts import ArtifactError, json_problem, safetensors_problem
from rpb.eval_routing import save_eval_routing
from rpb.methods import RouterMethod
from rpb.prior import RouterPrior
from rpb.train_spec import TrainSpec
from rpb.trainable import select_trainable
from rpb.trainer import RouterMethodTrainer, RoutingDriftCallback  # noqa: F401 (public here too)

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
# Written into each Trainer checkpoint by `CheckpointStateCallback`, after everything the Trainer
# writes there: its presence marks the checkpoint complete (see `last_complete_checkpoint`).
CHECKPOINT_STATE = "rpb_state.pt"


class TokenizedExamples(Dataset):
    """Pre-tokenised examples; labels mask the prompt for answer-only loss."""

    def __init__(self, examples: list[dict[str, list[int]]]):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.examples[i]


class RightPadCollator:
    """Right padding for training: positions then match unpadded text, as in pretraining."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, batch: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        width = max(len(ex["input_ids"]) for ex in batch)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, ex in enumerate(batch):
            n = len(ex["input_ids"])
            input_ids[row, :n] = torch.tensor(ex["input_ids"])
            labels[row, :n] = torch.tensor(ex["labels"])
            attention_mask[row, :n] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class CheckpointStateCallback(TrainerCallback):
    """Completes each Trainer checkpoint with what the Trainer does not save, then rotates.

    The Trainer saves model, optimizer, scheduler, RNG and data position, but not the router
    method's own state (rpb_adaptive's bias) nor our metric history. They are written last, and
    atomically, so a job killed mid-save leaves a checkpoint without them, which resume skips.
    Only after that is the previous checkpoint removed; the Trainer's own `save_total_limit`
    rotation would remove it before this callback runs, leaving no complete checkpoint at all if
    the job died in between.
    """

    def __init__(self, method: RouterMethod, history: list[dict[str, float]], meter: Any = None):
        self.method = method
        self.history = history
        self.meter = meter  # the trainer's RoutingMeter: the open logging interval's sums

    def on_step_end(self, args, state, control, **kwargs):
        # No checkpoint at the last step: the job saves the final model right after, and the
        # Trainer resuming from a checkpoint at max_steps would train one step too many.
        if state.global_step >= state.max_steps:
            control.should_save = False

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if self.meter is not None:  # each rank's own sums, before the completion mark
            meter = folder / meter_state_name(PartialState().process_index)
            torch.save(self.meter.state_dict(), meter.with_suffix(".tmp"))
            os.replace(meter.with_suffix(".tmp"), meter)
        # Every rank has written its part (its RNG state, shards) before the mark goes in.
        PartialState().wait_for_everyone()
        if not args.should_save:  # not the main process of a multi-process launch
            return
        payload = {"method": self.method.state_dict(), "history": list(self.history)}
        tmp = folder / f"{CHECKPOINT_STATE}.tmp"
        torch.save(payload, tmp)
        os.replace(tmp, folder / CHECKPOINT_STATE)
        for old in _checkpoints(Path(args.output_dir)):
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)


def meter_state_name(rank: int) -> str:
    """The file of one rank's routing-meter sums inside a checkpoint."""
    return f"rpb_meter.rank{rank}.pt"


def _checkpoints(checkpoint_dir: Path) -> list[Path]:
    """Trainer checkpoint folders (`checkpoint-<step>`) under `checkpoint_dir`, oldest first."""
    if not checkpoint_dir.is_dir():
        return []
    found = [p for p in checkpoint_dir.iterdir() if p.is_dir() and _checkpoint_step(p) is not None]
    return sorted(found, key=_checkpoint_step)


def _checkpoint_step(path: Path) -> int | None:
    prefix = f"{PREFIX_CHECKPOINT_DIR}-"
    tail = path.name.removeprefix(prefix)
    return int(tail) if path.name.startswith(prefix) and tail.isdigit() else None


def last_complete_checkpoint(
    checkpoint_dir: Path, *, remove_incomplete: bool = True
) -> Path | None:
    """The newest checkpoint that has our state file. Incomplete ones (the job died while saving)
    are deleted unless `remove_incomplete` is false: the Trainer would resume from the newest
    folder, or rotate the new ones away."""
    complete = None
    for path in _checkpoints(checkpoint_dir):
        if (path / CHECKPOINT_STATE).is_file():
            complete = path
        elif remove_incomplete:
            log.warning("removing incomplete checkpoint %s (the job died while saving it)", path)
            shutil.rmtree(path, ignore_errors=True)
    return complete


# What the Trainer reads back on resume, by the file's suffix: torch.save writes zip archives.
def _torch_file_problem(path: Path) -> str | None:
    try:
        with zipfile.ZipFile(path):
            return None
    except (zipfile.BadZipFile, OSError) as err:
        return f"{path.stat().st_size} bytes, not a whole torch file ({err}): truncated or damaged"


_CHECKPOINT_FILE_CHECKS: dict[str, Callable[[Path], str | None]] = {
    ".json": json_problem,
    ".safetensors": safetensors_problem,
    ".pt": _torch_file_problem,
    ".pth": _torch_file_problem,
    ".bin": _torch_file_problem,
}


def checkpoint_problem(folder: Path) -> str | None:
    """Why the complete checkpoint `folder` cannot be resumed from (a file the Trainer or rpb
    reads back is missing, cut or damaged), as `<file>: <what>`, or None. Reads headers and
    archive directories only, never the tensors."""
    if not (folder / TRAINER_STATE_NAME).is_file():
        return f"{TRAINER_STATE_NAME}: missing"
    for path in sorted(folder.iterdir()):
        check = _CHECKPOINT_FILE_CHECKS.get(path.suffix)
        problem = check(path) if check and path.is_file() else None
        if problem:
            return f"{path.name}: {problem}"
    return None


def drop_damaged_checkpoints(checkpoint_dir: Path) -> None:
    """Fall back from a damaged newest complete checkpoint to the previous complete one: the
    damaged one is removed, with one line naming it. The last complete checkpoint is kept even when
    damaged: `resumable_checkpoint` refuses it with the command that discards it."""
    complete = [p for p in _checkpoints(checkpoint_dir) if (p / CHECKPOINT_STATE).is_file()]
    while len(complete) > 1 and (problem := checkpoint_problem(complete[-1])):
        damaged = complete.pop()
        log.warning(
            "checkpoint %s is damaged (%s): resuming from the previous complete checkpoint %s",
            damaged,
            problem,
            complete[-1],
        )
        (damaged / CHECKPOINT_STATE).unlink()  # incomplete first, as remove_checkpoints does
        shutil.rmtree(damaged, ignore_errors=True)


def resumable_checkpoint(checkpoint_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None; ArtifactError in one line, naming it and the
    command that discards it, when it is damaged (`drop_damaged_checkpoints` has run: no earlier
    complete one is left to fall back to)."""
    last = last_complete_checkpoint(checkpoint_dir, remove_incomplete=False)
    problem = last and checkpoint_problem(last)
    if problem:
        raise ArtifactError(
            f"{last}: {problem}; the checkpoint is damaged and no earlier complete one is left: "
            f"discard it (rm -rf {shlex.quote(str(last))}) and rerun, which trains this run "
            "from step 0"
        )
    return last


def remove_checkpoints(checkpoint_dir: Path) -> None:
    """Delete a finished job's checkpoints (at paper scale each holds the optimizer state too).

    Completion marks go first: a removal cut short leaves only incomplete checkpoints, which a
    rerun ignores, never a complete-looking one with files missing.
    """
    for path in _checkpoints(checkpoint_dir):
        (path / CHECKPOINT_STATE).unlink(missing_ok=True)
    shutil.rmtree(checkpoint_dir, ignore_errors=True)


def _active_mlflow() -> Any:
    """The mlflow module while an MLflow run is active, else None. A run is started through
    mlflow, so where nothing imported it (the light install, which may not have it: `rpb
    finetune` without --mlflow) there is none, and mlflow is never imported here."""
    mlflow = sys.modules.get("mlflow")
    return mlflow if mlflow is not None and mlflow.active_run() is not None else None


def _log_to_active_run(metrics: dict[str, float], step: int) -> None:
    mlflow = _active_mlflow()
    if mlflow is None:
        return
    # Names as in train_history.json ("layer0/kl_to_base"): MLflow accepts "/".
    finite = {k: v for k, v in metrics.items() if math.isfinite(v)}
    mlflow.log_metrics(finite, step=step)


class MlflowHistoryCallback(TrainerCallback):
    """Sends each new `train_history.json` entry (the trainer's `router_history`, appended at
    every training log) to the job's active MLflow run, under the same names and step."""

    def __init__(self, history: list[dict[str, float]]):
        self.history = history
        self._sent: dict[str, float] | None = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        # Every log reaches this (also train()'s closing summary): send each entry once.
        entry = self.history[-1] if self.history else None
        if entry is not None and entry is not self._sent and entry["step"] == state.global_step:
            self._sent = entry
            _log_to_active_run({k: v for k, v in entry.items() if k != "step"}, int(entry["step"]))


def _resumed_to_active_run(checkpoint: Path, history: list[dict[str, float]]) -> None:
    """Tag the job's new MLflow run as resumed and give it the metrics logged before the kill."""
    mlflow = _active_mlflow()
    if mlflow is None:
        return
    mlflow.set_tag("resumed_from", checkpoint.name)
    for entry in history:
        _log_to_active_run({k: v for k, v in entry.items() if k != "step"}, int(entry["step"]))


def _training_arguments(spec: TrainSpec, out_dir: Path, *, evaluate: bool) -> TrainingArguments:
    every = evaluate and spec.eval_every > 0
    return TrainingArguments(
        output_dir=str(out_dir / "checkpoints"),
        max_steps=spec.steps,
        per_device_train_batch_size=spec.batch_size,
        per_device_eval_batch_size=spec.batch_size,
        gradient_accumulation_steps=spec.grad_accum,
        # The last step's evaluation is EvaluateAtEndCallback's (eval_every 0: that one alone).
        eval_strategy="steps" if every else "no",
        eval_steps=spec.eval_every if every else None,
        learning_rate=spec.lr,
        weight_decay=spec.weight_decay,
        warmup_steps=spec.warmup,
        lr_scheduler_type=spec.scheduler,
        seed=spec.torch_seed,
        data_seed=spec.torch_seed,
        logging_steps=spec.log_every,
        save_strategy="steps" if spec.save_every > 0 else "no",
        save_steps=spec.save_every if spec.save_every > 0 else 500,
        # One checkpoint is kept, by CheckpointStateCallback once the new one is complete.
        save_total_limit=None,
        report_to=spec.report_to if "," not in spec.report_to else spec.report_to.split(","),
        use_cpu=not torch.cuda.is_available(),
        bf16=spec.bf16,
        activation_checkpointing=spec.gradient_checkpointing,
        dataloader_num_workers=0,
        disable_tqdm=False,
        remove_unused_columns=False,
    )


class EvaluateAtEndCallback(TrainerCallback):
    """Evaluates the eval split at the last step too, whatever `eval_every` is: the final
    model's evaluation loss is the one a run is compared by."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:
            control.should_evaluate = True


def is_main_process() -> bool:
    """Whether this is the process that writes and tracks: global rank 0 of a multi-process launch
    (`accelerate launch`, torchrun), or the only process. Readable before any process group."""
    return int(os.environ.get("RANK", "0")) == 0


def run_training(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    dataset: TokenizedExamples,
    method: RouterMethod,
    spec: TrainSpec,
    out_dir: Path,
    *,
    save_to: Path | None = None,
    callbacks: Sequence[TrainerCallback] = (),
    complete_model: Callable[[Path], None] | None = None,
    eval_dataset: TokenizedExamples | None = None,
) -> list[dict[str, float]]:
    """Train `model` in place with `method` attached; resumes from the newest checkpoint.

    `eval_dataset` is evaluated (the task loss alone) every `spec.eval_every` steps and at the
    last; its losses are in the Trainer's `state.log_history` (a callback's `on_evaluate` and
    `on_train_end` see them, those from before a resume included).

    Under a multi-process launch every rank calls this; only the main process writes (and logs
    to its MLflow run, the only one open). `save_to` saves the final model and tokenizer there,
    as one folder that appears whole (`rpb.artifacts.atomic_folder`) with its integrity records;
    `complete_model` (main process) adds files to the folder before it appears.
    """
    torch.set_num_threads(max(1, spec.threads))
    out_dir.mkdir(parents=True, exist_ok=True)
    callbacks = [*callbacks, *([EvaluateAtEndCallback()] if eval_dataset is not None else [])]
    # A checkpoint's tokenizer may have no pad token (the testbed's always has): pad with EOS,
    # which the attention mask and the labels leave out anyway.
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    trainer = RouterMethodTrainer(
        model=model,
        args=_training_arguments(spec, out_dir, evaluate=eval_dataset is not None),
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        data_collator=RightPadCollator(pad),
        router_method=method,
        callbacks=callbacks,
    )
    # What the trainer logs (losses, drift, expert load, lr); restored on resume, written to
    # train_history.json, and sent to the job's MLflow run.
    history = trainer.router_history
    trainer.add_callback(CheckpointStateCallback(method, history, trainer.routing_meter))
    trainer.add_callback(MlflowHistoryCallback(history))
    # The Trainer has set up the process group: the main process removes incomplete checkpoints
    # while the others wait, then every rank resumes from the same one.
    if trainer.is_world_process_zero():
        # Which parallelism accelerate chose (FSDP's config runs as DDP on CPU processes).
        log.info(
            "training on %d process(es): %s",
            trainer.accelerator.num_processes,
            trainer.accelerator.distributed_type.value,
        )
        last_complete_checkpoint(out_dir / "checkpoints")
        drop_damaged_checkpoints(out_dir / "checkpoints")
    trainer.accelerator.wait_for_everyone()
    last = resumable_checkpoint(out_dir / "checkpoints")
    if last:
        # The Trainer restores model, optimizer, scheduler, RNG and data position; the router
        # method's state and the history logged so far come from our file in the checkpoint.
        saved = torch.load(last / CHECKPOINT_STATE, weights_only=True)
        method.load_state_dict(saved["method"])
        history.extend(saved["history"])
        meter = last / meter_state_name(trainer.accelerator.process_index)
        if meter.is_file():  # the logging interval the job was killed in goes on where it was
            trainer.routing_meter.load_state_dict(torch.load(meter, weights_only=True))
        log.info("resuming from %s (%d history entries restored)", last, len(history))
        _resumed_to_active_run(last, history)
    try:
        with method:
            trainer.train(resume_from_checkpoint=str(last) if last else None)
    except Exception:
        # A checkpoint cut short (a full disk) is useless (a resume deletes it) and holds the
        # space the tracking store needs to end the job's run FAILED: delete it now.
        if trainer.is_world_process_zero():
            last_complete_checkpoint(out_dir / "checkpoints")
        raise
    if save_to is not None:
        _save_model(trainer, tokenizer, save_to, complete_model)
    return history


def posttrain_model(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    dataset: TokenizedExamples,
    method: RouterMethod,
    spec: TrainSpec,
    out_dir: Path,
    *,
    prior: RouterPrior | None = None,
    new_token_ids: Sequence[int] = (),
    save_to: Path | None = None,
    callbacks: Sequence[TrainerCallback] = (),
    complete_model: Callable[[Path], None] | None = None,
    eval_dataset: TokenizedExamples | None = None,
) -> list[dict[str, float]]:
    """Post-train `model` with `method` attached: the one setup of the pipeline's runs
    (rpb.pipeline.training.posttrain) and `rpb finetune` (rpb.user_cli), then `run_training`.

    `spec.trainable` picks the parameters that train (rpb.trainable.select_trainable, the rest
    frozen or, with `spec.trunk_lr_scale`, at that fraction of the learning rate); with trainable
    `moe`, `new_token_ids` are the tokens whose embedding and output rows train with the experts
    (the pipeline's tokens unseen in pretraining; a checkpoint of unknown pretraining has none).
    Frozen embeddings under gradient checkpointing need input gradients. `method` is attached
    with `prior` (a method that needs one refuses None), which turns a checkpoint's own
    load-balancing loss off while training (one router term); the saved folder keeps the
    checkpoint's own flag, and the routing a method keeps at evaluation (hard,
    keep_bias_at_eval) travels with the model (rpb.eval_routing). `complete_model` adds the
    caller's files to the folder before that. The other arguments are `run_training`'s.
    """
    model.train()
    callbacks = list(callbacks)
    if spec.trainable != "all":
        selection = select_trainable(
            model,
            spec.trainable,
            new_token_ids=list(new_token_ids) if spec.trainable == "moe" else [],
            trunk_lr_scale=spec.trunk_lr_scale,
        )
        if selection.row_scales:
            callbacks.append(selection.callback(model))
        if spec.gradient_checkpointing:  # frozen embeddings: checkpointed layers need input grads
            model.enable_input_require_grads()
    method.attach(model, prior)

    def complete(folder: Path) -> None:
        if complete_model is not None:
            complete_model(folder)
        if method.turned_off_own_router_loss:  # the saved config is the checkpoint's own
            model.config.get_text_config().output_router_logits = True
            model.config.to_json_file(folder / "config.json")
        # Written into the folder before it appears, so no model lacks its routing.
        save_eval_routing(folder, method, prior)

    return run_training(
        model,
        tokenizer,
        dataset,
        method,
        spec,
        out_dir,
        save_to=save_to,
        callbacks=callbacks,
        complete_model=complete,
        eval_dataset=eval_dataset,
    )


def experts_kwargs(experts_implementation: str | None) -> dict[str, str]:
    """`from_pretrained`/`from_config` keywords choosing transformers' experts implementation;
    none (its default, `grouped_mm` in transformers 5.x) when `experts_implementation` is None."""
    return {"experts_implementation": experts_implementation} if experts_implementation else {}


def _save_model(
    trainer: Trainer,
    tokenizer: PreTrainedTokenizerBase,
    path: Path,
    complete: Callable[[Path], None] | None = None,
) -> None:
    """Save the trained model and tokenizer from the main process (every rank calls this).

    The main process writes into a temporary folder beside `path` that replaces `path` once
    complete, and records every file (`rpb.artifacts.atomic_folder`): a job killed or failing
    while saving leaves no folder that looks finished, and the results check before the next
    invocation names a truncated or lost weights file of a finished one."""
    from rpb.artifacts import atomic_folder, partial_folder

    trainer.model.eval()
    main = trainer.is_world_process_zero()
    # Every rank names the same temporary folder; only the main process creates and moves it.
    with atomic_folder(path) if main else contextlib.nullcontext(partial_folder(path)) as tmp:
        if trainer.is_fsdp_enabled:
            # A collective: gathers the full state dict from the shards (save_pretrained on the
            # sharded model would write this rank's DTensor shards), also where the checkpoints
            # are sharded (fsdp.yaml's SHARDED_STATE_DICT, with which trainer.save_model writes
            # nothing). The main process writes it, as one model.safetensors.
            state_dict = trainer.accelerator.get_state_dict(trainer.model)
            if main:
                trainer._save(str(tmp), state_dict=state_dict)
                (tmp / TRAINING_ARGS_NAME).unlink(missing_ok=True)  # the Trainer's pickled args
        elif main:  # DDP or one process: every rank holds the same full model
            trainer.model.save_pretrained(tmp)
        if main:
            tokenizer.save_pretrained(tmp)
            if complete is not None:
                complete(tmp)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """`payload` as indented, key-sorted JSON, written atomically with its integrity record."""
    from rpb.artifacts import write_text  # atomic, with its integrity record

    write_text(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")
