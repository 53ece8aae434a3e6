"""The report registry (rpb.report.registry): every entry can be built and shown as declared. The
entries read out of the modules' source are the ones importing them gives, from the same modules;
a module declaring a name the registry does not lend, or a key another module declares, or a
shape outside the vocabulary, is refused with its file and line. Its builder imports and takes
(results, spec, out_csv); a planned entry's rule gets its CSV first (the job's `--out` and its
results folder) and each shown output names a caption that exists; job names are unique on the
command line; every table a shipped config names is planned, and every shape plans from its
config entry (the config check accepts it, the planner reads what the shape says); and a new
table of any shape is one module (the config check, the CLI and the plan accept it, and its job
runs)."""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import re
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from rpb.pipeline.cli import build_parser
from rpb.report import registry
from rpb.report.registry import (
    REPORT_JOBS,
    REPORTS,
    SPEC_EXTRAS,
    Output,
    RegistryError,
    Shape,
    declared_reports,
    table_outputs,
)
from rpb.specs import PATHS, Run

ROOT = Path(__file__).resolve().parents[1]
CAPTIONS = ROOT / "workflow" / "report"
SCHEMA = ROOT / "workflow" / "schemas" / "config.schema.yaml"
PLANNED = sorted(key for key, job in REPORTS.items() if job.planned)


def _shipped(*names: str) -> dict[str, Any]:
    """The shipped configs merged as Snakemake merges --configfile (unchecked)."""
    from snakemake.utils import update_config

    config: dict[str, Any] = {}
    for name in names:
        update_config(config, yaml.safe_load((ROOT / "config" / name).read_text()))
    return config


SHIPPED = {
    "default": _shipped("config.yaml"),
    "smoke": _shipped("config.yaml", "smoke.yaml"),
    "paper": _shipped("config.yaml", "paper.yaml"),
}


@pytest.mark.parametrize("key", sorted(REPORT_JOBS))
def test_every_builder_imports_and_takes_results_spec_and_out(key: str) -> None:
    job = REPORT_JOBS[key]
    build = getattr(importlib.import_module(job.module), job.builder)
    assert list(inspect.signature(build).parameters)[:3] == ["results", "spec", "out_csv"]


def test_the_entries_read_from_source_are_the_imported_ones() -> None:
    """The registry evaluates each module's REPORT_ENTRIES without importing it; importing every
    module of the report wing evaluates the same expressions, and must find them in the same
    modules (none built otherwise, say in a function or a loop, that the source reading misses)
    and give the same jobs in the same order."""
    modules = dict.fromkeys(job.module for job in REPORTS.values())
    wing = [f"rpb.report.{path.stem}" for path in sorted((ROOT / "rpb" / "report").glob("*.py"))]
    declaring = [m for m in wing if hasattr(importlib.import_module(m), "REPORT_ENTRIES")]
    assert list(modules) == declaring and "rpb.report.table1" in declaring
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


def test_an_entry_with_a_shape_outside_the_vocabulary_is_refused(tmp_path: Path) -> None:
    for shape, problem in (
        ('Shape(base="every model")', "Shape.base: 'every model' is not one of"),
        ('Shape(reads=("evals",))', "Shape.reads: 'evals' is not one of eval, analysis"),
        ('Shape(spec=("family", "colour"))', "Shape.spec: 'colour' is not one of family"),
        ('Shape(("methods", "corpus"))', "Shape.labels: 'corpus' is neither a key of its entry"),
        ('Shape(("claims.margin",))', "Shape.labels: 'claims.margin' is neither"),
        ('Shape(("lower",), spec=("kinds",))', "Shape: spec 'kinds' and lists_claims read"),
        ('Shape(models=True, spec=("family",))', "Shape.spec: a table of several models has"),
    ):
        _module(tmp_path, "a", f'REPORT_ENTRIES = (ReportJob("t", "b", "t", shape={shape}),)\n')
        message = f"a.py:1: REPORT_ENTRIES cannot be read: {problem}"
        with pytest.raises(RegistryError, match=re.escape(message)):
            declared_reports(tmp_path, "pkg")


def test_the_shape_vocabulary_is_the_planners() -> None:
    """Each run output a shape may read is a kind of rpb.specs.PATHS of one run, and each spec
    extra is one the planner adds (checked on every planned table below)."""
    from rpb.report import registry as reg

    for kind in reg.RUN_KINDS:
        assert {"{model}", "{corpus}", "{method}", "{seed}"} <= set(
            re.findall(r"\{\w+\}", PATHS[kind])
        ), kind
    assert set(SPEC_EXTRAS) == {"family", "families", "claims", "kinds", "trunk_frozen"}


def test_entries_declare_what_their_rule_needs() -> None:
    shown = [job for job in REPORTS.values() if job.outputs]
    # Every table a shipped config names is a planned entry (tables.smk makes its rule).
    for name, config in SHIPPED.items():
        named = set(config.get("tables") or {}) - {"seeds"}
        assert named and named <= set(PLANNED), (name, named - set(PLANNED))
    # The entries with rules of their own in tables.smk take their outputs from here.
    own = set(re.findall(r'REPORTS\["(\w+)"\]', (ROOT / "workflow/rules/tables.smk").read_text()))
    assert own and own <= {job.key for job in shown if not job.planned}
    for job in REPORTS.values():
        assert not job.planned or job.outputs, job.key
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


def _entry(shape: Shape) -> dict[str, Any]:
    """A config entry of `shape` on the default config's models, corpora and methods."""
    entry: dict[str, Any] = {"models": ["tinyA", "tinyB"]} if shape.models else {"model": "tinyA"}
    entry |= {"corpora": ["math", "math2"]} if shape.corpora else {"corpus": "math"}
    return entry | {key: ["none", "rpb"] for key in shape.entry_keys}


# Shapes no shipped table has, covering the rest of the vocabulary: every spec extra, base runs
# on each corpus or the first, each run output, labels of a new key and of the claims.
NEW_SHAPES = {
    "new_family_kinds": Shape(base="every corpus", spec=("family", "kinds")),
    "new_grid": Shape(
        ("methods", "claims.reference"),
        models=True,
        corpora=True,
        base="first corpus",
        reads=("eval", "analysis", "analysis_counts"),
        spec=("families", "claims"),
    ),
    "new_history": Shape(("controls",), corpora=True, reads=("train_history",), exploratory=True),
}


@pytest.mark.parametrize("key", PLANNED + list(NEW_SHAPES))
def test_every_shape_plans_from_its_config_entry(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A planned table's entry (the default config's, else one made from its shape) passes the
    config check, and the planner reads what its shape says: each label its entry's label keys
    and the claims roles name, on each of its models and corpora, each run output it `reads`, the
    bases' own runs where `base` says, and a spec of its entry, seeds and `spec` extras."""
    from rpb.pipeline.config_check import check_config
    from rpb.pipeline.plan import Plan, plain
    from rpb.specs import results_path

    config = copy.deepcopy(SHIPPED["default"])
    if key in NEW_SHAPES:
        job = REPORTS["table2"]
        monkeypatch.setitem(REPORTS, key, replace(job, key=key, shape=NEW_SHAPES[key]))
    shape = REPORTS[key].shape
    config["tables"].setdefault(key, _entry(shape))  # a table no shipped config names
    plan = Plan(check_config(config, SCHEMA))
    t, claims = plan.config.tables[key], config["claims"]
    labels = plan.table_labels(key)
    for field in shape.entry_keys:
        value = t.entry[field]
        assert set([value] if isinstance(value, str) else value) <= set(labels), field
    assert {claims[role] for role in shape.claims_roles if f"claims.{role}" in shape.labels} <= set(
        labels
    )
    seeds = plan.table_seeds(key)
    base_corpora = {None: (), "every corpus": t.corpora, "first corpus": t.corpora[:1]}[shape.base]

    def paths(model: str, corpus: str, label: str, runs: list[Run]) -> set[str]:
        fields = {"model": model, "corpus": corpus, "method": label}
        return {
            f"{plan.results}/{results_path(kind, **fields, run=run)}"
            for run in runs
            for kind in shape.reads
        }

    expected: set[str] = set()
    for model in t.models:
        for corpus in t.corpora:
            for label in labels:
                expected |= paths(model, corpus, label, plan.runs(model, seeds))
            if corpus in base_corpora:
                expected |= paths(model, corpus, "base", plan.base_runs(model))
    inputs = plan.table_inputs(key)
    assert len(inputs) == len(set(inputs)) and set(inputs) == expected
    spec = json.loads(json.dumps(plan.table_spec(key)))
    assert {k: v for k, v in plain(t.entry).items() if k != "seeds"}.items() <= spec.items()
    assert spec["runs"] == [run.name for run in plan.runs(t.models[0], seeds)]
    for extra in shape.spec:  # the keys each extra adds, as SPEC_EXTRAS names them
        added = re.findall(r"`(\w+)`", SPEC_EXTRAS[extra].split(":")[0])
        assert added and all(spec.get(k) for k in added), (extra, added)


MY_TABLE = """\
    \"\"\"My table: each method's runs on each model and corpus, beside the bases'.\"\"\"

    from rpb.report.registry import ReportJob, Shape, table_outputs

    REPORT_ENTRIES = (
        ReportJob(
            "mytable",
            "build_mytable",
            "my table",
            "My table",
            table_outputs("mytable", heatmaps=False),
            shape=Shape(models=True, corpora=True, base="every corpus", spec=("families",)),
        ),
    )


    def build_mytable(results, spec, out_csv):
        rows = [("model", "family", "method")]
        rows += [(m, spec["families"][m], x) for m in spec["models"] for x in spec["methods"]]
        out_csv.write_text("".join(",".join(row) + "\\n" for row in rows))
    """


def test_a_new_table_is_one_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module declaring a planned entry is all a table needs, of a shape no other table has
    (several models and corpora, the bases' runs, each model's family): the registry reads it,
    the config check accepts its config entry (a schema from its shape) and refuses a key its
    shape lacks, the CLI has its job and finds its builder, and the plan gives its inputs and
    spec."""
    from rpb.pipeline.cli import cmd_report
    from rpb.pipeline.config_check import ConfigError, check_config
    from rpb.pipeline.plan import Plan

    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    _module(package, "mytable", MY_TABLE)
    monkeypatch.syspath_prepend(str(tmp_path))
    (job,) = declared_reports(package, "mypkg").values()
    assert (job.key, job.module, job.builder, job.planned, job.shape.base) == (
        "mytable",
        "mypkg.mytable",
        "build_mytable",
        True,
        "every corpus",
    )
    monkeypatch.setitem(REPORTS, "mytable", job)
    monkeypatch.setitem(REPORT_JOBS, "mytable", job)
    args = build_parser().parse_args(
        ["pipeline", "mytable", "--results", "r", "--spec", "{}", "--out", "o.csv"]
    )
    assert (args.report, args.func) == ("mytable", cmd_report)
    config = copy.deepcopy(SHIPPED["default"])
    config["tables"]["mytable"] = {
        "models": ["tinyA", "tinyB"],
        "corpora": ["math", "math2"],
        "methods": ["none", "rpb"],
        "correlate": ["lbl"],
    }
    with pytest.raises(ConfigError, match=r"^tables\.mytable\.correlate: unknown key"):
        check_config(copy.deepcopy(config), SCHEMA)
    del config["tables"]["mytable"]["correlate"]
    plan = Plan(check_config(config, SCHEMA))
    inputs = plan.table_inputs("mytable")
    assert "results/eval/tinyB/math2/rpb/base1/seed1.json" in inputs
    assert "results/analysis/tinyA/math2/base/base1/seed0.json" in inputs
    spec = json.loads(json.dumps(plan.table_spec("mytable")))
    assert spec["methods"] == ["none", "rpb"] and spec["corpora"] == ["math", "math2"]
    build = getattr(importlib.import_module(job.module), job.builder)
    build(tmp_path, spec, tmp_path / "mytable.csv")
    assert (tmp_path / "mytable.csv").read_text().splitlines() == [
        "model,family,method",
        "tinyA,A,none",
        "tinyA,A,rpb",
        "tinyB,B,none",
        "tinyB,B,rpb",
    ]
