"""Re-log a smoke results folder's runs into a fresh MLflow store with the current tracking code
(rpb.pipeline.tracking: its parameter schema, run names, metric units and table runs), without
running a model: for a store made by older code, so that `bench/browser_check.py` shows what the
current code logs.

    python bench/relog_smoke.py --results /tmp/rpb_smoke   # replaces <results>/mlflow.db

One invocation run; under it the corpora, each pretraining run of table 1's model, its prior, its
post-training runs (params, final training metrics), the eval and analysis runs of table 1's
methods (per-task scores and table 1's columns, from the eval and analysis outputs), and the
table 1 run (the table and its headline metrics).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import mlflow

from rpb.method_config import MethodConfig
from rpb.pipeline import tracking
from rpb.specs import Run, analysis_path, bases_of, eval_path, run_path, spec_runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--configfile", default="config/smoke.yaml")
    args = parser.parse_args(argv)
    import yaml

    from rpb.pipeline.config_check import expand_replicates

    results = args.results.resolve()
    config = yaml.safe_load(Path("config/config.yaml").read_text())
    _update(config, yaml.safe_load(Path(args.configfile).read_text()))
    expand_replicates(config)
    meta = json.loads((results / "table1.meta.json").read_text())
    model, corpus = meta["model"], meta["corpus"]
    db = results / "mlflow.db"
    db.unlink(missing_ok=True)
    shutil.rmtree(results / "mlartifacts", ignore_errors=True)
    uri = f"sqlite:///{db}"
    record = results / ".mlflow_invocation.json"
    os.environ[tracking.INVOCATION_ENV] = str(record)
    tracking.start_invocation(
        record, uri, config=config, configfiles=[args.configfile], command=["relog_smoke.py"]
    )
    kw = {"tracking_uri": uri}
    with tracking.tracked_run(stage="corpora", params={"preset": "smoke"}, **kw):
        pass
    for index, name in enumerate(bases_of(config["models"], model)):
        extra = {"base_name": name, "lbl_coef": config["models"][name]["pretrain"]["lbl_coef"]}
        with tracking.tracked_run(stage="pretrain", model=model, base=index, params=extra, **kw):
            pass
        with tracking.tracked_run(
            stage="prior", model=model, base=index, corpus=corpus, params={"base_name": name}, **kw
        ):
            pass
    for method in meta["methods"] if "methods" in meta else _methods(results):
        runs = [Run(0, 0), Run(1, 0)] if method == "base" else spec_runs(meta)
        for run in runs:
            schema = {
                "model": model,
                "method": method,
                "corpus": corpus,
                "base": run.base,
                "seed": run.seed,
            }
            history = run_path("train_history", results, model, corpus, method, run)
            if method != "base" and history.is_file():
                trained = json.loads(history.read_text())
                params = tracking.method_params(method, MethodConfig.from_dict(trained["method"]))
                with tracking.tracked_run(stage="train", params=params, **schema, **kw):
                    for entry in trained.get("history", []):
                        step = int(entry.get("step", 0))
                        values = {k: float(v) for k, v in entry.items() if k != "step"}
                        mlflow.log_metrics(values, step=step)
            eval_out = eval_path(results, model, corpus, method, run)
            model_dir = history.parent / "model"
            params = tracking.model_job_params(method=method, model_dir=model_dir)
            with tracking.tracked_run(stage="eval", params=params, **schema, **kw):
                result = json.loads(eval_out.read_text())
                mlflow.log_metrics(tracking.task_metrics(result))
                tracking.log_eval_summary(result, corpus)
            with tracking.tracked_run(stage="analysis", params=params, **schema, **kw):
                summary = json.loads(analysis_path(results, model, corpus, method, run).read_text())
                tracking.log_analysis_summary(summary)
    spec = {k: meta[k] for k in ("model", "corpus", "runs")}
    with tracking.tracked_run(stage="table1", model=model, corpus=corpus, params=spec, **kw):
        tracking.log_table_run("table1", results / "table1.csv")
    tracking.end_invocation(record)
    print(f"re-logged {results} into {uri}")
    return 0


def _update(into: dict, more: dict) -> None:
    """Snakemake's merge of a --configfile into the config: nested mappings key by key."""
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _update(into[key], value)
        else:
            into[key] = value


def _methods(results: Path) -> list[str]:
    import pandas as pd

    return list(pd.read_csv(results / "table1.csv")["method"])


if __name__ == "__main__":
    raise SystemExit(main())
