"""rpb.prior: extraction (padding excluded), save/load round trip, compatibility and corruption."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_batch, make_model
from safetensors.torch import save_file

from rpb.architectures import random_model
from rpb.prior import RouterPrior, extract_prior
from rpb.routing import find_routers

ARCHS = ["qwen3_moe", "deepseek_v3_grouped"]  # one per routing kind


def _extract(model, batches):
    return extract_prior(
        model, batches, model_id="tiny", revision="r0", corpus_hash="ab" * 32, progress=False
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_extract_counts_only_real_tokens(arch):
    model = make_model(arch)
    model.train()  # extraction must run in eval mode and restore the mode afterwards
    padded = make_batch(batch=2, seq=8, pad=3, seed=0)
    prior = _extract(model, [padded])
    assert model.training
    assert prior.n_tokens == 13
    # Right padding cannot change causal hidden states, so the same tokens fed unpadded,
    # one sequence at a time, must give exactly the same counts.
    rows = [padded["input_ids"][:1], padded["input_ids"][1:, :5]]
    ref = _extract(model, [{"input_ids": r} for r in rows])
    assert ref.n_tokens == 13
    assert torch.equal(prior.usage, ref.usage)
    assert torch.equal(prior.coactivation, ref.coactivation)
    assert torch.allclose(prior.mean_probs, ref.mean_probs, atol=1e-6)
    k = prior.top_k
    assert (prior.usage.sum(-1) == 13 * k).all()
    assert torch.equal(prior.coactivation.diagonal(dim1=1, dim2=2), prior.usage)
    assert torch.equal(prior.coactivation, prior.coactivation.transpose(1, 2))
    # each token contributes k * (k - 1) ordered off-diagonal pairs
    off = prior.coactivation.sum((1, 2)) - prior.usage.sum(-1)
    assert (off == 13 * k * (k - 1)).all()
    assert torch.allclose(prior.mean_probs.sum(-1), torch.ones(prior.num_layers))


def test_provenance_not_given_is_filled_in(tmp_path):
    """A local folder needs no invented model_id, revision or corpus hash: the folder the model
    was loaded from, "local", and a hash of the batches' tokens that padding does not change;
    explicit values are kept as given."""
    from transformers import AutoModelForCausalLM

    make_model("qwen3_moe").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    padded = make_batch(batch=2, seq=8, pad=3, seed=0)
    prior = extract_prior(model, [padded], progress=False)
    assert (prior.model_id, prior.revision) == (str(tmp_path), "local")
    assert prior.corpus_hash.startswith("tokens-sha256:") and len(prior.corpus_hash) == 14 + 64
    rows = [{"input_ids": padded["input_ids"][:1]}, {"input_ids": padded["input_ids"][1:, :5]}]
    assert extract_prior(model, rows, progress=False).corpus_hash == prior.corpus_hash
    other = extract_prior(model, [make_batch(batch=2, seq=8, pad=3, seed=1)], progress=False)
    assert other.corpus_hash != prior.corpus_hash
    # A model built from a config was loaded from nowhere: its class names it.
    assert extract_prior(make_model("qwen3_moe"), [padded], progress=False).model_id == (
        "Qwen3MoeForCausalLM"
    )
    given = _extract(model, [padded])
    assert (given.model_id, given.revision, given.corpus_hash) == ("tiny", "r0", "ab" * 32)
    assert RouterPrior.load(prior.save(tmp_path / "p.safetensors")).meta == prior.meta


def test_mean_probs_match_hand_computation():
    model = make_model("deepseek_v3")
    batch = make_batch(batch=1, seq=6, pad=0)
    prior = _extract(model, [batch])
    inputs = {}
    hooks = [
        h.module.register_forward_pre_hook(lambda m, a, i=h.moe_layer: inputs.update({i: a[0]}))
        for h in find_routers(model)
    ]
    with torch.no_grad():
        model(input_ids=batch["input_ids"])
    for hk in hooks:
        hk.remove()
    for h in find_routers(model):
        s = (inputs[h.moe_layer].reshape(-1, 32) @ h.module.weight.T).sigmoid()
        expected = (s / s.sum(-1, keepdim=True)).mean(0)
        assert torch.allclose(prior.mean_probs[h.moe_layer], expected, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_save_load_round_trip(arch, tmp_path):
    model = make_model(arch)
    prior = _extract(model, [make_batch(seed=s) for s in range(2)])
    path = prior.save(tmp_path / "sub" / "prior.safetensors")
    loaded = RouterPrior.load(path)
    for name in ("mean_probs", "usage", "coactivation"):
        assert torch.equal(getattr(loaded, name), getattr(prior, name))
    assert all(
        torch.equal(a, b) for a, b in zip(loaded.base_weights, prior.base_weights, strict=True)
    )
    assert (loaded.correction_bias is None) == (arch == "qwen3_moe")
    if loaded.correction_bias is not None:
        for a, h in zip(loaded.correction_bias, find_routers(model), strict=True):
            assert torch.equal(a, h.module.e_score_correction_bias)
    assert loaded.meta == prior.meta
    assert loaded.meta["n_tokens"] == prior.n_tokens == 26
    assert loaded.decoder_layers == [h.decoder_layer for h in find_routers(model)]
    sidecar = json.loads(path.with_suffix(".json").read_text())
    assert sidecar["corpus_hash"] == "ab" * 32 and sidecar["model_type"] == model.config.model_type
    assert len(sidecar["summary"]["usage_entropy"]) == 2
    loaded.check_compatible(model)


def test_check_compatible_names_the_mismatch(tmp_path):
    prior = _extract(make_model("qwen3_moe"), [make_batch()])
    with pytest.raises(ValueError, match=r"experts 8 \(prior\) vs 16 \(model\)"):
        prior.check_compatible(random_model("qwen3_moe", num_experts=16))
    with pytest.raises(ValueError, match=r"MoE layers 2 \(prior\) vs 3 \(model\)"):
        prior.check_compatible(random_model("qwen3_moe", num_hidden_layers=3))
    with pytest.raises(ValueError, match=r"hidden size 32 \(prior\) vs 48 \(model\)"):
        prior.check_compatible(random_model("qwen3_moe", hidden_size=48))
    with pytest.raises(ValueError, match=r"model_type 'qwen3_moe' \(prior\) vs 'olmoe'"):
        prior.check_compatible(make_model("olmoe"))


def test_load_rejects_corrupt_foreign_and_missing_files(tmp_path):
    prior = _extract(make_model("qwen3_moe"), [make_batch()])
    path = prior.save(tmp_path / "prior.safetensors")
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match=r"corrupt or unreadable router prior file .*truncated"):
        RouterPrior.load(truncated)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match=r"garbage\.safetensors"):
        RouterPrior.load(garbage)
    foreign = tmp_path / "foreign.safetensors"
    save_file({"x": torch.zeros(2)}, str(foreign))
    with pytest.raises(ValueError, match=r"foreign\.safetensors is not an rpb router prior"):
        RouterPrior.load(foreign)
    with pytest.raises(FileNotFoundError, match=r"nowhere\.safetensors"):
        RouterPrior.load(tmp_path / "nowhere.safetensors")
    with pytest.raises(ValueError, match=r"must not end in \.json"):
        prior.save(tmp_path / "prior.json")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_load_rejects_a_non_finite_prior_in_one_line(tmp_path, value):
    """Issue 47: an all-NaN prior was accepted by `rpb finetune`, and the model ended with dead
    experts."""
    prior = _extract(make_model("qwen3_moe"), [make_batch()])
    bad = RouterPrior(**{**vars(prior), "mean_probs": torch.full_like(prior.mean_probs, value)})
    path = bad.save(tmp_path / "prior.safetensors")
    with pytest.raises(ValueError) as raised:
        RouterPrior.load(path)
    assert str(raised.value) == (
        f"router prior file {path}: mean_probs holds 16 non-finite value(s) (NaN or inf) of 16: "
        "extract the prior again from a healthy model"
    )


def test_inconsistent_prior_is_rejected():
    prior = _extract(make_model("qwen3_moe"), [make_batch()])
    with pytest.raises(ValueError, match=r"usage shape \(2, 7\) != \(2, 8\)"):
        RouterPrior(**{**vars(prior), "usage": torch.zeros(2, 7, dtype=torch.long)})


def test_router_logit_bias_is_stored_and_checked(tmp_path):
    """gpt_oss routers have z = W h + b: the prior carries b0 and a model without it differs."""
    model = random_model("gpt_oss")
    prior = _extract(model, [make_batch()])
    handles = find_routers(model)
    assert all(
        torch.equal(b, h.router_bias) for b, h in zip(prior.router_bias, handles, strict=True)
    )
    loaded = RouterPrior.load(prior.save(tmp_path / "prior.safetensors"))
    assert all(
        torch.equal(a, b) for a, b in zip(loaded.router_bias, prior.router_bias, strict=True)
    )
    with pytest.raises(ValueError, match=r"router_bias must be 2 tensors of shape \(8,\)"):
        RouterPrior(**{**vars(prior), "router_bias": [torch.zeros(7)] * 2})
    plain = _extract(make_model("qwen3_moe"), [make_batch()])
    assert plain.router_bias is None
    with pytest.raises(ValueError, match=r"router logit bias False \(prior\) vs True \(model\)"):
        plain.check_compatible(model)
