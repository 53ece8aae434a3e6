"""`TrainSpec`, one training job's settings, and what each of them is to the config and to
`rpb finetune` (torch-free: building the command's parser or the config schema imports no torch).

Each field's metadata names the config sections that set it and its JSON-schema keywords
(rpb.pipeline.schema writes the config schema from them) and the `rpb finetune` flag that sets it
(rpb.user_cli generates the flags from them, as TRL's HfArgumentParser does from a dataclass).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rpb.specs import TRAINABLE, torch_seed

# The keys of a TrainSpec field's metadata that say whether, where and how a config sets it, and
# which `rpb finetune` flag sets it (rpb.user_cli.add_train_flags).
CONFIG_SETTING = "config"
CLI_FLAG = "flag"


# A Flag's default where it is the field's own.
FIELD_DEFAULT: Any = type("FieldDefault", (), {"__repr__": lambda _: "the field's default"})()


@dataclass(frozen=True)
class Flag:
    """How `rpb finetune` spells a TrainSpec field: its flag, help and metavar, and its default
    there where it differs from the field's (a user's run is not a tiny testbed job). The flag's
    type, bounds and choices are the field's type and JSON-schema keywords."""

    name: str
    help: str
    metavar: str | None = None
    default: Any = FIELD_DEFAULT


def _setting(
    *sections: str,
    description: str | None = None,
    fill_default: bool = False,
    flag: Flag | None = None,
    **schema: Any,
) -> dict[str, Any]:
    """Metadata of a TrainSpec field: the config sections that set it (`posttrain`; `pretrain`,
    each model's `models.<name>.pretrain`; none: the job or `rpb finetune` sets it), its schema
    description and JSON-schema keywords beyond its type, and with `fill_default` the schema
    fills in the field's default. rpb.pipeline.schema writes them into the config schema
    (`python -m rpb.pipeline.schema --write`), so the schema never lists them by hand; `flag`,
    `rpb finetune`'s flag setting it (none: the command sets it itself or leaves its default)."""
    setting = {"sections": sections, "description": description, "fill_default": fill_default}
    return {CONFIG_SETTING: {**setting, "schema": schema}, CLI_FLAG: flag}


_BOTH = ("posttrain", "pretrain")
_TRAINABLE_HELP = (
    "parameters to update: all, or moe (routed experts and routers; docs/design.md), or "
    "routed_experts_and_routers"
)


@dataclass
class TrainSpec:
    """Optimisation settings of one training job (pretraining or post-training). Each field's
    metadata says which config sections set it and how the config schema checks it, and which
    `rpb finetune` flag sets it."""

    steps: int = field(
        metadata=_setting(
            *_BOTH,
            minimum=1,
            flag=Flag("--steps", "optimizer steps (default: one epoch)", "N", default=None),
        )
    )
    batch_size: int = field(
        metadata=_setting(
            *_BOTH,
            minimum=1,
            flag=Flag("--batch-size", "examples per micro-batch and process", "N", default=8),
        )
    )
    lr: float = field(
        metadata=_setting(
            *_BOTH,
            exclusiveMinimum=0,
            flag=Flag("--lr", "peak learning rate (cosine decay)", "X", default=1e-5),
        )
    )
    weight_decay: float = field(default=0.0, metadata=_setting(*_BOTH, minimum=0))
    warmup_ratio: float = field(default=0.0, metadata=_setting(*_BOTH, minimum=0, maximum=1))
    # The warm-up as a number of steps (`rpb finetune --warmup-steps`); None: `warmup_ratio` of
    # the steps, as the pipeline's config sets it.
    warmup_steps: int | None = field(
        default=None,
        metadata=_setting(minimum=0, flag=Flag("--warmup-steps", "linear warmup steps", "N", 0)),
    )
    scheduler: str = field(default="cosine", metadata=_setting())
    max_length: int = field(
        default=64,
        metadata=_setting(
            *_BOTH, minimum=4, flag=Flag("--max-length", "tokens per example", "N", default=1024)
        ),
    )
    # A post-training run's base and its seed within the base (rpb.pipeline.plan.Plan.
    # posttrain_spec; `torch_seed` seeds it). Pretraining has no base: its seed is in the base's
    # identity (rpb.pipeline.bases), so the schema fills it in.
    base: int | None = field(default=None, metadata=_setting())
    seed: int = field(
        default=0,
        metadata=_setting(
            "pretrain",
            minimum=0,
            fill_default=True,
            flag=Flag("--seed", "model, data order, dropout", "N"),
        ),
    )
    log_every: int = field(
        default=10,
        metadata=_setting(
            "posttrain", minimum=1, flag=Flag("--log-every", "steps between logs", "N")
        ),
    )
    # 0: no intermediate checkpoints
    save_every: int = field(
        default=0,
        metadata=_setting(
            "posttrain",
            minimum=0,
            flag=Flag(
                "--save-steps",
                "steps between checkpoints in OUT/checkpoints, the last one kept (0: none); "
                "--resume continues from it",
                "N",
            ),
        ),
    )
    threads: int = field(default=1, metadata=_setting())  # the job's --threads
    bf16: bool = field(
        default=False, metadata=_setting("posttrain", flag=Flag("--bf16", "bf16 mixed precision"))
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata=_setting(
            "posttrain",
            flag=Flag(
                "--gradient-checkpointing",
                "recompute activations in the backward pass: less memory, more time",
            ),
        ),
    )
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
            flag=Flag("--trainable", _TRAINABLE_HELP),
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
            flag=Flag(
                "--trunk-lr-scale",
                "with --trainable moe, the rest of the model trains at this fraction of --lr "
                "(0: frozen)",
                "X",
            ),
        ),
    )
    # `rpb finetune`'s settings, which the pipeline leaves at these defaults (see `record`).
    grad_accum: int = field(
        default=1,
        metadata=_setting(
            minimum=1, flag=Flag("--grad-accum", "micro-batches per optimizer step", "N")
        ),
    )
    eval_every: int = field(
        default=0,
        metadata=_setting(
            minimum=0,
            flag=Flag(
                "--eval-every",
                "steps between evaluations of --eval-file (0: at the last step only)",
                "N",
            ),
        ),
    )
    report_to: str = field(
        default="none",
        metadata=_setting(
            flag=Flag(
                "--report-to",
                "transformers' loggers, comma-separated (TrainingArguments.report_to: "
                "tensorboard, wandb, mlflow, ...); each gets every log with rpb's metrics. "
                "--mlflow is rpb's own run",
                "NAMES",
            )
        ),
    )

    @property
    def torch_seed(self) -> int:
        """The torch and data-order seed: a post-training run's `rpb.specs.torch_seed(base,
        seed)`; without a base (pretraining, `rpb finetune`) the seed itself."""
        return self.seed if self.base is None else torch_seed(self.base, self.seed)

    @property
    def warmup(self) -> int:
        """The warm-up in steps: `warmup_steps`, else `warmup_ratio` of the steps."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return round(self.warmup_ratio * self.steps)

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


_RECORDED_WHEN_SET = ("base", "warmup_steps", "grad_accum", "eval_every", "report_to")
