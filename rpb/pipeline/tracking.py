"""MLflow tracking of the pipeline: every job's run nested under one parent run per `snakemake`
invocation, the datasets it read, and eval, analysis and table summaries (docs/tracking.md). One
job's run itself (its name, schema tags, params, store and end) is the library's rpb.tracking,
which this module re-exports, so its importers keep one name for both.

The store defaults to a sqlite file under `results/`; `MLFLOW_TRACKING_URI` or the config's
`tracking.uri` override it. A fresh sqlite store must be created by one process before jobs fan out
(concurrent first use races on schema migrations), which `init_store` does. Every job writes the id
of its run next to its outputs (`mlflow_run.json`) so downstream jobs can tag what they consumed.

Snakemake's onstart creates the invocation's parent run (`start_invocation`) and records it in a
file under the results folder, which every job of that invocation reads (`current_invocation`),
also on other nodes of a cluster; onsuccess/onerror end it (`end_invocation`). Importing this
module makes `tracked_run` nest a job's run under its invocation's (`set_parent_run_provider`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import socket
import sqlite3
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rpb.method_config import MethodConfig, method_params
from rpb.tracking import (  # noqa: F401  (re-exported: one job's run, the library's)
    DEFAULT_EXPERIMENT,
    DEFAULT_STORE_WAIT_S,
    END_REASON_TAG,
    GIT_COMMIT_TAG,
    GROUP_TAG,
    HOST_TAG,
    INVOCATION_ENV,
    JOB_DIR_TAG,
    JSON_PARAMS,
    PARENT_RUN_TAG,
    PID_TAG,
    RUN_COLOR_TAG,
    RUN_FILE,
    SCHEMA_TAGS,
    SECRET_KEY,
    SECRET_MARKERS,
    SECRET_VALUE,
    STORE_FULL_ERROR,
    STORE_GONE_ERRORS,
    STORE_WAIT_ENV,
    UI_PALETTE,
    JobTerminated,
    TrackingUnavailable,
    _sqlite_path,
    artifact_location,
    config_hash,
    configure_store_wait,
    end_stale_runs,
    git_commit,
    group_color,
    mlflow_run_name,
    numeric_path_params,
    parent_run_id,
    read_run_id,
    redact_uri,
    resolve_tracking_uri,
    run_color,
    schema_tags,
    scrub,
    scrub_tree,
    set_parent_run_provider,
    store_wait_s,
    tracked_run,
    tracking_failure,
)

log = logging.getLogger(__name__)

# MLflow's own tags: the experiment kind the UI opens an experiment with ("custom_model_development"
# is its "Machine learning" kind: the runs table of the "Model training" view, not GenAI traces),
# descriptions (experiment and run), and nesting.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"
NOTE_TAG = "mlflow.note.content"
INVOCATION_STAGE = "invocation"
PROJECT_NOTE = (
    'rpb reproduces the MoE post-training paper "Router Prior Bias" (arXiv:2609.08115): '
    "router methods (none, load balancing, anchors, RPB, ...) are post-trained on a base MoE and "
    "compared on in-domain and out-of-domain accuracy and on how much of the base's expert "
    "co-activation structure they keep.\n\n"
    "One parent run per `snakemake` invocation (`invocation/<UTC time>`); every job's run is "
    "nested under it, named `{stage}/{model}/{corpus}/{method}/base{base}/seed{seed}` (the parts "
    "it has). Table 1 here: Chart view, Group by, `method`: the first sections' bars, "
    "`accuracy` (in_domain, ood_mean), `coactivation` (community_nmi, coact_cosine, modularity) "
    "and `ood` (each OOD task), are table 1's columns per method (means over seeds)."
)


def half_migrated(path: Path) -> str | None:
    """The line for a sqlite store left half-migrated (an `_alembic_tmp_*` table: a schema creation
    or upgrade cut short, or raced by jobs after the store was deleted), which MLflow fails on at
    every start; None for a sound store or no file. Read-only: the store is not touched."""
    if not path.is_file():
        return None
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=store_wait_s())
        try:
            rows = db.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE '_alembic_tmp_%'"
            ).fetchall()
        finally:
            db.close()
    except sqlite3.DatabaseError:
        return None  # not ours to judge here; MLflow names what it finds
    if not rows:
        return None
    return (
        f"tracking store {path} is half-migrated (table {rows[0][0]} left by a schema creation "
        f"cut short, e.g. after the store was deleted while jobs ran): move it aside (mv {path} "
        f"{path}.broken) and rerun; a fresh store is created, the results' files are unaffected"
    )


def _announce_wait(uri: str) -> None:
    """Say at once, in one line, that the store is locked and how long we wait (the wait itself
    is silent)."""
    path = _sqlite_path(uri)
    if path is None or not path.is_file():
        return
    try:
        probe = sqlite3.connect(path, timeout=0, isolation_level=None)
        try:
            probe.execute("BEGIN IMMEDIATE")
            probe.execute("ROLLBACK")
        finally:
            probe.close()
    except sqlite3.OperationalError as err:
        if "locked" in str(err):
            print(
                f"rpb: tracking store {path} is locked by another process; waiting up to "
                f"{store_wait_s():g} s ({STORE_WAIT_ENV})",
                file=sys.stderr,
                flush=True,
            )


def init_store(uri: str, experiment: str = DEFAULT_EXPERIMENT, note: str | None = None) -> str:
    """Create the store's schema and the experiment from this one process; returns its id.

    The experiment is a model-training one (`EXPERIMENT_KIND_TAG`), so the UI opens its runs
    table; `note` (default `PROJECT_NOTE`) becomes its description. An existing experiment gets the
    kind if it has none (a kind set in the UI stays) and `note` if one is given.
    """
    import mlflow

    configure_store_wait()
    client = mlflow.MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        experiment_id = client.create_experiment(
            experiment,
            artifact_location=artifact_location(uri),
            tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND, NOTE_TAG: note or PROJECT_NOTE},
        )
    else:
        experiment_id = found.experiment_id
        if EXPERIMENT_KIND_TAG not in found.tags:
            client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND)
        if note or NOTE_TAG not in found.tags:
            client.set_experiment_tag(experiment_id, NOTE_TAG, note or PROJECT_NOTE)
    log.info(
        "MLflow store ready at %s (experiment %s = %s)", redact_uri(uri), experiment, experiment_id
    )
    return experiment_id


# --- the invocation's parent run ----------------------------------------------------------------


def _log_params_batched(client: Any, run_id: str, params: Mapping[str, Any]) -> None:
    """Log params through `log_batch`, 100 at a time (MLflow's per-request limit)."""
    from mlflow.entities import Param

    items = [Param(k, str(v)[:6000]) for k, v in scrub(params).items()]
    for start in range(0, len(items), 100):
        client.log_batch(run_id, params=items[start : start + 100])


def start_invocation(
    record: Path,
    uri: str,
    experiment: str = DEFAULT_EXPERIMENT,
    *,
    config: Mapping[str, Any] | None = None,
    configfiles: Sequence[str] = (),
    command: Sequence[str] | None = None,
) -> str | None:
    """Open the parent run of one pipeline invocation and write `record` (JSON: run id, store,
    experiment, and the config's evaluation split that eval jobs summarise with); returns the id.

    Called once, from Snakemake's onstart (one process, before any job: it also creates a fresh
    store). A record left by an invocation that never reached onsuccess/onerror (Snakemake
    SIGKILLed) names a run still RUNNING: it is marked KILLED first. Without mlflow in
    Snakemake's own environment (jobs in conda environments) it says so and returns None: the
    jobs' runs are then not nested.
    """
    try:
        import mlflow  # noqa: F401  (Snakemake's own environment may lack it)
    except ImportError:
        print(
            "rpb: mlflow is not importable where Snakemake runs: no invocation run", file=sys.stderr
        )
        return None

    configure_store_wait()
    path = _sqlite_path(uri)
    broken = half_migrated(path) if path is not None else None
    if broken:
        raise TrackingUnavailable(broken)
    _announce_wait(uri)
    try:
        return _open_invocation(record, uri, experiment, dict(config or {}), configfiles, command)
    except Exception as err:  # one line for a locked or full store; a bug keeps its traceback
        line = tracking_failure(err, uri)
        if line is None:
            raise
        raise TrackingUnavailable(line) from None


def _open_invocation(
    record: Path,
    uri: str,
    experiment: str,
    config: dict[str, Any],
    configfiles: Sequence[str],
    command: Sequence[str] | None,
) -> str:
    import mlflow

    command = list(sys.argv if command is None else command)
    record = Path(record)
    client = mlflow.MlflowClient(tracking_uri=uri)
    stale = read_invocation(record)
    if stale and stale.get("tracking_uri") == uri:
        with contextlib.suppress(Exception):  # a record of a store since deleted
            if client.get_run(stale["run_id"]).info.status == "RUNNING":
                client.set_tag(
                    stale["run_id"],
                    END_REASON_TAG,
                    "found RUNNING by the next invocation: Snakemake ended without its handlers",
                )
                client.set_terminated(stale["run_id"], status="KILLED")
    files = ", ".join(["config/config.yaml", *map(str, configfiles)])
    chash = config_hash(config)
    note = (
        f"{PROJECT_NOTE}\n\nLatest invocation: config {files} (scale {config.get('scale', '-')}, "
        f"config_hash {chash}), results in {config.get('results_dir', 'results')}."
    )
    experiment_id = init_store(uri, experiment, note=note)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    tags = {
        "stage": INVOCATION_STAGE,
        GIT_COMMIT_TAG: git_commit(),
        "config_hash": chash,
        "configfiles": files,
        HOST_TAG: socket.gethostname(),
        PID_TAG: str(os.getpid()),
        NOTE_TAG: (
            f"`{' '.join(command)}`\n\nConfig: {files} (config_hash {chash}). Each job of this "
            "invocation is a child run; jobs whose outputs were up to date did not run and "
            "are found under the invocation that made them."
        ),
    }
    run = client.create_run(experiment_id, run_name=f"{INVOCATION_STAGE}/{stamp}", tags=tags)
    run_id = run.info.run_id
    # A few params (every config key would crowd the job runs' params in the UI's menus); the
    # whole config is the run's artifact config.json.
    picked = {k: config[k] for k in ("scale", "results_dir", "seeds") if k in config}
    _log_params_batched(client, run_id, {**picked, "configfiles": files})
    client.log_dict(run_id, scrub_tree(config), "config.json")
    evaluation = config.get("evaluation") or {}
    payload = {
        "run_id": run_id,
        "tracking_uri": uri,
        "experiment": experiment,
        "experiment_id": experiment_id,
        "summary": {
            "ood": list(evaluation.get("ood") or []),
            "corpus_tasks": dict(evaluation.get("corpus_tasks") or {}),
        },
    }
    record.parent.mkdir(parents=True, exist_ok=True)
    from rpb.artifacts import atomic_path

    with atomic_path(record, record=False) as tmp:  # jobs never read half a record
        tmp.write_text(json.dumps(payload, indent=2) + "\n")
    log.info("invocation run %s (%s)", run_id, redact_uri(uri))
    return run_id


def read_invocation(record: Path) -> dict[str, Any] | None:
    """The invocation record at `record`, or None if there is none."""
    try:
        return json.loads(Path(record).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def current_invocation(uri: str | None = None, experiment_id: str | None = None) -> dict | None:
    """The record of the invocation this job belongs to (`INVOCATION_ENV` names its file), if it
    is for the same store and experiment; None for a job started by hand."""
    path = os.environ.get(INVOCATION_ENV)
    record = read_invocation(Path(path)) if path else None
    if not record:
        return None
    if uri is not None and record.get("tracking_uri") != uri:
        return None
    if experiment_id is not None and record.get("experiment_id") != experiment_id:
        return None
    return record


def end_invocation(record: Path, status: str = "FINISHED") -> str | None:
    """End the parent run `record` names with `status` (Snakemake's onsuccess: FINISHED, onerror:
    FAILED), tag it with its jobs' statuses, and remove the record; returns the run id."""
    found = read_invocation(Path(record))
    if not found:
        return None
    import mlflow

    configure_store_wait()
    client = mlflow.MlflowClient(tracking_uri=found["tracking_uri"])
    run_id = found["run_id"]
    try:
        children = client.search_runs(
            [found["experiment_id"]],
            filter_string=f"tags.`{PARENT_RUN_TAG}` = '{run_id}'",
            max_results=50000,
        )
        counts: dict[str, int] = {}
        for child in children:
            counts[child.info.status] = counts.get(child.info.status, 0) + 1
        summary = ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "no jobs"
        client.set_tag(run_id, "rpb.jobs", summary)
        if status != "FINISHED":  # a failed invocation says why, as a failed job's run does
            failed = [c.info.run_name for c in children if c.info.status == "FAILED"]
            shown = ", ".join(failed[:5]) + (f" (+{len(failed) - 5} more)" if failed[5:] else "")
            reason = (
                f"failed jobs: {shown}" if failed else "Snakemake failed before or between jobs"
            )
            client.set_tag(run_id, END_REASON_TAG, f"{reason} (see the Snakemake log)")
        client.set_terminated(run_id, status=status)
    except Exception as err:
        # The jobs are done either way; the record stays, so the next invocation ends the run.
        line = tracking_failure(err, found["tracking_uri"])
        if line is None:
            raise
        print(f"rpb: invocation run {run_id} not ended: {line}", file=sys.stderr)
        return None
    Path(record).unlink(missing_ok=True)
    log.info("invocation run %s ended %s (%s)", run_id, status, summary)
    return run_id


# --- what eval and analysis runs carry, for comparing methods in the UI -------------------------


def model_job_params(*, method: str, model_dir: Path, **extra: Any) -> dict[str, Any]:
    """Params of a job reading one trained model (eval, analysis) besides the schema's: the
    method's `kind`, `strength` and `options` (`method_params`), then `extra` and `model_dir`, so
    the UI groups and compares runs by them.

    Kind, strength and options come from the training job's record beside the model
    (`train_history.json`: what it actually trained with, also as written before MethodConfig);
    the base is kind `base`.
    """
    trained = None
    history = Path(model_dir).parent / "train_history.json"
    if method != "base" and history.is_file():
        recorded = json.loads(history.read_text()).get("method")
        if recorded:
            trained = MethodConfig.from_dict(recorded, where=f"{history}: method")
    return {**method_params(method, trained), **extra, "model_dir": str(model_dir)}


# Metric units, one per family (docs/tracking.md, "Metric units"): accuracy-like scores are
# percent everywhere, as the tables show them: exact match (`in_domain`, `ood_<task>`, `ood_mean`,
# `<task>.<metric>_pct`) and p(target) (the tables' `_p` columns, on table runs); the structure
# metrics keep table 1's unitless values (`coact_cosine` in [0, 1]); anything else keeps its own
# unit and has no `_pct` (`math_ll.ll_per_token`, nats). lm-eval's means of 0/1 item scores:
ACCURACY_METRICS = frozenset({"exact_match", "acc", "acc_norm", "em", "f1", "mc1", "mc2"})
PCT_SUFFIX = "_pct"
_METRIC_CHARS = re.compile(r"[^A-Za-z0-9_./ :-]")


def task_metrics(result: Mapping[str, Any]) -> dict[str, float]:
    """Each evaluated task's score under a plain name: `<task>.<metric>_pct` in percent for an
    accuracy-like metric (`math.exact_match_pct`), `<task>.<metric>` in its own unit otherwise
    (`math_ll.ll_per_token`); our eval sets' `rpb_` task prefix is dropped (it is no method)."""
    metrics: dict[str, float] = {}
    for task, entry in result["tasks"].items():
        name = _METRIC_CHARS.sub("_", f"{task.removeprefix('rpb_')}.{entry['metric']}")
        score = float(entry["score"])
        if str(entry["metric"]) in ACCURACY_METRICS:
            metrics[name + PCT_SUFFIX] = 100.0 * score
        else:
            metrics[name] = score
    return metrics


# Table 1's columns on eval and analysis runs, in MLflow chart sections that sort before the
# training runs' (`layer0/...`, `mean/...`): the UI orders named sections alphabetically and puts
# names without a `/` ("Model metrics") after all of them, so table 1's charts open the chart view
# grouped by method with no typing or scrolling (docs/tracking.md, "Table 1 in the UI").
# A chart's title is its metric's full name, cut with an ellipsis where it is wider than its
# card: at a 1400 px window MLflow 3.17 lays a section's charts three to a row, with room for 18
# characters of title (measured by bench/browser_check.py; `coactivation/community_nmi` read
# "coactivation/com..."). Table 1's names keep to that, but for the p(target) pair
# (`accuracy/in_domain_p`, 20), which table 1's view (`table1_view_state`) draws two to a row.
CHART_TITLE_CHARS = 18
STRUCTURE_METRICS = {
    "community_nmi": "coact/nmi",
    "coact_cosine": "coact/cosine",
    "modularity": "coact/modularity",
}
STRUCTURE_COLUMNS = tuple(STRUCTURE_METRICS)
# Table 1's p(target) columns, the measure its verdicts are judged on at tiny scale (docs/claims.md,
# "The primary metric at tiny scale"), beside their exact-match twins in the `accuracy` section:
# `accuracy/in_domain_p`, `accuracy/ood_mean_p`.
P_TARGET_COLUMNS = ("in_domain_p", "ood_mean_p")


def table1_metric(column: str) -> str:
    """The run metric holding table 1's `column` for one run: `accuracy/in_domain`,
    `accuracy/ood_mean`, `ood/<task>` for `ood_<task>`, `coact/<short name>` for the structure
    columns (`STRUCTURE_METRICS`: `coact/cosine` for `coact_cosine`); any other name is its
    own."""
    if column in ("in_domain", "ood_mean", *P_TARGET_COLUMNS):
        return f"accuracy/{column}"
    if column.startswith("ood_"):
        return f"ood/{column.removeprefix('ood_')}"
    if column in STRUCTURE_METRICS:
        return STRUCTURE_METRICS[column]
    return column


def eval_summary(result: Mapping[str, Any], corpus: str, spec: Mapping[str, Any]) -> dict:
    """Table 1's accuracy columns for one evaluation output (percent), named by `table1_metric`:
    `in_domain` (the corpus's in-domain items pooled), `ood_<task>` for each OOD task and
    `ood_mean`, computed by the same functions as table 1 (rpb.report.run_records), so that table
    1's cell is the mean of these over seeds.
    A task the output lacks leaves its metric (and `ood_mean`) out, with a warning."""
    import numpy as np

    from rpb.report.run_records import exact_match_items, in_domain_items

    where = Path(f"<eval {corpus}>")
    metrics: dict[str, float] = {}
    try:
        metrics[table1_metric("in_domain")] = 100.0 * float(
            in_domain_items(dict(result), dict(spec), corpus, where).mean()
        )
    except ValueError as err:
        log.warning("no in_domain metric: %s", err)
    ood = []
    for task in spec.get("ood", []):
        try:
            score = 100.0 * float(exact_match_items(dict(result), task, where).mean())
        except ValueError as err:
            log.warning("no ood_%s metric: %s", task, err)
            continue
        metrics[table1_metric(f"ood_{task}")] = score
        ood.append(score)
    if ood and len(ood) == len(spec.get("ood", [])):
        metrics[table1_metric("ood_mean")] = float(np.mean(ood))
    return metrics | p_target_summary(result, corpus, spec)


def p_target_summary(result: Mapping[str, Any], corpus: str, spec: Mapping[str, Any]) -> dict:
    """Table 1's p(target) columns for one evaluation output (percent), as table 1 computes them
    (rpb.report.tables.accuracy_record): `accuracy/in_domain_p`, the mean over the corpus's
    in-domain tasks, and `accuracy/ood_mean_p`, over the OOD tasks. An output without the eval
    sets' loglikelihood tasks (paper scale's standard benchmarks) has none."""
    from rpb.report.run_records import in_domain_tasks
    from rpb.report.tables import P_TARGET, measure_score

    where = Path(f"<eval {corpus}>")
    tasks = {"in_domain_p": in_domain_tasks(dict(spec), corpus), "ood_mean_p": spec.get("ood")}
    metrics: dict[str, float] = {}
    for column, of in tasks.items():
        if not of:
            continue
        try:
            score = measure_score(dict(result), list(of), where, P_TARGET)[0]
        except ValueError as err:
            log.info("no %s metric: %s", table1_metric(column), err)
            continue
        metrics[table1_metric(column)] = score
    return metrics


def log_eval_summary(result: Mapping[str, Any], corpus: str) -> dict[str, float]:
    """Log `eval_summary` to the active run, with the invocation's evaluation split (the config's
    `evaluation.ood` and `corpus_tasks`); a job started by hand has none and logs only its
    per-task scores."""
    import mlflow

    invocation = current_invocation()
    if mlflow.active_run() is None or not invocation:
        log.info("no invocation record: table 1's summary metrics are not logged")
        return {}
    metrics = eval_summary(result, corpus, invocation["summary"])
    mlflow.log_metrics(metrics)
    return metrics


def log_analysis_summary(summary: Mapping[str, Any]) -> dict[str, float]:
    """Log an analysis output's layer means (`topk_overlap_with_base`, `kl_to_base`, ...), table
    1's structure columns named by `table1_metric` (`coact/cosine`); non-finite
    values are left out, as table 1 shows them empty."""
    import math

    import mlflow

    metrics = {
        table1_metric(k): float(v) for k, v in summary["mean"].items() if math.isfinite(float(v))
    }
    if mlflow.active_run() is not None:
        mlflow.log_metrics(metrics)
    return metrics


# --- what table runs carry ------------------------------------------------------------------------


def table_metrics(stage: str, frame: Any) -> dict[str, float]:
    """A table's headline numbers as metrics of its run: `<stage>/<row>/<column>`
    (`table1/rpb/in_domain`, `table1/rpb/in_domain_ci_low`; `table3/in_domain/rpb/lbl/diff`; a
    row per run, `table4/rpb/base1/seed0/in_domain`), in the table's own units (its accuracy
    columns, exact match and `_p`, in percent); empty cells are left out. The stage first: one
    chart section per table, apart from the eval runs'."""
    import math

    from rpb.report.registry import REPORTS

    keys, columns = REPORTS[stage].headline if stage in REPORTS else ((), ())
    if not keys or not set(keys) <= set(frame.columns):
        return {}
    metrics: dict[str, float] = {}
    for _, row in frame.iterrows():
        label = "/".join(
            f"{k}{row[k]}" if k in ("base", "seed") else _METRIC_CHARS.sub("_", str(row[k]))
            for k in keys
        )
        for column in columns:
            if column not in frame.columns:
                continue
            try:
                value = float(row[column])
            except (TypeError, ValueError):
                continue
            if math.isfinite(value):
                metrics[f"{stage}/{label}/{column}"] = value
    return metrics


# Table 1 in MLflow's UI as one link (docs/tracking.md, "Table 1 in the UI"): a view that MLflow
# 3.17 keeps in an experiment tag `mlflow.sharedViewState.<key>` and opens from
# `...runs?viewStateShareKey=<key>` (its *Share* button writes the same). The view: table 1's
# eval runs (its methods' only: `hard`, which check M2 trains, is left out), grouped by method,
# the chart view without the runs list beside it, on the p(target) charts, two to a row. So the
# view reads whole in a 1400 px window with the Assistant panel MLflow opens on a fresh profile
# (three charts to a row beside it cut the titles to "accuracy/in_do..." and the legends to two
# methods; bench/browser_check.py looks at it).
TABLE1_VIEW = "table1"
TABLE1_VIEW_TAG = "mlflow.sharedViewState." + TABLE1_VIEW
TABLE1_VIEW_CHARTS = "_p"  # the chart search: accuracy/in_domain_p, accuracy/ood_mean_p


def table1_view_state(others: Iterable[str]) -> dict[str, Any]:
    """MLflow's view state of table 1's view: eval runs less those of the methods `others` (the
    store's methods that are no row of table 1), grouped by the tag `method`."""
    search = " and ".join(["tags.stage = 'eval'", *(f"tags.method != '{m}'" for m in others)])
    return {
        "searchFilter": search,
        "groupBy": {
            "aggregateFunction": "average",
            "groupByKeys": [{"mode": "tag", "groupByData": "method"}],
        },
        "runListHidden": True,
        "chartsSearchFilter": TABLE1_VIEW_CHARTS,
        "compareRunSections": [
            {
                "uuid": "rpb-table1-accuracy",
                "name": "accuracy",
                "display": True,
                "isReordered": False,
                "deleted": False,
                "isGenerated": True,
                "columns": 2,
            }
        ],
        "compareRunCharts": [
            {
                "uuid": f"rpb-table1-{column}",
                "type": "BAR",
                "metricSectionId": "rpb-table1-accuracy",
                "isGenerated": True,
                "deleted": False,
                "metricKey": table1_metric(column),
            }
            for column in P_TARGET_COLUMNS
        ],
    }


def table1_view_link(experiment_id: str, base: str = "") -> str:
    """The link (after the server's address `base`) that opens table 1's view."""
    return (
        f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
        f"&compareRunsMode=CHART&viewStateShareKey={TABLE1_VIEW}"
    )


def log_table1_view(methods: Iterable[str]) -> dict[str, Any] | None:
    """Write table 1's view (`table1_view_state`) into the active run's experiment: table 1's
    rows `methods` against the methods of the experiment's eval runs."""
    import mlflow

    run = mlflow.active_run()
    if run is None:
        return None
    client = mlflow.MlflowClient()
    experiment = run.info.experiment_id
    evals = client.search_runs([experiment], "tags.stage = 'eval'", max_results=50000)
    stored = {r.data.tags["method"] for r in evals if "method" in r.data.tags}
    state = table1_view_state(sorted(stored - set(methods)))
    client.set_experiment_tag(experiment, TABLE1_VIEW_TAG, json.dumps(state))
    return state


def log_table_run(stage: str, csv: Path) -> dict[str, float]:
    """Log a table's CSV to the active run as an MLflow table (`<stem>.json`, which the UI's
    artifact view shows as a table) and its headline numbers as metrics (`table_metrics`);
    table 1's run also writes table 1's view (`log_table1_view`)."""
    import mlflow
    import pandas as pd

    frame = pd.read_csv(csv)
    metrics = table_metrics(stage, frame)
    if mlflow.active_run() is None:
        return metrics
    if stage == "table1" and "method" in frame.columns:
        log_table1_view(frame["method"].astype(str))
    # log_table's JSON has no NaN: an empty cell is null.
    mlflow.log_table(frame.astype(object).where(frame.notna(), None), f"{Path(csv).stem}.json")
    if metrics:
        mlflow.log_metrics(metrics)
    return metrics


# --- datasets ------------------------------------------------------------------------------------


def _manifest_entry(path: Path) -> tuple[Path, dict[str, Any]] | None:
    """The data folder's `manifest.json` entry for `path` (its root and the entry), if listed."""
    for root in Path(path).resolve().parents[:3]:
        manifest = root / "manifest.json"
        if manifest.is_file():
            files = json.loads(manifest.read_text()).get("files", {})
            key = Path(path).resolve().relative_to(root).as_posix()
            if key in files:
                return root, files[key]
    return None


def jsonl_dataset(path: Path) -> Any:
    """An MLflow dataset of one JSONL file: its rows (schema and row count in the UI), named by
    its place in the data folder (`post/math`, `eval/addition`), its digest the file's sha256 as
    the corpora manifest records it (first 36 hex digits: MLflow's limit)."""
    import mlflow.data
    import pandas as pd
    from mlflow.data.sources import LocalArtifactDatasetSource

    path = Path(path)
    with path.open("rb") as f:
        sha = hashlib.file_digest(f, "sha256").hexdigest()
    found = _manifest_entry(path)
    name = path.stem
    if found is not None:
        root, entry = found
        name = path.resolve().relative_to(root).with_suffix("").as_posix()
        if entry.get("sha256") not in (None, sha):
            log.warning("%s: sha256 %s, but the manifest records %s", path, sha, entry["sha256"])
    frame = pd.read_json(path, lines=True, dtype=False)
    source = LocalArtifactDatasetSource(str(path.resolve()))
    return mlflow.data.from_pandas(frame, source=source, name=name, digest=sha[:36])


_DATASET_ATTEMPTS = 3  # log_datasets: a lost insert race needs one retry; 3 allows two


def log_datasets(paths: Iterable[Path | str | None], context: str) -> list[str]:
    """Log each existing JSONL file in `paths` as an input dataset of the active run (`context`:
    training, prior, evaluation, probe); returns the names logged. Others (lm-eval's own tasks at
    paper scale) are skipped; no active run (a non-main rank): nothing. Jobs call it after their
    work, so a malformed file is reported by the loader that names its line."""
    import mlflow

    if mlflow.active_run() is None:
        return []
    files = [Path(p) for p in paths if p is not None and Path(p).suffix == ".jsonl"]
    datasets = [jsonl_dataset(p) for p in files if p.is_file()]
    if datasets:
        n = len(datasets)
        for attempt in range(_DATASET_ATTEMPTS):
            try:
                mlflow.log_inputs(datasets=datasets, contexts=[context] * n, tags_list=[None] * n)
                break
            except mlflow.exceptions.MlflowException as error:
                # Two jobs logging the same new dataset at once: the slower insert hits the
                # store's unique (experiment, name, digest) key. The dataset now exists, and a
                # retry links it instead of inserting it, so the job keeps its finished work.
                lost_race = "UNIQUE constraint failed: datasets" in str(error)
                if not lost_race or attempt == _DATASET_ATTEMPTS - 1:
                    raise
                log.info("datasets inserted by a concurrent job; linking them (%d)", attempt + 1)
    return [d.name for d in datasets]


def eval_sets(eval_dir: Path, tasks: Iterable[str]) -> list[Path]:
    """The JSONL eval sets of `tasks` in `eval_dir` (`<task>.jsonl`)."""
    return [Path(eval_dir) / f"{task}.jsonl" for task in tasks]


def _invocation_run_id(uri: str, experiment_id: str) -> str | None:
    """The parent run of a job's run: its invocation's, when the job belongs to one."""
    invocation = current_invocation(uri, experiment_id)
    return invocation["run_id"] if invocation else None


# Every job of an invocation imports this module (its tracked_run is this one's); the library's
# commands never do, and their runs stand alone.
set_parent_run_provider(_invocation_run_id)
