"""Config validation: every bad config is rejected before any job runs, in one line naming its key.

Most cases call `check_config` in-process (fast); three run `snakemake -n` on a bad configfile to
check what a user actually sees: one stderr line, no traceback, a non-zero exit.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from smoke_pipeline import snakemake_in_repo

from rpb.pipeline.config_check import (
    METHOD_FAMILIES,
    ConfigError,
    check_config,
    expand_replicates,
    format_key_path,
)

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "workflow" / "schemas" / "config.schema.yaml"
DELETE = object()


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "config" / name).read_text())


BASE = _load("config.yaml")


def _set(*path: Any, value: Any) -> Callable[[dict], None]:
    """A mutation that sets (or, with DELETE, removes) the key at `path`."""

    def apply(config: dict) -> None:
        node = config
        for key in path[:-1]:
            node = node[key]
        if value is DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value

    where = format_key_path(path)
    apply.__doc__ = f"delete {where}" if value is DELETE else f"{where}: {json.dumps(value)}"
    return apply


HUB_MODEL = {
    "family": "A",
    "source": "hub",
    "model_type": "deepseek_v3",
    "hf_id": "moonshotai/Moonlight-16B-A3B",
}

# id -> (mutation of config/config.yaml, expected message start, expected fragment).
BAD: dict[str, tuple[Callable[[dict], None], str, str]] = {
    "unknown_method": (_set("methods", "foo", value={}), "methods.foo:", "unknown method 'foo'"),
    "misspelled_method": (
        _set("methods", "rbp", value={"strength": 1.0}),
        "methods.rbp:",
        "did you mean 'rpb'",
    ),
    "unknown_kind": (
        _set("methods", "rpb_half", value={"kind": "rpb_half"}),
        "methods.rpb_half.kind:",
        "unknown method 'rpb_half'",
    ),
    "negative_strength": (
        _set("methods", "rpb", "strength", value=-1),
        "methods.rpb.strength:",
        "-1 is not a finite number >= 0",
    ),
    "text_strength": (
        _set("methods", "rpb", "strength", value="high"),
        "methods.rpb.strength:",
        "'high' is not a number",
    ),
    "yaml_exponent_strength": (
        _set("methods", "lbl", "strength", value="1e-3"),
        "methods.lbl.strength:",
        "write 0.001",
    ),
    "nan_strength": (
        _set("methods", "rpb", "strength", value=float("nan")),
        "methods.rpb.strength:",
        "not a finite number",
    ),
    "bool_strength": (
        _set("methods", "rpb", "strength", value=True),
        "methods.rpb.strength:",
        "True is not a finite number >= 0",
    ),
    "family_strength_on_rpb": (
        _set("methods", "rpb", "strength", value="family"),
        "methods.rpb.strength:",
        "is a strength of 'lbl' only; give 'rpb' a number",
    ),
    "text_strength_on_lbl": (
        _set("methods", "lbl", "strength", value="own"),
        "methods.lbl.strength:",
        "'own' is neither a number >= 0 nor 'family'",
    ),
    "strength_on_none": (
        _set("methods", "none", "strength", value=0.5),
        "methods.none.strength:",
        "takes no strength",
    ),
    "strength_above_limit": (
        _set("methods", "rpb_interp", "strength", value=2.0),
        "methods.rpb_interp.strength:",
        "'rpb_interp' takes at most 1.0 (got 2.0)",
    ),
    "unknown_option": (
        _set("methods", "rpb", "options", value={"bias_at": "logits"}),
        "methods.rpb.options.bias_at:",
        "unknown option of 'rpb'",
    ),
    "option_not_bool": (
        _set("methods", "rpb", "options", value={"keep_bias_at_eval": "yes"}),
        "methods.rpb.options.keep_bias_at_eval:",
        "'yes' is not true or false",
    ),
    "bad_option_value": (
        _set("methods", "rpb", "options", value={"bias_on": "gates"}),
        "methods.rpb.options.bias_on:",
        "'gates' is not one of ['selection', 'logits']",
    ),
    "reserved_label": (
        _set("methods", "base", value={"kind": "none"}),
        "methods.base:",
        "reserved",
    ),
    "uppercase_label": (_set("methods", "RPB", value={}), "methods.RPB:", "name must match"),
    "no_methods": (_set("methods", value={}), "methods:", "non-empty"),
    "method_null": (
        _set("methods", "none", value=None),
        "methods.none:",
        "null is not of type 'object' (write {}",
    ),
    "table1_misspelled_model": (
        _set("table1", "model", value="tinya"),
        "table1.model:",
        "did you mean 'tinyA'",
    ),
    "table1_missing_model": (
        _set("table1", "model", value=DELETE),
        "table1.model:",
        "missing required key",
    ),
    "table1_unknown_method": (
        _set("table1", "methods", value=["none", "lbl", "rbp"]),
        "table1.methods:",
        "'rbp' is not a key of methods (did you mean 'rpb'?",
    ),
    "table1_duplicate_method": (
        _set("table1", "methods", value=["none", "rpb", "rpb"]),
        "table1.methods:",
        "'rpb' is listed twice",
    ),
    "table1_corpus_not_evaluated": (
        _set("evaluation", "in_domain", value=["math2"]),
        "table1.corpus:",
        "must be one of evaluation.in_domain",
    ),
    "unknown_corpus": (_set("table1", "corpus", value="gsm8k"), "table1.corpus:", "not one of"),
    "unknown_top_level_key": (_set("sedes", value=[0]), "sedes:", "did you mean 'seeds'"),
    "unknown_nested_key": (
        _set("posttrain", "stepz", value=3),
        "posttrain.stepz:",
        "did you mean 'steps'",
    ),
    "unknown_deep_key": (
        _set("models", "tinyA", "pretrain", "learning_rate", value=0.1),
        "models.tinyA.pretrain.learning_rate:",
        "unknown key",
    ),
    "missing_top_level_section": (
        _set("posttrain", value=DELETE),
        "posttrain:",
        "missing required key",
    ),
    "seed_fraction": (_set("seeds", value=[0, 1.5]), "seeds[1]:", "not of type 'integer'"),
    "seed_float_integral": (_set("seeds", value=[0, 1.0]), "seeds[1]:", "not of type 'integer'"),
    "seed_negative": (_set("seeds", value=[-1, 0]), "seeds[0]:", "less than the minimum of 0"),
    "seed_duplicate": (_set("seeds", value=[0, 1, 0]), "seeds:", "duplicate value 0"),
    "seed_text": (_set("seeds", value="0,1,2"), "seeds:", "not of type 'array'"),
    "seeds_empty": (_set("seeds", value=[]), "seeds:", "non-empty"),
    "ood_empty": (_set("evaluation", "ood", value=[]), "evaluation.ood:", "non-empty"),
    "in_domain_empty": (
        _set("evaluation", "in_domain", value=[]),
        "evaluation.in_domain:",
        "non-empty",
    ),
    "unknown_eval_task": (
        _set("evaluation", "ood", value=["addition", "arc_challenge"]),
        "evaluation.ood[1]:",
        "'arc_challenge' is neither an eval set",
    ),
    "duplicate_eval_task": (
        _set("evaluation", "ood", value=["facts", "sort", "facts"]),
        "evaluation.ood:",
        "'facts' is listed twice",
    ),
    "eval_limit_zero": (_set("evaluation", "limit", value=0), "evaluation.limit:", "minimum of 1"),
    "unknown_probe_task": (
        _set("analysis", "probe_tasks", value=["math", "mmlu"]),
        "analysis.probe_tasks[1]:",
        "is not an eval set",
    ),
    "bad_model_type": (
        _set("models", "tinyB", "model_type", value="qwen3"),
        "models.tinyB.model_type:",
        "'qwen3' is not a family the pipeline pretrains (did you mean 'qwen3_moe'?",
    ),
    "bad_family": (_set("models", "tinyB", "family", value="C"), "models.tinyB.family:", "not one"),
    "hub_without_revision": (
        _set("models", "moonlight", value=HUB_MODEL),
        "models.moonlight.revision:",
        "required when source is 'hub'",
    ),
    "pretrain_without_architecture": (
        _set("models", "tinyA", "architecture", value=DELETE),
        "models.tinyA.architecture:",
        "required when source is 'pretrain'",
    ),
    "model_name_not_a_wildcard": (
        _set("models", "tiny-A", value=copy.deepcopy(BASE["models"]["tinyA"])),
        "models.tiny-A:",
        "letters, digits and _",
    ),
    "trust_remote_code_text": (
        _set("models", "tinyA", "trust_remote_code", value="yes"),
        "models.tinyA.trust_remote_code:",
        "not of type 'boolean'",
    ),
    "section_wrong_type": (_set("tracking", value="mlflow"), "tracking:", "not of type 'object'"),
    "zero_lr": (_set("posttrain", "lr", value=0), "posttrain.lr:", "less than or equal to"),
    "zero_steps": (_set("posttrain", "steps", value=0), "posttrain.steps:", "minimum of 1"),
    "lr_by_base_unknown_model": (
        _set("posttrain", "lr_by_base", value={"tinyC": {"base0": 1e-4}}),
        "posttrain.lr_by_base.tinyC:",
        "not a model of the config; did you mean 'tinyB'?",
    ),
    "lr_by_base_unknown_base": (
        _set("posttrain", "lr_by_base", value={"tinyA": {"base2": 1e-4}}),
        "posttrain.lr_by_base.tinyA.base2:",
        "models.tinyA has bases ['base0', 'base1']",
    ),
    "lr_by_base_zero": (
        _set("posttrain", "lr_by_base", value={"tinyA": {"base1": 0}}),
        "posttrain.lr_by_base.tinyA.base1:",
        "less than or equal to",
    ),
    "max_length_over_positions": (
        _set("posttrain", "max_length", value=200),
        "posttrain.max_length:",
        "exceeds models.tinyA.architecture.max_position_embeddings (128)",
    ),
    "threads_text": (_set("threads_per_job", value="2"), "threads_per_job:", "not of type"),
    "threads_on_a_pinned_path": (
        _set("threads_per_job", value=2),
        "threads_per_job:",
        "cpu_numerics: native, which computes on one thread per job",
    ),
    "old_pinned_spelling": (_set("cpu_numerics", value="pinned"), "cpu_numerics:", "not one of"),
    "unknown_numerics": (_set("cpu_numerics", value="fast"), "cpu_numerics:", "not one of"),
    "unknown_bases": (_set("bases", value="hub"), "bases:", "not one of"),
    "unknown_scale": (_set("scale", value="huge"), "scale:", "not one of"),
    "unknown_preset": (_set("data", "preset", value="large"), "data.preset:", "not one of"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_config_is_one_line_naming_the_key(case: str) -> None:
    mutate, where, fragment = BAD[case]
    config = copy.deepcopy(BASE)
    mutate(config)
    with pytest.raises(ConfigError) as info:
        check_config(config, SCHEMA)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(where + " "), message
    assert fragment in message, message


def test_not_a_mapping_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"^\(top level\): null is not of type 'object'"):
        check_config(None, SCHEMA)  # type: ignore[arg-type]


def test_several_errors_report_the_first_and_count_the_rest() -> None:
    config = copy.deepcopy(BASE)
    config["seeds"] = [-1, 0]
    config["posttrain"]["steps"] = 0
    with pytest.raises(ConfigError, match=r"\(\+1 more\)$"):
        check_config(config, SCHEMA)


def test_missing_schema_names_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.yaml"):
        check_config(copy.deepcopy(BASE), tmp_path / "nope.yaml")


def _merged(*names: str) -> dict[str, Any]:
    """Configfiles merged the way Snakemake merges `--configfile` over the Snakefile's one."""
    from snakemake.utils import update_config

    config: dict[str, Any] = {}
    for name in names:
        update_config(config, _load(name))
    return config


@pytest.mark.parametrize(
    "names",
    [("config.yaml",), ("config.yaml", "smoke.yaml"), ("config.yaml", "readings_rule.yaml")],
)
def test_shipped_configs_pass_and_get_snakemakes_defaults(names: tuple[str, ...]) -> None:
    from snakemake.utils import validate

    ours, theirs = _merged(*names), _merged(*names)
    check_config(ours, SCHEMA)
    validate(theirs, str(SCHEMA))  # what the Snakefile used to call: same defaults, same order
    expand_replicates(theirs)  # and the replicate bases check_config adds
    assert ours == theirs
    assert ours["models"]["tinyA"]["trust_remote_code"] is False
    assert ours["evaluation"]["batch_size"] in (32, 64)


def test_valid_variants_pass() -> None:
    config = copy.deepcopy(BASE)
    config["models"]["moonlight"] = {**HUB_MODEL, "revision": "0" * 40}
    config["methods"]["rpb_logits"] = {
        "kind": "rpb",
        "strength": 0.5,
        "options": {"bias_on": "logits", "keep_bias_at_eval": True},
    }
    config["methods"]["adaptive"] = {"kind": "rpb_adaptive", "options": {"update_rate": 0.01}}
    config["methods"]["hard"] = {"options": {"gate_from": "base"}}
    config["table1"]["methods"] = ["none", "lbl", "rpb", "rpb_logits", "hard"]
    check_config(config, SCHEMA)
    assert config["tracking"]["experiment"] == "rpb"


def _planned_training_command(tmp_path: Path, methods: dict[str, Any], label: str) -> list[str]:
    """The command line (rpb's arguments, after the launcher) of `label`'s training job in
    `snakemake -n -p` of the smoke config with `methods` merged into its methods: what the
    training rule would run, quoting included."""
    import shlex

    extra = tmp_path / "methods.yaml"
    extra.write_text(yaml.safe_dump({"methods": methods}))
    results = tmp_path / "results"
    proc = snakemake_in_repo(
        *("-n", "-p", "--cores", "1", "--configfile", "config/smoke.yaml", str(extra)),
        *("--config", f"results_dir={results}", "--"),
        f"{results}/analysis/tinyA/math/{label}/base0/seed0.json",
    )
    (shell,) = [
        line.removeprefix("Shell command: ")
        for line in proc.stdout.splitlines()
        if line.startswith("Shell command: ") and f" --label {label} " in line
    ]
    words = shlex.split(shell)
    return words[1 : words.index(">")]  # after the launcher (`rpb`), before the log redirection


@pytest.mark.workflow
def test_a_family_strength_reaches_the_lbl_method_unchanged(tmp_path: Path) -> None:
    """`strength: family` (lbl's: the model family's own load-balancing coefficient) passes the
    check as it is, travels unchanged through the training rule's `--method` (the command line a
    dry run plans) into `rpb pipeline train`'s MethodConfig, and the library resolves it when the
    method attaches to the model."""
    from rpb.architectures import random_model
    from rpb.pipeline.cli import build_parser

    methods = {
        "lbl_own": {"kind": "lbl", "strength": "family"},
        "lbl": {"strength": "family", "options": {"pooling": "pooled"}},
    }
    config = copy.deepcopy(BASE)
    config["methods"].update(copy.deepcopy(methods))
    config["table1"]["methods"] = [*config["table1"]["methods"], "lbl_own"]
    check_config(config, SCHEMA)
    assert config["methods"]["lbl_own"] == {"kind": "lbl", "strength": "family"}
    args = build_parser().parse_args(_planned_training_command(tmp_path, methods, "lbl_own"))
    from rpb.method_config import MethodConfig

    assert args.method == MethodConfig("lbl", "family")
    assert args.method.to_dict() == {
        "kind": "lbl",
        "strength": "family",
        "options": {"pooling": "auto"},
    }
    method = args.method.build()
    assert method.family_strength
    model = random_model("qwen3_moe", num_experts=4, router_aux_loss_coef=0.02)
    with method.attach(model):
        assert method.strength == 0.02  # the model's own coefficient, not lbl's default 0.001


def test_posttrain_length_is_checked_against_the_trained_model_only() -> None:
    """Paper-scale configs keep the inert tiny entries: their short position tables must not
    reject a long post-training length meant for the hub model."""
    config = copy.deepcopy(BASE)
    config["models"]["tinyB"]["architecture"]["max_position_embeddings"] = 16
    check_config(config, SCHEMA)  # table 1 trains tinyA (128 positions), max_length 48
    config["table1"]["model"] = "tinyB"
    with pytest.raises(ConfigError, match=r"^posttrain\.max_length: 48 exceeds models\.tinyB"):
        check_config(config, SCHEMA)


def test_format_key_path() -> None:
    assert format_key_path(["methods", "rpb", "strength"]) == "methods.rpb.strength"
    assert format_key_path(["evaluation", "ood", 1]) == "evaluation.ood[1]"
    assert format_key_path([]) == "(top level)"


def test_the_check_knows_the_method_families_of_the_specs() -> None:
    """rpb.specs (read by the config check at every Snakefile parse) is the methods' registry
    (tests/test_specs.py checks it against rpb.methods)."""
    from rpb.specs import METHOD_SPECS

    assert tuple(METHOD_SPECS) == METHOD_FAMILIES


def test_schema_names_the_method_families_of_the_specs() -> None:
    from rpb.specs import METHOD_SPECS

    schema = yaml.safe_load(SCHEMA.read_text())
    kinds = schema["$defs"]["method"]["properties"]["kind"]
    assert kinds.get("enum", list(METHOD_SPECS)) == list(METHOD_SPECS)


def test_probe_tasks_must_be_eval_sets() -> None:
    config = copy.deepcopy(BASE)
    config["analysis"]["probe_tasks"] = ["math", "facs"]
    with pytest.raises(ConfigError, match=r"^analysis\.probe_tasks\[1\]: 'facs' .*'facts'\?"):
        check_config(config, SCHEMA)


def test_eval_set_names_match_the_generator() -> None:
    from rpb.pipeline import data
    from rpb.specs import EVAL_SETS

    assert tuple(data.POST_TASKS) == EVAL_SETS["in_domain"]
    assert tuple(data.PRETRAIN_DOMAINS) == EVAL_SETS["ood"]


# --- what a user sees from snakemake ----------------------------------------------------------

SNAKEMAKE_CASES = {
    "nested_value": (
        "methods:\n  rpb: {strength: -1}\n",
        "config error: methods.rpb.strength: -1 is not a finite number >= 0",
    ),
    "unknown_top_level_key": (
        "sedes: [0, 1]\n",
        "config error: sedes: unknown key (did you mean 'seeds'?)",
    ),
    "cross_key": (
        "table1: {model: tinyC, corpus: math, methods: [none]}\n",
        "config error: table1.model: 'tinyC' is not a key of models",
    ),
}


@pytest.mark.workflow
@pytest.mark.parametrize(
    "case",
    # Each case is a Snakemake process (seconds): the unit tier runs the first; the messages
    # themselves are the in-process check_config tests above.
    [
        pytest.param(case, marks=[pytest.mark.slow] if i else [])
        for i, case in enumerate(SNAKEMAKE_CASES)
    ],
)
def test_snakemake_dry_run_prints_one_line(case: str, tmp_path: Path) -> None:
    text, expected = SNAKEMAKE_CASES[case]
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--configfile", str(bad)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(expected), lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr


# Architecture settings that cannot build or route a model: (model, key, value, message fragment).
BAD_ARCHITECTURE = {
    "top_k_over_experts": ("tinyA", "num_experts_per_tok", 17, "exceeds n_routed_experts (16)"),
    "top_k_over_experts_qwen": ("tinyB", "num_experts_per_tok", 32, "exceeds num_experts (16)"),
    "groups_do_not_split": ("tinyA", "n_group", 3, "do not split into 3 groups"),
    "topk_group_over_groups": ("tinyA", "topk_group", 2, "exceeds n_group (1)"),
    "heads_do_not_divide": ("tinyB", "num_attention_heads", 5, "not divisible"),
    "kv_heads_do_not_divide": ("tinyB", "num_key_value_heads", 3, "not divisible"),
    "no_moe_layer": ("tinyA", "first_k_dense_replace", 4, "leaves no MoE layer"),
    "zero_experts": ("tinyB", "num_experts", 0, "not a positive integer"),
}


@pytest.mark.parametrize("case", list(BAD_ARCHITECTURE))
def test_impossible_architecture_is_one_line_naming_the_key(case: str) -> None:
    model, key, value, fragment = BAD_ARCHITECTURE[case]
    config = copy.deepcopy(BASE)
    config["models"][model]["architecture"][key] = value
    with pytest.raises(ConfigError) as info:
        check_config(config, SCHEMA)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"models.{model}.architecture.{key}: "), message
    assert fragment in message, message


def test_group_limited_top_k_must_fit_the_selected_groups() -> None:
    config = copy.deepcopy(BASE)
    arch = config["models"]["tinyA"]["architecture"]
    arch.update(n_group=4, topk_group=1, num_experts_per_tok=5)  # 1 group of 4 experts < 5
    with pytest.raises(ConfigError, match=r"^models\.tinyA\.architecture\.num_experts_per_tok: "):
        check_config(config, SCHEMA)
    arch.update(num_experts_per_tok=4)
    check_config(config, SCHEMA)


# Report sections (tables, claims, sweep) naming what the config lacks: (override, message start).
BAD_REPORT = {
    "unknown_method": (
        {"tables": {"table2": {"model": "tinyB", "corpus": "math", "methods": ["none", "rbp"]}}},
        "tables.table2.methods: 'rbp' is not a key of methods",
    ),
    "unknown_model": (
        {"tables": {"table5": {"model": "tinyC"}}},
        "tables.table5.model: 'tinyC' is not a key of models",
    ),
    "unknown_sweep_label": (
        {"sweep": {"curves": [{"name": "rpb", "labels": ["none", "rpb_l99"]}]}},
        "sweep.curves[0].labels: 'rpb_l99' is not a key of methods",
    ),
    "unknown_corpus": (
        {"tables": {"table4": {"corpora": ["math", "math3"]}}},
        "tables.table4.corpus: 'math3' is not a known corpus",
    ),
    "reference_not_in_table1": (
        {"claims": {"reference": "anchor_kl"}},
        "table1.methods: lacks claims.reference 'anchor_kl'",
    ),
    "method_not_in_table4": (
        {"tables": {"table4": {"methods": ["anchor_kl", "anchor_logit"]}}},
        "tables.table4.methods: lacks claims.method",
    ),
    "unknown_table": (
        {"tables": {"tabel2": {"model": "tinyB", "corpus": "math", "methods": ["none"]}}},
        "tables.tabel2: unknown table (did you mean 'table2'? a table is a report job",
    ),
    "corpus_task_not_in_domain": (
        {"evaluation": {"corpus_tasks": {"math": ["gsm8k"]}}},
        "evaluation.corpus_tasks.math: 'gsm8k' is not in evaluation.in_domain",
    ),
}


@pytest.mark.parametrize("case", list(BAD_REPORT))
def test_bad_report_config_is_one_line_naming_the_key(case: str) -> None:
    from snakemake.utils import update_config

    override, message = BAD_REPORT[case]
    config = _merged("config.yaml", "smoke.yaml")
    update_config(config, copy.deepcopy(override))
    with pytest.raises(ConfigError) as info:
        check_config(config, SCHEMA)
    assert str(info.value) == message or str(info.value).startswith(message), str(info.value)


def test_a_new_table_needs_only_its_report_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """A table needs no schema entry: its report job's shape (declared by its module, read by
    rpb.report.registry) makes it known and gives the keys its entry takes, and its keys are
    checked like the others'. A report job without a shape is no table."""
    from rpb.report import registry

    config = _merged("config.yaml", "smoke.yaml")
    config["tables"]["tablex_unregistered"] = {
        "model": "tinyA",
        "corpus": "math",
        "methods": ["none", "rbp"],
    }
    with pytest.raises(ConfigError, match=r"^tables\.tablex_unregistered: unknown table"):
        check_config(copy.deepcopy(config), SCHEMA)
    job = registry.ReportJob("tablex_unregistered", "build_table2", "t", module="rpb.report.table1")
    monkeypatch.setitem(registry.REPORTS, "tablex_unregistered", job)
    with pytest.raises(ConfigError, match=r"^tables\.tablex_unregistered: unknown table"):
        check_config(copy.deepcopy(config), SCHEMA)
    monkeypatch.setitem(
        registry.REPORTS, "tablex_unregistered", replace(job, shape=registry.Shape())
    )
    with pytest.raises(
        ConfigError, match=r"^tables\.tablex_unregistered\.methods: 'rbp' is not a key"
    ):
        check_config(copy.deepcopy(config), SCHEMA)
    config["tables"]["tablex_unregistered"]["methods"] = ["none", "rpb"]
    check_config(config, SCHEMA)
    config["tables"]["tablex_unregistered"]["extra"] = 1
    with pytest.raises(ConfigError, match=r"^tables\.tablex_unregistered\.extra: unknown key"):
        check_config(config, SCHEMA)
    # Another shape, other keys: several corpora and a second list of labels, checked as methods.
    shape = registry.Shape(("methods", "controls"), corpora=True, spec=("claims",))
    monkeypatch.setitem(registry.REPORTS, "tablex_unregistered", replace(job, shape=shape))
    entry = {"model": "tinyA", "corpora": ["math"], "methods": ["rpb"], "controls": ["rbp"]}
    config["tables"]["tablex_unregistered"] = entry
    with pytest.raises(
        ConfigError, match=r"^tables\.tablex_unregistered\.controls: 'rbp' is not a key"
    ):
        check_config(copy.deepcopy(config), SCHEMA)
    entry["controls"] = ["none"]
    check_config(copy.deepcopy(config), SCHEMA)
    del config["claims"], config["tables"]["table3"]  # its spec carries the claims' pair
    with pytest.raises(
        ConfigError,
        match=r"^tables\.tablex_unregistered: reads claims\.method and claims\.reference: add",
    ):
        check_config(config, SCHEMA)


def test_the_schema_names_each_table_as_its_shape_does() -> None:
    """A table the schema file names keeps its entry there, which takes at least the keys its
    shape gives (config_check.table_schema); the schema's `$defs/table`, the entry of a table it
    does not name, is the plain shape's."""
    from rpb.pipeline.config_check import _load_schema, table_schema
    from rpb.report.registry import REPORTS, Shape

    schema = _load_schema(SCHEMA)
    plain = {k: v for k, v in schema["$defs"]["table"].items() if k != "description"}
    assert plain == table_schema(Shape())
    named = schema["properties"]["tables"]["properties"]
    for key, job in REPORTS.items():
        if job.shape is None or key not in named:
            continue
        entry = named[key]
        entry = schema["$defs"]["table"] if entry.get("$ref") == "#/$defs/table" else entry
        given = table_schema(job.shape)
        assert set(given["properties"]) <= set(entry["properties"]), key
        defaults = {k for k, v in entry["properties"].items() if "default" in v}
        assert set(given["required"]) <= set(entry.get("required", [])) | defaults, key


def test_claims_without_the_tables_they_read_is_named() -> None:
    config = _merged("config.yaml", "smoke.yaml")
    del config["tables"]["table5"]
    with pytest.raises(ConfigError, match=r"^claims: needs tables\.table5$"):
        check_config(config, SCHEMA)


def test_replicates_become_bases_with_their_pretraining_seed() -> None:
    from rpb.specs import bases_of

    config = copy.deepcopy(BASE)
    config["models"]["tinyA"]["replicates"] = [1, 2]
    config["models"]["tinyB"]["replicates"] = [1, 2]
    check_config(config, SCHEMA)
    check_config(config, SCHEMA)  # idempotent: a config checked twice stays the same
    models = config["models"]
    # Named by base (their order in `replicates`), as their paths are: models/tinyA/base2.
    assert bases_of(models, "tinyA") == ["tinyA", "tinyA_base1", "tinyA_base2"]
    assert bases_of(models, "tinyB") == ["tinyB", "tinyB_base1", "tinyB_base2"]
    assert models["tinyA_base2"]["pretrain"]["seed"] == 2
    assert models["tinyA"]["pretrain"]["seed"] == 0  # the original is untouched
    assert models["tinyA_base1"]["replicate_of"] == "tinyA"
    assert models["tinyA_base1"]["architecture"] == models["tinyA"]["architecture"]
    config["models"]["tinyA"]["replicates"] = [5, 3]
    config["models"]["tinyB"]["replicates"] = [5, 3]
    del config["models"]["tinyA_base1"], config["models"]["tinyA_base2"]
    check_config(config, SCHEMA)
    assert [models[f"tinyA_base{k}"]["pretrain"]["seed"] for k in (1, 2)] == [5, 3]


@pytest.mark.parametrize(
    ("name", "replicates", "other", "message"),
    [
        ("tinyA", [0], "tinyC", "models.tinyA.replicates[0]: 0 is the model's own pretrain.seed"),
        (
            "tinyA",
            [3],
            "tinyA_base1",
            "models.tinyA_base1: the name of models.tinyA's replicate 3 is taken",
        ),
        (
            "tinyB",
            [1, 2],
            "tinyC",
            "models.tinyB.replicates: every pretrained model needs the same number of "
            "replicates (tinyA: 1, tinyB: 2, tinyC: 2)",
        ),
    ],
)
def test_bad_replicates_name_the_key(name: str, replicates: list, other: str, message: str) -> None:
    config = copy.deepcopy(BASE)
    config["models"][name]["replicates"] = replicates
    config["models"][other] = copy.deepcopy(config["models"]["tinyB"])
    with pytest.raises(ConfigError) as err:
        check_config(config, SCHEMA)
    assert str(err.value) == message


def test_the_premise_screens_families_must_be_table_models() -> None:
    config = _merged("config.yaml")
    config["calibration"]["premise_not_met"] = {"tinyA": "no grid point passes L"}
    check_config(copy.deepcopy(config), SCHEMA)
    config["calibration"]["premise_not_met"] = {"tinyA_base1": "a replicate"}
    with pytest.raises(
        ConfigError, match=r"^calibration\.premise_not_met: 'tinyA_base1' is not a model"
    ):
        check_config(copy.deepcopy(config), SCHEMA)
    config["calibration"]["premise_not_met"] = {"tinyA": ""}
    with pytest.raises(ConfigError, match=r"^calibration\.premise_not_met\.tinyA: "):
        check_config(config, SCHEMA)


def test_a_sweep_label_with_a_family_strength_is_refused_in_one_line() -> None:
    """A sweep places labels by strength (rpb.report.exploratory.method_strength): "family" has no
    place on that axis, so the config check refuses it before any job (it crashed the sweep job)."""
    config = _merged("config.yaml")
    config["methods"]["lbl"] = {"strength": "family"}
    config["sweep"]["curves"][0]["labels"] = ["none", "lbl", "hard"]
    with pytest.raises(ConfigError, match=r"^sweep\.curves\[0\]\.labels: 'lbl' has strength"):
        check_config(config, SCHEMA)


def test_eval_only_sets_are_out_of_domain_tasks_of_the_synthetic_corpora() -> None:
    config = _merged("config.yaml", "smoke.yaml")
    config["evaluation"]["ood"] = [*config["evaluation"]["ood"], "addition3"]
    config["analysis"]["probe_tasks"] = [*config["analysis"]["probe_tasks"], "addition3"]
    check_config(copy.deepcopy(config), SCHEMA)
    config["evaluation"]["in_domain"] = ["math", "addition3"]
    with pytest.raises(ConfigError, match=r"^evaluation\.in_domain\[1\]: 'addition3' is neither"):
        check_config(config, SCHEMA)
    paper = _merged("config.yaml", "paper.yaml")
    paper["analysis"]["probe_tasks"] = ["addition3"]
    with pytest.raises(
        ConfigError,
        match=r"^analysis\.probe_tasks\[0\]: 'addition3' is an eval-only set of the synthetic",
    ):
        check_config(paper, SCHEMA)


def test_the_readings_rule_overlay_reruns_the_readings_at_the_seeds_the_rule_ran() -> None:
    """docs/methods.md's readings table (4 runs per reading) regenerates from the default with
    config/readings_rule.yaml; the default itself runs seed 0 alone (docs/testbed.md, budget)."""
    default = _merged("config.yaml")
    overlaid = _merged("config.yaml", "readings_rule.yaml")
    assert default["tables"]["readings"]["seeds"] == [0]
    assert overlaid["tables"]["readings"]["seeds"] == default["tables"]["seeds"] == [0, 1]
    for config in (default, overlaid):
        del config["tables"]["readings"]["seeds"]
    assert overlaid == default  # the overlay changes nothing else
