"""`rpb` command line with the pipeline's verbs. For people: `rpb finetune` and `rpb prior` on any
Hugging Face MoE checkpoint folder and a JSONL file (the library's rpb.user_cli, whose parser this
extends), `rpb check-config` and `rpb relayout`. For the workflow: `rpb pipeline <job>`, one job per
pipeline stage, which the Snakemake rules call.

Each pipeline job opens one MLflow run (`rpb.pipeline.tracking.tracked_run`) named
`{stage}/{model}/{corpus}/{method}/base{base}/seed{seed}` (the parts it has) and records its run
id beside its outputs for lineage (`train` under a multi-process launch: from the main process
only). `run` is `train`, `eval` and `analyze` of one post-training run in one process: the same
outputs and MLflow runs, one start-up (docs/performance.md).

Imports stay inside the subcommands: `rpb --help` and each job load only what that job uses.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rpb.method_config import MethodConfig
from rpb.report.registry import REPORT_JOBS
from rpb.specs import TRAINABLE, Run
from rpb.user_cli import (
    VERBS,
    add_compute,
    add_prior_flags,
    add_trust,
    command_name,
    new_parser,
    run_command,
)

log = logging.getLogger("rpb")
# What `rpb[pipeline]` adds to the core install (pyproject.toml); a subcommand missing one of
# them says which extra to install.
PIPELINE_PACKAGES = frozenset(
    {"mlflow", "lm_eval", "snakemake", "datasets", "pandas", "scipy", "matplotlib", "yaml",
     "jsonschema", "tabulate", "sklearn", "networkx"}
)  # fmt: skip


def _json_arg(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({err.msg}): {text[:80]}") from None


def _method_arg(text: str) -> MethodConfig:
    """A training job's `--method`: a MethodConfig as `to_dict` spells it."""
    try:
        return MethodConfig.from_dict(_json_arg(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _csv_arg(text: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated, non-empty list")
    return items


def _train_spec(args: argparse.Namespace, checkpoints: bool = False):
    """The job's TrainSpec: `--spec` with `--threads` (Snakemake's `{threads}`) applied; with
    `checkpoints` (post-training) also the checkpoint settings the workflow puts in the
    environment (rpb.pipeline.plan.CHECKPOINTS_ENV) where `--spec` does not name them. Both reach
    `args.spec`, which the MLflow run records."""
    from rpb.pipeline.plan import CHECKPOINTS_ENV
    from rpb.pipeline.training import TrainSpec

    if checkpoints and os.environ.get(CHECKPOINTS_ENV):
        args.spec = json.loads(os.environ[CHECKPOINTS_ENV]) | args.spec
    if getattr(args, "trainable", None) is not None:  # overrides posttrain.trainable
        args.spec = {**args.spec, "trainable": args.trainable}
    spec = TrainSpec.from_dict(args.spec)
    if args.threads is not None:
        spec.threads = args.threads
    return spec


def _run_of(spec: Any) -> Run:
    """The run a post-training TrainSpec trains: its base and seed (a spec written by hand
    without a base: base 0, whose torch seed is the seed itself, TrainSpec.torch_seed)."""
    return Run(spec.base if spec.base is not None else 0, spec.seed)


def _track_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "tracking_uri": args.tracking_uri,
        "experiment": args.experiment,
        "group": getattr(args, "run_group", None),
    }


def _run_dir_of(model_dir: Path) -> Path:
    """Model directories live in `<job dir>/model`; the job's run id file sits in `<job dir>`."""
    return Path(model_dir).parent


def _lineage(**dirs: Path | None) -> dict[str, str | None]:
    from rpb.pipeline.tracking import read_run_id

    return {role: read_run_id(path) if path else None for role, path in dirs.items()}


# --- subcommands -----------------------------------------------------------------------------


def cmd_init_tracking(args: argparse.Namespace) -> None:
    from rpb.pipeline.tracking import init_store, resolve_tracking_uri

    init_store(resolve_tracking_uri(args.tracking_uri), args.experiment)


def cmd_corpora(args: argparse.Namespace) -> None:
    import mlflow

    from rpb.artifacts import atomic_folder
    from rpb.pipeline.data import preset_sizes, write_corpora
    from rpb.pipeline.tokenizer import build_tokenizer
    from rpb.pipeline.tracking import tracked_run

    sizes = preset_sizes(args.preset, args.post_pairs)
    # `data_seed`: the schema's `seed` is a post-training seed within a base, which corpora lack.
    params = {"data_seed": args.seed, "preset": args.preset, "sizes": sizes, "level": args.level}
    if args.holdout is not None:
        params["holdout"] = args.holdout
    with tracked_run(stage="corpora", params=params, run_dir=args.out, **_track_kwargs(args)):
        manifest = write_corpora(
            args.out, seed=args.seed, sizes=sizes, level=args.level, holdout=args.holdout
        )
        # Whole or not at all, as every output: what a job finishes is kept even when its
        # Snakemake was killed (rpb.pipeline.results_folder.keep_finished_outputs).
        with atomic_folder(args.out / "tokenizer") as folder:
            build_tokenizer(folder)
        mlflow.log_artifact(str(args.out / "manifest.json"))
        log.info("corpora written to %s: %s", args.out, json.dumps(manifest.get("files", {}))[:400])


def cmd_eval_set(args: argparse.Namespace) -> None:
    """An eval-only set beside the corpora (rpb.pipeline.data.write_eval_only_set)."""
    import mlflow

    from rpb.pipeline.data import write_eval_only_set
    from rpb.pipeline.tracking import tracked_run

    run_dir = args.data / "eval" / f"{args.task}.run"
    with tracked_run(
        stage="eval_set", params={"task": args.task}, run_dir=run_dir, **_track_kwargs(args)
    ):
        path = write_eval_only_set(args.data, args.task)
        mlflow.log_artifact(str(path))
        log.info("eval-only set %s written to %s", args.task, path)


def cmd_pretrain(args: argparse.Namespace) -> None:
    import mlflow

    from rpb.pipeline.tracking import log_datasets, tracked_run
    from rpb.pipeline.training import pretrain

    spec = _train_spec(args)
    params = {
        "base_name": args.name,
        "model_type": args.model_type,
        "architecture": args.architecture,
        "train": args.spec,
        "lbl_coef": args.lbl_coef,
        # Where the base comes from: the committed fixed base (rpb.pipeline.bases) or pretrained.
        "base_source": f"fixed:{args.fixed_base}" if args.fixed_base else "pretrained",
    }
    parents = _lineage(corpora=args.corpus.parent)
    with tracked_run(
        stage="pretrain",
        model=args.family or args.name,
        base=args.base_index,  # no corpus: the pretraining corpus is the run's input dataset
        params=params,
        parents=parents,
        run_dir=args.out,
        **_track_kwargs(args),
    ):
        if args.fixed_base:
            from rpb.pipeline.bases import install

            entry = install(
                _fixed_bases_root(), args.fixed_base, args.out, args.corpus, args.tokenizer
            )
            mlflow.log_artifact(str(args.out / "train_history.json"))
            log_datasets([args.corpus], "training")
            log.info(
                "fixed base %s installed (pretrained on %s, %s; sha256 checked)",
                args.fixed_base,
                entry["numeric_path"].get("cpu"),
                entry["numeric_path"].get("capability"),
            )
            return
        summary = pretrain(
            model_type=args.model_type,
            architecture=args.architecture,
            tokenizer_dir=args.tokenizer,
            corpus=args.corpus,
            spec=spec,
            lbl_coef=args.lbl_coef,
            out_dir=args.out,
            experts_implementation=args.experts_implementation,
        )
        mlflow.log_artifact(str(args.out / "train_history.json"))
        log_datasets([args.corpus], "training")
        log.info("pretraining done: %s", summary["final"])
        if args.compare_base:
            from rpb.pipeline.bases import compare

            same, line = compare(_fixed_bases_root(), args.compare_base, args.out)
            mlflow.set_tag("rpb.fixed_base_bytes", "same" if same else "different")
            log.info(line)
            print(line, flush=True)


def cmd_fix_bases(args: argparse.Namespace) -> None:
    """Record every base pretrained under --results by the config of --configfile (merged over
    config/config.yaml, as Snakemake merges them) as the committed fixed bases."""
    from rpb.pipeline.bases import record
    from rpb.pipeline.config_check import check_config
    from rpb.pipeline.plan import Plan
    from rpb.pipeline.relayout import read_config

    workflow = Path(__file__).resolve().parents[2]
    config = read_config(args.configfile)
    plan = Plan(check_config(config, workflow / "workflow" / "schemas" / "config.schema.yaml"))
    data = args.results / "data"
    for model in plan.original_pretrained:
        for base, entry in enumerate(plan.bases(model)):  # base k: the model's k-th entry
            name = f"{model}/base{base}"
            folder = args.results / "models" / name
            if not (folder / "model").is_dir():
                continue
            identity = plan.base_identity(entry)
            corpus, tokenizer = data / "pretrain.jsonl", data / "tokenizer"
            record(_fixed_bases_root(), name, folder, identity, corpus, tokenizer)
            print(f"recorded {_fixed_bases_root() / name} from {folder}")


def _fixed_bases_root() -> Path:
    """The committed bases' folder: the workflow's (RPB_FIXED_BASES), else ./bases."""
    from rpb.pipeline.bases import FIXED_BASES

    return Path(os.environ.get("RPB_FIXED_BASES", FIXED_BASES))


def cmd_prior(args: argparse.Namespace) -> None:
    """`rpb pipeline prior --name ...`: the rules' prior job (the people's `rpb prior` is
    rpb.user_cli.cmd_prior)."""
    import mlflow

    from rpb.pipeline.analysis import extract_prior_from_corpus
    from rpb.pipeline.tracking import log_datasets, tracked_run

    parents = _lineage(base=_run_dir_of(args.model), corpora=args.corpus.parent.parent)
    with tracked_run(
        stage="prior",
        model=args.family or args.name,
        base=args.base_index,
        corpus=args.corpus.stem,
        params={
            "base_name": args.name,
            "model_dir": str(args.model),
            "corpus_file": str(args.corpus),
        },
        parents=parents,
        run_dir=args.out.parent / f"{args.out.stem}.run",
        **_track_kwargs(args),
    ):
        prior = extract_prior_from_corpus(
            args.model,
            args.corpus,
            args.out,
            model_id=args.name,
            batch_size=args.batch_size,
            trust_remote_code=args.trust_remote_code,
            experts_implementation=args.experts_implementation,
        )
        mlflow.log_metrics({"tokens": float(prior.meta["n_tokens"])})
        log_datasets([args.corpus], "prior")
        mlflow.log_artifact(str(args.out.with_suffix(".json")))


def cmd_train(args: argparse.Namespace) -> None:
    """Under `accelerate launch` every rank runs this; only the main process opens the MLflow run
    (the others have none, so their metric logging is a no-op) and writes outputs."""
    import mlflow

    from rpb.pipeline.tracking import log_datasets, method_params, tracked_run
    from rpb.pipeline.training import is_main_process, posttrain

    spec = _train_spec(args, checkpoints=True)
    identity = _run_of(spec)
    parents = _lineage(
        base=_run_dir_of(args.base),
        prior=args.prior.parent / f"{args.prior.stem}.run" if args.prior else None,
    )
    main = is_main_process()
    run = (
        tracked_run(
            stage="train",
            model=args.name,
            method=args.label,
            corpus=args.corpus_name,
            # The run's base and seed (its torch seed is TrainSpec.torch_seed of the two).
            base=identity.base,
            seed=identity.seed,
            params={**method_params(args.label, args.method), "train": args.spec},
            parents=parents,
            run_dir=args.out,
            **_track_kwargs(args),
        )
        if main
        else contextlib.nullcontext()
    )
    with run:
        summary = posttrain(
            base_dir=args.base,
            prior_path=args.prior,
            corpus=args.corpus,
            method=args.method,
            spec=spec,
            out_dir=args.out,
            trust_remote_code=args.trust_remote_code,
            experts_implementation=args.experts_implementation,
        )
        if main:
            mlflow.log_artifact(str(args.out / "train_history.json"))
            log_datasets([args.corpus], "training")
            log.info("post-training done: %s", summary["final"])


def cmd_router_swap(args: argparse.Namespace) -> None:
    import mlflow

    from rpb.pipeline.tracking import tracked_run
    from rpb.router_swap import swap_saved_parts

    parents = _lineage(target=_run_dir_of(args.target), source=_run_dir_of(args.source))
    with tracked_run(
        stage="router_swap",
        model=args.name,
        method=args.label,
        corpus=args.corpus_name,
        base=args.base_index,
        seed=args.seed,
        params={"target": str(args.target), "source": str(args.source), "parts": args.parts},
        parents=parents,
        run_dir=_run_dir_of(args.out),
        **_track_kwargs(args),
    ):
        summary = swap_saved_parts(args.target, args.source, args.parts, args.out)
        mlflow.log_metrics(
            {
                "swapped_tensors": float(len(summary["swapped"])),
                **{f"distance_{p}": d for p, d in summary["distance"].items()},
            }
        )


def _model_job_run(args: argparse.Namespace, stage: str):
    """The MLflow run of a job that reads one trained model (eval, analysis), with lineage to the
    training run that made it and its run record beside the job's output."""
    from rpb.pipeline.tracking import model_job_params, tracked_run

    return tracked_run(
        stage=stage,
        model=args.name,
        method=args.label,
        corpus=args.corpus_name,
        base=args.base_index,
        seed=args.seed,
        params=model_job_params(
            method=args.label,
            model_dir=args.model,
            tasks=args.tasks,
            limit=args.limit,
        ),
        parents=_lineage(trained=_run_dir_of(args.model)),
        run_dir=args.out.parent / f"{args.out.stem}.run",
        **_track_kwargs(args),
    )


def cmd_eval(args: argparse.Namespace) -> None:
    import mlflow

    from rpb.pipeline.evaluation import evaluate_model
    from rpb.pipeline.tracking import eval_sets, log_datasets, log_eval_summary, task_metrics

    with _model_job_run(args, "eval"):
        result = evaluate_model(
            args.model,
            args.eval_dir,
            args.tasks,
            args.out,
            args.work,
            batch_size=args.batch_size,
            limit=args.limit or None,
            trust_remote_code=args.trust_remote_code,
            experts_implementation=args.experts_implementation,
        )
        mlflow.log_metrics(task_metrics(result))
        log_eval_summary(result, args.corpus_name)
        log_datasets(eval_sets(args.eval_dir, args.tasks), "evaluation")
        mlflow.log_artifact(str(args.out))


def cmd_analyze(args: argparse.Namespace) -> None:
    import mlflow

    from rpb.pipeline.analysis import analyze_model
    from rpb.pipeline.tracking import eval_sets, log_analysis_summary, log_datasets

    with _model_job_run(args, "analysis"):
        summary = analyze_model(
            model_dir=args.model,
            base_dir=args.base,
            prior_path=args.prior,
            eval_dir=args.eval_dir,
            tasks=args.tasks,
            limit=args.limit,
            out_json=args.out,
            trust_remote_code=args.trust_remote_code,
            experts_implementation=args.experts_implementation,
        )
        log_analysis_summary(summary)
        log_datasets(eval_sets(args.eval_dir, args.tasks), "probe")
        mlflow.log_artifact(str(args.out))


def cmd_run(args: argparse.Namespace) -> None:
    """Post-train, evaluate and analyse one run in this one process.

    Each stage is its job's own subcommand function (`train`, `eval`, `analyze`) with the
    arguments its rule would pass, so outputs, MLflow runs and lineage are those of three
    separate jobs; only the interpreter start-up and imports are paid once. Ends with one line
    naming the run and its wall time, which the pipeline prints."""
    from rpb.pipeline.training import is_main_process

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            "rpb pipeline run: one process only; under a multi-process launch use train"
        )
    start = time.perf_counter()
    cmd_train(args)
    trained = time.perf_counter()
    if not is_main_process():
        return
    run = _run_of(_train_spec(args))
    shared = {
        "name": args.name,
        "label": args.label,
        "base_index": run.base,
        "seed": run.seed,
        "corpus_name": args.corpus_name,
        "model": args.out / "model",
        "eval_dir": args.eval_dir,
        "trust_remote_code": args.trust_remote_code,
        "experts_implementation": args.experts_implementation,
        "tracking_uri": args.tracking_uri,
        "experiment": args.experiment,
        "run_group": args.run_group,
    }
    cmd_eval(
        argparse.Namespace(
            **shared,
            tasks=args.tasks,
            limit=args.limit,
            batch_size=args.batch_size,
            work=args.work,
            out=args.eval_out,
        )
    )
    evaluated = time.perf_counter()
    cmd_analyze(
        argparse.Namespace(
            **shared,
            base=args.base,
            prior=args.analysis_prior or args.prior,
            tasks=args.probe_tasks,
            limit=args.probe_limit,
            out=args.analysis_out,
        )
    )
    done = time.perf_counter()
    line = (
        f"rpb pipeline run: {args.name}/{args.corpus_name}/{args.label}/{run} "
        f"done in {done - start:.1f} s (train {trained - start:.1f} s, "
        f"eval {evaluated - trained:.1f} s, analysis {done - evaluated:.1f} s)"
    )
    log.info(line)
    print(line, flush=True)


@contextlib.contextmanager
def _whole_table_or_none(out: Path) -> Iterator[None]:
    """A table job's files appear with its success only: cleared before it builds them (no old
    one outlives a failed build) and again when it fails after writing them (a full tracking
    store while it logs them), since Snakemake deletes only the declared ones."""
    from rpb.report.render import clear_table

    clear_table(out)
    try:
        yield
    except BaseException:
        clear_table(out)
        raise


def cmd_table1(args: argparse.Namespace) -> None:
    import mlflow

    from rpb.pipeline.tracking import log_table_run, tracked_run
    from rpb.report.claims import judge_table
    from rpb.report.table1 import build_table1

    spec = args.spec
    with _whole_table_or_none(args.out):
        # Table 1's own claims (C1, C2) judged from its runs open its caption and landing page.
        judged = judge_table(args.results, args.claims_spec) if args.claims_spec else None
        verdicts = judged.lines() if judged else []
        landing = judged.landing() if judged else {}
        with tracked_run(
            stage="table1",
            model=spec["model"],
            corpus=spec["corpus"],
            params=spec,
            run_dir=args.out.parent / "table1.run",
            **_track_kwargs(args),
        ):
            build_table1(args.results, spec, args.out, verdicts, **landing)
            log_table_run("table1", args.out)
            for suffix in (".csv", ".md", ".meta.json"):
                mlflow.log_artifact(str(args.out.with_suffix(suffix)))
            mlflow.log_artifacts(str(args.out.parent / "figures"), artifact_path="figures")


def cmd_testbed(args: argparse.Namespace) -> None:
    import mlflow

    from rpb.pipeline.testbed import testbed_report
    from rpb.pipeline.tracking import resolve_tracking_uri, tracked_run

    spec = args.spec
    with tracked_run(
        stage="testbed",
        model=",".join(spec["models"]),
        corpus=spec["corpus"],
        params=spec,
        run_dir=args.out.parent / "testbed.run",
        **_track_kwargs(args),
    ):
        testbed_report(
            results=args.results,
            models=spec["models"],
            corpus=spec["corpus"],
            seeds=spec["seeds"],
            tasks=spec["tasks"],
            out=args.out,
            tracking_uri=resolve_tracking_uri(args.tracking_uri),
        )
        mlflow.log_artifact(str(args.out))


def _report_job(args: argparse.Namespace, stage: str, build: Callable[..., Any]) -> None:
    """One tables/claims/sweep job: build its outputs inside one MLflow run and log them (every
    file beside `--out` whose name starts with its stem, and the figures folder)."""
    import mlflow

    from rpb.pipeline.tracking import SCHEMA_TAGS, log_table_run, tracked_run

    spec = args.spec
    models = spec.get("models") or [spec.get("model") or spec.get("table1", {}).get("model", "-")]
    corpus = spec.get("corpus") or ",".join(spec.get("corpora", [])) or "-"
    run = {"model": ",".join(models), "corpus": corpus}
    # A spec key named like a schema tag but not the run's (the `method` of table 3 and of the
    # claims: the claim's; of the router-swap table: the label swapped) is what the report is
    # about, not a tag of its run: param `spec.method`, so grouping by `method` keeps table runs
    # out of the methods' groups.
    params = {
        f"spec.{k}" if k in SCHEMA_TAGS and str(v) != run.get(k) else k: v for k, v in spec.items()
    }
    with (
        _whole_table_or_none(args.out),
        tracked_run(
            stage=stage,
            **run,
            params=params,
            run_dir=args.out.parent / f"{args.out.stem}.run",
            **_track_kwargs(args),
        ),
    ):
        build(args.results, spec, args.out)
        if args.out.suffix == ".csv" and args.out.is_file():
            log_table_run(stage, args.out)
        for path in sorted(args.out.parent.glob(f"{args.out.stem}*")):
            if path.is_file():
                mlflow.log_artifact(str(path))
        figures = args.out.parent / "figures"
        if figures.is_dir():
            mlflow.log_artifacts(str(figures), artifact_path="figures")


def cmd_permute_prior(args: argparse.Namespace) -> None:
    """The claims audit's prior-permutation control (rpb.pipeline.controls): no MLflow run, a file
    transform."""
    from rpb.pipeline.controls import write_permuted_prior

    write_permuted_prior(args.prior, args.out, seed=args.seed)


def cmd_check_config(args: argparse.Namespace) -> None:
    """The YAML syntax of config files, one line per bad file (no MLflow run). Snakemake reads
    `--configfile` files itself, before any workflow code runs, and its message for a syntax
    error names neither the file nor the line: check a config file with this first."""
    from rpb.pipeline.config_check import ConfigError, check_yaml_syntax

    problems = []
    for path in args.files:
        try:
            if not path.is_file():
                raise ConfigError(f"{path}: no such config file")
            check_yaml_syntax(path)
        except ConfigError as err:
            problems.append(err)
    for err in problems[:-1]:
        print(f"{command_name(args)}: error: {err}", file=sys.stderr)
    if problems:
        raise problems[-1]


def cmd_relayout(args: argparse.Namespace) -> None:
    """Move a results folder of the first layout (run ids in paths) to `base{b}/seed{s}`
    (rpb.pipeline.relayout); prints the moves, makes them with --apply."""
    from rpb.pipeline.relayout import (
        apply_moves,
        legacy_bases,
        misread_diagnostics,
        moves,
        read_config,
    )

    config = read_config(args.configfile)
    results = args.results or Path(config.get("results_dir", "results"))
    if not results.is_dir():
        raise SystemExit(f"{command_name(args)}: error: {results}: no such results folder")
    planned = moves(results, legacy_bases(config.get("models") or {}))
    for source, target in planned:
        print(f"{source} -> {target}")
    if args.apply:
        apply_moves(results, planned)
    verb = "moved" if args.apply else "would move (run with --apply to move)"
    print(f"{len(planned)} paths {verb} under {results}", file=sys.stderr)
    if misread := misread_diagnostics(planned):
        print(
            f"{len(misread)} routing-regime diagnostic outputs of replicate bases were computed "
            "against base 0; recompute them: snakemake --cores all [--configfile ...] "
            "--forcerun diagnostic_evaluate diagnostic_analyze",
            file=sys.stderr,
        )


def cmd_report(args: argparse.Namespace) -> None:
    """A report job of the registry (`args.report`, its key: the stage and the config's
    `tables` key)."""
    import importlib

    job = REPORT_JOBS[args.report]
    _report_job(args, args.report, getattr(importlib.import_module(job.module), job.builder))


# --- parser ----------------------------------------------------------------------------------


# Where the config sets a job's --trust-remote-code.
_TRUST_KEY = " (models.<m>.trust_remote_code)"


def _add_train(p: argparse.ArgumentParser) -> None:
    """The options of a post-training job (`train`, and `run`, which also evaluates)."""
    p.add_argument("--name", required=True)
    p.add_argument("--label", required=True, help="the method's label in the config")
    p.add_argument("--base", type=Path, required=True)
    p.add_argument("--prior", type=Path, default=None)
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--corpus-name", required=True)
    p.add_argument(
        "--method",
        type=_method_arg,
        required=True,
        help='{"kind", "strength", "options"} (rpb.method_config.MethodConfig)',
    )
    p.add_argument("--spec", type=_json_arg, required=True, help="TrainSpec as JSON")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--trainable",
        choices=list(TRAINABLE),
        default=None,
        help="parameters post-training updates (default: the spec's, else all)",
    )
    add_trust(p, _TRUST_KEY)
    add_compute(p, threads=True)


def _add_eval(p: argparse.ArgumentParser, out: str = "--out") -> None:
    """The options of an lm-eval job (`eval`, and `run`, where the output is `--eval-out`)."""
    p.add_argument("--eval-dir", type=Path, required=True)
    p.add_argument("--tasks", type=_csv_arg, required=True)
    p.add_argument("--limit", type=int, default=0, help="items per task (0: all)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--work", type=Path, required=True, help="lm-eval task/cache folder")
    p.add_argument(out, type=Path, required=True)


def _add_run(p: argparse.ArgumentParser) -> None:
    """The run a job reads the model of, for the tracking schema's `base` and `seed` (a job started
    by hand may leave them out)."""
    p.add_argument("--base-index", type=int, default=None, help="the run's base (0: the model)")
    p.add_argument("--seed", type=int, default=None, help="the run's seed within its base")


def _add_base_of(p: argparse.ArgumentParser) -> None:
    """Which family and base a pretrained model is (`tinyA_base1`: family tinyA, base 1), for the
    tracking schema's `model` and `base` (rpb.pipeline.tracking.SCHEMA_TAGS)."""
    p.add_argument(
        "--family", default=None, help="the model it is a base of (default: --name itself)"
    )
    p.add_argument(
        "--base-index", type=int, default=0, help="which of the family's bases (0: the model)"
    )


def _add_tracking(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: env/config)")
    p.add_argument("--experiment", default="rpb", help="MLflow experiment name")
    p.add_argument(
        "--run-group",
        default=None,
        help="a group the run belongs to beyond the main tables (e.g. diagnostic): prefixes its "
        "name and tags it, so its runs never pass for the main runs of the same method",
    )


def _add_prior_job(p: argparse.ArgumentParser) -> None:
    """The pipeline's `rpb pipeline prior` (`cmd_prior`): the people's `rpb prior` flags
    (rpb.user_cli.add_prior_flags), the job's `--name` and the base's place."""
    p.set_defaults(func=cmd_prior)

    def job(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--name",
            required=True,
            help="the model's name in the config: the job runs as the rules run it, an MLflow "
            "run over a prompt/completion corpus (`rpb prior` is the form without it)",
        )
        _add_base_of(p)

    add_prior_flags(p, job=job, trust_key=_TRUST_KEY)


def build_parser() -> argparse.ArgumentParser:
    # The verbs for people (rpb.user_cli): finetune, prior; then check-config, relayout.
    parser, sub = new_parser()
    p = sub.add_parser(
        "check-config",
        help="check the YAML syntax of config files (a --configfile before snakemake reads it)",
    )
    p.set_defaults(func=cmd_check_config)
    p.add_argument("files", nargs="+", type=Path, metavar="FILE")
    p = sub.add_parser(
        "relayout",
        help="move a results folder with run ids in its paths to base<b>/seed<s> paths",
        description="Move a results folder written before runs were named base<b>/seed<s> "
        "(runs/tinyA/math/rpb/seed1002, models/tinyA_p1/) to the current layout, so that "
        "Snakemake keeps what it computed. Prints the moves; --apply makes them.",
    )
    p.set_defaults(func=cmd_relayout)
    p.add_argument(
        "--configfile",
        nargs="+",
        type=Path,
        default=[],
        help="the --configfile files the folder was built with (over config/config.yaml)",
    )
    p.add_argument("--results", type=Path, default=None, help="default: the config's results_dir")
    p.add_argument("--apply", action="store_true", help="make the moves")
    pipeline = sub.add_parser(
        "pipeline",
        help="the pipeline's jobs, one per Snakemake rule (the workflow runs these)",
        description="The jobs the Snakemake rules run, one MLflow run each. Run the workflow "
        "(snakemake) rather than these by hand; `rpb pipeline JOB --help` lists a job's flags.",
    )
    jobs = pipeline.add_subparsers(dest="job", required=True, metavar="JOB")

    def add(name: str, func: Callable[[argparse.Namespace], None], help_: str, **kwargs: Any):
        p = jobs.add_parser(name, help=help_, **kwargs)
        p.set_defaults(func=func)
        _add_tracking(p)
        return p

    add("init-tracking", cmd_init_tracking, "create the MLflow store and experiment once")

    p = add("corpora", cmd_corpora, "write the synthetic corpora, eval sets and tokenizer")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--preset", choices=["default", "smoke"], default="default")
    p.add_argument("--level", type=int, default=1, help="post-training difficulty (POST_LEVELS)")
    p.add_argument(
        "--post-pairs", type=int, default=None, help="cut each post-training corpus to N pairs"
    )
    p.add_argument(
        "--holdout",
        default=None,
        help="post-training hold-out region, e.g. corner50 (rpb.pipeline.data.check_holdout)",
    )

    p = add(
        "eval-set", cmd_eval_set, "write an eval-only set beside the corpora (no base reads it)"
    )
    p.add_argument("--data", type=Path, required=True, help="the corpora's folder (manifest.json)")
    p.add_argument("--task", required=True, help="a name of rpb.specs.EVAL_SETS['eval_only']")

    p = add("pretrain", cmd_pretrain, "pretrain a tiny MoE base with a load-balancing loss")
    p.add_argument("--name", required=True)
    p.add_argument("--model-type", required=True)
    p.add_argument("--architecture", type=_json_arg, required=True)
    p.add_argument("--spec", type=_json_arg, required=True, help="TrainSpec as JSON")
    p.add_argument("--lbl-coef", type=float, required=True)
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    source = p.add_mutually_exclusive_group()  # of the pretrain job
    source.add_argument(
        "--fixed-base", help="install this committed base (bases/<NAME>) instead of pretraining"
    )
    source.add_argument(
        "--compare-base", help="pretrain, then say whether the bytes equal bases/<NAME>'s"
    )
    _add_base_of(p)
    add_compute(p, threads=True)

    _add_prior_job(add("prior", cmd_prior, "the router prior of the pipeline's base over a corpus"))

    p = add("train", cmd_train, "post-train a base with one router method")
    _add_train(p)

    p = add("router-swap", cmd_router_swap, "save a model with parts of another model")
    p.add_argument("--name", required=True)
    p.add_argument("--label", required=True, help="the swapped model's label")
    _add_run(p)
    p.add_argument("--corpus-name", default="-")
    p.add_argument("--target", type=Path, required=True, help="the model the swap starts from")
    p.add_argument("--source", type=Path, required=True, help="the model the parts come from")
    p.add_argument(
        "--parts",
        nargs="+",
        required=True,
        metavar="PART",
        help="the parts to take from the source: routers, routed_experts, trunk (checked by "
        "rpb.router_swap; rpb.trainable.parameter_parts)",
    )
    p.add_argument("--out", type=Path, required=True, help="the new model folder")

    p = add("eval", cmd_eval, "evaluate a model with lm-evaluation-harness")
    p.add_argument("--name", required=True)
    p.add_argument("--label", required=True)
    _add_run(p)
    p.add_argument("--corpus-name", default="-")
    p.add_argument("--model", type=Path, required=True)
    _add_eval(p)
    add_trust(p, _TRUST_KEY)
    add_compute(p)

    p = add("analyze", cmd_analyze, "co-activation and routing-drift analysis against the base")
    p.add_argument("--name", required=True)
    p.add_argument("--label", required=True)
    _add_run(p)
    p.add_argument("--corpus-name", default="-")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--base", type=Path, required=True)
    p.add_argument("--prior", type=Path, required=True)
    p.add_argument("--eval-dir", type=Path, required=True)
    p.add_argument("--tasks", type=_csv_arg, required=True)
    p.add_argument("--limit", type=int, default=200)
    p.add_argument("--out", type=Path, required=True)
    add_trust(p, _TRUST_KEY)
    add_compute(p)

    p = add("run", cmd_run, "train, evaluate and analyse one post-training run in one process")
    _add_train(p)
    _add_eval(p, out="--eval-out")
    p.add_argument("--probe-tasks", type=_csv_arg, required=True, help="analysis probe sets")
    p.add_argument("--probe-limit", type=int, default=200)
    p.add_argument("--analysis-out", type=Path, required=True)
    p.add_argument(
        "--analysis-prior",
        type=Path,
        default=None,
        help="the base's prior the analysis compares with (default: --prior; differs when the "
        "run trains with a control prior)",
    )

    p = add("table1", cmd_table1, "build table 1 from evaluation and analysis outputs")
    p.add_argument("--results", type=Path, required=True)
    p.add_argument("--spec", type=_json_arg, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--claims-spec",
        type=_json_arg,
        default=None,
        help="the claims audit's spec: C1 and C2 judged from table 1's runs open its caption",
    )

    p = add(
        "fix-bases",
        cmd_fix_bases,
        "record the bases pretrained in a results folder as the committed fixed bases (bases/)",
    )
    p.add_argument("--results", type=Path, required=True)
    p.add_argument(
        "--configfile",
        nargs="*",
        default=[],
        help="the config that pretrained them (merged over config/config.yaml; run from the "
        "repository's root)",
    )

    p = add("testbed", cmd_testbed, "testbed calibration report of the pretrained tiny bases")
    p.add_argument("--results", type=Path, required=True)
    p.add_argument("--spec", type=_json_arg, required=True)
    p.add_argument("--out", type=Path, required=True)

    p = add(
        "permute-prior", cmd_permute_prior, "a router prior with its experts permuted per layer"
    )
    p.add_argument("--prior", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)

    for key, job in REPORT_JOBS.items():
        # One spelling for every job name: dashes (the key keeps the config's underscores).
        p = add(job.command, cmd_report, job.help)
        p.set_defaults(report=key)
        p.add_argument("--results", type=Path, required=True)
        p.add_argument("--spec", type=_json_arg, required=True)
        p.add_argument("--out", type=Path, required=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand. As the `rpb` command (no `argv`) in a single process: with
    RPB_JOB_SERVER set the job runs in a fork of the job server (rpb.pipeline.jobserver), and a job
    that succeeded exits at once (`jobserver.exit_now`); a call with `argv` returns its exit
    status."""
    single = int(os.environ.get("WORLD_SIZE", "1")) == 1
    # The standard library's imports only; importing rpb.pipeline also installs the integrity
    # records of what the job writes (rpb.pipeline.results_folder.IntegrityRecords).
    from rpb.pipeline.results_folder import RESULTS_ENV, hold_job_lock

    if argv is None and sys.argv[1:2] == ["pipeline"] and os.environ.get(RESULTS_ENV):
        # A pipeline job: seen by the next invocation if its Snakemake is killed alone (a served
        # job dies with this process, so this process's life is the job's).
        hold_job_lock(os.environ[RESULTS_ENV], ["rpb", *sys.argv[1:]])
    if argv is None and single and os.environ.get("RPB_JOB_SERVER"):
        from rpb.pipeline.jobserver import exit_now, run_via_server

        code = run_via_server(sys.argv[1:])
        if code is not None:
            exit_now(code)
    args = build_parser().parse_args(argv)
    from rpb.pipeline.tracking import tracking_failure

    # A core-only install (`pip install .`) has the library, not the pipeline's packages; `rpb
    # finetune/prior --mlflow` needs MLflow alone, which its own extra installs.
    extras = dict.fromkeys(PIPELINE_PACKAGES, "pipeline")
    code = run_command(
        args,
        extras=extras | ({"mlflow": "mlflow"} if args.command in VERBS else {}),
        explain=tracking_failure,
    )
    if code:
        return code
    given = sys.argv[1:] if argv is None else list(argv)
    if given[:1] == ["pipeline"] and os.environ.get(RESULTS_ENV):
        # A job of an invocation whose Snakemake was killed alone ends unseen by it: this note
        # lets the next invocation keep what the job wrote (results_folder.keep_finished_outputs).
        from rpb.pipeline.results_folder import record_finished_job

        record_finished_job(os.environ[RESULTS_ENV], ["rpb", *given])
    if argv is None and single:
        from rpb.pipeline.jobserver import exit_now

        exit_now(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
