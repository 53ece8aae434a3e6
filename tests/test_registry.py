"""The report registry (rpb.report.registry): every entry can be built and shown as declared. Its
builder imports and takes (results, spec, out_csv); a planned entry's rule gets its CSV first (the
job's `--out` and its results folder) and each shown output names a caption that exists; job
names are unique on the command line; the workflow makes one rule per planned entry, and a new
planned entry needs nothing but itself (the config check, the CLI and the plan accept it)."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

from rpb.pipeline.cli import build_parser
from rpb.report import registry
from rpb.report.registry import REPORT_JOBS, REPORTS, Output, ReportJob, table_outputs

ROOT = Path(__file__).resolve().parents[1]
CAPTIONS = ROOT / "workflow" / "report"


@pytest.mark.parametrize("key", sorted(REPORT_JOBS))
def test_every_builder_imports_and_takes_results_spec_and_out(key: str) -> None:
    module, function = REPORT_JOBS[key].builder.split(":")
    build = getattr(importlib.import_module(module), function)
    assert list(inspect.signature(build).parameters)[:3] == ["results", "spec", "out_csv"]


def test_entries_declare_what_their_rule_needs() -> None:
    planned = [job for job in REPORTS.values() if job.planned]
    shown = [job for job in REPORTS.values() if job.outputs]
    assert {job.key for job in planned} == {
        "table2",
        "table3",
        "table4",
        "table5",
        "drift",
        "readings",
    }
    assert {"sweep", "claims"} <= {job.key for job in shown}  # rules of their own, outputs here
    for job in shown:
        assert job.builder and job.category, job.key
        assert job.outputs[0].name == "csv" and job.outputs[0].path.endswith(".csv"), job.key
        names = [out.name for out in job.outputs]
        assert len(names) == len(set(names)), job.key
        for out in job.outputs:
            if out.caption is not None:
                assert (CAPTIONS / out.caption).is_file(), (job.key, out.caption)
            assert not out.patterns or out.caption is not None, (job.key, out.name)


def test_job_names_are_unique_and_table1_has_its_own() -> None:
    commands = [job.command for job in REPORT_JOBS.values()]
    assert len(commands) == len(set(commands))
    assert "table1" not in REPORT_JOBS and REPORTS["table1"].builder is None
    assert REPORTS["router_swap_table"].command == "router-swap-table"


def test_table_outputs_put_the_csv_first_and_the_run_figures_last() -> None:
    extra = Output("pairs", "t_pairs.csv", registry.DATA, "Data")
    outputs = table_outputs("t", extra)
    assert [o.name for o in outputs] == ["csv", "md", "html", "pairs", "heatmaps", "heatmaps_runs"]
    assert outputs[-1].patterns == registry.RUN_FIGURES
    assert outputs[-1].path == "figures/t_coactivation_runs"
    assert [o.name for o in table_outputs("t", heatmaps=False)] == ["csv", "md", "html"]


def test_a_new_planned_table_is_its_entry_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """With one registry entry, the CLI has its job and the plan its inputs and spec (a table of
    the plain shape: model, corpus, methods)."""
    import copy

    import yaml
    from snakemake.utils import update_config

    from rpb.pipeline.config_check import check_config
    from rpb.pipeline.plan import PipelineConfig, Plan

    job = ReportJob(
        "mytable",
        "rpb.report.tables:build_table2",
        "my table",
        "My table",
        table_outputs("mytable", heatmaps=False),
        planned=True,
    )
    monkeypatch.setitem(REPORTS, "mytable", job)
    monkeypatch.setitem(REPORT_JOBS, "mytable", job)
    args = build_parser().parse_args(
        ["pipeline", "mytable", "--results", "r", "--spec", "{}", "--out", "o.csv"]
    )
    assert args.report == "mytable"
    config: dict = {}
    update_config(config, yaml.safe_load((ROOT / "config" / "config.yaml").read_text()))
    config["tables"]["mytable"] = {"model": "tinyA", "corpus": "math", "methods": ["none", "rpb"]}
    check_config(config, ROOT / "workflow" / "schemas" / "config.schema.yaml")
    plan = Plan(PipelineConfig.parse(copy.deepcopy(config)))
    assert "results/eval/tinyA/math/rpb/base1/seed2.json" in plan.table_inputs("mytable")
    assert plan.table_spec("mytable")["methods"] == ["none", "rpb"]
