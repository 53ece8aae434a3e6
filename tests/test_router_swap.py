"""Router swap and the routing-sensitive regime on tiny random models: swapping routers moves
exactly the router tensors (twice: the original, bitwise), the 2x2 decomposition adds up and
recovers a known answer, and `trainable: routed_experts_and_routers` leaves every other parameter
bitwise unchanged while the trainable ones move."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import ARCHS, make_batch, make_model, perturb_routers
from transformers import AutoModelForCausalLM

from rpb.architectures import random_model
from rpb.config_check import ConfigError, check_config
from rpb.router_swap import (
    build_router_swap_table,
    decompose,
    router_state,
    swap_labels,
    swap_routers,
    swap_saved_routers,
)
from rpb.routing import find_routers
from rpb.trainable import TRAINABLE, select_trainable
from rpb.training import TokenizedExamples, TrainSpec, run_training

ROOT = Path(__file__).resolve().parents[1]


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys) -> bool:
    return all(torch.equal(a[k], b[k]) for k in keys)


def _trained_from(base, seed: int = 1, routers: bool = True, others: bool = True):
    """A copy of `base` moved as post-training would: its routers and/or its other weights."""
    trained = copy.deepcopy(base)
    names = set(router_state(trained))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if routers:
            perturb_routers(trained, seed=seed)
            for handle in find_routers(trained):
                bias = handle.correction_bias
                if bias is not None:
                    bias.add_(0.1 * torch.randn(bias.shape, generator=g))
        if others:
            for name, param in trained.named_parameters():
                if name not in names:
                    param.add_(0.05 * torch.randn(param.shape, generator=g))
    return trained


@pytest.mark.parametrize("arch", list(ARCHS))
def test_swap_moves_exactly_the_routers_and_twice_is_the_original(arch: str) -> None:
    base = make_model(arch)
    trained = _trained_from(base)
    routers = set(router_state(base))
    others = set(base.state_dict()) - routers
    # DeepSeek-V3's correction bias is a buffer of the router and travels with it.
    has_bias = any(h.correction_bias is not None for h in find_routers(base))
    assert any(k.endswith("e_score_correction_bias") for k in routers) == has_bias
    original, donor = _state(trained), copy.deepcopy(trained)
    swapped = swap_routers(trained, base)
    assert set(swapped) == routers
    now = _state(trained)
    assert _equal(now, _state(base), routers)  # the base's routers
    assert _equal(now, original, others)  # everything else still trained's
    assert not _equal(now, original, routers)
    base_with_trained = copy.deepcopy(base)
    swap_routers(base_with_trained, donor)
    assert _equal(_state(base_with_trained), original, routers)
    assert _equal(_state(base_with_trained), _state(base), others)
    swap_routers(trained, base_with_trained)  # the second swap puts trained's routers back
    assert _equal(_state(trained), original, original)  # bitwise the original, every tensor


def test_swap_refuses_models_with_other_routers() -> None:
    a = make_model("qwen3_moe")
    b = random_model("qwen3_moe", seed=0, num_experts=4)
    with pytest.raises(ValueError, match="shape"):
        swap_routers(a, b)
    with pytest.raises(ValueError, match="OlmoeForCausalLM's routers cannot go into a Qwen3"):
        swap_routers(a, make_model("olmoe"))


def _nll(model, batch) -> float:
    with torch.no_grad():
        return float(model(**batch).loss)


def _cells(base, trained, tmp_path: Path) -> dict[str, float]:
    """The four cells' loss on a fixed batch, the swapped ones saved and reloaded."""
    dirs = {"base": tmp_path / "base", "trained": tmp_path / "trained"}
    base.save_pretrained(dirs["base"])
    trained.save_pretrained(dirs["trained"])
    swap_saved_routers(dirs["trained"], dirs["base"], tmp_path / "trained_base_routers")
    swap_saved_routers(dirs["base"], dirs["trained"], tmp_path / "base_trained_routers")
    batch = make_batch(seed=4)
    return {
        name: _nll(AutoModelForCausalLM.from_pretrained(tmp_path / name), batch)
        for name in ("base", "trained", "trained_base_routers", "base_trained_routers")
    }


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_saved_swap_is_bitwise_and_the_parts_add_up(arch: str, tmp_path: Path) -> None:
    base = make_model(arch)
    trained = _trained_from(base)
    cells = _cells(base, trained, tmp_path)
    parts = decompose(*cells.values())
    assert parts["total"] == pytest.approx(cells["trained"] - cells["base"])
    assert parts["routing"] + parts["non_routing"] + parts["interaction"] == pytest.approx(
        parts["total"], abs=1e-12
    )
    # Saved and reloaded: the swapped model holds the donor's routers and its own other weights.
    swapped = AutoModelForCausalLM.from_pretrained(tmp_path / "trained_base_routers")
    routers = set(router_state(base))
    assert _equal(_state(swapped), _state(base), routers)
    assert _equal(_state(swapped), _state(trained), set(_state(trained)) - routers)
    # Swapping back on disk gives the trained model bitwise.
    swap_saved_routers(tmp_path / "trained_base_routers", tmp_path / "trained", tmp_path / "back")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert _equal(_state(back), _state(trained), _state(trained))
    assert json.loads((tmp_path / "back" / "router_swap.json").read_text())["router_distance"] > 0


def test_decomposition_recovers_a_known_answer(tmp_path: Path) -> None:
    """A model that differs from its base only in its routers: routing is the whole change; one
    that differs only elsewhere: routing is none of it."""
    base = make_model("deepseek_v3")
    only_routers = _cells(base, _trained_from(base, others=False), tmp_path / "r")
    parts = decompose(*only_routers.values())
    assert parts["total"] != 0
    assert parts["non_routing"] == 0 and parts["interaction"] == 0
    assert parts["routing"] == parts["total"] and parts["routing_share"] == 1.0
    only_others = _cells(base, _trained_from(base, routers=False), tmp_path / "o")
    parts = decompose(*only_others.values())
    assert parts["routing"] == 0 and parts["interaction"] == 0 and parts["routing_share"] == 0.0


def test_decompose_is_the_2x2_factorial() -> None:
    parts = decompose(base=90.0, trained=30.0, trained_base_routers=50.0, base_trained_routers=80.0)
    assert parts == {
        "total": -60.0,
        "routing": -10.0,
        "non_routing": -40.0,
        "interaction": -10.0,
        "routing_share": pytest.approx(15.0 / 60.0),
    }
    assert np.isnan(decompose(1.0, 1.0, 0.0, 2.0)["routing_share"])  # no change to explain


def _eval_json(path: Path, scores: dict[str, float], ll: float) -> None:
    """An evaluation output with exact-match items giving `scores` (fractions of 4 items)."""
    tasks = {}
    for task, score in scores.items():
        hits = round(4 * score)
        tasks[f"rpb_{task}"] = {"metric": "exact_match", "items": [1.0] * hits + [0.0] * (4 - hits)}
        tasks[f"rpb_{task}_ll"] = {"metric": "ll_per_token", "score": ll}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"tasks": tasks}))


def test_table_reads_the_four_cells_per_seed_and_task(tmp_path: Path) -> None:
    spec = {
        "models": ["tinyA"],
        "corpus": "math",
        "method": "none",
        "seeds": [0, 1],
        "in_domain": ["math"],
        "ood": ["addition", "facts"],
        "swap_tree": "diagnostic/router_swap",
        "scale": "smoke",
    }
    labels = swap_labels("none")
    ev = tmp_path / "eval" / "tinyA" / "math"
    swap = tmp_path / "diagnostic" / "router_swap" / "eval" / "tinyA" / "math"
    _eval_json(ev / "base" / "seed0.json", {"math": 0, "addition": 1, "facts": 1}, -0.1)
    for seed in (0, 1):
        _eval_json(
            ev / "none" / f"seed{seed}.json", {"math": 1, "addition": 0.25, "facts": 0.5}, -2
        )
        cells = {
            "trained_base_routers": {"math": 0.75, "addition": 0.5, "facts": 0.75},
            "base_trained_routers": {"math": 0, "addition": 1, "facts": 0.75},
        }
        for cell, scores in cells.items():
            _eval_json(swap / labels[cell] / f"seed{seed}.json", scores, -1)
    rows = build_router_swap_table(tmp_path, spec, tmp_path / "router_swap.csv")
    assert len(rows) == 2 * (3 + 2) * 2  # seeds x (tasks + in_domain, ood_mean) x metrics
    facts = rows[(rows.task == "facts") & (rows.metric == "exact_match") & (rows.seed == 1)].iloc[0]
    assert (facts.base, facts.trained) == (100.0, 50.0)
    assert (facts.routing, facts.non_routing, facts.interaction) == (-25.0, -25.0, 0.0)
    ood = rows[(rows.task == "ood_mean") & (rows.metric == "exact_match")].iloc[0]
    assert ood.total == pytest.approx(-62.5) and ood.routing == pytest.approx(-12.5)
    summary = pd.read_csv(tmp_path / "router_swap_summary.csv")
    assert set(summary.n_seeds) == {2}
    assert "base + none routers" in (tmp_path / "router_swap.md").read_text()
    (swap / labels["base_trained_routers"] / "seed1.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"base_with_none_routers/seed1.json"):
        build_router_swap_table(tmp_path, spec, tmp_path / "again.csv")


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
    from rpb.cli import build_parser

    parser = build_parser()
    train = parser._subparsers._group_actions[0].choices["train"]
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
    regime = {"trainable": "routed_experts_and_routers", "model": "tinyA", "corpus": "math"}
    with pytest.raises(ConfigError, match=r"diagnostics.regime.methods: 'nope'"):
        check_config(_config(regime=regime | {"methods": ["none", "nope"]}), schema)
    with pytest.raises(ConfigError, match=r"diagnostics.regime.trainable"):
        check_config(_config(regime=regime | {"trainable": "experts", "methods": ["none"]}), schema)


def test_posttrain_with_trainable_setting_saves_frozen_weights_unchanged(tmp_path: Path) -> None:
    """The pipeline's path: TrainSpec.trainable reaches posttrain and the saved model."""
    from safetensors.torch import load_file

    from rpb.tokenizer import build_tokenizer
    from rpb.training import MethodSpec, posttrain

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
        method_spec=MethodSpec("none"),
        spec=spec,
        out_dir=tmp_path / "post",
    )
    before = load_file(tmp_path / "base" / "model.safetensors")
    after = load_file(tmp_path / "post" / "model" / "model.safetensors")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".mlp.experts." in k or k.endswith(".mlp.gate.weight") for k in changed)
    assert any(k.endswith(".mlp.gate.weight") for k in changed)


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
    commands = [line for line in proc.stdout.splitlines() if " train --name " in line]
    diagnostic = [c for c in commands if f"{results}/diagnostic/runs/" in c]
    assert diagnostic and all('"trainable": "routed_experts_and_routers"' in c for c in diagnostic)
    assert all('"trainable": "all"' in c for c in commands if c not in diagnostic)
    for target in ("router_swap.csv", "diagnostic_table1.csv"):
        assert str(results / target) in proc.stdout
    swaps = [line for line in proc.stdout.splitlines() if " router-swap --name " in line]
    assert len(swaps) == 2  # tinyA, seed 0: none with base routers, base with none routers
