"""Parameter selections (rpb.trainable): `moe` trains the routed experts, the routers and the new
tokens' rows and leaves every other parameter and every other row bitwise unchanged; the damped
trunk trains at exactly the scaled learning rate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rpb.architectures import random_model
from rpb.method_config import MethodConfig
from rpb.pipeline.data import DOMAIN_TOKENS, PRETRAIN_DOMAINS
from rpb.pipeline.tokenizer import build_tokenizer
from rpb.pipeline.training import TrainSpec, posttrain, tokenize_prompt_completion
from rpb.pipeline.training import unseen_token_ids as unseen
from rpb.trainable import UpdateScaleCallback, parameter_parts, select_trainable


def _base(tmp_path: Path, arch: str, **extra) -> Path:
    tokenizer = build_tokenizer(tmp_path / "base")
    model = random_model(
        arch,
        seed=0,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **extra,
    )
    model.save_pretrained(tmp_path / "base")
    return tmp_path / "base"


def _corpus(path: Path) -> Path:
    pairs = [(a, b) for a in range(10, 40, 3) for b in range(50, 60, 4)]
    path.write_text(
        "".join(
            json.dumps({"prompt": f"SumOf{a}And{b}?", "completion": str(a + b)[::-1]}) + "\n"
            for a, b in pairs
        )
    )
    return path


def test_unseen_tokens_are_the_templates_new_tokens(tmp_path: Path) -> None:
    """The math template's words and mark are new; its digits were seen (addition)."""
    tokenizer = build_tokenizer()
    corpus = _corpus(tmp_path / "math.jsonl")
    ids = unseen(tokenizer, tokenize_prompt_completion(corpus, tokenizer, 48))
    assert sorted(tokenizer.convert_ids_to_tokens(ids)) == ["?", "And", "Of", "Sum"]
    seen = {t for d in PRETRAIN_DOMAINS for t in DOMAIN_TOKENS[d]}
    assert not seen & set(tokenizer.convert_ids_to_tokens(ids))


def test_unseen_tokens_of_a_foreign_tokenizer_are_none(tmp_path: Path) -> None:
    class Foreign:
        def get_vocab(self) -> dict[str, int]:
            return {"a": 0, "SumOf": 1}

    dataset = tokenize_prompt_completion(_corpus(tmp_path / "m.jsonl"), build_tokenizer(), 48)
    assert unseen(Foreign(), dataset) == []


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
@pytest.mark.parametrize("tie", [False, True])
def test_moe_changes_only_experts_routers_and_new_rows(
    tmp_path: Path, arch: str, tie: bool
) -> None:
    """After post-training with `moe` (weight decay on, which would move zero-gradient rows), the
    routed experts, the routers and the new tokens' rows moved; every other tensor and every other
    row of the embedding and output head is bitwise the base's."""
    base = _base(tmp_path, arch, tie_word_embeddings=tie)
    tokenizer = build_tokenizer()
    spec = TrainSpec(steps=3, batch_size=8, lr=1e-2, weight_decay=0.1, seed=0, trainable="moe")
    posttrain(
        base_dir=base,
        prior_path=None,
        corpus=_corpus(tmp_path / "math.jsonl"),
        method=MethodConfig("none"),
        spec=spec,
        out_dir=tmp_path / "post",
    )
    base_model = AutoModelForCausalLM.from_pretrained(base)
    before = base_model.state_dict()
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "post" / "model").state_dict()
    assert before.keys() == after.keys()
    parts = parameter_parts(base_model)
    new = torch.tensor(tokenizer.convert_tokens_to_ids(["Sum", "Of", "And", "?"]))
    rows = ("embed_tokens.weight", "lm_head.weight")
    for name in before:
        if name.endswith(rows):
            old = torch.ones(before[name].shape[0], dtype=torch.bool)
            old[new] = False
            assert torch.equal(before[name][old], after[name][old]), name
            assert not torch.equal(before[name][new], after[name][new]), name
        elif parts[name] in ("routers", "routed_experts") and "bias" not in name:
            assert not torch.equal(before[name], after[name]), name
        elif parts[name] == "trunk":
            assert torch.equal(before[name], after[name]), name


def test_moe_parts_cover_every_tensor_once() -> None:
    model = make_model("deepseek_v3")
    parts = parameter_parts(model)
    assert set(parts) == set(model.state_dict())
    assert {"routers", "routed_experts", "trunk"} == set(parts.values())
    assert all(parts[n] == "trunk" for n in parts if "shared_experts" in n or "embed" in n)


def test_selection_errors_name_the_key() -> None:
    model = make_model("qwen3_moe")
    with pytest.raises(ValueError, match=r"posttrain.trunk_lr_scale: 0.1 needs"):
        select_trainable(model, "all", trunk_lr_scale=0.1)
    with pytest.raises(ValueError, match=r"posttrain.trunk_lr_scale: 2"):
        select_trainable(model, "moe", trunk_lr_scale=2)
    with pytest.raises(ValueError, match=r"new token id 100000 is outside"):
        select_trainable(model, "moe", new_token_ids=[100000])


def test_update_scale_is_a_learning_rate_scale_for_adamw() -> None:
    """AdamW at lr with the callback's scale s equals AdamW at s * lr, decay included; a row of
    scale 0 stays bitwise and keeps zero optimizer moments."""
    torch.manual_seed(0)
    scaled = torch.nn.Linear(4, 6)
    direct = torch.nn.Linear(4, 6)
    direct.load_state_dict(scaled.state_dict())
    scale = torch.full((6, 1), 0.1)
    scale[2] = 0.0
    callback = UpdateScaleCallback(scaled, {"weight": scale})
    opt_scaled = torch.optim.AdamW([scaled.weight], lr=1e-2, weight_decay=0.1)
    opt_direct = torch.optim.AdamW([direct.weight], lr=1e-3, weight_decay=0.1)
    frozen_row = scaled.weight[2].detach().clone()
    for _ in range(5):
        x = torch.randn(8, 4)
        for layer, opt in ((scaled, opt_scaled), (direct, opt_direct)):
            opt.zero_grad()
            layer(x).pow(2).sum().backward()
        callback.on_pre_optimizer_step(None, None, None)
        opt_scaled.step()
        callback.on_optimizer_step(None, None, None)
        opt_direct.step()
    moving = torch.ones(6, dtype=torch.bool)
    moving[2] = False
    torch.testing.assert_close(scaled.weight[moving], direct.weight[moving], rtol=1e-5, atol=1e-7)
    assert torch.equal(scaled.weight[2], frozen_row)
    assert torch.count_nonzero(opt_scaled.state[scaled.weight]["exp_avg"][2]) == 0


def test_damped_trunk_moves_everything_and_trunk_less(tmp_path: Path) -> None:
    """`trunk_lr_scale` 0.1: every tensor moves, the trunk by far less than under `all`."""
    base = _base(tmp_path, "qwen3_moe")
    corpus = _corpus(tmp_path / "math.jsonl")
    changes = {}
    for label, extra in (("all", {}), ("damped", {"trainable": "moe", "trunk_lr_scale": 0.1})):
        spec = TrainSpec(steps=3, batch_size=8, lr=1e-2, seed=0, **extra)
        posttrain(
            base_dir=base,
            prior_path=None,
            corpus=corpus,
            method=MethodConfig("none"),
            spec=spec,
            out_dir=tmp_path / label,
        )
        before = load_file(base / "model.safetensors")
        after = load_file(tmp_path / label / "model" / "model.safetensors")
        changes[label] = {k: float((after[k] - before[k]).abs().max()) for k in before}
    attn = "model.layers.0.self_attn.q_proj.weight"
    assert 0 < changes["damped"][attn] < 0.3 * changes["all"][attn]
