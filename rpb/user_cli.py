"""`rpb finetune` and `rpb prior`: the command line for people, in the library (no module of
rpb.pipeline behind them; rpb.cli adds the pipeline's verbs where it is installed).

Both work on any Hugging Face MoE checkpoint folder of a family rpb supports (docs/families.md)
and a JSONL file of training texts, with plain flags:

    rpb prior --model DIR --data FILE.jsonl --out prior.safetensors
    rpb finetune --model DIR --data FILE.jsonl --method rpb --strength 1 --out DIR

The data holds one JSON object per line: `{"text": ...}` (loss on every token; `--text-field`
names another field) or `{"prompt": ..., "completion": ...}` (loss on the completion only, as the
pipeline trains). Training is the pipeline's own post-training setup and loop,
`rpb.posttraining.posttrain_model` (transformers' Trainer with the method's term and rpb's
metrics), with its checkpoints, `--resume`, multi-process launch and atomic model folder; the
training flags are generated from `TrainSpec`'s field metadata (rpb.train_spec). MLflow only with
`--mlflow` (or transformers' own loggers with `--report-to`): its run is a pipeline job's kind of
run (rpb.tracking's `tracked_run`, which the pipeline's jobs log through too), so one schema
covers every run.

Errors on bad input (a missing file, an unknown method, a model family rpb cannot route) end the
command with one line naming the culprit and exit status 2. Heavy imports stay inside the
commands: building the parser costs nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import sys
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from rpb import inspection
from rpb.artifacts import sha256_of
from rpb.method_config import MethodConfig, method_params
from rpb.numerics import PIN_ENV
from rpb.specs import METHOD_SPECS, install_hint
from rpb.train_spec import CLI_FLAG, CONFIG_SETTING, FIELD_DEFAULT, TrainSpec

log = logging.getLogger("rpb")

# The people's verbs (`inspect`'s code is rpb.inspection's); `rpb` runs any other with the
# pipeline's command line (rpb.cli).
VERBS = ("finetune", "prior", "inspect")

# The prior a finetune run extracts itself (no --prior), beside the saved model.
PRIOR_FILE = "router_prior.safetensors"
HISTORY_FILE = "train_history.json"
# In --out while a run is unfinished: its settings, which --resume must repeat.
PARAMS_FILE = "rpb_finetune.json"

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

A long run: --save-steps 200 checkpoints it under OUT/checkpoints; after a preemption the same
command with --resume continues from the last complete checkpoint to the weights an unbroken run
reaches. Several GPUs:
  accelerate launch --config_file config/accelerate/fsdp.yaml --num_processes 8 -m rpb.cli \
      finetune ... --prior prior.safetensors
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
    """A number, or text (lbl's `family`): the method's MethodConfig checks it."""
    try:
        return float(text)
    except ValueError:
        return text


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


def bounded(kind: type, schema: Mapping[str, Any]) -> Callable[[str], Any]:
    """An argparse type: an int or float (`kind`) within the JSON-schema bounds of `schema`
    (`minimum`, `exclusiveMinimum`, `maximum`), refused in one line otherwise."""
    low, above, high = (schema.get(k) for k in ("minimum", "exclusiveMinimum", "maximum"))

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            noun = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"not {noun}: {text!r}") from None
        for bound, fails, says in ((low, "<", ">="), (above, "<=", ">"), (high, ">", "<=")):
            if bound is not None and _FAILS[fails](value, bound):
                raise argparse.ArgumentTypeError(f"must be {says} {bound}, got {value}")
        return value

    return parse


_FAILS = {"<": lambda v, b: v < b, "<=": lambda v, b: v <= b, ">": lambda v, b: v > b}


# --- inputs -----------------------------------------------------------------------------------


# What a Hugging Face hub id looks like (owner/name), as a --model that is no local folder.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9]")


def check_model_dir(path: Path) -> None:
    """A local checkpoint folder whose config.json names a MoE family rpb routes (else a one-line
    error naming the folder and, for a family rpb does not route, its model type), checked before
    any weight loads."""
    from rpb.eval_routing import base_config_dict
    from rpb.families import FAMILIES, routed_model_types
    from rpb.router.spec import UnsupportedRouter

    if not path.is_dir():
        hint = ""
        if _HUB_ID.fullmatch(str(path)):
            hint = (
                f"; to use the hub's {path}, download it first: hf download {path} "
                "--local-dir DIR (or huggingface-cli download), then --model DIR"
            )
        raise FileNotFoundError(f"--model {path}: no such folder (a local checkpoint folder){hint}")
    config = path / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"--model {path}: not a checkpoint folder (no config.json)")
    try:
        saved = json.loads(config.read_text(encoding="utf-8"))
        # A steered folder (rpb.eval_routing) names its family under rpb_base_model_type.
        model_type = base_config_dict(saved).get("model_type")
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
    from rpb.jsonl import check_string_fields, jsonl_objects

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
    """`rpb.posttraining.TokenizedExamples` of the records: the tokenizer's own special tokens
    (a BOS where it adds one) before the text or prompt, EOS after, cut at `max_length`. Labels
    cover every token of a text, or the completion and EOS of a prompt/completion pair. Records
    left with no target token by the cut are dropped (with a warning)."""
    from rpb.posttraining import IGNORE_INDEX, TokenizedExamples

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


def prior_of(
    model: Any, tokenizer: Any, dataset: Any, data: Path, model_dir: Path, batch_size: int
) -> Any:
    """The router prior of `model` on the tokenized `dataset` (all its tokens, prompts included,
    as the pipeline's prior covers the whole corpus texts)."""
    from rpb.posttraining import RightPadCollator
    from rpb.prior import extract_prior

    collate = RightPadCollator(_pad_id(tokenizer))
    rows = dataset.examples
    batches = [collate(rows[i : i + batch_size]) for i in range(0, len(rows), batch_size)]
    return extract_prior(
        model,
        batches,
        model_id=str(model_dir),
        revision="local",
        corpus_hash=sha256_of(data),
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
    if not args.mlflow:
        return contextlib.nullcontext()
    import mlflow  # first: without it, one line naming the mlflow extra

    from rpb import tracking

    uri = args.tracking_uri or tracking.resolve_tracking_uri(results_dir=Path("."))
    client = mlflow.MlflowClient(tracking_uri=uri)
    if client.get_experiment_by_name(args.experiment) is None:  # artifacts beside a sqlite store
        client.create_experiment(args.experiment, artifact_location=tracking.artifact_location(uri))
    return tracking.tracked_run(
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
    from rpb.eval_routing import load_for_inference

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
    failed run leaves no empty --out. The settings file a new run wrote there (PARAMS_FILE) goes
    too when nothing else is beside it: there is nothing to resume. A folder holding anything (a
    prior it extracted, a checkpoint, a folder that was there before) is kept."""
    created = [p for p in [folder, *folder.parents] if not p.exists()]  # innermost first
    fresh = not (folder / PARAMS_FILE).exists()
    try:
        yield
    except BaseException:
        if fresh and folder.is_dir() and [p.name for p in folder.iterdir()] == [PARAMS_FILE]:
            (folder / PARAMS_FILE).unlink()
        for path in created:
            with contextlib.suppress(OSError):  # not empty: kept, and so are its parents
                path.rmdir()
        raise


def _check_out(args: argparse.Namespace) -> None:
    """--out: a new or empty folder; with --resume also the folder of an unfinished run (its
    PARAMS_FILE marks one). A finished model there is never replaced."""
    if args.out.resolve() == args.model.resolve():
        raise ValueError(f"--out {args.out}: is --model itself; give a new folder")
    held = sorted(p.name for p in args.out.iterdir()) if args.out.is_dir() else []
    if not held:
        return
    listed = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
    if not args.resume:
        # A finished model there would be replaced file by file (seen: an rpb model silently
        # overwritten by an anchor_kl run).
        raise ValueError(
            f"--out {args.out}: not empty (holds {listed}); give a new or empty folder, or "
            "--resume the interrupted run there"
        )
    if PARAMS_FILE not in held:
        raise ValueError(
            f"--out {args.out}: no interrupted rpb finetune to resume (no {PARAMS_FILE}; holds "
            f"{listed})"
        )


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested settings as {"train.lr": 1e-05, ...}, so a difference names its key."""
    if not isinstance(value, dict) or not value:
        return {prefix: value}
    flat: dict[str, Any] = {}
    for key, sub in value.items():
        flat.update(_flat(sub, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _check_same_run(out: Path, params: dict[str, Any]) -> None:
    """--resume continues the run in `out` only with the settings it was started with: other
    settings would train on past the checkpoint a run that neither of them describes."""
    path = out / PARAMS_FILE
    try:
        then = _flat(json.loads(path.read_text(encoding="utf-8")))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not JSON ({err})") from None
    now = _flat(json.loads(json.dumps(params)))
    differ = sorted(k for k in set(then) | set(now) if then.get(k) != now.get(k))
    if differ:
        first = differ[0]
        raise ValueError(
            f"--resume {out}: the run started with other settings: {', '.join(differ)} "
            f"({first} {then.get(first)!r} then, {now.get(first)!r} now); give the flags it "
            "started with"
        )


def _one_epoch(examples: int, batch_size: int, grad_accum: int, processes: int) -> int:
    """Optimizer steps of one pass over `examples`, as the Trainer counts an epoch: batches per
    process, then micro-batches per step, each rounded up."""
    batches = math.ceil(examples / (batch_size * processes))
    return max(1, math.ceil(batches / grad_accum))


def _finetune_inputs(args: argparse.Namespace, tokenizer: Any) -> tuple[Any, Any, str]:
    """The tokenized training and eval sets (None without --eval-file) and the data's form."""
    records, form = read_records(args.corpus, args.text_field)
    keep = {"text_field": args.text_field, "max_length": args.max_length}
    dataset = tokenize_records(records, tokenizer, source=str(args.corpus), **keep)
    log.info("%s: %d training examples (%s)", args.corpus, len(dataset), form.replace("_", "/"))
    if args.eval_file is None:
        return dataset, None, form
    eval_records, _ = read_records(args.eval_file, args.text_field)
    evaluation = tokenize_records(eval_records, tokenizer, source=str(args.eval_file), **keep)
    log.info("%s: %d eval examples", args.eval_file, len(evaluation))
    return dataset, evaluation, form


def _eval_loss_callback(entries: list[dict[str, float]], to_mlflow: bool) -> Any:
    """A Trainer callback that sends each eval-split loss to the --mlflow run (`to_mlflow`), and
    at the end puts all of them, from the Trainer's log history (a resume restores it), into
    `entries`."""
    from transformers import TrainerCallback  # here: building the parser imports no torch

    class EvalLoss(TrainerCallback):
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            if to_mlflow and state.is_world_process_zero and "eval_loss" in (metrics or {}):
                import mlflow

                mlflow.log_metric("eval_loss", metrics["eval_loss"], step=state.global_step)

        def on_train_end(self, args, state, control, **kwargs):
            entries[:] = [
                {"step": e["step"], "eval_loss": e["eval_loss"]}
                for e in state.log_history
                if "eval_loss" in e
            ]

    return EvalLoss()


def method_choice(args: argparse.Namespace) -> MethodConfig:
    """The method `rpb finetune`'s --method, --strength and --option choose (the family's own
    strength and options where not given: `--method rpb` is table 1's rpb, its bias kept at
    evaluation)."""
    return MethodConfig(args.method, args.strength, dict(args.option or []))


def _check_finetune(args: argparse.Namespace, processes: int) -> tuple[MethodConfig, Any]:
    """Everything about the inputs that can be refused before a weight loads, in one line each;
    the method's choice and the method (made first: a bad strength or option fails at once)."""
    check_model_dir(args.model)
    check_file(args.corpus, "--data")
    for path, flag in ((args.eval_file, "--eval-file"), (args.prior, "--prior")):
        if path is not None:
            check_file(path, flag)
    if args.mlflow and "mlflow" in args.report_to.split(","):
        raise ValueError(
            "--report-to mlflow and --mlflow both log to MLflow (transformers' run and rpb's); "
            "choose one"
        )
    choice = method_choice(args)
    method = choice.build()
    _check_out(args)
    extracted = (args.out / PRIOR_FILE).is_file()
    if processes > 1 and method.needs_prior and args.prior is None and not extracted:
        # Each rank would extract it, and under FSDP's low-memory loading only rank 0 holds
        # weights to extract it from.
        raise ValueError(
            f"method {args.method} needs the base's router prior: under a multi-process launch "
            "give --prior (from `rpb prior --model ... --data ...`)"
        )
    return choice, method


def finetune_spec(
    args: argparse.Namespace, examples: int, processes: int, evaluate: bool
) -> TrainSpec:
    """The run's TrainSpec: its flags' values (`add_train_flags`), one epoch of `examples` where
    --steps is not given, no evaluations without an eval split, and the process's own torch
    threads (the pipeline's jobs set theirs)."""
    import torch

    values = {f.name: getattr(args, f.name) for f in train_flag_fields()}
    if values["steps"] is None:
        values["steps"] = _one_epoch(examples, args.batch_size, args.grad_accum, processes)
    if not evaluate:
        values["eval_every"] = 0
    return TrainSpec(**values, threads=torch.get_num_threads())


# TrainSpec's flags that do not change what a run computes: a --resume may give others.
_NOT_THE_RUN = ("log_every", "report_to")


def _finetune_params(
    args: argparse.Namespace, choice: MethodConfig, spec: TrainSpec, form: str, processes: int
) -> dict[str, Any]:
    """What the run is, as its MLflow params and OUT/PARAMS_FILE (which --resume compares)."""
    settings = {f.name: getattr(spec, f.name) for f in train_flag_fields()}
    return {
        "model_dir": str(args.model),
        "data": str(args.corpus),
        "eval_data": str(args.eval_file) if args.eval_file else None,
        "prior": str(args.prior) if args.prior else None,
        "form": form,
        "text_field": args.text_field,
        **method_params(_label(args), choice),
        "train": {k: v for k, v in settings.items() if k not in _NOT_THE_RUN}
        | {"processes": processes},
    }


def _label(args: argparse.Namespace) -> str:
    return args.method if args.strength is None else f"{args.method}@{args.strength}"


def _finetune_prior(
    args: argparse.Namespace, method: Any, model: Any, tokenizer: Any, dataset: Any
) -> Any:
    """The base's router prior: --prior, else the one an interrupted run extracted into --out,
    else, for a method that reads one, extracted from the model on --data (and kept in --out)."""
    import torch

    from rpb.prior import RouterPrior

    extracted = args.out / PRIOR_FILE
    if args.prior is not None or (method.needs_prior and extracted.is_file()):
        path = args.prior or extracted
        log.info("router prior: %s", path)
        return RouterPrior.load(path)
    if not method.needs_prior:
        return None
    log.info(
        "method %s needs the base's router prior and no --prior was given: extracting it from "
        "%s on %s into %s",
        args.method,
        args.model,
        args.corpus,
        extracted,
    )
    if torch.cuda.is_available():
        model.to("cuda")
    prior = prior_of(model, tokenizer, dataset, args.corpus, args.model, args.batch_size)
    prior.save(extracted)
    return prior


def _keep_beside_model(out: Path) -> Callable[[Path], None]:
    """What the finished folder keeps from --out before it takes --out's place: the prior the
    run extracted and transformers' loggers' files (tensorboard's `runs`)."""
    import shutil

    def complete(folder: Path) -> None:
        for path in out.iterdir():
            if path.name not in ("checkpoints", PARAMS_FILE):
                copy = shutil.copytree if path.is_dir() else shutil.copy2
                copy(path, folder / path.name)
        runs = out / "checkpoints" / "runs"  # tensorboard's default folder
        if runs.is_dir():
            shutil.copytree(runs, folder / "runs")

    return complete


def cmd_finetune(args: argparse.Namespace) -> None:
    """Supervised fine-tuning of `--model` on `--data` with one router method attached: the
    pipeline's post-training setup and loop (`rpb.posttraining.posttrain_model`), with its
    checkpoints, resume, multi-process launch and atomic model folder."""
    import torch
    from accelerate import PartialState
    from transformers import AutoTokenizer

    from rpb.artifacts import write_text
    from rpb.eval_routing import load_model
    from rpb.posttraining import is_main_process, posttrain_model

    processes, main = int(os.environ.get("WORLD_SIZE", "1")), is_main_process()
    choice, method = _check_finetune(args, processes)
    state = PartialState()
    state.wait_for_everyone()  # every rank has looked at --out before the main process writes
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    dataset, evaluation, form = _finetune_inputs(args, tokenizer)
    spec = finetune_spec(args, len(dataset), processes, evaluate=evaluation is not None)
    params = _finetune_params(args, choice, spec, form, processes)
    if (args.out / PARAMS_FILE).is_file():
        _check_same_run(args.out, params)
    run = _mlflow_run(args, "finetune", _label(args), params) if main else contextlib.nullcontext()
    with run, _removed_if_left_empty(args.out):
        if main:
            args.out.mkdir(parents=True, exist_ok=True)
            # Marks an unfinished run (--resume continues it with these settings only); the
            # finished model's folder replaces it.
            write_text(args.out / PARAMS_FILE, json.dumps(params, indent=2, sort_keys=True) + "\n")
        state.wait_for_everyone()
        torch.manual_seed(spec.torch_seed)
        # A steered folder (rpb.eval_routing): its weights, routing with its saved routers.
        model = load_model(args.model, steer=False, dtype=torch.float32)
        _check_routers(model, args.model)
        prior = _finetune_prior(args, method, model, tokenizer, dataset)
        evals: list[dict[str, float]] = []
        callbacks = [_eval_loss_callback(evals, args.mlflow)] if evaluation is not None else []
        log.info("fine-tuning with %r", method)
        history = posttrain_model(
            *(model, tokenizer, dataset, method, spec, args.out),
            prior=prior,  # a checkpoint's tokens have no pretraining record: no new_token_ids
            save_to=args.out,
            callbacks=callbacks,
            complete_model=_keep_beside_model(args.out),
            eval_dataset=evaluation,
        )
        if main:
            record = {"history": history, "params": params}
            _write_history(args, record | ({"eval": evals} if evaluation is not None else {}))
        state.wait_for_everyone()
    if main:
        _say_where(args.out)


def _write_history(args: argparse.Namespace, record: dict[str, Any]) -> None:
    """OUT/train_history.json (and, with --mlflow, the run's copy of it)."""
    from rpb.artifacts import write_text

    write_text(args.out / HISTORY_FILE, json.dumps(record, indent=2, sort_keys=True) + "\n")
    if args.mlflow:
        import mlflow

        mlflow.log_artifact(str(args.out / HISTORY_FILE))


def _say_where(out: Path) -> None:
    if (out / "eval_routing").is_dir():
        log.info(
            "the model steers at evaluation with %s: load it with trust_remote_code=True "
            "(lm-eval: --model_args pretrained=%s,trust_remote_code=True) or "
            "rpb.eval_routing.load_model",
            out / "eval_routing",
            out,
        )
    log.info("model and tokenizer saved to %s", out)


# --- the parser -------------------------------------------------------------------------------


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The epilog as written, and every optional flag's default in its help (a help that says
    what its default means keeps its own words; an on/off flag is off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.required or "default" in text or action.nargs == 0:
            return text
        return super()._get_help_string(action)


def train_flag_fields() -> list[dataclasses.Field]:
    """TrainSpec's fields that an `rpb finetune` flag sets (their metadata's `Flag`)."""
    return [f for f in dataclasses.fields(TrainSpec) if f.metadata.get(CLI_FLAG)]


def add_train_flags(p: argparse.ArgumentParser) -> None:
    """`rpb finetune`'s training flags, one per TrainSpec field whose metadata has a `Flag`
    (as TRL's HfArgumentParser reads a dataclass): its name, help, metavar and default from the
    Flag, its type, bounds and choices from the field's type and JSON-schema keywords; the value
    lands in `args.<field>`."""
    hints = typing.get_type_hints(TrainSpec)
    for f in train_flag_fields():
        flag, schema = f.metadata[CLI_FLAG], f.metadata[CONFIG_SETTING]["schema"]
        default = f.default if flag.default is FIELD_DEFAULT else flag.default
        kind = next(t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not None)
        if kind is bool:
            p.add_argument(flag.name, dest=f.name, action="store_true", help=flag.help)
        elif "enum" in schema:
            p.add_argument(
                flag.name, dest=f.name, choices=schema["enum"], default=default, help=flag.help
            )
        else:
            parse = bounded(kind, schema) if kind in (int, float) else kind
            p.add_argument(
                flag.name,
                dest=f.name,
                type=parse,
                default=default,
                metavar=flag.metavar,
                help=flag.help,
            )


def add_finetune(sub: Any) -> argparse.ArgumentParser:
    """Register `rpb finetune` on the `rpb` subparsers `sub`."""
    p = sub.add_parser(
        "finetune",
        help="fine-tune a Hugging Face MoE checkpoint on a JSONL file with a router method",
        description="Supervised fine-tuning of a Hugging Face MoE checkpoint folder on a JSONL "
        "file with one router method attached (transformers' Trainer, as the pipeline trains).",
        epilog=FINETUNE_EPILOG,
        formatter_class=HelpFormatter,
    )
    one_line_errors(p)
    p.set_defaults(func=cmd_finetune)
    add_model_and_data(p)
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="DIR",
        help="folder for the fine-tuned model: new or empty (with --resume: an interrupted run's)",
    )
    p.add_argument(
        "--method",
        type=method_arg,
        default="rpb",
        metavar="NAME",
        help=f"router method: {', '.join(METHOD_SPECS)} (default: rpb, the method table 1 "
        "measures, its bias kept at evaluation)",
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
        help="a method option, e.g. bias_on=logits, or keep_bias_at_eval=false for rpb's "
        "selection-only reading (repeatable; docs/methods.md) (default: the method's own)",
    )
    p.add_argument(
        "--prior",
        type=Path,
        default=None,
        metavar="FILE",
        help="router prior from `rpb prior` (default: extracted from --model on --data when "
        "the method needs one; a multi-process launch needs it given)",
    )
    add_train_flags(p)
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the interrupted run in --out from its last complete checkpoint, with "
        "the flags it started with (from the start if it saved none)",
    )
    p.add_argument(
        "--eval-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="eval split, JSONL as --data: its loss (the task loss alone) is logged and kept in "
        "train_history.json (default: none)",
    )
    add_text_field(p)
    add_trust(p)
    add_mlflow(p)
    return p


def add_model_and_data(p: argparse.ArgumentParser, *, corpus_alias: bool = False) -> None:
    """--model and --data (with `corpus_alias` also spelt --corpus, the rules' spelling)."""
    p.add_argument(
        "--model", type=Path, required=True, metavar="DIR", help="checkpoint folder (config.json)"
    )
    p.add_argument(
        *(("--data", "--corpus") if corpus_alias else ("--data",)),
        dest="corpus",
        type=Path,
        required=True,
        metavar="FILE",
        help=DATA_HELP,
    )


def add_text_field(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--text-field", default="text", metavar="NAME", help="the field holding the whole text"
    )


def add_trust(p: argparse.ArgumentParser, config_key: str = "") -> None:
    """--trust-remote-code (`config_key`: the config key that sets it, for a pipeline job)."""
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the tokenizer's own code from the model folder" + config_key,
    )


def add_compute(p: argparse.ArgumentParser, *, threads: bool = False) -> None:
    """Options of a command that runs a model: how its experts run (and its torch threads)."""
    p.add_argument(
        "--experts-implementation",
        default=None,
        help="transformers experts implementation (eager, grouped_mm, ...; default: its own)",
    )
    if threads:
        p.add_argument("--threads", type=int, default=None, help="torch threads (default: spec)")


def add_prior_flags(
    p: argparse.ArgumentParser,
    *,
    job: Callable[[argparse.ArgumentParser], None] | None = None,
    trust_key: str = "",
) -> None:
    """The flags of the two router-prior commands: the people's `rpb prior` has the user's flags
    alone, so its `--help` lists no job's; the pipeline's `rpb pipeline prior` passes `job`,
    which adds the job's own (its --name and the base's place), takes --corpus too, and names
    the config key of its --trust-remote-code (`trust_key`)."""
    one_line_errors(p)
    add_model_and_data(p, corpus_alias=job is not None)
    p.add_argument("--out", type=Path, required=True, metavar="FILE", help="the prior to write")
    p.add_argument("--batch-size", type=int, default=128, metavar="N", help="texts per forward")
    if job is not None:
        job(p)
    add_text_field(p)
    p.add_argument(
        "--max-length",
        type=int,
        default=1024,
        metavar="N",
        help="tokens per text" + (" (without --name)" if job else ""),
    )
    add_mlflow(p, uri=job is None)  # the pipeline's job has the store's flags of its own
    add_trust(p, trust_key)
    add_compute(p)


def add_prior(sub: Any) -> argparse.ArgumentParser:
    """Register `rpb prior` on the `rpb` subparsers `sub`."""
    p = sub.add_parser(
        "prior",
        help="extract a MoE checkpoint's router prior over a JSONL file",
        description="Extract the router prior of a Hugging Face MoE checkpoint folder over a "
        "JSONL file.",
        epilog=PRIOR_EPILOG,
        formatter_class=HelpFormatter,
    )
    p.set_defaults(func=cmd_prior)
    add_prior_flags(p)
    return p


def add_mlflow(p: argparse.ArgumentParser, *, uri: bool = True) -> None:
    """`--mlflow` (and the store's flags, unless the parser already has them)."""
    p.add_argument(
        "--mlflow",
        action="store_true",
        help="log the run to MLflow (store: --tracking-uri, else $MLFLOW_TRACKING_URI, else "
        f"./mlflow.db; needs the mlflow extra: {install_hint('mlflow')})",
    )
    if uri:
        p.add_argument(
            "--tracking-uri",
            default=None,
            metavar="URI",
            help="MLflow tracking URI (with --mlflow) (default: $MLFLOW_TRACKING_URI, else "
            "./mlflow.db)",
        )
        p.add_argument(
            "--experiment", default="rpb", metavar="NAME", help="MLflow experiment (with --mlflow)"
        )


def new_parser() -> tuple[argparse.ArgumentParser, Any]:
    """The `rpb` parser with the people's verbs, and its subparsers (the pipeline adds its own)."""
    parser = argparse.ArgumentParser(
        prog="rpb",
        description="Router Prior Bias (Lee et al., arXiv:2609.08115): post-train a Hugging Face "
        "MoE checkpoint with a router method, extract its router prior, or run the pipeline's "
        "jobs.",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_finetune(sub)
    add_prior(sub)
    one_line_errors(inspection.add_inspect(sub))
    return parser, sub


def build_parser() -> argparse.ArgumentParser:
    """The `rpb` parser of the people's verbs alone."""
    return new_parser()[0]


# --- running a command ------------------------------------------------------------------------


def command_name(args: argparse.Namespace) -> str:
    """The command as typed, for messages: `rpb finetune`, `rpb pipeline train`."""
    job = getattr(args, "job", None)
    return f"rpb {args.command} {job}" if job else f"rpb {args.command}"


def offline() -> None:
    """Compute commands never touch a hub (downloads happen in their own rules at paper scale;
    a user downloads a checkpoint folder first)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def run_command(
    args: argparse.Namespace,
    *,
    extras: Mapping[str, str] = {"mlflow": "mlflow"},
    explain: Callable[[BaseException], str | None] | None = None,
) -> int:
    """Run the parsed command `args.func(args)` as `rpb` does: logging, no hub, the pinned
    numeric path where the pipeline pins it; its exit status. A missing package that `extras`
    maps to an extra is one line naming the extra; bad input, a damaged file, a full disk (and
    what `explain` words, e.g. a locked tracking store) one line naming the file, key or store;
    any other error is a bug and keeps its traceback."""
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    offline()
    name = command_name(args)
    try:
        if os.environ.get(PIN_ENV):
            # The pipeline pins every job's CPU numeric path (rpb.numerics); a job that would
            # compute with other kernels stops before it computes anything.
            from rpb.numerics import NumericPathError, apply_path

            try:
                apply_path()
            except NumericPathError as err:
                print(f"{name}: error: {err}", file=sys.stderr)
                return 2
        args.func(args)
    except ModuleNotFoundError as err:
        extra = extras.get((err.name or "").split(".")[0])
        if extra is None:
            raise
        print(
            f"{name}: error: needs {err.name}, which the {extra} extra installs: "
            f"{install_hint(extra)}",
            file=sys.stderr,
        )
        return 2
    except Exception as err:
        from rpb.artifacts import failure_line

        line = (explain(err) if explain else None) or failure_line(err, getattr(args, "out", None))
        if line is None:
            raise
        log.debug("command failed", exc_info=True)
        print(f"{name}: error: {line}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`rpb finetune` / `rpb prior`; the exit status."""
    args = build_parser().parse_args(argv)
    explain = None
    if getattr(args, "mlflow", False):  # a locked or lost store: the tracking's own line

        def explain(err: BaseException) -> str | None:
            from rpb.tracking import tracking_failure

            return tracking_failure(err) if "mlflow" in sys.modules else None

    return run_command(args, explain=explain)
