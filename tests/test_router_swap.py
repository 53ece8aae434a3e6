"""Part swap and the routing-sensitive regime on tiny random models: swapping a part (routers,
routed experts, trunk) moves exactly that part's tensors (twice: the original, bitwise), in memory
and through saved folders; the 2^k factorial decomposition recovers planted effects, exact Shapley
shares and the put-back effect, and its cells add up; `all` schedules the cells; and
`trainable: routed_experts_and_routers` leaves every other parameter bitwise unchanged while the
trainable ones move. The table made from the cells' evaluations: tests/test_router_swap_table.py.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import ARCHS, make_batch, make_model
from result_worlds import PLANTED, R, T, planted_values, shapley_by_orders
from transformers import AutoModelForCausalLM

from rpb.architectures import random_model
from rpb.pipeline.config_check import ConfigError, check_config
from rpb.pipeline.training import TokenizedExamples, TrainSpec, run_training
from rpb.router_swap import (
    LABEL_PATTERN,
    PARTS,
    cell_eval_paths,
    cells,
    decompose,
    factors,
    model_label,
    parse_label,
    part_state,
    router_state,
    swap_input_dirs,
    swap_parts,
    swap_routers,
    swap_saved_parts,
)
from rpb.routing import find_routers
from rpb.specs import Run
from rpb.trainable import TRAINABLE, parameter_parts, select_trainable

ROOT = Path(__file__).resolve().parents[1]
# The families of the part tests: fused experts with a shared expert and a correction bias
# (DeepSeek-V3), fused experts alone (Qwen3-MoE), Mixtral's experts.
PART_ARCHS = ["deepseek_v3", "qwen3_moe", "mixtral"]
# Names that must land in each part (a misclassified tensor would swap with the wrong part).
EXPECTED = {
    "deepseek_v3": {
        "routers": [r"\.mlp\.gate\.weight$", r"\.mlp\.gate\.e_score_correction_bias$"],
        "routed_experts": [r"\.mlp\.experts\."],
        "trunk": [r"\.mlp\.shared_experts\.", r"self_attn", r"embed_tokens", r"^lm_head"],
    },
    "qwen3_moe": {
        "routers": [r"\.mlp\.gate\.weight$"],
        "routed_experts": [r"\.mlp\.experts\."],
        "trunk": [r"self_attn", r"embed_tokens", r"layernorm"],
    },
    "mixtral": {
        "routers": [r"\.mlp\.gate\.weight$"],
        "routed_experts": [r"\.mlp\.experts\."],
        "trunk": [r"self_attn", r"embed_tokens", r"layernorm"],
    },
}


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys) -> bool:
    return all(torch.equal(a[k], b[k]) for k in keys)


def _trained_from(base, parts=PARTS, seed: int = 1):
    """A copy of `base` with every tensor of `parts` moved, as post-training would move them."""
    trained = copy.deepcopy(base)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in part_state(trained, parts).values():
            if tensor.is_floating_point():
                tensor.add_(0.05 * torch.randn(tensor.shape, generator=g, dtype=tensor.dtype))
    return trained


def _names(model, part: str) -> set[str]:
    return {n for n, p in parameter_parts(model).items() if p == part}


def test_parts_are_the_trainable_parts() -> None:
    from rpb.trainable import PARTS as TRAINABLE_PARTS

    assert PARTS == TRAINABLE_PARTS


@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("arch", PART_ARCHS)
def test_swapping_a_part_moves_exactly_its_tensors(arch: str, part: str) -> None:
    base = make_model(arch)
    trained = _trained_from(base)
    names = _names(base, part)
    others = set(base.state_dict()) - names
    for pattern in EXPECTED[arch][part]:
        assert any(re.search(pattern, n) for n in names), (part, pattern)
    original, donor = _state(trained), copy.deepcopy(trained)
    assert set(swap_parts(trained, base, [part])) == names
    now = _state(trained)
    assert _equal(now, _state(base), names)  # the base's part
    assert _equal(now, original, others)  # everything else still trained's, bitwise
    assert not any(torch.equal(now[n], original[n]) for n in names)  # and the part did move
    base_with_part = copy.deepcopy(base)
    swap_parts(base_with_part, donor, [part])
    assert _equal(_state(base_with_part), original, names)
    assert _equal(_state(base_with_part), _state(base), others)
    swap_parts(trained, base_with_part, [part])  # the second swap puts trained's part back
    assert _equal(_state(trained), original, original)  # bitwise the original, every tensor


@pytest.mark.parametrize("arch", list(ARCHS))
def test_swap_routers_is_the_routers_part(arch: str) -> None:
    """The earlier callers' swap_routers moves what swap_parts(["routers"]) moves."""
    base = make_model(arch)
    trained = _trained_from(base)
    routers = set(router_state(base))
    has_bias = any(h.correction_bias is not None for h in find_routers(base))
    assert any(k.endswith("e_score_correction_bias") for k in routers) == has_bias
    original = _state(trained)
    assert set(swap_routers(trained, base)) == routers == _names(base, "routers")
    now = _state(trained)
    assert _equal(now, _state(base), routers)
    assert _equal(now, original, set(original) - routers)


def test_swap_refuses_other_models_and_unknown_parts() -> None:
    a = make_model("qwen3_moe")
    b = random_model("qwen3_moe", seed=0, num_experts=4)
    with pytest.raises(ValueError, match="in the target"):
        swap_routers(a, b)
    with pytest.raises(ValueError, match="in the target"):
        swap_parts(a, b, ["routed_experts"])
    with pytest.raises(ValueError, match="OlmoeForCausalLM's routers cannot go into a Qwen3"):
        swap_routers(a, make_model("olmoe"))
    with pytest.raises(ValueError, match="OlmoeForCausalLM's trunk cannot go into a Qwen3"):
        swap_parts(a, make_model("olmoe"), ["trunk"])
    with pytest.raises(ValueError, match=r"parts: \['experts'\] must be"):
        swap_parts(a, make_model("qwen3_moe"), ["experts"])


def _nll(model, batch) -> float:
    with torch.no_grad():
        return float(model(**batch).loss)


def _saved_cells(base, trained, tmp_path: Path, parts=PARTS) -> dict[str, Path]:
    """Every cell of the factorial over `parts` as a saved model folder, each swapped one made as
    the pipeline makes it (its label's target, source and part)."""
    dirs = {"base": tmp_path / "base", "none": tmp_path / "none"}
    base.save_pretrained(dirs["base"])
    trained.save_pretrained(dirs["none"])
    out = {}
    for cell, taken in cells(parts).items():
        label = model_label("none", parts, taken)
        if label not in dirs:
            target, source, part = parse_label(label)
            swap_saved_parts(dirs[target], dirs[source], [part], tmp_path / label)
            dirs[label] = tmp_path / label
        out[cell] = dirs[label]
    return out


@pytest.mark.parametrize("arch", PART_ARCHS)
def test_saved_cells_hold_each_part_from_its_model_bitwise(arch: str, tmp_path: Path) -> None:
    base = make_model(arch)
    trained = _trained_from(base)
    folders = _saved_cells(base, trained, tmp_path)
    assert len(folders) == 8 and len(set(folders.values())) == 8
    b, t = _state(base), _state(trained)
    batch = make_batch(seed=4)
    loss = {}
    for cell, folder in folders.items():
        model = AutoModelForCausalLM.from_pretrained(folder)
        state = _state(model)
        for part in PARTS:
            source = t if part in cells(PARTS)[cell] else b
            assert _equal(state, source, _names(base, part)), (cell, part)
        loss[cell] = _nll(model, batch)
    summary = json.loads((folders["trained_with_base_trunk"] / "swap.json").read_text())
    assert summary["parts"] == ["trunk"] and summary["distance"]["trunk"] > 0
    # Swapping back on disk gives the trained model bitwise.
    swap_saved_parts(
        folders["trained_with_base_trunk"], tmp_path / "none", ["trunk"], tmp_path / "b"
    )
    assert _equal(_state(AutoModelForCausalLM.from_pretrained(tmp_path / "b")), t, t)
    # Real losses: the effects and the Shapley values add up to the change.
    parts = decompose({cells(PARTS)[c]: v for c, v in loss.items()}, list(PARTS))
    assert parts["total"] == pytest.approx(loss["trained"] - loss["base"], abs=1e-12)
    effects = [v for k, v in parts.items() if k.startswith(("main_", "interaction_"))]
    assert len(effects) == 7 and sum(effects) == pytest.approx(parts["total"], abs=1e-12)
    shapley = sum(parts[f"shapley_{p}"] for p in PARTS)
    assert shapley == pytest.approx(parts["total"], abs=1e-12)


@pytest.mark.parametrize("moved", PARTS)
def test_a_model_that_moved_one_part_is_all_that_part(moved: str, tmp_path: Path) -> None:
    """Known answer on a real model: trained differs from its base only in `moved`, so that part's
    main effect, Shapley value and put-back are the whole change, and every other effect is 0."""
    base = make_model("deepseek_v3")
    folders = _saved_cells(base, _trained_from(base, [moved]), tmp_path)
    batch = make_batch(seed=4)
    loss = {c: _nll(AutoModelForCausalLM.from_pretrained(f), batch) for c, f in folders.items()}
    parts = decompose({cells(PARTS)[c]: v for c, v in loss.items()}, list(PARTS))
    assert parts["total"] != 0
    for key, value in parts.items():
        if key in (f"main_{moved}", f"shapley_{moved}", "total"):
            assert value == parts["total"], key
        elif key == f"put_back_{moved}":
            assert value == -parts["total"]
        elif key in (f"shapley_share_{moved}", f"put_back_share_{moved}"):
            assert value == 1.0, key
        else:
            assert value == 0.0, key


# --- the factorial, on planted scores ----------------------------------------------------------


def test_decompose_recovers_planted_effects_and_exact_shapley() -> None:
    base, effects = PLANTED["p_target"]
    v = planted_values(base, effects)
    out = decompose(v, list(PARTS))
    assert out["total"] == pytest.approx(sum(effects.values()))
    for subset, effect in effects.items():
        name = f"main_{subset[0]}" if len(subset) == 1 else "interaction_" + "_x_".join(subset)
        assert out[name] == pytest.approx(effect, abs=1e-12), name
    by_orders = shapley_by_orders(v, list(PARTS))
    for f in PARTS:
        assert out[f"shapley_{f}"] == pytest.approx(by_orders[f], abs=1e-12)
        assert out[f"shapley_share_{f}"] == pytest.approx(by_orders[f] / out["total"])
        put_back = v[frozenset(PARTS) - {f}] - v[frozenset(PARTS)]
        assert out[f"put_back_{f}"] == pytest.approx(put_back, abs=1e-12)
        assert out[f"put_back_share_{f}"] == pytest.approx(put_back / -out["total"])
    # By hand: routers' Shapley value = -0.05 + 0.03/2 + 0/2 - 0.01/3; its put-back undoes
    # -(-0.05 + 0.03 + 0 - 0.01) = 0.03 of the loss 0.31.
    assert out["shapley_routers"] == pytest.approx(-0.05 + 0.015 - 0.01 / 3)
    assert out["put_back_share_routers"] == pytest.approx(0.03 / 0.31)
    no_change = decompose(dict.fromkeys(v, 1.0), list(PARTS))
    assert math.isnan(no_change["shapley_share_routers"])


def test_two_factors_are_the_earlier_2x2() -> None:
    """`parts: [routers]`: routers against the rest, the earlier decomposition and labels."""
    assert factors(["routers"]) == {"routers": ("routers",), "rest": ("routed_experts", "trunk")}
    grid = cells(["routers"])
    assert list(grid) == [
        "base",
        "base_with_trained_routers",
        "trained_with_base_routers",
        "trained",
    ]
    labels = {c: model_label("none", ["routers"], s) for c, s in grid.items()}
    assert labels["trained_with_base_routers"] == "none_with_base_routers"
    assert labels["base_with_trained_routers"] == "base_with_none_routers"
    v = {
        frozenset(): 90.0,
        frozenset({"routers", "rest"}): 30.0,
        frozenset({"rest"}): 50.0,  # trained with the base's routers
        frozenset({"routers"}): 80.0,  # base with the trained routers
    }
    out = decompose(v, ["routers", "rest"])
    assert (out["total"], out["main_routers"], out["main_rest"]) == (-60.0, -10.0, -40.0)
    assert out["interaction_routers_x_rest"] == -10.0
    assert out["shapley_share_routers"] == pytest.approx(15.0 / 60.0)  # (routing + x / 2) / total
    assert out["put_back_share_routers"] == pytest.approx(20.0 / 60.0)


def test_labels_name_the_actual_parts_whatever_the_factors() -> None:
    full = {model_label("rpb_l0p25", PARTS, s) for s in cells(PARTS).values()}
    assert full == {
        "base",
        "rpb_l0p25",
        *(f"base_with_rpb_l0p25_{p}" for p in PARTS),
        *(f"rpb_l0p25_with_base_{p}" for p in PARTS),
    }
    # Two listed parts and `rest`: the same 8 models under the same labels (shared in the tree).
    assert {model_label("rpb_l0p25", [R, T], s) for s in cells([R, T]).values()} == full
    for label in full - {"base", "rpb_l0p25"}:
        assert re.fullmatch(LABEL_PATTERN, label)
        target, source, part = parse_label(label)
        assert {target, source} == {"base", "rpb_l0p25"}
        assert label == (
            f"base_with_rpb_l0p25_{part}" if target == "base" else f"rpb_l0p25_with_base_{part}"
        )
    # A method whose name ends like a part keeps its name.
    assert parse_label("base_with_x_routed_routers") == ("base", "x_routed", "routers")
    assert parse_label("x_trunk_with_base_routed_experts") == ("x_trunk", "base", "routed_experts")
    with pytest.raises(ValueError, match="not a swap label"):
        parse_label("none_with_base_experts")


def test_a_run_on_a_replicate_base_swaps_with_its_own_base(tmp_path: Path) -> None:
    models = {"tinyA": {"replicates": [1]}}
    dirs = swap_input_dirs("res", models, "tinyA", "math", "none_with_base_trunk", Run(1, 2))
    assert dirs == {
        "target": "res/runs/tinyA/math/none/base1/seed2/model",
        "source": "res/models/tinyA/base1/model",
    }
    spec = {"corpus": "math", "method": "none", "swap_tree": "diagnostic/router_swap"}
    paths = cell_eval_paths(tmp_path, spec, "tinyA", Run(1, 2))
    assert paths["base"] == tmp_path / "eval/tinyA/math/base/base1/seed0.json"
    assert paths["trained"] == tmp_path / "eval/tinyA/math/none/base1/seed2.json"
    assert paths["base_with_trained_trunk"] == (
        tmp_path / "diagnostic/router_swap/eval/tinyA/math/base_with_none_trunk/base1/seed2.json"
    )


# --- the routing-sensitive regime --------------------------------------------------------------


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen2_moe", "mixtral"])
def test_routed_experts_and_routers_only(arch: str, tmp_path: Path) -> None:
    """Frozen parameters are bitwise unchanged after training; every trainable one moved."""
    from rpb.methods import make_method

    model = make_model(arch)
    model.train()
    names = set(select_trainable(model, "routed_experts_and_routers").names)
    routers = {f"{h.name}.weight" for h in find_routers(model)}
    assert routers <= names
    assert any(".experts." in n for n in names)
    # Shared experts, the shared-expert gate, attention, embeddings and norms are not routed.
    assert not any(p in n for n in names for p in ("shared_expert", "attn", "embed", "norm"))
    before = _state(model)
    g = torch.Generator().manual_seed(0)
    dataset = TokenizedExamples(
        [
            {"input_ids": ids, "labels": ids}
            for ids in torch.randint(3, 64, (16, 12), generator=g).tolist()
        ]
    )
    spec = TrainSpec(steps=3, batch_size=8, lr=1e-2, seed=0, log_every=1)
    method = make_method("none").attach(model)
    run_training(model, SimpleNamespace(pad_token_id=0), dataset, method, spec, tmp_path)
    after = _state(model)
    params = dict(model.named_parameters())
    for name in params:
        changed = not torch.equal(before[name], after[name])
        assert changed == (name in names), name


def test_trainable_all_keeps_everything_and_unknown_is_refused() -> None:
    model = make_model("qwen3_moe")
    assert set(select_trainable(model, "all").names) == {n for n, _ in model.named_parameters()}
    with pytest.raises(ValueError, match=r"posttrain.trainable"):
        select_trainable(model, "experts")


def test_cli_trainable_choices_are_the_library_s() -> None:
    from rpb.pipeline.cli import build_parser

    parser = build_parser()
    pipeline = parser._subparsers._group_actions[0].choices["pipeline"]
    train = pipeline._subparsers._group_actions[0].choices["train"]
    flag = next(a for a in train._actions if a.dest == "trainable")
    assert tuple(flag.choices) == TRAINABLE


def _config(**diagnostics) -> dict:
    import yaml

    config = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    config["diagnostics"] = diagnostics
    return config


def test_config_diagnostics_errors_name_the_key() -> None:
    schema = ROOT / "workflow" / "schemas" / "config.schema.yaml"
    check_config(_config(router_swap={"models": ["tinyA"], "corpus": "math"}), schema)
    with pytest.raises(ConfigError, match=r"diagnostics.router_swap.method: 'hard' keeps"):
        check_config(
            _config(router_swap={"models": ["tinyA"], "corpus": "math", "method": "hard"}), schema
        )
    with pytest.raises(ConfigError, match=r"diagnostics.router_swap.models: 'tinyC'"):
        check_config(_config(router_swap={"models": ["tinyC"], "corpus": "math"}), schema)
    config = _config(router_swap={"models": ["tinyA"], "corpus": "math"})
    check_config(config, schema)
    assert config["diagnostics"]["router_swap"]["parts"] == list(PARTS)  # the default: all three
    with pytest.raises(ConfigError, match=r"diagnostics.router_swap.parts"):
        swap = {"models": ["tinyA"], "corpus": "math", "parts": ["routers", "experts"]}
        check_config(_config(router_swap=swap), schema)
    regime = {"trainable": "routed_experts_and_routers", "model": "tinyA", "corpus": "math"}
    with pytest.raises(ConfigError, match=r"diagnostics.regime.methods: 'nope'"):
        check_config(_config(regime=regime | {"methods": ["none", "nope"]}), schema)
    with pytest.raises(ConfigError, match=r"diagnostics.regime.trainable"):
        check_config(_config(regime=regime | {"trainable": "experts", "methods": ["none"]}), schema)
    # The damped trunk needs the MoE preset (the trunk is what `moe` leaves out).
    damped = regime | {"methods": ["none"], "trunk_lr_scale": 0.1}
    with pytest.raises(ConfigError, match=r"diagnostics.regime.trunk_lr_scale: 0.1 needs .*moe"):
        check_config(_config(regime=damped), schema)
    check_config(_config(regime=damped | {"trainable": "moe"}), schema)


def test_posttrain_with_trainable_setting_saves_frozen_weights_unchanged(tmp_path: Path) -> None:
    """The pipeline's path: TrainSpec.trainable reaches posttrain and the saved model."""
    from safetensors.torch import load_file

    from rpb.method_config import MethodConfig
    from rpb.pipeline.tokenizer import build_tokenizer
    from rpb.pipeline.training import posttrain

    tokenizer = build_tokenizer(tmp_path / "base")
    base = random_model(
        "deepseek_v3",
        seed=0,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    base.save_pretrained(tmp_path / "base")
    corpus = tmp_path / "math.jsonl"
    pairs = [(a, b) for a in range(10, 40, 3) for b in range(50, 60, 4)]
    corpus.write_text(
        "".join(
            json.dumps({"prompt": f"SumOf{a}And{b}?", "completion": str(a + b)[::-1]}) + "\n"
            for a, b in pairs
        )
    )
    spec = TrainSpec(
        steps=3, batch_size=8, lr=1e-2, seed=0, log_every=1, trainable="routed_experts_and_routers"
    )
    posttrain(
        base_dir=tmp_path / "base",
        prior_path=None,
        corpus=corpus,
        method=MethodConfig("none"),
        spec=spec,
        out_dir=tmp_path / "post",
    )
    before = load_file(tmp_path / "base" / "model.safetensors")
    after = load_file(tmp_path / "post" / "model" / "model.safetensors")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".mlp.experts." in k or k.endswith(".mlp.gate.weight") for k in changed)
    assert any(k.endswith(".mlp.gate.weight") for k in changed)


@pytest.mark.workflow
def test_diagnostics_join_all_and_leave_the_main_jobs_alone(tmp_path: Path) -> None:
    """`all` builds both diagnostics; only the diagnostic jobs train with the regime's setting."""
    import subprocess
    import sys

    results = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "all", "-n", "-p", "--cores", "1", "--configfile",
         "config/smoke.yaml", "--config", f"results_dir={results}"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    commands = [line for line in proc.stdout.splitlines() if " pipeline train --name " in line]
    diagnostic = [c for c in commands if f"{results}/diagnostic/runs/" in c]
    damped = ('"trainable": "moe"', '"trunk_lr_scale": 0.1')
    assert diagnostic and all(all(s in c for s in damped) for c in diagnostic)
    assert not any('"trunk_lr_scale": 0.1' in c for c in commands if c not in diagnostic)
    assert all('"trainable": "all"' in c for c in commands if c not in diagnostic)
    for target in ("router_swap.csv", "diagnostic_table1.csv"):
        assert str(results / target) in proc.stdout
    # tinyA, seed 0: the 6 swapped cells of the three parts, each made from the right folders.
    swaps = _swap_commands(proc.stdout)
    runs, base = (
        f"{results}/runs/tinyA/math/none/base0/seed0/model",
        f"{results}/models/tinyA/base0/model",
    )
    assert swaps == {
        **{f"base_with_none_{p}": (base, runs, p) for p in PARTS},
        **{f"none_with_base_{p}": (runs, base, p) for p in PARTS},
    }
    for label in swaps:  # and each is evaluated for the table
        assert (
            f"{results}/diagnostic/router_swap/eval/tinyA/math/{label}/base0/seed0.json"
            in proc.stdout
        )
    # `parts: [routers]` schedules the earlier 2x2's two models.
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", str(results / "router_swap.csv"), "-n", "-p",
         "--cores", "1", "--configfile", "config/smoke.yaml", "--config",
         f"results_dir={results}", "diagnostics={'router_swap': {'parts': ['routers']}}"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert _swap_commands(proc.stdout) == {
        "base_with_none_routers": (base, runs, "routers"),
        "none_with_base_routers": (runs, base, "routers"),
    }


def _swap_commands(stdout: str) -> dict[str, tuple[str, str, str]]:
    """label -> (--target, --source, --parts) of each `rpb pipeline router-swap` command of a
    dry run."""
    out = {}
    for line in stdout.splitlines():
        if " pipeline router-swap --name " in line:
            flags = dict(re.findall(r"--([a-z-]+) (\S+)", line))
            out[flags["label"]] = (flags["target"], flags["source"], flags["parts"])
    return out
