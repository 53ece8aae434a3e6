"""Training: tiny-base pretraining and post-training with a router method, on transformers' Trainer.

Both stages are one code path: a `Trainer` whose `compute_loss` adds the attached router method's
term to the task loss, and a callback that advances the method's per-step state (rpb_adaptive) and
logs loss and per-layer routing drift to the active MLflow run. Pretraining is simply `lbl` from a
random initialisation with a full-sequence loss; post-training is any method from the base with an
answer-only loss. Seeds fix the data order, so every method sees the same batches for a given seed
(the paired design of docs/design.md, section 10).
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from torch.utils.data import Dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer import TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from rpb.architectures import build_config
from rpb.artifacts import ArtifactError, json_problem, safetensors_problem
from rpb.eval_routing import load_model, save_eval_routing
from rpb.method_config import MethodConfig
from rpb.methods import RouterMethod, make_method
from rpb.numerics import numeric_path
from rpb.pipeline.data import (
    DOMAIN_TOKENS,
    PRETRAIN_DOMAINS,
    SPECIAL_TOKENS,
    load_jsonl,
    vocabulary,
)
from rpb.pipeline.preemption import PreemptionCallback
from rpb.pipeline.tokenizer import encode
from rpb.prior import RouterPrior
from rpb.specs import TRAINABLE, torch_seed
from rpb.trainable import select_trainable
from rpb.trainer import RouterMethodTrainer, RoutingDriftCallback  # noqa: F401 (public here too)

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
# Written into each Trainer checkpoint by `CheckpointStateCallback`, after everything the Trainer
# writes there: its presence marks the checkpoint complete (see `last_complete_checkpoint`).
CHECKPOINT_STATE = "rpb_state.pt"


# The key of a TrainSpec field's metadata that says whether, where and how a config sets it.
CONFIG_SETTING = "config"


def _setting(
    *sections: str, description: str | None = None, fill_default: bool = False, **schema: Any
) -> dict[str, Any]:
    """Metadata of a TrainSpec field: the config sections that set it (`posttrain`; `pretrain`,
    each model's `models.<name>.pretrain`; none: the job or `rpb finetune` sets it), its schema
    description and JSON-schema keywords beyond its type, and with `fill_default` the schema
    fills in the field's default. rpb.pipeline.schema writes them into the config schema
    (`python -m rpb.pipeline.schema --write`), so the schema never lists them by hand."""
    return {
        CONFIG_SETTING: {
            "sections": sections,
            "description": description,
            "fill_default": fill_default,
            "schema": schema,
        }
    }


_BOTH = ("posttrain", "pretrain")


@dataclass
class TrainSpec:
    """Optimisation settings of one training job (pretraining or post-training). Each field's
    metadata says which config sections set it and how the config schema checks it."""

    steps: int = field(metadata=_setting(*_BOTH, minimum=1))
    batch_size: int = field(metadata=_setting(*_BOTH, minimum=1))
    lr: float = field(metadata=_setting(*_BOTH, exclusiveMinimum=0))
    weight_decay: float = field(default=0.0, metadata=_setting(*_BOTH, minimum=0))
    warmup_ratio: float = field(default=0.0, metadata=_setting(*_BOTH, minimum=0, maximum=1))
    scheduler: str = field(default="cosine", metadata=_setting())
    max_length: int = field(default=64, metadata=_setting(*_BOTH, minimum=4))
    # A post-training run's base and its seed within the base (rpb.pipeline.plan.Plan.
    # posttrain_spec; `torch_seed` seeds it). Pretraining has no base: its seed is in the base's
    # identity (rpb.pipeline.bases), so the schema fills it in.
    base: int | None = field(default=None, metadata=_setting())
    seed: int = field(default=0, metadata=_setting("pretrain", minimum=0, fill_default=True))
    log_every: int = field(default=10, metadata=_setting("posttrain", minimum=1))
    # 0: no intermediate checkpoints
    save_every: int = field(default=0, metadata=_setting("posttrain", minimum=0))
    threads: int = field(default=1, metadata=_setting())  # the job's --threads
    bf16: bool = field(default=False, metadata=_setting("posttrain"))
    gradient_checkpointing: bool = field(default=False, metadata=_setting("posttrain"))
    # Which parameters post-training updates (rpb.trainable.TRAINABLE); the others stay bitwise
    # unchanged, or with `trunk_lr_scale` > 0 (trainable `moe` only) train at that fraction of lr.
    trainable: str = field(
        default="all",
        metadata=_setting(
            "posttrain",
            description=(
                "parameters post-training updates (rpb.trainable): all (the paper's setting); moe "
                "(the routed experts, the routers and the embedding/output rows of the tokens "
                "unseen in pretraining); or routed_experts_and_routers (new tokens' rows frozen "
                "too); the others stay bitwise unchanged unless trunk_lr_scale > 0"
            ),
            enum=list(TRAINABLE),
        ),
    )
    trunk_lr_scale: float = field(
        default=0.0,
        metadata=_setting(
            "posttrain",
            description=(
                "with trainable moe, the rest of the model (the trunk, and the embedding rows of "
                "tokens seen in pretraining) trains at this fraction of the learning rate; 0 keeps "
                "it frozen (docs/testbed.md, the damped-trunk arm)"
            ),
            minimum=0,
            maximum=1,
        ),
    )
    # `rpb finetune`'s settings, which the pipeline leaves at these defaults (see `record`).
    # Micro-batches per optimizer step.
    grad_accum: int = field(default=1, metadata=_setting())
    # Steps between evaluations of an eval split (0: at the last step only).
    eval_every: int = field(default=0, metadata=_setting())
    # transformers' loggers (TrainingArguments.report_to), comma-separated.
    report_to: str = field(default="none", metadata=_setting())

    @property
    def torch_seed(self) -> int:
        """The torch and data-order seed: a post-training run's `rpb.specs.torch_seed(base,
        seed)`; without a base (pretraining, `rpb finetune`) the seed itself."""
        return self.seed if self.base is None else torch_seed(self.base, self.seed)

    def record(self) -> dict[str, Any]:
        """The settings as recorded in `train_history.json`: the finetune-only fields are left
        out at their defaults, so a pipeline run's history stays byte for byte what it was before
        they existed (bench/compare_results.py compares it), and so is `base` without one
        (pretraining)."""
        record = asdict(self)
        for name in _RECORDED_WHEN_SET:
            if record[name] == TrainSpec.__dataclass_fields__[name].default:
                del record[name]
        return record

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TrainSpec:
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown training setting(s): {', '.join(unknown)}")
        return cls(**raw)


_RECORDED_WHEN_SET = ("base", "grad_accum", "eval_every", "report_to")


class TokenizedExamples(Dataset):
    """Pre-tokenised examples; labels mask the prompt for answer-only loss."""

    def __init__(self, examples: list[dict[str, list[int]]]):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.examples[i]


def tokenize_pretraining(
    path: Path, tokenizer: PreTrainedTokenizerBase, max_length: int
) -> TokenizedExamples:
    """Full-sequence LM examples: every token of `text` + EOS is a target."""
    rows = load_jsonl(path, required_keys=("text",))
    eos = tokenizer.eos_token_id
    examples = []
    for row in rows:
        ids = [
            *tokenizer(row["text"], add_special_tokens=False)["input_ids"][: max_length - 1],
            eos,
        ]
        examples.append({"input_ids": ids, "labels": list(ids)})
    return TokenizedExamples(examples)


def tokenize_prompt_completion(
    path: Path, tokenizer: PreTrainedTokenizerBase, max_length: int
) -> TokenizedExamples:
    """Answer-only examples: loss on `completion` + EOS, never on the prompt."""
    rows = load_jsonl(path, required_keys=("prompt", "completion"))
    eos = tokenizer.eos_token_id
    examples = []
    for line, row in enumerate(rows, start=1):
        prompt = encode(tokenizer, row["prompt"], f"{path}:{line}")
        answer = [*encode(tokenizer, row["completion"], f"{path}:{line}"), eos]
        ids = (prompt + answer)[:max_length]
        labels = ([IGNORE_INDEX] * len(prompt) + answer)[:max_length]
        examples.append({"input_ids": ids, "labels": labels})
    return TokenizedExamples(examples)


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
        warmup_steps=round(spec.warmup_ratio * spec.steps),
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


def experts_kwargs(experts_implementation: str | None) -> dict[str, str]:
    """`from_pretrained`/`from_config` keywords choosing transformers' experts implementation;
    none (its default, `grouped_mm` in transformers 5.x) when `experts_implementation` is None."""
    return {"experts_implementation": experts_implementation} if experts_implementation else {}


def new_base_model(
    model_type: str,
    architecture: dict[str, Any],
    tokenizer: PreTrainedTokenizerBase,
    seed: int,
    experts_implementation: str | None = None,
) -> PreTrainedModel:
    """A randomly initialised base of the given transformers MoE architecture."""
    config = build_config(
        model_type,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        **architecture,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, **experts_kwargs(experts_implementation)
    )


def pretrain(
    *,
    model_type: str,
    architecture: dict[str, Any],
    tokenizer_dir: Path,
    corpus: Path,
    spec: TrainSpec,
    lbl_coef: float,
    out_dir: Path,
    experts_implementation: str | None = None,
) -> dict[str, Any]:
    """Pretrain a tiny base on the domain mixture with a load-balancing loss, like a real base."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = new_base_model(
        model_type, architecture, tokenizer, spec.torch_seed, experts_implementation
    )
    model.train()
    dataset = tokenize_pretraining(corpus, tokenizer, spec.max_length)
    method = make_method("lbl", strength=lbl_coef).attach(model)
    history = run_training(
        model, tokenizer, dataset, method, spec, out_dir, save_to=out_dir / "model"
    )
    summary = {
        "final": history[-1] if history else {},
        "spec": spec.record(),
        "numeric_path": numeric_path(),
    }
    if is_main_process():
        _write_json(out_dir / "train_history.json", {"history": history, **summary})
        remove_checkpoints(out_dir / "checkpoints")
    PartialState().wait_for_everyone()
    return summary


def posttrain(
    *,
    base_dir: Path,
    prior_path: Path | None,
    corpus: Path,
    method: MethodConfig,
    spec: TrainSpec,
    out_dir: Path,
    trust_remote_code: bool = False,
    experts_implementation: str | None = None,
    callbacks: Sequence[TrainerCallback] = (),
    save_model: bool = True,
) -> dict[str, Any]:
    """Post-train a base on a prompt/completion corpus with one router method attached.

    `trust_remote_code` applies to the tokenizer only (Moonlight's); the model always loads with
    transformers' own class. `experts_implementation` picks transformers' experts kernel (None:
    its default). Every rank of a multi-process launch calls this; the main process writes the
    outputs while the others wait. `callbacks` join the Trainer's (e.g. dev-accuracy
    readings); `save_model` false keeps no model (for runs that need only their readings).
    """
    tokenizer = AutoTokenizer.from_pretrained(base_dir, trust_remote_code=trust_remote_code)
    torch.manual_seed(spec.torch_seed)
    # A steered folder (rpb.eval_routing) as base: its weights, routing with its saved routers.
    model = load_model(
        base_dir, steer=False, dtype=torch.float32, **experts_kwargs(experts_implementation)
    )
    model.train()
    dataset = tokenize_prompt_completion(corpus, tokenizer, spec.max_length)
    callbacks = list(callbacks)
    if spec.trainable != "all":
        new_ids = unseen_token_ids(tokenizer, dataset) if spec.trainable == "moe" else []
        selection = select_trainable(
            model, spec.trainable, new_token_ids=new_ids, trunk_lr_scale=spec.trunk_lr_scale
        )
        if selection.row_scales:
            callbacks.append(selection.callback(model))
        if spec.gradient_checkpointing:  # frozen embeddings: checkpointed layers need input grads
            model.enable_input_require_grads()
    prior = RouterPrior.load(prior_path) if prior_path else None
    if prior is not None:
        prior.check_compatible(model)
    router_method = method.build()
    router_method.attach(model, prior)
    history = run_training(
        model,
        tokenizer,
        dataset,
        router_method,
        spec,
        out_dir,
        save_to=out_dir / "model" if save_model else None,
        # A signal (Slurm's warning before the time limit, a cancel) saves and exits to requeue.
        callbacks=[*callbacks, PreemptionCallback()],
        # A method that keeps steering at evaluation (hard, keep_bias_at_eval) travels with the
        # model: written into the folder before it appears, so no model lacks its routing.
        complete_model=lambda folder: save_eval_routing(folder, router_method, prior),
    )
    summary = {
        "final": history[-1] if history else {},
        "spec": spec.record(),
        "method": method.to_dict(),
        "numeric_path": numeric_path(),
    }
    if is_main_process():
        _write_json(out_dir / "train_history.json", {"history": history, **summary})
        remove_checkpoints(out_dir / "checkpoints")
    PartialState().wait_for_everyone()
    return summary


def unseen_token_ids(tokenizer: PreTrainedTokenizerBase, dataset: TokenizedExamples) -> list[int]:
    """Ids of the tokens in `dataset` that the tiny bases never saw in pretraining: the
    post-training tasks' own template tokens (the generator declares each pretraining domain's
    alphabet, rpb.pipeline.data.DOMAIN_TOKENS). With a tokenizer that is not the tiny testbed's (a
    real checkpoint's) there are none: every embedding row is trunk."""
    seen = {t for d in PRETRAIN_DOMAINS for t in DOMAIN_TOKENS[d]} | set(SPECIAL_TOKENS)
    vocab = tokenizer.get_vocab()
    if set(vocab) != set(vocabulary()):
        return []
    used = {i for ex in dataset.examples for i in ex["input_ids"]}
    return sorted(vocab[t] for t in vocab if t not in seen and vocab[t] in used)


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


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    from rpb.artifacts import write_text  # atomic, with its integrity record

    write_text(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")
