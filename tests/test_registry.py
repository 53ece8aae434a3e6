"""The report registry (rpb.report.registry): every entry can be built and shown as declared. The
entries read out of the modules' source are the ones importing them gives; a module declaring a
name the registry does not lend, or a key another module declares, is refused with its file and
line. Its builder imports and takes (results, spec, out_csv); a planned entry's rule gets its CSV
first (the job's `--out` and its results folder) and each shown output names a caption that
exists; job names are unique on the command line; the workflow makes one rule per planned entry,
and a new table is one module (the config check, the CLI and the plan accept it, and its job
runs)."""

from __future__ import annotations

import importlib
import inspect
import json
import re
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from rpb.pipeline.cli import build_parser
from rpb.report import registry
from rpb.report.registry import (
    REPORT_JOBS,
    REPORTS,
    Output,
    RegistryError,
    declared_reports,
    table_outputs,
)

ROOT = Path(__file__).resolve().parents[1]
CAPTIONS = ROOT / "workflow" / "report"


@pytest.mark.parametrize("key", sorted(REPORT_JOBS))
def test_every_builder_imports_and_takes_results_spec_and_out(key: str) -> None:
    job = REPORT_JOBS[key]
    build = getattr(importlib.import_module(job.module), job.builder)
    assert list(inspect.signature(build).parameters)[:3] == ["results", "spec", "out_csv"]


def test_the_entries_read_from_source_are_the_imported_ones() -> None:
    """The registry evaluates each module's REPORT_ENTRIES without importing it; importing the
    module evaluates the same expression, and both must give the same jobs in the same order."""
    modules = dict.fromkeys(job.module for job in REPORTS.values())
    assert set(modules) == {
        "rpb.report.claims",
        "rpb.report.exploratory",
        "rpb.report.router_swap_table",
        "rpb.report.tables",
    }
    imported = [
        replace(job, module=name)
        for name in modules
        for job in importlib.import_module(name).REPORT_ENTRIES
    ]
    assert imported == list(REPORTS.values())


def _module(folder: Path, name: str, source: str) -> Path:
    path = folder / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return path


def test_an_entry_naming_what_the_registry_does_not_lend_is_refused_with_its_line(
    tmp_path: Path,
) -> None:
    _module(
        tmp_path,
        "bad",
        """\
        from rpb.report.registry import ReportJob

        HELP = "my table"
        REPORT_ENTRIES = (
            ReportJob("mytable", "build", HELP),
        )
        """,
    )
    with pytest.raises(RegistryError) as err:
        declared_reports(tmp_path, "pkg")
    assert str(err.value).startswith(f"{tmp_path / 'bad.py'}:5: REPORT_ENTRIES names 'HELP'")


def test_an_entry_reaching_through_an_attribute_is_refused(tmp_path: Path) -> None:
    _module(tmp_path, "a", 'REPORT_ENTRIES = (ReportJob("t", "".__class__.__name__, "t"),)\n')
    message = "a.py:1: REPORT_ENTRIES names '''.__class__.__name__'; an entry may use only"
    with pytest.raises(RegistryError, match=re.escape(message)):
        declared_reports(tmp_path, "pkg")


def test_an_entry_with_a_wrong_argument_or_a_taken_key_is_refused(tmp_path: Path) -> None:
    _module(tmp_path, "a", 'REPORT_ENTRIES = (ReportJob("t", "build", "t", colour=1),)\n')
    with pytest.raises(RegistryError, match=r"a\.py:1: REPORT_ENTRIES cannot be read: .*colour"):
        declared_reports(tmp_path, "pkg")
    _module(tmp_path, "a", 'REPORT_ENTRIES = (ReportJob("t", "build", "t"),)\n')
    _module(tmp_path, "b", 'REPORT_ENTRIES = (ReportJob("t", "build", "t"),)\n')
    with pytest.raises(RegistryError, match=r"b\.py: report job 't' is also declared by pkg\.a$"):
        declared_reports(tmp_path, "pkg")
    _module(tmp_path, "b", 'REPORT_ENTRIES = [ReportJob("u", "build", "u")]\n')
    with pytest.raises(RegistryError, match=r"b\.py:1: REPORT_ENTRIES must be a tuple"):
        declared_reports(tmp_path, "pkg")


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


MY_TABLE = """\
    \"\"\"My table: the methods a spec names, one row each.\"\"\"

    from rpb.report.registry import ReportJob, table_outputs

    REPORT_ENTRIES = (
        ReportJob(
            "mytable",
            "build_mytable",
            "my table",
            "My table",
            table_outputs("mytable", heatmaps=False),
            planned=True,
        ),
    )


    def build_mytable(results, spec, out_csv):
        out_csv.write_text("method\\n" + "".join(m + "\\n" for m in spec["methods"]))
    """


def test_a_new_table_is_one_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module declaring a planned entry is all a table of the plain shape (model, corpus,
    methods) needs: the registry reads it, the config check accepts its config entry, the CLI
    has its job and finds its builder, and the plan gives its inputs and spec."""
    import copy

    import yaml
    from snakemake.utils import update_config

    from rpb.pipeline.cli import cmd_report
    from rpb.pipeline.config_check import check_config
    from rpb.pipeline.plan import PipelineConfig, Plan

    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    _module(package, "mytable", MY_TABLE)
    monkeypatch.syspath_prepend(str(tmp_path))
    (job,) = declared_reports(package, "mypkg").values()
    assert (job.key, job.module, job.builder, job.planned) == (
        "mytable",
        "mypkg.mytable",
        "build_mytable",
        True,
    )
    monkeypatch.setitem(REPORTS, "mytable", job)
    monkeypatch.setitem(REPORT_JOBS, "mytable", job)
    args = build_parser().parse_args(
        ["pipeline", "mytable", "--results", "r", "--spec", "{}", "--out", "o.csv"]
    )
    assert (args.report, args.func) == ("mytable", cmd_report)
    config: dict = {}
    update_config(config, yaml.safe_load((ROOT / "config" / "config.yaml").read_text()))
    config["tables"]["mytable"] = {"model": "tinyA", "corpus": "math", "methods": ["none", "rpb"]}
    check_config(config, ROOT / "workflow" / "schemas" / "config.schema.yaml")
    plan = Plan(PipelineConfig.parse(copy.deepcopy(config)))
    assert "results/eval/tinyA/math/rpb/base1/seed1.json" in plan.table_inputs("mytable")
    spec = json.loads(json.dumps(plan.table_spec("mytable")))
    assert spec["methods"] == ["none", "rpb"]
    build = getattr(importlib.import_module(job.module), job.builder)
    build(tmp_path, spec, tmp_path / "mytable.csv")
    assert (tmp_path / "mytable.csv").read_text() == "method\nnone\nrpb\n"
