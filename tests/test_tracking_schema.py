"""One schema across every run kind (rpb.pipeline.tracking.SCHEMA_TAGS; docs/tracking.md):
`method`, `base`, `seed`, `model` and `corpus` as tags under the same names everywhere, first in
MLflow's Group-by menu and one colour per table 1 method when grouped, no placeholder in a run
name, no tag named like a param, one unit per metric family, and table runs that carry their table
and its headline numbers."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from conftest import new_store

from rpb.method_config import MethodConfig
from rpb.pipeline import tracking

# A pretraining run's architecture (cli.cmd_pretrain's `--architecture`), nested.
ARCHITECTURE = {"hidden_size": 32, "num_experts": 8, "rope": {"theta": 10000.0}}

# Each run kind as its job opens it (rpb.pipeline.cli), on results run id 1001 (seed 1 on base 1)
# where it has one: (kwargs of tracked_run, the run name, the schema tags it has).
KINDS: list[tuple[dict[str, Any], str, dict[str, str]]] = [
    ({"stage": "corpora", "params": {"data_seed": 0}}, "corpora", {}),
    (
        {"stage": "pretrain", "model": "tinyA", "base": 1,
         "params": {"base_name": "tinyA_p1", "train": {"seed": 1}, "architecture": ARCHITECTURE}},
        "pretrain/tinyA/base1",
        {"model": "tinyA", "base": "1"},
    ),
    (
        {"stage": "prior", "model": "tinyA", "base": 1, "corpus": "math",
         "params": {"base_name": "tinyA_p1", "corpus_file": "post/math.jsonl"}},
        "prior/tinyA/math/base1",
        {"model": "tinyA", "base": "1", "corpus": "math"},
    ),
    (
        {"stage": "train", "model": "tinyA", "method": "rpb", "corpus": "math", "base": 1,
         "seed": 1, "params": {**tracking.method_params("rpb", MethodConfig("rpb")),
                               "train": {"seed": 1001}}},
        "train/tinyA/math/rpb/base1/seed1",
        {"model": "tinyA", "base": "1", "method": "rpb", "corpus": "math", "seed": "1"},
    ),
    (
        {"stage": "eval", "model": "tinyA", "method": "base", "corpus": "math", "base": 1,
         "seed": 0, "params": {"kind": "base", "tasks": ["math"]}},
        "eval/tinyA/math/base/base1/seed0",
        {"model": "tinyA", "base": "1", "method": "base", "corpus": "math", "seed": "0"},
    ),
    (
        {"stage": "table1", "model": "tinyA", "corpus": "math",
         "params": {"model": "tinyA", "corpus": "math", "methods": ["none", "rpb"]}},
        "table1/tinyA/math",
        {"model": "tinyA", "corpus": "math"},
    ),
]  # fmt: skip


@pytest.fixture
def uri(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, empty_store: Path) -> str:
    """A fresh store per test (a copy of the session's empty one: creating one costs seconds)."""
    import mlflow

    previous = mlflow.get_tracking_uri()
    monkeypatch.delenv(tracking.INVOCATION_ENV, raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    yield new_store(empty_store, tmp_path / "mlflow.db")
    mlflow.set_tracking_uri(previous)


def test_every_run_kind_logs_the_schema_and_a_plain_name(uri: str) -> None:
    from mlflow.tracking import MlflowClient

    for kwargs, _, _ in KINDS:
        with tracking.tracked_run(tracking_uri=uri, **kwargs):
            pass
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("rpb").experiment_id
    runs = {r.info.run_name: r for r in client.search_runs([experiment])}
    assert set(runs) == {name for _, name, _ in KINDS}
    for kwargs, name, schema in KINDS:
        run = runs[name]
        params, tags = run.data.params, run.data.tags
        assert {k: tags[k] for k in tracking.SCHEMA_TAGS if k in tags} == schema, name
        assert "-" not in name.split("/") and "seed-" not in name, name
        assert not set(tags) & set(params), f"{name}: a tag named like a param"
        assert not any(k.startswith("method.") for k in params), name
        assert tags["stage"] == kwargs["stage"]
        # The schema's tags first, in SCHEMA_TAGS's order: the UI's Group-by menu lists a run's
        # tags (but MLflow's own) in the order the store returns them, which is the logged one.
        own = [k for k in tags if not k.startswith("mlflow.")]
        assert own[: len(schema)] == [k for k in tracking.SCHEMA_TAGS if k in schema], name
    # No method on runs that have none: the pretraining runs are no `lbl` group.
    assert "method" not in runs["pretrain/tinyA/base1"].data.tags
    train = runs["train/tinyA/math/rpb/base1/seed1"].data.params
    assert (train["kind"], train["strength"]) == ("rpb", "1.0")
    # The architecture is one JSON param, not twenty `architecture.*` names at the top of the
    # UI's Group-by list; nested `train` keeps its dotted params.
    pretrain = runs["pretrain/tinyA/base1"].data.params
    assert json.loads(pretrain["architecture"]) == ARCHITECTURE
    assert not any(k.startswith("architecture.") for k in pretrain)
    assert pretrain["train.seed"] == "1"
    # One colour per method (MLflow's run colour tag); runs without a method have none.
    colors = {name: run.data.tags.get(tracking.RUN_COLOR_TAG) for name, run in runs.items()}
    assert colors["train/tinyA/math/rpb/base1/seed1"] == tracking.run_color("rpb")
    assert colors["eval/tinyA/math/base/base1/seed0"] == tracking.run_color("base")
    assert colors["pretrain/tinyA/base1"] is None and colors["table1/tinyA/math"] is None


def test_a_methods_runs_have_its_groups_colour() -> None:
    """A run's colour is the one MLflow draws its method's group in: one colour per method, grouped
    or not; a hash of the label, not a counter, so the same in every store."""
    fixed = [tracking.run_color(m) for m in ("none", "lbl", "rpb", "base")]
    assert len(set(fixed)) == 4
    assert all(re.fullmatch(r"#[0-9a-f]{6}", c) for c in fixed)
    for method in ("none", "lbl", "rpb", "base", "rpb_strong"):
        assert tracking.run_color(method) == tracking.group_color(f"tag.method.{method}")
    assert tracking.run_color(None) is None and tracking.run_color("-") is None


def test_a_schema_name_with_two_values_is_refused(uri: str) -> None:
    with (
        pytest.raises(ValueError, match="'model'"),
        tracking.tracked_run(
            stage="table1", model="tinyA", params={"model": "tinyB"}, tracking_uri=uri
        ),
    ):
        pass


def test_a_schema_name_the_run_lacks_is_refused_as_a_param(uri: str) -> None:
    with (
        pytest.raises(ValueError, match="'method'"),
        tracking.tracked_run(
            stage="table3", model="tinyA", params={"method": "rpb"}, tracking_uri=uri
        ),
    ):
        pass


def test_a_report_about_a_method_logs_it_as_a_spec_param(uri: str, tmp_path: Path) -> None:
    """Table 3's spec names the claim's method; its run is no run of that method: the param
    `spec.method`, no tag `method`, so grouping by method keeps the table run out of rpb's group."""
    import argparse

    from mlflow.tracking import MlflowClient

    from rpb.pipeline import cli

    spec = {"models": ["tinyA", "tinyB"], "corpus": "math2", "method": "rpb", "reference": "none"}
    args = argparse.Namespace(
        spec=spec, out=tmp_path / "table3.csv", results=tmp_path, tracking_uri=uri, experiment="rpb"
    )
    cli._report_job(args, "table3", lambda results, spec, out: None)
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("rpb").experiment_id])
    assert run.info.run_name == "table3/tinyA,tinyB/math2"
    assert run.data.params["spec.method"] == "rpb" and run.data.params["reference"] == "none"
    assert "method" not in run.data.tags and "method" not in run.data.params
    assert run.data.tags["corpus"] == "math2" and "corpus" not in run.data.params


def test_schema_tags_leave_out_missing_parts() -> None:
    schema = tracking.schema_tags(model="m", method="-", seed=None, corpus="")
    assert schema == {"model": "m"} and tracking.mlflow_run_name("eval", schema, "diagnostic") == (
        "diagnostic/eval/m"
    )


# What MLflow 3.17's UI drew for the groups of table 1's methods in bench/browser_check.py while
# `method` was a param: `base` and `lbl` in one slate grey (rpb.pipeline.tracking.group_color
# reproduces its hash).
DRAWN_AS_PARAM = {"none": "#1f272d", "lbl": "#5f7281", "rpb": "#de7921", "base": "#5f7281"}


def test_group_colours_of_table1_methods_are_distinct() -> None:
    """Grouped by the tag `method`, MLflow's UI colours each group by a hash of its key
    (`tag.method.<label>`), reading no run's colour: table 1's methods (default and smoke) and
    the base must fall on distinct colours, or two groups read as one. A regression here (another
    MLflow hash or palette, a renamed tag or label) fails this before the browser check would."""
    import yaml

    config = Path(__file__).resolve().parents[1] / "config"
    labels = {"none", "lbl", "rpb", "base"}  # base: each base evaluated as a row of table 1
    for name in ("config.yaml", "smoke.yaml"):
        table1 = yaml.safe_load((config / name).read_text()).get("table1") or {}
        labels |= set(table1.get("methods") or [])
    colors = {m: tracking.group_color(f"tag.method.{m}") for m in sorted(labels)}
    assert len(set(colors.values())) == len(colors), colors
    assert all(c in tracking.UI_PALETTE for c in colors.values())
    # The hash is MLflow's: it reproduces what the UI drew when `method` was a param.
    assert {m: tracking.group_color(f"param.method.{m}") for m in DRAWN_AS_PARAM} == DRAWN_AS_PARAM


def test_accuracy_metrics_are_percent_with_plain_names() -> None:
    """The unit rule: accuracy-like scores in percent (`_pct` on per-task names), the `rpb_`
    task prefix dropped; other metrics keep their unit and no `_pct`."""
    result = {
        "tasks": {
            "rpb_math": {"metric": "exact_match", "score": 0.25},
            "rpb_math_ll": {"metric": "ll_per_token", "score": -1.5},
            "mmlu": {"metric": "acc", "score": 0.5},
        }
    }
    metrics = tracking.task_metrics(result)
    assert metrics == {
        "math.exact_match_pct": 25.0,
        "math_ll.ll_per_token": -1.5,
        "mmlu.acc_pct": 50.0,
    }
    assert not any(name.startswith("rpb_") for name in metrics)
    summary = tracking.eval_summary(
        {"tasks": {"rpb_math": {"items": [1, 0, 0, 0]}, "rpb_facts": {"items": [1, 1]}}},
        "math",
        {"ood": ["facts"], "corpus_tasks": {}},
    )
    # table 1's columns in the same unit as the per-task scores: percent.
    assert summary == {"accuracy/in_domain": 25.0, "ood/facts": 100.0, "accuracy/ood_mean": 100.0}


def test_table1_run_logs_its_table_and_headline_numbers(uri: str, tmp_path: Path) -> None:
    import mlflow
    from mlflow.tracking import MlflowClient

    csv = tmp_path / "table1.csv"
    csv.write_text(
        "model,method,in_domain,in_domain_ci_low,in_domain_ci_high,in_domain_p,ood_mean,"
        "ood_mean_p,paper_in_domain\n"
        "tinyA,base,10.0,5.0,15.0,1.5,3.0,0.5,\n"
        "tinyA,rpb,40.0,30.0,50.0,2.5,4.0,0.7,45.77\n"
    )
    with tracking.tracked_run(
        stage="table1", model="tinyA", corpus="math", tracking_uri=uri
    ) as run:
        logged = tracking.log_table_run("table1", csv)
    assert (
        logged["table1/rpb/in_domain"] == 40.0 and logged["table1/base/in_domain_ci_high"] == 15.0
    )
    assert logged["table1/rpb/ood_mean_p"] == 0.7 and "table1/rpb/paper_in_domain" not in logged
    client = MlflowClient(tracking_uri=uri)
    found = client.get_run(run.info.run_id)
    assert found.data.metrics == logged
    table = json.loads(Path(client.download_artifacts(run.info.run_id, "table1.json")).read_text())
    assert table["columns"][:2] == ["model", "method"] and len(table["data"]) == 2
    assert mlflow.active_run() is None


def test_table1_metrics_open_the_chart_view() -> None:
    """MLflow's chart view orders named sections (a metric's name up to its last `/`)
    alphabetically and puts unsectioned metrics after them: table 1's run metrics must sit in
    sections that sort before every section a training run logs, so they show first."""
    columns = ["in_domain", "ood_mean", "ood_addition", *tracking.STRUCTURE_COLUMNS]
    names = [tracking.table1_metric(c) for c in columns]
    assert names[:3] == ["accuracy/in_domain", "accuracy/ood_mean", "ood/addition"]
    assert tracking.table1_metric("topk_overlap_with_base") == "topk_overlap_with_base"
    table1 = {n.rsplit("/", 1)[0] for n in names if "/" in n} - {"ood"}
    assert table1 == {"accuracy", "coact"}
    # Each title legible in its chart at 1400 px (issue 48: "coactivation/com..." was cut).
    long = [n for n in names if len(n) > tracking.CHART_TITLE_CHARS]
    assert not long, f"chart titles cut with an ellipsis: {long}"
    # What training logs (rpb.trainer's router statistics: per layer and their mean).
    training = {"layer0", "layer11", "layer0/load", "mean"}
    assert max(table1, key=str.casefold).casefold() < min(training, key=str.casefold).casefold()
