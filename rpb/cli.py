"""`rpb` command line: one subcommand per pipeline stage; the Snakemake rules call these.

Each job subcommand opens one MLflow run (`rpb.tracking.tracked_run`) named
`{stage}/{model}/{method}/seed{seed}` and records its run id beside its outputs for lineage
(`train` under a multi-process launch: from the main process only).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("rpb")


def _json_arg(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({err.msg}): {text[:80]}") from None


def _csv_arg(text: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated, non-empty list")
    return items


def _offline() -> None:
    # Compute jobs never touch a hub; downloads happen in their own rules at paper scale.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def _track_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"tracking_uri": args.tracking_uri, "experiment": args.experiment}


def _run_dir_of(model_dir: Path) -> Path:
    """Model directories live in `<job dir>/model`; the job's run id file sits in `<job dir>`."""
    return Path(model_dir).parent


def _lineage(**dirs: Path | None) -> dict[str, str | None]:
    from rpb.tracking import read_run_id

    return {role: read_run_id(path) if path else None for role, path in dirs.items()}


# --- subcommands -----------------------------------------------------------------------------


def cmd_init_tracking(args: argparse.Namespace) -> None:
    from rpb.tracking import init_store, resolve_tracking_uri

    init_store(resolve_tracking_uri(args.tracking_uri), args.experiment)


def cmd_corpora(args: argparse.Namespace) -> None:
    import mlflow

    from rpb.data import SIZE_PRESETS, write_corpora
    from rpb.tokenizer import build_tokenizer
    from rpb.tracking import tracked_run

    sizes = SIZE_PRESETS[args.preset]
    params = {"seed": args.seed, "preset": args.preset, "sizes": sizes}
    with tracked_run(
        stage="corpora", model="-", params=params, run_dir=args.out, **_track_kwargs(args)
    ):
        manifest = write_corpora(args.out, seed=args.seed, sizes=sizes)
        build_tokenizer(args.out / "tokenizer")
        mlflow.log_artifact(str(args.out / "manifest.json"))
        log.info("corpora written to %s: %s", args.out, json.dumps(manifest.get("files", {}))[:400])


def cmd_pretrain(args: argparse.Namespace) -> None:
    import mlflow

    from rpb.tracking import tracked_run
    from rpb.training import TrainSpec, pretrain

    spec = TrainSpec.from_dict(args.spec)
    params = {
        "model_type": args.model_type,
        "architecture": args.architecture,
        "train": args.spec,
        "lbl_coef": args.lbl_coef,
    }
    parents = _lineage(corpora=args.corpus.parent)
    with tracked_run(
        stage="pretrain",
        model=args.name,
        method="lbl",
        seed=spec.seed,
        corpus="pretrain",
        params=params,
        parents=parents,
        run_dir=args.out,
        **_track_kwargs(args),
    ):
        summary = pretrain(
            model_type=args.model_type,
            architecture=args.architecture,
            tokenizer_dir=args.tokenizer,
            corpus=args.corpus,
            spec=spec,
            lbl_coef=args.lbl_coef,
            out_dir=args.out,
        )
        mlflow.log_artifact(str(args.out / "train_history.json"))
        log.info("pretraining done: %s", summary["final"])


def cmd_prior(args: argparse.Namespace) -> None:
    import mlflow

    from rpb.analysis import extract_prior_from_corpus
    from rpb.tracking import tracked_run

    parents = _lineage(base=_run_dir_of(args.model), corpora=args.corpus.parent.parent)
    with tracked_run(
        stage="prior",
        model=args.name,
        corpus=args.corpus.stem,
        params={"model_dir": str(args.model), "corpus": str(args.corpus)},
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
        )
        mlflow.log_metrics({"tokens": float(prior.meta["n_tokens"])})
        mlflow.log_artifact(str(args.out.with_suffix(".json")))


def cmd_train(args: argparse.Namespace) -> None:
    """Under `accelerate launch` every rank runs this; only the main process opens the MLflow run
    (the others have none, so their metric logging is a no-op) and writes outputs."""
    import mlflow

    from rpb.tracking import tracked_run
    from rpb.training import MethodSpec, TrainSpec, is_main_process, posttrain

    spec = TrainSpec.from_dict(args.spec)
    method = MethodSpec(**args.method)
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
            seed=spec.seed,
            corpus=args.corpus_name,
            params={"method": args.method, "train": args.spec},
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
            method_spec=method,
            spec=spec,
            out_dir=args.out,
            trust_remote_code=args.trust_remote_code,
        )
        if main:
            mlflow.log_artifact(str(args.out / "train_history.json"))
            log.info("post-training done: %s", summary["final"])


def _model_job_run(args: argparse.Namespace, stage: str):
    """The MLflow run of a job that reads one trained model (eval, analysis), with lineage to the
    training run that made it and its run record beside the job's output."""
    from rpb.tracking import tracked_run

    return tracked_run(
        stage=stage,
        model=args.name,
        method=args.label,
        seed=args.seed,
        corpus=args.corpus_name,
        params={"tasks": args.tasks, "limit": args.limit, "model_dir": str(args.model)},
        parents=_lineage(trained=_run_dir_of(args.model)),
        run_dir=args.out.parent / f"{args.out.stem}.run",
        **_track_kwargs(args),
    )


def cmd_eval(args: argparse.Namespace) -> None:
    import mlflow

    from rpb.evaluation import evaluate_model

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
        )
        scores = {
            f"{task}.{entry['metric']}": float(entry["score"])
            for task, entry in result["tasks"].items()
        }
        mlflow.log_metrics(scores)
        mlflow.log_artifact(str(args.out))


def cmd_analyze(args: argparse.Namespace) -> None:
    import mlflow

    from rpb.analysis import analyze_model

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
        )
        mlflow.log_metrics({f"mean.{k}": float(v) for k, v in summary["mean"].items()})
        mlflow.log_artifact(str(args.out))


def cmd_table1(args: argparse.Namespace) -> None:
    import mlflow

    from rpb.tables import build_table1
    from rpb.tracking import tracked_run

    spec = args.spec
    with tracked_run(
        stage="table1",
        model=spec["model"],
        corpus=spec["corpus"],
        params=spec,
        run_dir=args.out.parent / "table1.run",
        **_track_kwargs(args),
    ):
        build_table1(args.results, spec, args.out)
        for suffix in (".csv", ".md", ".meta.json"):
            mlflow.log_artifact(str(args.out.with_suffix(suffix)))
        mlflow.log_artifacts(str(args.out.parent / "figures"), artifact_path="figures")


def cmd_testbed(args: argparse.Namespace) -> None:
    import mlflow

    from rpb.testbed import testbed_report
    from rpb.tracking import resolve_tracking_uri, tracked_run

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

    from rpb.tracking import tracked_run

    spec = args.spec
    models = spec.get("models") or [spec.get("model") or spec.get("table1", {}).get("model", "-")]
    corpus = spec.get("corpus") or ",".join(spec.get("corpora", [])) or "-"
    with tracked_run(
        stage=stage,
        model=",".join(models),
        corpus=corpus,
        params=spec,
        run_dir=args.out.parent / f"{args.out.stem}.run",
        **_track_kwargs(args),
    ):
        build(args.results, spec, args.out)
        for path in sorted(args.out.parent.glob(f"{args.out.stem}*")):
            if path.is_file():
                mlflow.log_artifact(str(path))
        figures = args.out.parent / "figures"
        if figures.is_dir():
            mlflow.log_artifacts(str(figures), artifact_path="figures")


# Report jobs: stage -> (builder "module:function", help). Imported lazily: `rpb --help` stays fast.
REPORT_JOBS: dict[str, tuple[str, str]] = {
    "table2": ("rpb.tables:build_table2", "table 2: table 1's rows for the family-B model"),
    "table3": ("rpb.tables:build_table3", "table 3: method vs reference on the independent corpus"),
    "table4": (
        "rpb.tables:build_table4",
        "table 4: anchors and RPB, ranks and ordering consistency",
    ),
    "table5": ("rpb.tables:build_table5", "table 5: structure retention vs accuracy, hard routing"),
    "sweep": ("rpb.tables:build_sweep", "softness sweep: accuracy and retention against strength"),
    "drift": ("rpb.tables:build_drift", "training-time routing drift curves"),
    "readings": ("rpb.tables:build_readings", "which RPB reading anchors (the default's rule)"),
    "claims": ("rpb.claims:build_claims", "claims audit C1-C6 (results/claims.csv)"),
}


def cmd_permute_prior(args: argparse.Namespace) -> None:
    """The claims audit's prior-permutation control (rpb.controls): no MLflow run, a file
    transform."""
    from rpb.controls import write_permuted_prior

    write_permuted_prior(args.prior, args.out, seed=args.seed)


def cmd_report(args: argparse.Namespace) -> None:
    import importlib

    module, function = REPORT_JOBS[args.command][0].split(":")
    _report_job(args, args.command, getattr(importlib.import_module(module), function))


# --- parser ----------------------------------------------------------------------------------


def _add_trust(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the tokenizer's own code from the model folder (models.<m>.trust_remote_code)",
    )


def _add_tracking(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: env/config)")
    p.add_argument("--experiment", default="rpb", help="MLflow experiment name")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rpb", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, func: Callable[[argparse.Namespace], None], help_: str):
        p = sub.add_parser(name, help=help_)
        p.set_defaults(func=func)
        _add_tracking(p)
        return p

    add("init-tracking", cmd_init_tracking, "create the MLflow store and experiment once")

    p = add("corpora", cmd_corpora, "write the synthetic corpora, eval sets and tokenizer")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--preset", choices=["default", "smoke"], default="default")

    p = add("pretrain", cmd_pretrain, "pretrain a tiny MoE base with a load-balancing loss")
    p.add_argument("--name", required=True)
    p.add_argument("--model-type", required=True)
    p.add_argument("--architecture", type=_json_arg, required=True)
    p.add_argument("--spec", type=_json_arg, required=True, help="TrainSpec as JSON")
    p.add_argument("--lbl-coef", type=float, required=True)
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)

    p = add("prior", cmd_prior, "extract the base router prior over a corpus")
    p.add_argument("--name", required=True)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--batch-size", type=int, default=128)
    _add_trust(p)

    p = add("train", cmd_train, "post-train a base with one router method")
    p.add_argument("--name", required=True)
    p.add_argument("--label", required=True, help="the method's label in the config")
    p.add_argument("--base", type=Path, required=True)
    p.add_argument("--prior", type=Path, default=None)
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--corpus-name", required=True)
    p.add_argument(
        "--method", type=_json_arg, required=True, help='{"name", "strength", "options"}'
    )
    p.add_argument("--spec", type=_json_arg, required=True, help="TrainSpec as JSON")
    p.add_argument("--out", type=Path, required=True)
    _add_trust(p)

    p = add("eval", cmd_eval, "evaluate a model with lm-evaluation-harness")
    p.add_argument("--name", required=True)
    p.add_argument("--label", required=True)
    p.add_argument("--seed", default="-")
    p.add_argument("--corpus-name", default="-")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--eval-dir", type=Path, required=True)
    p.add_argument("--tasks", type=_csv_arg, required=True)
    p.add_argument("--limit", type=int, default=0, help="items per task (0: all)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--work", type=Path, required=True, help="lm-eval task/cache folder")
    p.add_argument("--out", type=Path, required=True)
    _add_trust(p)

    p = add("analyze", cmd_analyze, "co-activation and routing-drift analysis against the base")
    p.add_argument("--name", required=True)
    p.add_argument("--label", required=True)
    p.add_argument("--seed", default="-")
    p.add_argument("--corpus-name", default="-")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--base", type=Path, required=True)
    p.add_argument("--prior", type=Path, required=True)
    p.add_argument("--eval-dir", type=Path, required=True)
    p.add_argument("--tasks", type=_csv_arg, required=True)
    p.add_argument("--limit", type=int, default=200)
    p.add_argument("--out", type=Path, required=True)
    _add_trust(p)

    p = add("table1", cmd_table1, "build table 1 from evaluation and analysis outputs")
    p.add_argument("--results", type=Path, required=True)
    p.add_argument("--spec", type=_json_arg, required=True)
    p.add_argument("--out", type=Path, required=True)

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

    for name, (_, help_) in REPORT_JOBS.items():
        p = add(name, cmd_report, help_)
        p.add_argument("--results", type=Path, required=True)
        p.add_argument("--spec", type=_json_arg, required=True)
        p.add_argument("--out", type=Path, required=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    _offline()
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as err:
        # Bad input is reported in one line; the MLflow run has already been marked FAILED.
        log.debug("bad input", exc_info=True)
        print(f"rpb {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
