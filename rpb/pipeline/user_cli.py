"""`rpb finetune` and `rpb prior`: the command line for people, beside the pipeline's plumbing.

Both work on any Hugging Face MoE checkpoint folder of a family rpb supports (docs/families.md)
and a JSONL file of training texts, with plain flags:

    rpb prior --model DIR --data FILE.jsonl --out prior.safetensors
    rpb finetune --model DIR --data FILE.jsonl --method rpb --strength 1 --out DIR

The data holds one JSON object per line: `{"text": ...}` (loss on every token; `--text-field`
names another field) or `{"prompt": ..., "completion": ...}` (loss on the completion only, as the
pipeline trains). Training is `rpb.trainer.RouterMethodTrainer` (transformers' Trainer with the
method's term and rpb's metrics), with the Trainer's progress bar; MLflow only with `--mlflow`.

Errors on bad input (a missing file, an unknown method, a model family rpb cannot route) end the
command with one line naming the culprit and exit status 2. Heavy imports stay inside the
commands: building the parser costs nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rpb.specs import METHOD_SPECS, TRAINABLE

log = logging.getLogger("rpb")

# The prior a finetune run extracts itself (no --prior), beside the saved model.
PRIOR_FILE = "router_prior.safetensors"
HISTORY_FILE = "train_history.json"

DATA_HELP = (
    'JSONL file, one object per line: {"text": ...} (loss on every token; --text-field names '
    'another field) or {"prompt": ..., "completion": ...} (loss on the completion only)'
)

FINETUNE_EPILOG = """\
example:
  rpb finetune --model ./Qwen3-30B-A3B --data train.jsonl --method rpb --strength 1 \\
      --steps 500 --lr 1e-5 --out ./qwen3-rpb

data: one JSON object per line, {"text": "..."} (loss on every token; --text-field names
another field) or {"prompt": "...", "completion": "..."} (loss on the completion only).

Methods (docs/methods.md): none (plain fine-tuning), lbl (re-applied load-balancing loss), rpb
and its variants, anchor_weight, anchor_logit, anchor_kl, hard. Those that read the base's router
prior (rpb*, anchor_*, hard) extract it from --model on --data before training unless --prior
is given, and save it as OUT/router_prior.safetensors. OUT receives the model, its tokenizer and
train_history.json (rpb's metrics at every log: router loss, drift from the base, expert load).
"""

PRIOR_EPILOG = """\
example:
  rpb prior --model ./Qwen3-30B-A3B --data train.jsonl --out prior.safetensors

One inference pass of the model over the data records each MoE layer's base router weights and
how it routes the data (mean routing distribution, expert usage, co-activation counts); OUT's
.json sibling (prior.json here) summarises it. `rpb finetune --prior prior.safetensors` uses it.
The pipeline's form of this command is `rpb pipeline prior --name ...` (each job an MLflow run).
"""


class _OneLineErrorParser(argparse.ArgumentParser):
    """A parser whose usage errors are one line naming the flag and value, not the whole usage."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make `parser` (a subcommand's) report usage errors in one line."""
    parser.__class__ = _OneLineErrorParser
    return parser


# --- argument types ---------------------------------------------------------------------------


def method_arg(text: str) -> str:
    if text not in METHOD_SPECS:
        raise argparse.ArgumentTypeError(
            f"unknown router method {text!r} (known: {', '.join(METHOD_SPECS)})"
        )
    return text


def strength_arg(text: str) -> float | str:
    if text == "family":  # lbl: the coefficient the model's family was pretrained with
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def option_arg(text: str) -> tuple[str, Any]:
    """KEY=VALUE: true/false are booleans, numbers are numbers, anything else a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    if raw.lower() in ("true", "false"):
        return key, raw.lower() == "true"
    try:
        return key, float(raw)
    except ValueError:
        return key, raw


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


# --- inputs -----------------------------------------------------------------------------------


def check_model_dir(path: Path) -> None:
    """A local checkpoint folder whose config.json names a MoE family rpb routes (else a one-line
    error naming the folder and, for a family rpb does not route, its model type), checked before
    any weight loads."""
    from rpb.families import FAMILIES, routed_model_types
    from rpb.router_specs import UnsupportedRouter

    if not path.is_dir():
        raise FileNotFoundError(f"--model {path}: no such folder (a local checkpoint folder)")
    config = path / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"--model {path}: not a checkpoint folder (no config.json)")
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError) as err:
        raise ValueError(f"{config}: not a JSON object ({err})") from None
    family = FAMILIES.get(model_type)
    refused = family.routing if family else None
    if isinstance(refused, UnsupportedRouter):
        raise ValueError(f"--model {path}: model type {model_type!r} is refused: {refused.reason}")
    if model_type not in routed_model_types():
        raise ValueError(
            f"--model {path}: model type {model_type!r} is not a MoE family rpb routes (those "
            f"are: {', '.join(routed_model_types())}; docs/families.md)"
        )


def check_file(path: Path, flag: str) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"{flag} {path}: no such file")


def read_records(path: Path, text_field: str = "text") -> tuple[list[dict[str, str]], str]:
    """The JSONL records of `path` and their form: "text" (`text_field` holds the whole text) or
    "prompt_completion". The first record decides; blank lines are skipped; errors name
    file:line."""
    from rpb.pipeline.data import check_string_fields, jsonl_objects

    check_file(path, "--data")
    records: list[dict[str, str]] = []
    keys: tuple[str, ...] | None = None
    for lineno, rec in jsonl_objects(path, skip_blank=True):
        if keys is None:
            if text_field in rec:
                keys = (text_field,)
            elif "prompt" in rec and "completion" in rec:
                keys = ("prompt", "completion")
            else:
                raise ValueError(
                    f"{path}:{lineno}: expected a {text_field!r} field or 'prompt' and "
                    f"'completion' fields, found {sorted(rec)}"
                )
        check_string_fields(rec, keys, f"{path}:{lineno}", noun="field")
        records.append({k: rec[k] for k in keys} | {"_line": str(lineno)})
    if keys is None:
        raise ValueError(f"{path}: no records (expected JSON lines with a {text_field!r} field)")
    return records, "text" if keys == (text_field,) else "prompt_completion"


def tokenize_records(
    records: list[dict[str, str]],
    tokenizer: Any,
    *,
    text_field: str,
    max_length: int,
    source: str,
) -> Any:
    """`rpb.pipeline.training.TokenizedExamples` of the records: the tokenizer's own special tokens
    (a BOS where it adds one) before the text or prompt, EOS after, cut at `max_length`. Labels
    cover every token of a text, or the completion and EOS of a prompt/completion pair. Records
    left with no target token by the cut are dropped (with a warning)."""
    from rpb.pipeline.training import IGNORE_INDEX, TokenizedExamples

    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the model's tokenizer has no EOS token; set eos_token in its config")

    def ids(text: str, line: str, special: bool) -> list[int]:
        try:
            return list(tokenizer(text, add_special_tokens=special)["input_ids"])
        except Exception as err:  # tokenizers raises its own types
            raise ValueError(f"{source}:{line}: cannot tokenize {text[:60]!r} ({err})") from None

    examples, dropped = [], 0
    for rec in records:
        if text_field in rec:
            body = ids(rec[text_field], rec["_line"], True)
            seq = body if body and body[-1] == eos else [*body, eos]
            labels = list(seq)
        else:
            prompt = ids(rec["prompt"], rec["_line"], True)
            answer = [*ids(rec["completion"], rec["_line"], False), eos]
            seq, labels = prompt + answer, [IGNORE_INDEX] * len(prompt) + answer
        seq, labels = seq[:max_length], labels[:max_length]
        if all(label == IGNORE_INDEX for label in labels):
            dropped += 1
            continue
        examples.append({"input_ids": seq, "labels": labels})
    if dropped:
        log.warning(
            "%d of %d records have no target token within --max-length %d: left out",
            dropped,
            len(records),
            max_length,
        )
    if not examples:
        raise ValueError(f"{source}: no record has a target token within --max-length {max_length}")
    return TokenizedExamples(examples)


def _pad_id(tokenizer: Any) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def prior_of(
    model: Any, tokenizer: Any, dataset: Any, data: Path, model_dir: Path, batch_size: int
) -> Any:
    """The router prior of `model` on the tokenized `dataset` (all its tokens, prompts included,
    as the pipeline's prior covers the whole corpus texts)."""
    from rpb.pipeline.training import RightPadCollator
    from rpb.prior import extract_prior

    collate = RightPadCollator(_pad_id(tokenizer))
    rows = dataset.examples
    batches = [collate(rows[i : i + batch_size]) for i in range(0, len(rows), batch_size)]
    return extract_prior(
        model,
        batches,
        model_id=str(model_dir),
        revision="local",
        corpus_hash=_sha256(data),
    )


def _check_routers(model: Any, model_dir: Path) -> list[Any]:
    """The model's routers; a family rpb cannot route is refused in one line naming it."""
    from rpb.routing import find_routers

    try:
        handles = find_routers(model)
    except ValueError as err:
        model_type = getattr(model.config, "model_type", "?")
        raise ValueError(f"--model {model_dir} ({model_type}): {err}") from None
    first = handles[0]
    log.info(
        "%s: %s with %d MoE layers of %d experts, top-%d (%s routing)",
        model_dir,
        type(model).__name__,
        len(handles),
        first.num_experts,
        first.top_k,
        first.kind,
    )
    return handles


def _mlflow_run(args: argparse.Namespace, stage: str, method: str | None, params: dict[str, Any]):
    """The command's MLflow run with `--mlflow` (the store: --tracking-uri, else
    $MLFLOW_TRACKING_URI, else ./mlflow.db); otherwise nothing."""
    import contextlib

    if not args.mlflow:
        return contextlib.nullcontext()
    import mlflow

    from rpb.pipeline.tracking import artifact_location, resolve_tracking_uri, tracked_run

    uri = args.tracking_uri or resolve_tracking_uri(results_dir=Path("."))
    client = mlflow.MlflowClient(tracking_uri=uri)
    if client.get_experiment_by_name(args.experiment) is None:  # artifacts beside a sqlite store
        client.create_experiment(args.experiment, artifact_location=artifact_location(uri))
    return tracked_run(
        stage=stage,
        model=args.model.resolve().name,
        method=method,
        seed=getattr(args, "seed", None),
        corpus=args.corpus.stem,
        params=params,
        tracking_uri=uri,
        experiment=args.experiment,
    )


# --- rpb prior --------------------------------------------------------------------------------


def cmd_prior(args: argparse.Namespace) -> None:
    """`rpb prior --model DIR --data FILE --out prior.safetensors` (the form without --name)."""
    from rpb.pipeline.analysis import load_for_inference

    check_model_dir(args.model)
    records, form = read_records(args.corpus, args.text_field)
    if args.out.suffix == ".json":
        raise ValueError(f"--out {args.out}: must not end in .json (the summary's name)")
    params = {"model_dir": str(args.model), "data": str(args.corpus), "form": form}
    with _mlflow_run(args, "prior", None, params):
        tokenizer, model = load_for_inference(
            args.model,
            trust_remote_code=args.trust_remote_code,
            experts_implementation=args.experts_implementation,
        )
        _check_routers(model, args.model)
        dataset = tokenize_records(
            records,
            tokenizer,
            text_field=args.text_field,
            max_length=args.max_length,
            source=str(args.corpus),
        )
        prior = prior_of(model, tokenizer, dataset, args.corpus, args.model, args.batch_size)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        prior.save(args.out)
        if args.mlflow:
            import mlflow

            mlflow.log_metrics({"tokens": float(prior.meta["n_tokens"])})
            mlflow.log_artifact(str(args.out.with_suffix(".json")))
    log.info(
        "router prior of %s over %d tokens of %s written to %s",
        args.model,
        prior.n_tokens,
        args.corpus,
        args.out,
    )


# --- rpb finetune -----------------------------------------------------------------------------


@contextlib.contextmanager
def _removed_if_left_empty(folder: Path) -> Iterator[None]:
    """On failure, remove `folder` and the parents this run created, if nothing is in them: a
    failed run leaves no empty --out. A folder holding anything (a prior it extracted, a folder
    that was there before) is kept."""
    created = [p for p in [folder, *folder.parents] if not p.exists()]  # innermost first
    try:
        yield
    except BaseException:
        for path in created:
            with contextlib.suppress(OSError):  # not empty: kept, and so are its parents
                path.rmdir()
        raise


def cmd_finetune(args: argparse.Namespace) -> None:
    """Supervised fine-tuning of `--model` on `--data` with one router method attached."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments

    from rpb.artifacts import write_text
    from rpb.eval_routing import save_eval_routing
    from rpb.methods import make_method
    from rpb.pipeline.tracking import method_params
    from rpb.pipeline.training import RightPadCollator, unseen_token_ids
    from rpb.prior import RouterPrior
    from rpb.trainable import select_trainable
    from rpb.trainer import RouterMethodTrainer, own_router_loss_message

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            "rpb finetune runs as one process (one GPU, or the CPU); for a multi-process launch "
            "use rpb.trainer.RouterMethodTrainer in a script (docs/library.md)"
        )
    check_model_dir(args.model)
    records, form = read_records(args.corpus, args.text_field)
    if args.prior is not None:
        check_file(args.prior, "--prior")
    if args.out.resolve() == args.model.resolve():
        raise ValueError(f"--out {args.out}: is --model itself; give a new folder")
    if args.out.is_dir() and any(args.out.iterdir()):
        # A finished model there would be replaced file by file (seen: an rpb model silently
        # overwritten by an anchor_kl run).
        held = ", ".join(sorted(p.name for p in args.out.iterdir())[:3])
        raise ValueError(
            f"--out {args.out}: not empty (holds {held}, ...); give a new or empty folder"
        )
    spec = METHOD_SPECS[args.method]
    options = dict(args.option or [])
    # The method is built before anything loads: a bad strength or option fails at once.
    method = make_method(args.method, strength=args.strength, **options)
    label = args.method if args.strength is None else f"{args.method}@{args.strength}"
    params = {
        "model_dir": str(args.model),
        "data": str(args.corpus),
        "form": form,
        **method_params(
            label,
            {
                "name": args.method,
                "strength": args.strength if args.strength == "family" else method.strength,
                "options": method.options,
            },
        ),
        "train": {
            k: getattr(args, k)
            for k in ("steps", "lr", "batch_size", "grad_accum", "max_length", "seed", "trainable")
        },
    }
    with _mlflow_run(args, "finetune", label, params), _removed_if_left_empty(args.out):
        tokenizer = AutoTokenizer.from_pretrained(
            args.model, trust_remote_code=args.trust_remote_code
        )
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        _check_routers(model, args.model)
        dataset = tokenize_records(
            records,
            tokenizer,
            text_field=args.text_field,
            max_length=args.max_length,
            source=str(args.corpus),
        )
        log.info("%s: %d training examples (%s)", args.corpus, len(dataset), form.replace("_", "/"))
        args.out.mkdir(parents=True, exist_ok=True)
        if args.prior is not None:
            prior = RouterPrior.load(args.prior)
            prior.check_compatible(model)
            log.info("router prior: %s", args.prior)
        elif spec.needs_prior:
            prior_path = args.out / PRIOR_FILE
            log.info(
                "method %s needs the base's router prior and no --prior was given: extracting it "
                "from %s on %s into %s",
                args.method,
                args.model,
                args.corpus,
                prior_path,
            )
            if torch.cuda.is_available():
                model.to("cuda")
            prior = prior_of(model, tokenizer, dataset, args.corpus, args.model, args.batch_size)
            prior.save(prior_path)
        else:
            prior = None
        callbacks = []
        if args.trainable != "all":
            new_ids = unseen_token_ids(tokenizer, dataset) if args.trainable == "moe" else []
            selection = select_trainable(model, args.trainable, new_token_ids=new_ids)
            if selection.row_scales:
                callbacks.append(selection.callback(model))
        # A checkpoint whose config asks for router logits adds its own load-balancing loss to
        # the task loss: beside the method's term that is a second router term nobody chose.
        text_config = model.config.get_text_config()
        own_lbl = bool(getattr(text_config, "output_router_logits", False))
        if own_lbl:
            text_config.output_router_logits = False
            log.warning("%s", own_router_loss_message(model, method.name))
        method.attach(model, prior)
        model.train()
        training = TrainingArguments(
            output_dir=str(args.out),
            max_steps=args.steps if args.steps is not None else -1,
            num_train_epochs=1,
            per_device_train_batch_size=args.batch_size,
            gradient_accumulation_steps=args.grad_accum,
            learning_rate=args.lr,
            lr_scheduler_type="cosine",
            warmup_steps=args.warmup_steps,
            seed=args.seed,
            data_seed=args.seed,
            logging_steps=args.log_every,
            save_strategy="no",
            report_to="none",
            use_cpu=not torch.cuda.is_available(),
            bf16=args.bf16,
            disable_tqdm=False,
            remove_unused_columns=False,
            dataloader_num_workers=0,
        )
        # Every expert's share goes to train_history.json and MLflow, as in the pipeline; the
        # progress bar's line summarises the layers (rpb.trainer.console_logs).
        trainer = RouterMethodTrainer(
            model=model,
            args=training,
            train_dataset=dataset,
            data_collator=RightPadCollator(_pad_id(tokenizer)),
            router_method=method,
            callbacks=callbacks,
        )
        if args.mlflow:
            from rpb.pipeline.training import MlflowHistoryCallback

            trainer.add_callback(MlflowHistoryCallback(trainer.router_history))
        log.info("fine-tuning with %r", method)
        with method:  # detached afterwards: the saved model routes natively
            trainer.train()
        trainer.model.eval()
        if own_lbl:  # the saved config is the checkpoint's own
            text_config.output_router_logits = True
        trainer.model.save_pretrained(args.out)
        tokenizer.save_pretrained(args.out)
        # A method that steers at evaluation too (keep_bias_at_eval, hard) travels with the model.
        steering = save_eval_routing(args.out, method, prior)
        history = {"history": trainer.router_history, "params": params}
        write_text(args.out / HISTORY_FILE, json.dumps(history, indent=2, sort_keys=True) + "\n")
        if args.mlflow:
            import mlflow

            mlflow.log_artifact(str(args.out / HISTORY_FILE))
    if steering is not None:
        log.info("the model steers at evaluation with %s (rpb.eval_routing loads it)", steering)
    log.info("model and tokenizer saved to %s", args.out)


def add_finetune(sub: Any) -> argparse.ArgumentParser:
    """Register `rpb finetune` on the `rpb` subparsers `sub`."""
    p = sub.add_parser(
        "finetune",
        help="fine-tune a Hugging Face MoE checkpoint on a JSONL file with a router method",
        description="Supervised fine-tuning of a Hugging Face MoE checkpoint folder on a JSONL "
        "file with one router method attached (transformers' Trainer).",
        epilog=FINETUNE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    one_line_errors(p)
    p.set_defaults(func=cmd_finetune)
    p.add_argument(
        "--model", type=Path, required=True, metavar="DIR", help="checkpoint folder (config.json)"
    )
    p.add_argument(
        "--data", dest="corpus", type=Path, required=True, metavar="FILE", help=DATA_HELP
    )
    p.add_argument(
        "--out", type=Path, required=True, metavar="DIR", help="folder for the fine-tuned model"
    )
    p.add_argument(
        "--method",
        type=method_arg,
        default="rpb",
        metavar="NAME",
        help=f"router method: {', '.join(METHOD_SPECS)} (default: rpb)",
    )
    p.add_argument(
        "--strength",
        type=strength_arg,
        default=None,
        metavar="X",
        help="the method's strength (default: its own, docs/methods.md; lbl also takes 'family')",
    )
    p.add_argument(
        "--option",
        type=option_arg,
        action="append",
        metavar="KEY=VALUE",
        help="a method option, e.g. bias_on=logits (repeatable; docs/methods.md)",
    )
    p.add_argument(
        "--prior",
        type=Path,
        default=None,
        metavar="FILE",
        help="router prior from `rpb prior` (default: extracted from --model on --data when the "
        "method needs one)",
    )
    p.add_argument(
        "--steps",
        type=_positive_int,
        default=None,
        metavar="N",
        help="optimizer steps (default: one epoch)",
    )
    p.add_argument(
        "--lr", type=float, default=1e-5, metavar="X", help="peak learning rate (cosine decay)"
    )
    p.add_argument("--warmup-steps", type=int, default=0, metavar="N")
    p.add_argument(
        "--batch-size", type=_positive_int, default=8, metavar="N", help="examples per step"
    )
    p.add_argument(
        "--grad-accum", type=_positive_int, default=1, metavar="N", help="gradient accumulation"
    )
    p.add_argument(
        "--max-length", type=_positive_int, default=1024, metavar="N", help="tokens per example"
    )
    p.add_argument("--seed", type=int, default=0, metavar="N")
    p.add_argument(
        "--trainable",
        choices=list(TRAINABLE),
        default="all",
        help="parameters to update: all, or moe (routed experts and routers; docs/design.md)",
    )
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision")
    p.add_argument(
        "--log-every", type=_positive_int, default=10, metavar="N", help="steps between logs"
    )
    p.add_argument(
        "--text-field", default="text", metavar="NAME", help="the field holding the whole text"
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the tokenizer's own code from the model folder",
    )
    add_mlflow(p)
    return p


def add_mlflow(p: argparse.ArgumentParser, *, uri: bool = True) -> None:
    """`--mlflow` (and the store's flags, unless the parser already has them)."""
    p.add_argument(
        "--mlflow",
        action="store_true",
        help="log the run to MLflow (store: --tracking-uri, else $MLFLOW_TRACKING_URI, else "
        "./mlflow.db; needs pip install 'rpb[mlflow]')",
    )
    if uri:
        p.add_argument(
            "--tracking-uri",
            default=None,
            metavar="URI",
            help="MLflow tracking URI (with --mlflow)",
        )
        p.add_argument(
            "--experiment", default="rpb", metavar="NAME", help="MLflow experiment (with --mlflow)"
        )
