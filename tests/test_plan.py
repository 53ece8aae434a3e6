"""The planner (rpb.pipeline.plan), called directly on the shipped configs after the config check:
the typed config it parses (frozen, each method's options a dataclass of its family's spec), the
runs and paths of replicate bases, and the inputs and specs of the jobs whose planning has cases
(table 4's first corpus, the claims' extra inputs, the permuted-prior control, a model's own
hold-out). tests/test_plan_snapshot.py checks the whole plan through Snakemake against the
committed job lists."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from rpb.method_config import MethodConfig, options_class
from rpb.pipeline.config_check import check_config
from rpb.pipeline.plan import Execution, MethodEntry, PipelineConfig, Plan, plain
from rpb.specs import Run

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "workflow" / "schemas" / "config.schema.yaml"


def _checked(*names: str, **overrides: Any) -> dict[str, Any]:
    """The shipped configs merged as Snakemake merges --configfile, then checked and expanded."""
    from snakemake.utils import update_config

    config: dict[str, Any] = {}
    for name in names:
        update_config(config, yaml.safe_load((ROOT / "config" / name).read_text()))
    update_config(config, overrides)
    check_config(config, SCHEMA)
    return config


@pytest.fixture(scope="module")
def default_config() -> dict[str, Any]:
    return _checked("config.yaml", results_dir="R")


@pytest.fixture(scope="module")
def plan(default_config: dict[str, Any]) -> Plan:
    return Plan(PipelineConfig.parse(copy.deepcopy(default_config)))


def test_the_parsed_config_is_frozen_and_typed(plan: Plan) -> None:
    config = plan.config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seeds = (9,)  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.tables["table2"].entry["methods"] = ["x"]  # type: ignore[index]
    with pytest.raises(TypeError):
        config.tables["table9"] = config.tables["table2"]  # type: ignore[index]
    assert config.seeds == tuple(range(14))
    # Every section is typed: a table's runs, the claims' pair, the sweep's curves, diagnostics.
    table3 = config.tables["table3"]
    assert (table3.models, table3.corpus, table3.corpora) == (
        ("tinyA", "tinyB"),
        "math2",
        ("math2",),
    )
    assert config.tables["readings"].lower == "none" and "seeds" not in config.tables
    assert (config.claims.method, config.claims.reference) == ("rpb", "lbl")
    assert config.sweep.curves[0].labels[0] == "none"
    assert config.diagnostics.router_swap.parts == ("routers", "routed_experts", "trunk")
    # The damped-trunk arm: the MoE preset, the rest of the model at a tenth of the rate.
    assert (config.diagnostics.regime.trainable, config.diagnostics.regime.trunk_lr_scale) == (
        "moe",
        0.1,
    )
    assert config.models["tinyA_base1"].replicate_of == "tinyA"  # added by the config check
    assert config.evaluation.tasks == [*config.evaluation.in_domain, *config.evaluation.ood]


def test_how_jobs_run_is_parsed_with_the_schemas_defaults(plan: Plan) -> None:
    """The execution keys (threads, launcher, one process per run, job server, tracking), read
    once for common.smk, with the schema's defaults where a config leaves them out."""
    assert plan.config.execution == Execution(
        threads_per_job=1,
        cpu_numerics="native",
        train_launcher="rpb",
        one_process_per_run=True,
        job_server=True,
        tracking_uri=None,
        experiment="rpb",
    )
    paper = PipelineConfig.parse(
        _checked(
            "config.yaml",
            "paper.yaml",
            threads_per_job=4,
            tracking={"uri": "http://mlflow:5000", "experiment": "moe"},
        )
    ).execution
    assert paper.threads_per_job == 4 and not paper.one_process_per_run
    assert paper.cpu_numerics == "free"  # GPUs: no CPU pinning
    # The paper launcher runs accelerate launch on each node of the job (one srun task a node).
    assert paper.train_launcher == "bash workflow/scripts/accelerate_launch.sh"
    assert (paper.tracking_uri, paper.experiment) == ("http://mlflow:5000", "moe")


def test_each_method_is_its_value_and_jobs_get_its_options_off_the_default(plan: Plan) -> None:
    entry = plan.config.methods["rpb_logits"]
    rpb = entry.method
    assert type(rpb) is MethodConfig and (entry.label, entry.prior) == ("rpb_logits", None)
    assert rpb.kind == "rpb" and rpb.strength == 1.0
    assert type(rpb.options) is options_class("rpb")
    assert (rpb.options.bias_on, rpb.options.keep_bias_at_eval) == ("logits", False)
    # The job's --method: options off their default only, so a new option reruns nothing; the
    # strength written out, the family's default when the entry sets none (below).
    assert plan.method_entry("rpb_logits") == {
        "kind": "rpb",
        "strength": 1.0,
        "options": {"bias_on": "logits", "keep_bias_at_eval": False},
    }
    # Table 1's rpb is the family's default (it keeps its bias at evaluation): no option to spell.
    assert plan.method_entry("rpb") == {"kind": "rpb", "strength": 1.0, "options": {}}
    assert plan.method_entry("none") == {"kind": "none", "strength": None, "options": {}}
    assert plan.config.methods["rpb_permuted"].prior == "permuted"
    assert dataclasses.fields(options_class("none")) == ()
    with pytest.raises(ValueError, match=r"^methods\.x\.options\.bias_in: unknown option of 'rpb'"):
        MethodEntry.parse("x", {"kind": "rpb", "options": {"bias_in": "logits"}})
    interp = MethodEntry.parse("rpb_interp", {}).method
    assert interp.strength == 0.5 and type(interp.strength) is float


def test_runs_span_every_base_and_name_their_base(plan: Plan) -> None:
    assert plan.bases("tinyA") == ["tinyA", "tinyA_base1"]
    assert plan.runs("tinyA", [0, 2]) == [Run(0, 0), Run(0, 2), Run(1, 0), Run(1, 2)]
    assert plan.base_runs("tinyA") == [Run(0, 0), Run(1, 0)]
    assert plan.run_base("tinyA", Run(1, 2)) == "tinyA_base1"
    assert plan.run("1", "2") == Run(1, 2)  # the rules' {base} and {seed}
    assert plan.base_model("tinyA", "1") == "tinyA_base1"
    assert plan.evaluated_model("tinyA", "math", "base", Run(1, 0)) == "R/models/tinyA/base1/model"
    with pytest.raises(ValueError, match="needs base 2, but tinyA has 2"):
        plan.base_model_dir("tinyA", Run(2, 0))
    assert (
        plan.evaluated_model("tinyA", "math", "rpb", Run(1, 2))
        == "R/runs/tinyA/math/rpb/base1/seed2/model"
    )


def test_job_specs_name_a_run_by_its_base_and_seed(plan: Plan) -> None:
    """No job's spec packs a run into one number: a training job's carries its base and seed
    (TrainSpec derives the torch seed, the one the run always had), a report job's names its
    runs `base<b>/seed<s>`."""
    import json

    from rpb.pipeline.training import TrainSpec

    for spec in (plan.posttrain_spec("tinyA", Run(1, 0)), plan.diagnostic_spec(Run(1, 0))):
        assert (spec["base"], spec["seed"]) == (1, 0)
        assert "1000" not in json.dumps(spec)
        assert TrainSpec.from_dict(spec).torch_seed == 1000
    reports = {name: plan.table_spec(name) for name in plan.config.tables}
    reports |= {"table1": plan.table1_spec(), "claims": plan.claims_spec()}
    reports |= {"sweep": plan.sweep_spec(), "router_swap": plan.router_swap_spec()}
    reports |= {"diagnostic_table1": plan.diagnostic_table1_spec()}

    def runs_in(node: Any) -> list[str]:
        """Every run a (nested) spec names."""
        if not isinstance(node, dict):
            return []
        assert "seeds" not in node  # seeds per base are spelled out as runs
        found = list(node.get("runs", []))
        for value in node.values():
            found += runs_in(value)
        return found

    for name, spec in reports.items():
        runs = runs_in(spec)
        assert runs and all(Run.parse(run).name == run for run in runs), name
    assert reports["table2"]["runs"][:3] == ["base0/seed0", "base0/seed1", "base1/seed0"]
    assert plan.table1_spec()["runs"][-1] == "base1/seed13"


def test_a_base_trains_at_its_own_rate_where_lr_by_base_names_it() -> None:
    config = _checked(
        "config.yaml",
        results_dir="R",
        posttrain={"lr": 3e-4, "lr_by_base": {"tinyA": {"base1": 6e-4}}},
    )
    plan = Plan(PipelineConfig.parse(config))
    rates = {run: plan.posttrain_spec("tinyA", run)["lr"] for run in plan.runs("tinyA", [0, 2])}
    assert list(rates.values()) == [3e-4, 3e-4, 6e-4, 6e-4]  # base 0's two seeds, then base 1's
    assert plan.posttrain_spec("tinyB", Run(1, 2))["lr"] == 3e-4  # another model's base1
    spec = plan.posttrain_spec("tinyA", Run(1, 2))
    assert "lr_by_base" not in spec  # what TrainSpec.from_dict takes
    assert (spec["base"], spec["seed"]) == (1, 2)


def test_the_permuted_control_trains_with_its_own_bases_permuted_prior(plan: Plan) -> None:
    assert plan.permuted_prior_labels == ["rpb_permuted"]
    assert plan.method_prior("tinyA", "math", "rpb_permuted", Run(1, 1)) == (
        "R/priors/tinyA/base1/permuted/math.safetensors"
    )
    assert (
        plan.method_prior("tinyA", "math", "rpb", Run(1, 1))
        == "R/priors/tinyA/base1/math.safetensors"
    )


def test_table4_reads_the_base_on_its_first_corpus_only(plan: Plan) -> None:
    paths = plan.table_inputs("table4")
    assert "R/eval/tinyA/math/base/base1/seed0.json" in paths
    assert not any("/math2/base/" in p for p in paths)
    methods = plan.config.tables["table4"].methods
    runs = 2 * len(methods) * 2 * 2 + 2  # corpora x methods x bases x seeds, + each base once
    assert len(paths) == 2 * runs  # an eval and an analysis output each


def test_exploratory_tables_take_their_own_seeds() -> None:
    config = _checked("config.yaml", tables={"seeds": [0, 1], "drift": {"seeds": [0]}})
    plan = Plan(PipelineConfig.parse(config))
    assert plan.table_seeds("drift") == [0]  # exploratory: its own
    assert plan.table_seeds("table2") == [0, 1]  # confirmatory: tables.seeds
    spec = plan.table_spec("drift")
    assert spec["runs"] == ["base0/seed0", "base1/seed0"] and "seeds" not in spec


def test_check_m2_reads_the_confirmatory_seeds_where_the_readings_run_fewer() -> None:
    config = _checked(
        "config.yaml", results_dir="R", tables={"seeds": [0, 1], "readings": {"seeds": [0]}}
    )
    plan = Plan(PipelineConfig.parse(config))
    assert plan.table_spec("readings")["runs"] == ["base0/seed0", "base1/seed0"]
    confirmatory = ["base0/seed0", "base0/seed1", "base1/seed0", "base1/seed1"]
    assert plan.claims_spec()["readings"]["runs"] == confirmatory
    m2 = plan.readings_check_runs()
    for label in ("none", "rpb", "hard"):  # the rule's lower end, claims.method, its upper end
        assert f"R/analysis/tinyA/math/{label}/base1/seed1.json" in m2
    # Table 1 builds M2's runs, so its verdicts do not depend on how many the readings run.
    assert "R/analysis/tinyA/math/hard/base1/seed1.json" in plan.table1_inputs()
    assert not any("rpb_keep/base0/seed1" in p for p in plan.claims_runs())


def test_table_specs_carry_what_each_table_needs(plan: Plan) -> None:
    t3 = plan.table_spec("table3")
    assert (t3["method"], t3["reference"]) == ("rpb", "lbl")
    assert t3["families"] == {"tinyA": "A", "tinyB": "B"}
    assert plan.table_spec("table5")["kinds"]["hard"] == "hard"
    assert plan.table_spec("table2")["bases"]["tinyB"] == ["tinyB", "tinyB_base1"]
    sweep = plan.sweep_spec()
    assert sweep["methods"]["rpb_l4"] == {
        "kind": "rpb",
        "strength": 4.0,
        "options": {"keep_bias_at_eval": False},
    }


def test_the_claims_read_the_tables_runs_controls_and_testbed_once(plan: Plan) -> None:
    runs = plan.claims_runs()
    assert runs == sorted(set(runs))
    assert "R/testbed.json" in runs
    assert "R/eval/tinyA/math/placebo/base1/seed1.json" in runs  # control P1
    assert "R/analysis/tinyA/math/hard/base0/seed0.json" in runs  # readings' upper bound (M2)
    paper = Plan(PipelineConfig.parse(_checked("config.yaml", "paper.yaml")))
    assert not any(p.endswith("testbed.json") for p in paper.claims_runs())
    assert paper.diagnostic_targets() == []


def test_a_models_own_holdout_reads_its_own_corpus(default_config: dict[str, Any]) -> None:
    config = copy.deepcopy(default_config)
    config["models"]["tinyB"]["holdout"] = "below50"
    plan = Plan(PipelineConfig.parse(config))
    assert plan.post_corpus("tinyA", "math") == "R/data/post/math.jsonl"
    assert plan.post_corpus("tinyB", "math") == "R/data/holdout/below50/post/math.jsonl"


def test_specs_are_plain_json_values(plan: Plan) -> None:
    import json

    spec = plan.claims_spec()
    assert json.loads(json.dumps(spec)) == spec  # no read-only mapping or tuple left in it
    assert plain(plan.config.tables["table2"].entry) == {
        "model": "tinyB",
        "corpus": "math",
        "methods": ["none", "lbl", "rpb"],
    }


def test_the_damped_trunk_arm_trains_only_the_diagnostic_jobs_trunk(plan: Plan) -> None:
    """The diagnostic regime's runs train the trunk at a tenth of the rate; table 1's keep it
    frozen; the diagnostic table's title says which regime it is."""
    run = plan.runs("tinyA", [0])[0]
    assert plan.diagnostic_spec(run)["trunk_lr_scale"] == 0.1
    assert plan.diagnostic_spec(run)["trainable"] == "moe"
    assert plan.posttrain_spec("tinyA", run).get("trunk_lr_scale", 0.0) == 0.0
    assert "trunk_lr_scale: 0.1" in plan.diagnostic_table1_spec()["title"]
    # The table reads every run its inputs train: 2 seeds on each of tinyA's 2 bases.
    read = plan.diagnostic_table1_spec()["runs"]
    assert read == ["base0/seed0", "base0/seed1", "base1/seed0", "base1/seed1"]
    trained = {
        p.split("/")[-2] + "/" + p.split("/")[-1].removesuffix(".json")
        for p in plan.diagnostic_table1_inputs()
        if "/eval/" in p and "/none/" in p
    }
    assert trained == set(read)
    # Table 5 states hard's handicap where the trunk is frozen (the default's posttrain).
    assert plan.table_spec("table5")["trunk_frozen"] is True


def test_the_sweep_trains_the_bases_it_names(default_config: dict[str, Any]) -> None:
    """`sweep.bases: 1` (the default's budget trim) keeps the sweep on base 0; without it the
    sweep pools every base; its spec reads exactly the runs its inputs list."""
    trimmed = Plan(PipelineConfig.parse(copy.deepcopy(default_config)))
    assert trimmed.sweep_runs() == [Run(0, 0)]
    assert trimmed.sweep_spec()["runs"] == ["base0/seed0"]
    assert not [p for p in trimmed.sweep_inputs() if "/base1/" in p]
    config = copy.deepcopy(default_config)
    del config["sweep"]["bases"]
    every = Plan(PipelineConfig.parse(config))
    assert every.sweep_runs() == [Run(0, 0), Run(1, 0)]
    assert {p.split("/")[-2] for p in every.sweep_inputs()} == {"base0", "base1"}


def test_checkpoint_settings_reach_the_training_job_outside_its_params(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 59, item 5: `posttrain.save_every` is in no job's spec (params, the rerun trigger)
    but in the environment the workflow gives its jobs, from which a post-training job, and only
    it, adds it to its TrainSpec and MLflow params (`--spec` naming it wins)."""
    import argparse

    from rpb.pipeline.cli import _train_spec
    from rpb.pipeline.plan import CHECKPOINTS_ENV

    raw = _checked("config.yaml", "smoke.yaml", posttrain={"save_every": 5})
    plan = Plan(PipelineConfig.parse(raw))
    assert "save_every" not in plan.posttrain_spec("tinyA", Run(1, 0))
    assert plan.checkpoint_settings == {"save_every": 5}

    monkeypatch.setenv(CHECKPOINTS_ENV, json.dumps(plan.checkpoint_settings))
    spec = plan.posttrain_spec("tinyA", Run(1, 0))
    args = argparse.Namespace(spec=dict(spec), threads=None)
    assert _train_spec(args, checkpoints=True).save_every == 5
    assert args.spec == spec | {"save_every": 5}  # what the MLflow run records
    assert _train_spec(argparse.Namespace(spec=dict(spec), threads=None)).save_every == 0
    given = argparse.Namespace(spec=spec | {"save_every": 2}, threads=None)
    assert _train_spec(given, checkpoints=True).save_every == 2
