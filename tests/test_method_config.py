"""rpb.method_config: one method value, from a config entry to MLflow.

A method's strength, followed from a config entry through the planner, the training job's command
line, training, the RouterMethod it builds, the steered model folder's method file, the run's
train_history.json and its MLflow runs (training and evaluation), has one name (`strength`, beside
the family's `kind`) and one type (a float, the family's default written in when the entry gives
none; MLflow's params are text, that float's). The value itself: made once (checked and
completed), frozen, spelled and read back, the spellings written before it read alike.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import new_store, save_tiny_base

from rpb import posttraining
from rpb.eval_routing import eval_routing_spec, load_model
from rpb.method_config import MethodConfig, options_class
from rpb.pipeline import training
from rpb.pipeline.analysis import extract_prior_from_corpus
from rpb.pipeline.cli import main
from rpb.pipeline.config_check import ConfigError, check_config
from rpb.pipeline.plan import Plan, plain
from rpb.pipeline.tracking import model_job_params, tracked_run
from rpb.specs import METHOD_SPECS

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "workflow" / "schemas" / "config.schema.yaml"
BASE = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
SPELLING = {"kind", "strength", "options"}
SPEC = {"steps": 1, "batch_size": 2, "lr": 1e-3, "max_length": 16}

# A config entry (kept at evaluation, so its folder carries its method file) and the strength
# every part must meet: given, the family's default, and given as a YAML integer.
ENTRIES: dict[str, tuple[dict[str, Any], float]] = {
    "given": ({"kind": "rpb", "strength": 0.25, "options": {"keep_bias_at_eval": True}}, 0.25),
    "default": ({"kind": "rpb", "options": {"keep_bias_at_eval": True}}, 1.0),
    "integer": ({"kind": "rpb", "strength": 2, "options": {"keep_bias_at_eval": True}}, 2.0),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, empty_store: Path) -> Iterator[dict[str, Any]]:
    """A tiny saved base with the testbed tokenizer, a corpus, its router prior, an MLflow store."""
    import mlflow

    root = tmp_path_factory.mktemp("method_config")
    base = save_tiny_base(root / "base" / "model", num_experts=4)
    rows = [{"prompt": f"SumOf{a}And{a + 1}?", "completion": str(2 * a + 1)} for a in (10, 20)]
    corpus = root / "math.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prior = root / "prior.safetensors"
    extract_prior_from_corpus(base, corpus, prior, model_id="tiny")
    previous = mlflow.get_tracking_uri()
    uri = new_store(empty_store, root / "mlflow.db")
    yield {"root": root, "base": base, "corpus": corpus, "prior": prior, "uri": uri}
    mlflow.set_tracking_uri(previous)


def _plan_with(label: str, entry: dict[str, Any]) -> Plan:
    """The planner of the shipped config with `methods.<label>: entry`, after the config check."""
    config = copy.deepcopy(BASE)
    config["methods"][label] = copy.deepcopy(entry)
    return Plan(check_config(config, SCHEMA))


@pytest.mark.parametrize("case", list(ENTRIES))
def test_a_strength_has_one_name_and_one_type_from_the_config_to_mlflow(
    world: dict[str, Any], case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    entry, strength = ENTRIES[case]
    label = f"pinned_{case}"
    plan = _plan_with(label, entry)
    planned = plan.config.methods[label].method
    spec = plan.method_entry(label)
    # The training rule's --method, as workflow/rules/common.smk's as_json writes it.
    command_line = json.dumps(plain(spec), sort_keys=True)

    # What training gets, and the method it builds (which its model folder keeps).
    seen: dict[str, Any] = {}
    posttrain, save = training.posttrain, posttraining.save_eval_routing

    def watched_posttrain(**kwargs: Any) -> dict[str, Any]:
        seen["trained"] = kwargs["method"]
        return posttrain(**kwargs)

    def watched_save(folder: Path, method: Any, prior: Any) -> Path | None:
        seen["built"] = method
        return save(folder, method, prior)

    monkeypatch.setattr(training, "posttrain", watched_posttrain)
    monkeypatch.setattr(posttraining, "save_eval_routing", watched_save)  # the one setup's
    out = world["root"] / "runs" / label
    experiment = f"pin_{case}"
    argv = [
        *("pipeline", "train", "--tracking-uri", world["uri"], "--experiment", experiment),
        *("--name", "tiny", "--label", label, "--base", str(world["base"])),
        *("--prior", str(world["prior"]), "--corpus", str(world["corpus"])),
        *("--corpus-name", "math", "--method", command_line, "--spec", json.dumps(SPEC)),
        *("--out", str(out)),
    ]
    assert main(argv) == 0
    history = json.loads((out / "train_history.json").read_text())["method"]
    saved = json.loads((out / "model" / "eval_routing" / "method.json").read_text())
    reloaded = load_model(out / "model").rpb_eval_routing
    # An evaluation run of the trained model, its params as the eval job logs them.
    with tracked_run(
        stage="eval",
        model="tiny",
        method=label,
        corpus="math",
        base=0,
        seed=0,
        params=model_job_params(method=label, model_dir=out / "model", tasks=["math"]),
        tracking_uri=world["uri"],
        experiment=experiment,
    ):
        pass
    client = MlflowClient(tracking_uri=world["uri"])
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 2  # training and evaluation

    # One name: every spelling is {kind, strength, options}, the family under `kind`.
    for where, spelled in {
        "the planner's spec": spec,
        "the command line": json.loads(command_line),
        "train_history.json": history,
        "eval_routing/method.json": saved,
    }.items():
        assert set(spelled) == SPELLING and spelled["kind"] == "rpb", where
    # One type: a float, the same number, in every part (the default written in once, when the
    # planner made the value from the entry).
    strengths = {
        "the planner's value": planned.strength,
        "the planner's spec": spec["strength"],
        "the command line": json.loads(command_line)["strength"],
        "training's value": seen["trained"].strength,
        "the built RouterMethod": seen["built"].strength,
        "train_history.json": history["strength"],
        "eval_routing/method.json": saved["strength"],
        "the reloaded model's method": reloaded.strength,
    }
    for where, value in strengths.items():
        assert type(value) is float and value == strength, (where, value)
    assert seen["trained"] == planned == eval_routing_spec(out / "model")
    assert MethodConfig.of(seen["built"]) == planned
    # MLflow: the label is the run's tag `method`; what it is, the params `kind`, `strength`
    # (text of that float: never `-`, never an integer's) and `options`, on both runs alike.
    logged = []
    for run in runs:
        params, tags = run.data.params, run.data.tags
        assert tags["method"] == label
        assert [k for k in params if "strength" in k or k.startswith("method")] == ["strength"]
        assert params["kind"] == "rpb" and params["strength"] == str(strength)
        assert json.loads(params["options"]) == dataclasses.asdict(planned.options)
        logged.append({k: params[k] for k in SPELLING})
    assert logged[0] == logged[1]


def test_the_value_is_made_once_frozen_and_compares_by_what_it_is() -> None:
    rpb = MethodConfig("rpb")
    assert rpb == MethodConfig("rpb", 1.0) == MethodConfig("rpb", 1, {"bias_on": "selection"})
    assert hash(rpb) == hash(MethodConfig("rpb", 1.0))
    assert type(rpb.strength) is float and type(rpb.options) is options_class("rpb")
    assert rpb.options == options_class("rpb")(bias_on="selection", keep_bias_at_eval=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rpb.strength = 2.0  # type: ignore[misc]
    # A family without a strength has none (not 0); lbl's model-family coefficient stays text
    # until the method attaches to a model.
    assert MethodConfig("hard").strength is None and MethodConfig("none").strength is None
    lbl = MethodConfig("lbl", "family")
    assert lbl.strength == "family" and lbl.build().family_strength
    assert MethodConfig.from_dict(lbl.to_dict()) == lbl
    # Options given as the family's dataclass or as a mapping make the same value.
    logits = MethodConfig("rpb", options={"bias_on": "logits"})
    assert MethodConfig("rpb", options=logits.options) == logits
    assert dataclasses.replace(logits, strength=2.0).options.bias_on == "logits"


@pytest.mark.parametrize("kind", list(METHOD_SPECS))
def test_every_family_is_spelled_read_back_and_built_alike(kind: str) -> None:
    method = MethodConfig(kind)
    spelled = method.to_dict()
    assert set(spelled) == SPELLING and MethodConfig.from_dict(spelled) == method
    assert json.loads(json.dumps(spelled)) == spelled  # JSON as it is
    assert spelled["options"] == METHOD_SPECS[kind].option_defaults
    assert method.to_dict(defaults=False) == {**spelled, "options": {}}
    built = method.build()
    assert type(built).name == kind and built.options == spelled["options"]
    assert built.strength == (method.strength if method.strength is not None else 0.0)
    assert MethodConfig.of(built) == method
    assert method.gradient_path == built.gradient_path


def test_the_gradient_path_is_the_values() -> None:
    assert MethodConfig("anchor_kl").gradient_path == "moves_router"
    assert MethodConfig("anchor_kl", 0.0).gradient_path == "plain"  # no term at strength 0
    assert MethodConfig("none").gradient_path == "plain"
    assert MethodConfig("rpb").gradient_path == "selection_only"
    assert MethodConfig("rpb", options={"bias_on": "logits"}).gradient_path == "moves_router"
    assert MethodConfig("hard", options={"gate_from": "base"}).gradient_path == "none"


def test_a_bad_value_is_refused_once_in_one_line_naming_its_key() -> None:
    """One check (rpb.specs.check_method) behind the config check, the value and make_method:
    the same words, after where the value was written."""
    from rpb.methods import make_method

    problem = "'rpb_interp' takes at most 1.0 (got 2)"
    with pytest.raises(ValueError) as made:
        MethodConfig.from_entry("half", {"kind": "rpb_interp", "strength": 2})
    assert str(made.value) == f"methods.half.strength: {problem}"
    config = copy.deepcopy(BASE)
    config["methods"]["half"] = {"kind": "rpb_interp", "strength": 2}
    with pytest.raises(ConfigError) as checked:
        check_config(config, SCHEMA)
    assert str(checked.value) == str(made.value)
    with pytest.raises(ValueError) as library:
        make_method("rpb_interp", 2)
    assert str(library.value) == f"strength of method 'rpb_interp': {problem}"
    with pytest.raises(ValueError, match=r"^methods\.x\.options\.bias_on: 'both' is not one of"):
        MethodConfig.from_entry("x", {"kind": "rpb", "options": {"bias_on": "both"}})


def test_what_was_written_before_reads_as_the_same_value() -> None:
    """The spellings rpb wrote before MethodConfig: a training job's `--method` and its
    train_history.json named the family `name` and left a default strength null and unset
    options out; a steered folder's eval_routing/method.json named it `method`, with every
    option and RouterMethod's strength (0.0 for `hard`)."""
    history = {"name": "rpb", "strength": None, "options": {"bias_on": "logits"}}
    # Written when rpb dropped its bias at evaluation by default: read as that, not as today's
    # default (a value of the current spelling, `kind`, has every option written out).
    dropped = {"bias_on": "logits", "keep_bias_at_eval": False}
    assert MethodConfig.from_dict(history) == MethodConfig("rpb", 1.0, dropped)
    assert MethodConfig.from_dict({"kind": "rpb"}).options.keep_bias_at_eval is True
    folder = {"method": "hard", "strength": 0.0, "options": {"gate_from": "live"}}
    assert MethodConfig.from_dict(folder) == MethodConfig("hard")
    kept = {"method": "rpb", "strength": 2.0, "options": {"keep_bias_at_eval": True}}
    assert MethodConfig.from_dict(kept).to_dict() == {
        "kind": "rpb",
        "strength": 2.0,
        "options": {"bias_on": "selection", "keep_bias_at_eval": True},
    }
    for bad, problem in (
        ({"kind": "rpb", "name": "rpb"}, "unknown key(s) name"),
        ({"strength": 1.0}, "no 'kind'"),
        ({"method": "hard", "strength": 3.0}, "'hard' takes no strength (got 3.0)"),
        ([1, 2], "is not a mapping"),
    ):
        with pytest.raises(ValueError, match=r"^f\.json: ") as info:
            MethodConfig.from_dict(bad, where="f.json")  # type: ignore[arg-type]
        assert problem in str(info.value)
