"""MLflow as a researcher browses it: a model-training experiment, one parent run per invocation
with every job's run nested under it, eval and analysis runs that carry table 1's numbers, and the
corpora and eval sets as datasets (rpb/pipeline/tracking.py; docs/tracking.md)."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import new_store

from rpb.pipeline import tracking
from rpb.specs import Run, analysis_path, eval_path, spec_runs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, empty_store: Path) -> dict[str, Any]:
    """A fresh sqlite store, and the invocation record path every job of this test reads."""
    import mlflow

    previous = mlflow.get_tracking_uri()
    record = tmp_path / "results" / ".mlflow_invocation.json"
    monkeypatch.setenv(tracking.INVOCATION_ENV, str(record))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = new_store(empty_store, tmp_path / "mlflow.db")
    yield {"uri": uri, "record": record, "dir": tmp_path}
    mlflow.set_tracking_uri(previous)


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


CONFIG = {
    "scale": "smoke",
    "evaluation": {"in_domain": ["math"], "ood": ["addition", "facts"]},
    "hub": {"hf_token": "hf_" + "a" * 30},
}


def test_experiment_is_model_training_with_a_description(store: dict[str, Any]) -> None:
    client = _client(store["uri"])
    experiment_id = tracking.init_store(store["uri"])
    tags = client.get_experiment(experiment_id).tags
    assert tags[tracking.EXPERIMENT_KIND_TAG] == "custom_model_development"
    assert "Router Prior Bias" in tags[tracking.NOTE_TAG]
    # A kind chosen in the UI afterwards is the user's: init_store leaves it.
    client.set_experiment_tag(experiment_id, tracking.EXPERIMENT_KIND_TAG, "finetuning")
    tracking.init_store(store["uri"])
    assert client.get_experiment(experiment_id).tags[tracking.EXPERIMENT_KIND_TAG] == "finetuning"


def test_jobs_nest_under_their_invocation(store: dict[str, Any]) -> None:
    uri, record = store["uri"], store["record"]
    client = _client(uri)
    first = tracking.start_invocation(
        record, uri, config=CONFIG, configfiles=["config/smoke.yaml"], command=["snakemake"]
    )
    note = client.get_experiment_by_name("rpb").tags[tracking.NOTE_TAG]
    assert "config/smoke.yaml" in note and tracking.config_hash(CONFIG) in note
    with tracking.tracked_run(stage="corpora", tracking_uri=uri):
        pass
    with tracking.tracked_run(
        stage="train", model="m", method="rpb", seed=0, parents={"base": "b1"}, tracking_uri=uri
    ):
        pass
    assert tracking.end_invocation(record, "FINISHED") == first
    assert not record.exists()
    parent = client.get_run(first)
    assert parent.info.status == "FINISHED" and parent.data.tags["stage"] == "invocation"
    assert parent.data.tags["rpb.jobs"] == "2 FINISHED"
    assert parent.data.params["scale"] == "smoke"
    config = json.loads(Path(client.download_artifacts(first, "config.json")).read_text())
    assert config["evaluation"] == CONFIG["evaluation"]
    assert "hf_token" not in json.dumps(config), "a credential reached MLflow"
    experiment_id = parent.info.experiment_id
    children = client.search_runs([experiment_id], f"tags.`mlflow.parentRunId` = '{first}'")
    assert sorted(r.info.run_name for r in children) == ["corpora", "train/m/rpb/seed0"]
    train = next(r for r in children if r.info.run_name.startswith("train"))
    assert train.data.tags["parent.base"] == "b1", "lineage tags stay beside the nesting"

    # A second invocation gets its own parent; a job started by hand afterwards nests nowhere.
    second = tracking.start_invocation(record, uri, config=CONFIG, command=["snakemake"])
    with tracking.tracked_run(stage="eval", model="m", method="rpb", seed=0, tracking_uri=uri):
        pass
    tracking.end_invocation(record, "FAILED")
    assert second != first and client.get_run(second).info.status == "FAILED"
    # Issue 47 (item 4): a failed invocation says why, as its failed jobs' runs do.
    reason = client.get_run(second).data.tags[tracking.END_REASON_TAG]
    assert reason == "Snakemake failed before or between jobs (see the Snakemake log)"
    with tracking.tracked_run(stage="eval", model="m", method="lbl", seed=0, tracking_uri=uri):
        pass
    by_name = {r.info.run_name: r for r in client.search_runs([experiment_id])}
    assert by_name["eval/m/rpb/seed0"].data.tags[tracking.PARENT_RUN_TAG] == second
    assert tracking.PARENT_RUN_TAG not in by_name["eval/m/lbl/seed0"].data.tags


def test_a_run_group_keeps_diagnostic_runs_apart_from_the_main_ones(
    store: dict[str, Any],
) -> None:
    uri = store["uri"]
    for group in (None, "diagnostic"):
        with tracking.tracked_run(
            stage="eval", model="m", method="none", seed=0, tracking_uri=uri, group=group
        ):
            pass
    client = _client(uri)
    experiment_id = client.get_experiment_by_name("rpb").experiment_id
    by_name = {r.info.run_name: r for r in client.search_runs([experiment_id])}
    assert by_name["eval/m/none/seed0"].data.tags[tracking.GROUP_TAG] == "main"
    assert by_name["diagnostic/eval/m/none/seed0"].data.tags[tracking.GROUP_TAG] == "diagnostic"


def test_record_of_another_store_or_a_killed_invocation(
    store: dict[str, Any], empty_store: Path
) -> None:
    uri, record = store["uri"], store["record"]
    client = _client(uri)
    killed = tracking.start_invocation(record, uri, config=CONFIG, command=["snakemake"])
    # Snakemake SIGKILLed: no onsuccess/onerror, the record stays. The next invocation ends it.
    again = tracking.start_invocation(record, uri, config=CONFIG, command=["snakemake"])
    assert client.get_run(killed).info.status == "KILLED"
    assert "next invocation" in client.get_run(killed).data.tags[tracking.END_REASON_TAG]
    other = new_store(empty_store, store["dir"] / "other.db")
    with tracking.tracked_run(stage="eval", model="m", tracking_uri=other) as run:
        run_id = run.info.run_id
    assert tracking.PARENT_RUN_TAG not in _client(other).get_run(run_id).data.tags
    tracking.end_invocation(record)
    assert client.get_run(again).info.status == "FINISHED"


def test_eval_summary_has_known_percentages() -> None:
    result = {
        "tasks": {
            "rpb_math": {"items": [1, 0, 1, 1]},
            "rpb_addition": {"items": [1, 1, 0, 0, 0]},
            "rpb_facts": {"items": [0, 0]},
            "rpb_math2": {"items": [0]},
        }
    }
    spec = {"ood": ["addition", "facts"], "corpus_tasks": {}}
    assert tracking.eval_summary(result, "math", spec) == {
        "accuracy/in_domain": 75.0,
        "ood/addition": 40.0,
        "ood/facts": 0.0,
        "accuracy/ood_mean": 20.0,
    }
    # Paper scale: a corpus scored by standard benchmarks, items pooled across them.
    paper = {"tasks": {"gsm8k": {"items": [1, 1, 1]}, "math": {"items": [0]}}}
    spec = {"ood": [], "corpus_tasks": {"math": ["gsm8k", "math"]}}
    assert tracking.eval_summary(paper, "math", spec) == {"accuracy/in_domain": 75.0}
    # A missing OOD task leaves it and the mean out instead of a mean over fewer tasks.
    spec = {"ood": ["addition", "sort"], "corpus_tasks": {}}
    summary = tracking.eval_summary(result, "math", spec)
    assert "accuracy/ood_mean" not in summary and summary["ood/addition"] == 40.0


def test_eval_summary_has_table1s_p_target(tmp_path: Path) -> None:
    """p(target), the measure table 1's verdicts are judged on, is an eval run's metric too, with
    table 1's value for the run (rpb.report.tables.accuracy_record: the mean of the tasks'
    means)."""
    from rpb.report.tables import accuracy_record

    result = {
        "tasks": {
            "rpb_math": {"items": [1, 0, 1, 1]},
            "rpb_math_ll": {"p_target": [0.5, 0.25, 0.75, 0.5]},
            "rpb_addition": {"items": [1, 0]},
            "rpb_addition_ll": {"p_target": [0.2, 0.4]},
            "rpb_facts": {"items": [0, 0]},
            "rpb_facts_ll": {"p_target": [0.1, 0.3]},
        }
    }
    spec = {"ood": ["addition", "facts"], "corpus_tasks": {}}
    summary = tracking.eval_summary(result, "math", spec)
    assert summary["accuracy/in_domain_p"] == pytest.approx(50.0)
    assert summary["accuracy/ood_mean_p"] == pytest.approx(25.0)  # (30 + 20) / 2
    # The same numbers as table 1's row of this one run.
    run = Run(0, 0)
    path = eval_path(tmp_path, "tinyA", "math", "rpb", run)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(result))
    analysis = analysis_path(tmp_path, "tinyA", "math", "rpb", run)
    analysis.parent.mkdir(parents=True)
    analysis.write_text(json.dumps({"mean": {}}))
    record = accuracy_record(tmp_path, spec | {"scale": "tiny"}, "tinyA", "math", "rpb", run)
    for column in tracking.P_TARGET_COLUMNS:
        assert summary[tracking.table1_metric(column)] == pytest.approx(record[column])
    # Without the loglikelihood tasks (paper scale's standard benchmarks): exact match alone.
    paper = {"tasks": {"gsm8k": {"items": [1, 0]}}}
    spec = {"ood": [], "corpus_tasks": {"math": ["gsm8k"]}}
    assert tracking.eval_summary(paper, "math", spec) == {"accuracy/in_domain": 50.0}


def test_table1_view_shows_table1s_methods_on_p_target() -> None:
    """Table 1's view (the experiment tag MLflow's shared views read): eval runs less the
    methods that are no row of table 1, grouped by the tag `method`, the p(target) charts two to
    a row beside the runs list hidden, and a link that opens it."""
    state = tracking.table1_view_state(["hard"])
    assert state["searchFilter"] == "tags.stage = 'eval' and tags.method != 'hard'"
    assert state["groupBy"]["groupByKeys"] == [{"mode": "tag", "groupByData": "method"}]
    assert state["runListHidden"] is True and state["compareRunSections"][0]["columns"] == 2
    charts = [c["metricKey"] for c in state["compareRunCharts"]]
    assert charts == ["accuracy/in_domain_p", "accuracy/ood_mean_p"]
    assert all(state["chartsSearchFilter"] in c for c in charts)
    assert tracking.TABLE1_VIEW_TAG == "mlflow.sharedViewState." + tracking.TABLE1_VIEW
    link = tracking.table1_view_link("1", "http://127.0.0.1:5000")
    assert link.endswith(
        "runs?workflowType=machine_learning&compareRunsMode=CHART&viewStateShareKey=table1"
    )


def test_model_job_params_name_the_trained_method(tmp_path: Path) -> None:
    from rpb.method_config import MethodConfig

    job = tmp_path / "runs" / "m" / "math" / "rpb_strong" / "base0" / "seed1"
    (job / "model").mkdir(parents=True)
    method = MethodConfig("rpb", 0.5, {"bias_on": "logits", "keep_bias_at_eval": False}).to_dict()
    (job / "train_history.json").write_text(json.dumps({"history": [], "method": method}))
    params = tracking.model_job_params(method="rpb_strong", model_dir=job / "model", limit=5)
    assert params["kind"] == "rpb" and params["strength"] == 0.5
    assert json.loads(params["options"]) == {"bias_on": "logits", "keep_bias_at_eval": False}
    assert params["limit"] == 5 and params["model_dir"] == str(job / "model")
    # A history written before MethodConfig (`name`, the default strength as null, the options
    # the entry set) reads as the same value: its default strength written out, the options left
    # out at their defaults of then (rpb's bias dropped at evaluation).
    earlier = {"name": "rpb", "strength": None, "options": {"bias_on": "logits"}}
    (job / "train_history.json").write_text(json.dumps({"history": [], "method": earlier}))
    again = tracking.model_job_params(method="rpb_strong", model_dir=job / "model", limit=5)
    assert again == {**params, "strength": 1.0}
    # The schema's tags are tracked_run's: none of them here, no `method.<key>` either.
    assert not set(params) & set(tracking.SCHEMA_TAGS)
    assert not any(k.startswith("method.") for k in params)
    base = tracking.model_job_params(method="base", model_dir=tmp_path / "base" / "model")
    assert base["kind"] == "base" and base["strength"] == "-" and base["options"] == "{}"


def test_jsonl_dataset_digest_is_the_manifest_hash(store: dict[str, Any]) -> None:
    data = store["dir"] / "data"
    (data / "eval").mkdir(parents=True)
    path = data / "eval" / "addition.jsonl"
    path.write_text('{"prompt": "1+2=", "target": "3"}\n{"prompt": "2+2=", "target": "4"}\n')
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    manifest = {"files": {"eval/addition.jsonl": {"lines": 2, "sha256": sha}}}
    (data / "manifest.json").write_text(json.dumps(manifest))
    with tracking.tracked_run(stage="eval", model="m", tracking_uri=store["uri"]) as run:
        names = tracking.log_datasets(
            [*tracking.eval_sets(data / "eval", ["addition", "gsm8k"]), None], "evaluation"
        )
    assert names == ["eval/addition"], "a task without a JSONL set (lm-eval's own) is skipped"
    (found,) = _client(store["uri"]).get_run(run.info.run_id).inputs.dataset_inputs
    assert found.dataset.digest == sha[:36]
    assert json.loads(found.dataset.profile)["num_rows"] == 2
    assert [t.value for t in found.tags if t.key == "mlflow.data.context"] == ["evaluation"]


def _one_eval_set(store: dict[str, Any]) -> Path:
    (store["dir"] / "eval").mkdir(parents=True, exist_ok=True)
    path = store["dir"] / "eval" / "facts.jsonl"
    path.write_text('{"prompt": "sky?", "target": "blue"}\n')
    return path


def test_a_dataset_a_concurrent_job_inserted_first_is_linked_not_fatal(
    store: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two parallel jobs logging the same new eval set: the slower insert hits the store's unique
    (experiment, name, digest) key (seen in `make smoke`, which then lost a finished evaluation).
    log_datasets retries, and the retry links the dataset to the run."""
    import mlflow

    path = _one_eval_set(store)
    with tracking.tracked_run(stage="eval", model="m", tracking_uri=store["uri"]):
        tracking.log_datasets([path], "evaluation")  # the other job: the dataset now exists
    real, calls = mlflow.log_inputs, []

    def racing(**kwargs: Any) -> None:
        calls.append(kwargs)
        if len(calls) == 1:  # what the store raises for the losing insert
            raise mlflow.exceptions.MlflowException(
                "(sqlite3.IntegrityError) UNIQUE constraint failed: datasets.experiment_id, "
                "datasets.name, datasets.digest"
            )
        real(**kwargs)

    monkeypatch.setattr(mlflow, "log_inputs", racing)
    with tracking.tracked_run(stage="eval", model="m", tracking_uri=store["uri"]) as run:
        assert tracking.log_datasets([path], "evaluation") == ["facts"]
    assert len(calls) == 2
    (found,) = _client(store["uri"]).get_run(run.info.run_id).inputs.dataset_inputs
    assert found.dataset.name == "facts"


def test_other_tracking_errors_of_log_datasets_are_not_swallowed(
    store: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow

    path = _one_eval_set(store)

    def broken(**kwargs: Any) -> None:
        raise mlflow.exceptions.MlflowException("disk I/O error")

    monkeypatch.setattr(mlflow, "log_inputs", broken)
    error = pytest.raises(mlflow.exceptions.MlflowException, match="disk I/O error")
    with tracking.tracked_run(stage="eval", model="m", tracking_uri=store["uri"]), error:
        tracking.log_datasets([path], "evaluation")


@pytest.mark.workflow
def test_dry_run_creates_no_run(tmp_path: Path) -> None:
    results = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "snakemake", "-n", "--configfile", "config/smoke.yaml"),
            *("--config", f"results_dir={results}", "--", f"{results}/table1.csv"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tracking_init" in proc.stdout, "the dry run planned nothing"
    assert not results.exists() or not any(results.iterdir()), sorted(results.rglob("*"))


# --- on the suite's shared smoke run ------------------------------------------------------------


def _latest_runs(results: Path) -> tuple[Any, list[Any]]:
    client = _client(f"sqlite:///{results / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("rpb")
    runs = client.search_runs(
        [experiment.experiment_id], max_results=5000, order_by=["attributes.start_time ASC"]
    )
    return client, runs


def _finished_by_name(runs: list[Any]) -> dict[str, Any]:
    """The latest finished main run of each name (names carry the corpus: table 3's math2 runs
    are apart from table 1's math runs)."""
    return {
        r.info.run_name: r
        for r in runs
        if r.info.status == "FINISHED" and r.data.tags.get(tracking.GROUP_TAG, "main") == "main"
    }


def _job_name(stage: str, model: str, corpus: str, method: str, run: Run) -> str:
    """The run name of a job on run `run`."""
    schema = tracking.schema_tags(
        model=model, corpus=corpus, method=method, base=run.base, seed=run.seed
    )
    return tracking.mlflow_run_name(stage, schema)


@pytest.mark.slow
def test_smoke_runs_are_nested_under_invocations(smoke_run: Path) -> None:
    client, runs = _latest_runs(smoke_run)
    experiment = client.get_experiment_by_name("rpb")
    assert experiment.tags[tracking.EXPERIMENT_KIND_TAG] == tracking.MODEL_TRAINING_KIND
    assert "config/smoke.yaml" in experiment.tags[tracking.NOTE_TAG]
    invocations = {r.info.run_id: r for r in runs if r.data.tags["stage"] == "invocation"}
    assert invocations and all(r.info.status == "FINISHED" for r in invocations.values())
    jobs = [r for r in runs if r.info.run_id not in invocations]
    orphans = [r.info.run_name for r in jobs if r.data.tags.get(tracking.PARENT_RUN_TAG) is None]
    assert not orphans, f"runs outside any invocation: {orphans}"
    assert {r.data.tags[tracking.PARENT_RUN_TAG] for r in jobs} <= set(invocations)
    assert not (smoke_run / ".mlflow_invocation.json").exists()


@pytest.mark.slow
def test_smoke_eval_and_analysis_runs_reproduce_table1(smoke_run: Path) -> None:
    import pandas as pd

    _, runs = _latest_runs(smoke_run)
    table = pd.read_csv(smoke_run / "table1.csv").set_index("method")
    spec = json.loads((smoke_run / "table1.meta.json").read_text())
    latest = _finished_by_name(runs)
    # The exact-match columns and the p(target) columns the verdicts are judged on (`in_domain_p`,
    # `ood_mean_p`: accuracy/in_domain_p, accuracy/ood_mean_p); the per-task p(target) twins
    # (`ood_<task>_p`) are no run metrics.
    ood = [c for c in table.columns if c.startswith("ood_") and not c.endswith("_p")]
    accuracy = ["in_domain", "ood_mean", *ood, *tracking.P_TARGET_COLUMNS]
    assert set(tracking.P_TARGET_COLUMNS) <= set(table.columns)
    structure = ["community_nmi", "coact_cosine", "modularity"]
    # Each base is evaluated as method `base` under its seed 0.
    table_runs = spec_runs(spec)
    base_runs = sorted({Run(run.base, 0) for run in table_runs})
    for method, row in table.iterrows():
        names = [
            (spec["model"], spec["corpus"], method, r)
            for r in (base_runs if method == "base" else table_runs)
        ]
        evals = [latest[_job_name("eval", *name)] for name in names]
        analyses = [latest[_job_name("analysis", *name)] for name in names]
        for run in evals + analyses:
            params, tags = run.data.params, run.data.tags
            assert (tags["model"], tags["method"], tags["corpus"]) == (
                spec["model"],
                method,
                spec["corpus"],
            )
            assert {"kind", "strength", "options"} <= set(params)
            assert {"base", "seed"} <= set(tags) and not set(tracking.SCHEMA_TAGS) & set(params)
            assert run.data.tags[tracking.RUN_COLOR_TAG] == tracking.run_color(method)
            if method == "base":
                assert params["kind"] == "base" and params["strength"] == "-"
        # Table 1's cell: the mean over seeds of the runs' metrics (CSV rounded to 4 places).
        for column, group in [(c, evals) for c in accuracy] + [(c, analyses) for c in structure]:
            metric = tracking.table1_metric(column)
            values = [run.data.metrics.get(metric, math.nan) for run in group]
            mean = sum(values) / len(values)
            assert mean == pytest.approx(row[column], abs=1e-4, nan_ok=True), (method, column)
        assert all("topk_overlap_with_base" in run.data.metrics for run in analyses)
    kinds = {
        r.data.tags["method"]: r.data.params["kind"]
        for r in latest.values()
        if r.data.tags["stage"] == "eval"
    }
    assert kinds["lbl"] == "lbl" and kinds["rpb"] == "rpb"
    # Table 1's view in the experiment: its methods' eval runs (no `hard`), on p(target).
    experiment = _client(f"sqlite:///{smoke_run / 'mlflow.db'}").get_experiment_by_name("rpb")
    view = json.loads(experiment.tags[tracking.TABLE1_VIEW_TAG])
    # (`all`'s eval runs, when test_report ran first, came after table 1's run wrote it.)
    search = view["searchFilter"]
    assert search.startswith("tags.stage = 'eval'") and "tags.method != 'hard'" in search
    assert not any(f"!= '{m}'" in search for m in table.index)
    charts = [c["metricKey"] for c in view["compareRunCharts"]]
    assert charts == ["accuracy/in_domain_p", "accuracy/ood_mean_p"]
    assert view["groupBy"]["groupByKeys"] == [{"mode": "tag", "groupByData": "method"}]


@pytest.mark.slow
def test_smoke_datasets_and_training_metric_names(smoke_run: Path) -> None:
    _, runs = _latest_runs(smoke_run)
    manifest = json.loads((smoke_run / "data" / "manifest.json").read_text())["files"]
    latest = _finished_by_name(runs)

    def inputs(name: str) -> dict[str, tuple[str, str]]:
        found = latest[name].inputs.dataset_inputs
        return {d.dataset.name: (d.dataset.digest, d.tags[0].value) for d in found}

    train = inputs("train/tinyA/math/rpb/base0/seed0")
    assert train == {"post/math": (manifest["post/math.jsonl"]["sha256"][:36], "training")}
    assert inputs("pretrain/tinyA/base0")["pretrain"][1] == "training"
    pretrain = latest["pretrain/tinyA/base0"].data.params  # the architecture: one JSON param
    assert json.loads(pretrain["architecture"])
    assert not any(k.startswith("architecture.") for k in pretrain)
    evaluated = inputs("eval/tinyA/math/rpb/base0/seed0")
    assert evaluated["eval/addition"] == (
        manifest["eval/addition.jsonl"]["sha256"][:36],
        "evaluation",
    )
    assert inputs("analysis/tinyA/math/rpb/base0/seed0")["eval/math"][1] == "probe"
    # Training metrics keep train_history.json's names ("layer1/kl_to_base").
    history = json.loads(
        (
            smoke_run / "runs" / "tinyA" / "math" / "rpb" / "base0" / "seed0" / "train_history.json"
        ).read_text()
    )["history"]
    names = {k for entry in history for k in entry if k != "step"}
    logged = set(latest["train/tinyA/math/rpb/base0/seed0"].data.metrics)
    assert any("/" in n for n in names) and names <= logged, names - logged


# --- a locked store: wait up to RPB_TRACKING_WAIT_S, then one line ------------------------------
# (docs/records/reliability.md, section 10)

_HOLD = """
import sqlite3, sys, time
from pathlib import Path
db, flag, seconds = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
connection = sqlite3.connect(db, isolation_level=None)
connection.execute("BEGIN EXCLUSIVE")  # what a sqlite3 shell or a backup holding the store does
flag.write_text("locked")
time.sleep(seconds)
connection.execute("COMMIT")
"""


def _lock_store(db: Path, seconds: float) -> subprocess.Popen:
    """Another process holding the store's lock for `seconds`; returns once it holds it."""
    import time

    flag = db.with_suffix(".locked")
    flag.unlink(missing_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(db), str(flag), str(seconds)])
    while not flag.exists():
        assert holder.poll() is None, "the lock holder died"
        time.sleep(0.01)
    return holder


def test_every_store_session_waits_the_configured_time(
    store: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow sets `PRAGMA busy_timeout = 20000` per session; the policy replaces it."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    monkeypatch.setenv(tracking.STORE_WAIT_ENV, "7.5")
    tracking.configure_store_wait()
    sql_store = SqlAlchemyStore(store["uri"], str(store["dir"] / "artifacts"))
    with sql_store.ManagedSessionMaker() as session:
        from sqlalchemy import text

        assert session.execute(text("PRAGMA busy_timeout")).scalar() == 7500


def test_a_lock_shorter_than_the_policy_is_waited_for(
    store: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    import mlflow

    monkeypatch.setenv(tracking.STORE_WAIT_ENV, "30")
    with tracking.tracked_run(stage="eval", model="m", tracking_uri=store["uri"]) as run:
        holder = _lock_store(store["dir"] / "mlflow.db", 1.5)
        start = time.monotonic()
        mlflow.log_metric("score", 1.0)
        waited = time.monotonic() - start
    holder.wait()
    assert waited > 1.0
    assert _client(store["uri"]).get_run(run.info.run_id).info.status == "FINISHED"


def test_a_lock_past_the_policy_fails_in_one_line_and_the_run_ends_failed(
    store: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Before: MLflow's 20 s, then one traceback per failed call (441 lines in a job whose store
    was locked for 60 s) and the run left RUNNING. Now: the job fails after the policy's wait
    with one line naming the store, and ends its run FAILED once the store answers again."""
    import time

    import mlflow

    from rpb.artifacts import failure_line

    db = store["dir"] / "mlflow.db"
    monkeypatch.setenv(tracking.STORE_WAIT_ENV, "2")
    with tracking.tracked_run(stage="eval", model="m", tracking_uri=store["uri"]) as run:
        pass  # the store and the experiment exist
    capfd.readouterr()
    start = time.monotonic()
    with (
        pytest.raises(mlflow.exceptions.MlflowException) as raised,
        tracking.tracked_run(stage="eval", model="m", tracking_uri=store["uri"]) as run,
    ):
        holder = _lock_store(db, 3.5)  # longer than the policy, shorter than two of them
        start = time.monotonic()
        mlflow.log_metric("score", 1.0)
    failed_after = time.monotonic() - start
    holder.wait()
    assert 1.5 < failed_after < 15, failed_after  # the policy's 2 s (+ ending the run), not 20 s
    line = tracking.tracking_failure(raised.value, store["uri"])
    assert line == (
        f"tracking store {db} is locked by another process (`fuser {db}` names it): waited 2 s "
        f"(RPB_TRACKING_WAIT_S); let that process finish or stop it, then rerun"
    )
    assert failure_line(raised.value) is None  # the CLI asks tracking_failure first
    logged = capfd.readouterr().err
    assert "Traceback" not in logged and "database is locked" not in logged, logged[-2000:]
    ended = _client(store["uri"]).get_run(run.info.run_id)
    assert ended.info.status == "FAILED"
    assert "is locked by another process" in ended.data.tags[tracking.END_REASON_TAG]


@pytest.mark.slow
def test_onstart_on_a_locked_store_is_one_line(tmp_path: Path) -> None:
    """Before: a 25-line traceback from onstart. Now: a note that it waits, then one line."""
    results = tmp_path / "results"
    db = results / "mlflow.db"
    tracking.init_store(f"sqlite:///{db}")
    holder = _lock_store(db, 120)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env[tracking.STORE_WAIT_ENV] = "1"
    try:
        proc = subprocess.run(
            [
                *(sys.executable, "-m", "snakemake", "--cores", "1"),
                *("--configfile", "config/smoke.yaml", "--config", f"results_dir={results}"),
                *("--", f"{results}/.mlflow_ready"),
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        holder.kill()
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-2:] == [
        f"rpb: tracking store {db} is locked by another process; waiting up to 1 s "
        "(RPB_TRACKING_WAIT_S)",
        f"tracking error: tracking store {db} is locked by another process (`fuser {db}` names "
        "it): waited 1 s (RPB_TRACKING_WAIT_S); let that process finish or stop it, then rerun",
    ]
    assert not (results / ".mlflow_ready").exists()  # no job ran


# --- a deleted or half-migrated store (issue 47, item 3) ------------------------------------------


def test_a_job_whose_store_is_gone_fails_in_one_line_and_creates_nothing(
    store: dict[str, Any],
) -> None:
    """Before: every job of the invocation created the schema again in the new file at once, and
    they raced (1-15 tracebacks a job). Now a job of an invocation refuses a missing or empty
    store before MLflow's first connection; a job started by hand still creates its store."""
    db = store["dir"] / "mlflow.db"
    db.unlink()
    with (
        pytest.raises(tracking.TrackingUnavailable) as raised,
        tracking.tracked_run(stage="eval", model="m", tracking_uri=store["uri"]),
    ):
        pytest.fail("the job ran without its store")
    line = tracking.tracking_failure(raised.value)
    assert line == (
        f"tracking store {db} is gone (deleted while the pipeline ran); rerun the pipeline: its "
        "start creates a fresh store (finished outputs are kept; their runs were in the old one)"
    )
    assert not db.exists()
    db.touch()  # the empty file a connection leaves where the store was: refused too
    with (
        pytest.raises(tracking.TrackingUnavailable),
        tracking.tracked_run(stage="eval", model="m", tracking_uri=store["uri"]),
    ):
        pass
    assert db.stat().st_size == 0


def test_a_store_deleted_under_a_running_job_is_one_line(
    store: dict[str, Any], capfd: pytest.CaptureFixture[str]
) -> None:
    """sqlite refuses writes to a deleted file ('attempt to write a readonly database'); MLflow
    logged a traceback per statement. Now: no traceback, one line naming the store."""
    import mlflow

    db = store["dir"] / "mlflow.db"
    with tracking.tracked_run(stage="eval", model="m", tracking_uri=store["uri"]):
        pass  # the engine and its connections exist
    capfd.readouterr()
    with (
        pytest.raises(mlflow.exceptions.MlflowException) as raised,
        tracking.tracked_run(stage="eval", model="m", tracking_uri=store["uri"]),
    ):
        db.unlink()
        mlflow.log_metric("score", 1.0)
    line = tracking.tracking_failure(raised.value, store["uri"])
    assert line is not None and line.startswith(
        f"tracking store {db} was deleted or replaced while the job ran (sqlite: attempt to write"
    )
    assert "Traceback" not in capfd.readouterr().err


def test_a_half_migrated_store_is_one_line_at_the_start(store: dict[str, Any]) -> None:
    """A schema creation cut short leaves an `_alembic_tmp_*` table; MLflow then failed every
    later onstart with 87 lines (`table _alembic_tmp_experiments already exists`) naming neither
    the store nor the fix. Now onstart says both in one line and touches nothing."""
    import sqlite3

    db = store["dir"] / "mlflow.db"
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE _alembic_tmp_experiments (experiment_id INTEGER)")
    con.close()
    before = db.read_bytes()
    with pytest.raises(tracking.TrackingUnavailable) as raised:
        tracking.start_invocation(store["record"], store["uri"], config=CONFIG, command=["x"])
    assert str(raised.value) == (
        f"tracking store {db} is half-migrated (table _alembic_tmp_experiments left by a schema "
        f"creation cut short, e.g. after the store was deleted while jobs ran): move it aside (mv "
        f"{db} {db}.broken) and rerun; a fresh store is created, the results' files are unaffected"
    )
    assert db.read_bytes() == before and not store["record"].exists()


def test_a_full_store_at_the_start_is_one_line_without_tracebacks(
    store: dict[str, Any], capfd: pytest.CaptureFixture
) -> None:
    """Issue 59, item 7: a full disk under the store printed 111 console lines with two
    SQLAlchemy tracebacks (MLflow logs one per failed statement) before rpb's line at the
    invocation's start. Here sqlite's driver fails every write with its full-disk error, as on a
    full filesystem (SQLITE_FULL), under SQLAlchemy and MLflow as they are."""
    import sqlite3

    import sqlalchemy.exc
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    db = store["dir"] / "mlflow.db"

    def full_disk(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith(("INSERT", "UPDATE", "DELETE")):
            full = sqlite3.OperationalError("database or disk is full")  # as SQLAlchemy wraps it
            raise sqlalchemy.exc.OperationalError(statement, None, full)

    class Printed(logging.Handler):  # what MLflow's loggers print (past their filters)
        def emit(self, record: logging.LogRecord) -> None:
            printed.append(self.format(record))

    printed: list[str] = []
    handler = Printed()
    loggers = [logging.getLogger(n) for n in ("mlflow.store.db.utils", "mlflow.store.tracking")]
    event.listen(Engine, "before_cursor_execute", full_disk)
    for logger in loggers:
        logger.addHandler(handler)
    try:
        with pytest.raises(tracking.TrackingUnavailable) as raised:
            tracking.start_invocation(store["record"], store["uri"], config=CONFIG, command=["x"])
    finally:
        event.remove(Engine, "before_cursor_execute", full_disk)
        for logger in loggers:
            logger.removeHandler(handler)
    assert str(raised.value) == f"tracking store {db}: disk full; free space, then rerun"
    assert printed == []
    err = capfd.readouterr().err
    assert "Traceback" not in err and "SQLAlchemy database error" not in err, err[-2000:]
