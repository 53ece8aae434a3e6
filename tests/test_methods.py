"""rpb.methods: the step-0 invariant, each router term against a hand computation, LBL against
transformers, hard as the lambda -> infinity limit of rpb, and the drift statistics."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import SOFTMAX_ARCHS, make_batch, make_model, perturb_routers
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from rpb.methods import METHODS, make_method, switch_lbl
from rpb.prior import extract_prior
from rpb.routing import find_routers

# Every method variant that must compute exactly the base model's outputs at step 0.
STEP0_EXACT = [
    ("none", {}),
    ("lbl", {}),
    ("rpb", {}),
    ("rpb", {"keep_bias_at_eval": True}),
    ("rpb_adaptive", {}),
    ("anchor_weight", {}),
    ("anchor_logit", {}),
    ("anchor_kl", {}),
    ("hard", {}),
    ("hard", {"gate_from": "base"}),
]


def _prior(model):
    return extract_prior(
        model, [make_batch()], model_id="m", revision="r", corpus_hash="h", progress=False
    )


def _router_inputs(model, batch):
    """Each router's input hidden states [T, H], captured independently of rpb's hooks."""
    seen = {}
    hooks = [
        h.module.register_forward_pre_hook(
            lambda m, a, i=h.moe_layer: seen.update({i: a[0].reshape(-1, m.weight.shape[1])})
        )
        for h in find_routers(model)
    ]
    with torch.no_grad():
        model(**batch)
    for hk in hooks:
        hk.remove()
    return [seen[i] for i in sorted(seen)]


def test_registry_and_bad_input():
    assert set(METHODS) == {
        "none",
        "lbl",
        "rpb",
        "rpb_marginal",
        "rpb_adaptive",
        "anchor_weight",
        "anchor_logit",
        "anchor_kl",
        "hard",
    }
    assert make_method("rpb").strength == 1.0 and make_method("lbl").strength == 0.001
    with pytest.raises(ValueError, match="unknown router method 'rbp'"):
        make_method("rbp")
    with pytest.raises(ValueError, match=r"unknown option\(s\) bias for method 'rpb'"):
        make_method("rpb", bias="logits")
    with pytest.raises(ValueError, match="option bias_on of method 'rpb' must be one of"):
        make_method("rpb", bias_on="gates")
    with pytest.raises(
        ValueError, match=r"option keep_bias_at_eval of method 'rpb' must be true or false"
    ):
        make_method("rpb", keep_bias_at_eval="yes")
    with pytest.raises(ValueError, match="strength of method 'anchor_kl'"):
        make_method("anchor_kl", strength=-1.0)
    with pytest.raises(ValueError, match="method 'hard' takes no strength"):
        make_method("hard", strength=5.0)


def test_prior_is_required_and_checked(tiny_model, tiny_prior):
    with pytest.raises(ValueError, match="method 'rpb' needs a router prior"):
        make_method("rpb").attach(tiny_model)
    other = make_model("olmoe" if tiny_model.config.model_type != "olmoe" else "qwen3_moe")
    with pytest.raises(ValueError, match="does not match the model"):
        make_method("none").attach(other, tiny_prior)
    method = make_method("lbl").attach(tiny_model)
    with pytest.raises(RuntimeError, match="already attached"):
        method.attach(tiny_model)
    with pytest.raises(RuntimeError, match="no routed forward recorded"):
        method.router_loss()
    method.detach()
    with pytest.raises(RuntimeError, match="not attached"):
        method.router_loss()


@pytest.mark.parametrize(("name", "options"), STEP0_EXACT)
def test_step0_outputs_equal_the_base(tiny_model, tiny_prior, tiny_batch, name, options):
    tiny_model.train()  # steering applies in training mode
    ref = tiny_model(**tiny_batch)
    keys = list(tiny_model.state_dict())
    with make_method(name, **options).attach(tiny_model, tiny_prior) as method:
        out = tiny_model(**tiny_batch)
        assert torch.equal(out.logits, ref.logits)
        loss = method.router_loss(tiny_batch["attention_mask"])
        if name.startswith("anchor"):
            assert loss.item() == 0.0
        stats = method.routing_stats()
        assert stats["mean/kl_to_base"] == 0.0 and stats["mean/topk_overlap_with_base"] == 1.0
    assert list(tiny_model.state_dict()) == keys
    assert all(not h.module._forward_hooks for h in find_routers(tiny_model))


@pytest.mark.parametrize(
    ("name", "options"), [("rpb", {"bias_on": "logits"}), ("rpb_marginal", {"strength": 5.0})]
)
def test_methods_that_change_step0_routing_do(tiny_model, tiny_prior, tiny_batch, name, options):
    # The control for the invariant above: these variants are allowed to, and do, differ.
    ref_eval = tiny_model(**tiny_batch).logits
    ref_train = tiny_model.train()(**tiny_batch).logits
    options = dict(options)
    strength = options.pop("strength", None)
    with make_method(name, strength, **options).attach(tiny_model, tiny_prior):
        assert not torch.equal(tiny_model(**tiny_batch).logits, ref_train)
        tiny_model.eval()  # the bias is a training-time device by default
        assert torch.equal(tiny_model(**tiny_batch).logits, ref_eval)


def test_keep_bias_at_eval(tiny_model, tiny_prior, tiny_batch):
    ref = tiny_model(**tiny_batch).logits  # eval mode
    with make_method("rpb", bias_on="logits").attach(tiny_model, tiny_prior):
        assert torch.equal(tiny_model(**tiny_batch).logits, ref)
    with make_method("rpb", bias_on="logits", keep_bias_at_eval=True).attach(
        tiny_model, tiny_prior
    ):
        assert not torch.equal(tiny_model(**tiny_batch).logits, ref)


@pytest.mark.parametrize("name", ["anchor_weight", "anchor_logit", "anchor_kl"])
def test_anchor_terms_match_hand_computation(arch, name):
    model = make_model(arch)
    prior = _prior(model)
    base = [w.clone() for w in prior.base_weights]
    perturb_routers(model)
    batch = make_batch(seed=5)
    mask = batch["attention_mask"].reshape(-1).float()
    hidden = _router_inputs(model, batch)
    kind = find_routers(model)[0].kind
    with make_method(name, strength=0.3).attach(model, prior) as method:
        model(**batch)
        loss = method.router_loss(batch["attention_mask"])
    per_layer = []
    for h, w0, x in zip(find_routers(model), base, hidden, strict=True):
        w = h.module.weight.detach()
        z, z0 = x @ w.T, x @ w0.T
        if name == "anchor_weight":
            per_layer.append(((w - w0) ** 2).sum())
            continue
        if name == "anchor_logit":
            tok = ((z - z0) ** 2).sum(-1)
        else:
            if kind == "softmax":
                p, p0 = z.softmax(-1), z0.softmax(-1)
            else:
                p, p0 = z.sigmoid() / z.sigmoid().sum(-1, keepdim=True), z0.sigmoid()
                p0 = p0 / p0.sum(-1, keepdim=True)
            tok = (p0 * (p0.log() - p.log())).sum(-1)
        per_layer.append((tok * mask).sum() / mask.sum())
    agg = sum(per_layer) if name == "anchor_weight" else sum(per_layer) / len(per_layer)
    assert loss.item() > 0
    assert loss.item() == pytest.approx(0.3 * agg.item(), rel=1e-4)


@pytest.mark.parametrize("arch_name", SOFTMAX_ARCHS)
@pytest.mark.parametrize("masked", [False, True])
def test_lbl_matches_transformers(arch_name, masked):
    model = make_model(arch_name)
    model.train()
    batch = make_batch()
    mask = batch["attention_mask"] if masked else None
    with make_method("lbl", strength=2.0).attach(model) as method:
        out = model(input_ids=batch["input_ids"], attention_mask=mask, output_router_logits=True)
        loss = method.router_loss(mask)
        loss.backward()
    ref = load_balancing_loss_func(out.router_logits, 8, 2, mask)
    assert torch.allclose(loss, 2.0 * ref, rtol=0, atol=1e-7)
    assert all(h.module.weight.grad.abs().sum() > 0 for h in find_routers(model))
    # Our pooled formula (used for DeepSeek-V3) is the same function on softmax routing.
    probs = [z.softmax(-1) for z in out.router_logits]
    picks = [p.topk(2)[1] for p in probs]
    flat = None if mask is None else mask.reshape(-1)
    assert torch.allclose(switch_lbl(probs, picks, 8, flat), ref, atol=1e-6)


def test_lbl_on_deepseek_uses_normalised_sigmoid_scores():
    model = make_model("deepseek_v3")
    model.train()
    batch = make_batch()
    with make_method("lbl", strength=1.0).attach(model) as method:
        model(**batch)
        loss = method.router_loss(batch["attention_mask"])
        loss.backward()
        assert all(h.module.weight.grad.abs().sum() > 0 for h in find_routers(model))
        with torch.no_grad():  # uniform scores: E * sum_e f_e / E = sum_e f_e = k
            for h in find_routers(model):
                h.module.weight.zero_()
        model(**batch)
        assert method.router_loss(batch["attention_mask"]).item() == pytest.approx(2.0)


def test_hard_is_rpb_with_huge_lambda(tiny_model, tiny_prior, tiny_batch):
    perturb_routers(tiny_model, scale=2.0)
    tiny_model.train()
    runs = {}
    for name, strength in (("hard", None), ("rpb", 1e6), ("none", None)):
        with make_method(name, strength).attach(tiny_model, tiny_prior) as method:
            tiny_model(**tiny_batch)
            runs[name] = [r.indices.sort(-1)[0] for r in method.control.records]
    assert all(torch.equal(a, b) for a, b in zip(runs["hard"], runs["rpb"], strict=True))
    # the perturbed live router really does choose differently, so the comparison has teeth
    assert any(not torch.equal(a, b) for a, b in zip(runs["hard"], runs["none"], strict=True))


def test_hard_gate_from_base_reproduces_the_base_after_drift(tiny_model, tiny_prior, tiny_batch):
    base = copy.deepcopy(tiny_model).train()
    perturb_routers(tiny_model, scale=2.0)
    tiny_model.train()
    with make_method("hard", gate_from="base").attach(tiny_model, tiny_prior):
        out = tiny_model(**tiny_batch)
        assert torch.equal(out.logits, base(**tiny_batch).logits)
        out.loss.backward()
    assert all(h.module.weight.grad is None for h in find_routers(tiny_model))
    with make_method("hard").attach(tiny_model, tiny_prior):  # gate_from live: router learns
        tiny_model(**tiny_batch).loss.backward()
    assert all(h.module.weight.grad.abs().sum() > 0 for h in find_routers(tiny_model))


def test_rpb_marginal_bias_is_log_prior():
    model = make_model("qwen3_moe")
    prior = _prior(model)
    prior.mean_probs = torch.full((2, 8), 1e-6)
    prior.mean_probs[:, [3, 4]] = 0.5
    model.train()
    with make_method("rpb_marginal", strength=10.0).attach(model, prior) as method:
        model(**make_batch())
        for rec in method.control.records:
            assert (rec.indices.sort(-1)[0] == torch.tensor([3, 4])).all()
            bias = method.control.policies[rec.layer].selection_bias(rec)
            assert torch.allclose(bias, 10.0 * prior.mean_probs[rec.layer].log())


def test_rpb_adaptive_sign_rule_pulls_usage_toward_prior():
    model = make_model("qwen3_moe")
    prior = _prior(model)
    prior.usage = torch.zeros(2, 8, dtype=torch.long)
    prior.usage[:, 0] = 10  # the prior wants expert 0 only
    model.train()
    batch = make_batch()
    flat = batch["attention_mask"].reshape(-1).bool()
    with make_method("rpb_adaptive", strength=2.0, update_rate=0.5).attach(model, prior) as m:
        model(**batch)
        m.router_loss(batch["attention_mask"])
        live = [torch.bincount(r.indices[flat].reshape(-1), minlength=8) for r in m.control.records]
        m.on_step_end()
        for layer, counts in enumerate(live):
            frac = counts / counts.sum()
            assert torch.equal(m.bias[layer], 0.5 * torch.sign(prior.usage_probs[layer] - frac))
        assert (m.bias[:, 0] == 0.5).all()
        for _ in range(40):  # applied bias is strength * b: expert 0 ends up on every token
            model(**batch)
            m.router_loss(batch["attention_mask"])
            m.on_step_end()
        assert all((r.indices == 0).any(-1).all() for r in m.control.records)
        state = m.state_dict()
    resumed = make_method("rpb_adaptive", strength=2.0).attach(model, prior)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.bias, state["bias"]) and state["bias"].abs().sum() > 0
    with pytest.raises(ValueError, match="rpb_adaptive state must be"):
        resumed.load_state_dict({"bias": torch.zeros(3)})
    resumed.detach()


def test_routing_stats(tiny_model, tiny_prior, tiny_batch):
    with make_method("none").attach(tiny_model) as method:
        tiny_model(**tiny_batch)
        stats = method.routing_stats(tiny_batch["attention_mask"])
    assert set(stats) == {"layer0/usage_entropy", "layer1/usage_entropy", "mean/usage_entropy"}
    perturb_routers(tiny_model, scale=2.0)
    with make_method("none").attach(tiny_model, tiny_prior) as method:
        tiny_model(**tiny_batch)
        stats = method.routing_stats(tiny_batch["attention_mask"])
        flat = tiny_batch["attention_mask"].reshape(-1).bool()
        rec = method.control.records[1]
        counts = torch.bincount(rec.indices[flat].reshape(-1), minlength=8).double()
        q = counts[counts > 0] / counts.sum()
        assert stats["layer1/usage_entropy"] == pytest.approx(
            float(-(q * q.log()).sum() / math.log(8))
        )
    for key in ("kl_to_base", "topk_overlap_with_base", "usage_entropy"):
        assert stats[f"mean/{key}"] == pytest.approx(
            (stats[f"layer0/{key}"] + stats[f"layer1/{key}"]) / 2
        )
    assert stats["mean/kl_to_base"] > 0 and stats["mean/topk_overlap_with_base"] < 1
    assert 0 < stats["mean/usage_entropy"] <= 1


def test_stats_describe_the_live_router_not_the_biased_selection(
    tiny_prior, tiny_model, tiny_batch
):
    perturb_routers(tiny_model, scale=2.0)
    tiny_model.train()
    with make_method("none").attach(tiny_model, tiny_prior) as m:
        tiny_model(**tiny_batch)
        plain = m.routing_stats()
    with make_method("hard").attach(tiny_model, tiny_prior) as m:
        tiny_model(**tiny_batch)
        steered = m.routing_stats()
    # Layer 0 sees the same hidden states either way (deeper layers see hard routing's effects).
    layer0 = [k for k in plain if k.startswith("layer0/")]
    assert len(layer0) == 3
    assert {k: steered[k] for k in layer0} == pytest.approx({k: plain[k] for k in layer0})


@pytest.mark.parametrize("arch_name", ["qwen3_moe", "deepseek_v3"])
def test_anchor_kl_trains_under_gradient_checkpointing(arch_name):
    model = make_model(arch_name)
    prior = _prior(model)
    perturb_routers(model)
    model.train()
    model.activation_checkpointing_enable()
    batch = make_batch()
    with make_method("anchor_kl").attach(model, prior) as method:
        out = model(**batch, use_cache=False)
        (out.loss + method.router_loss(batch["attention_mask"])).backward()
    assert all(h.module.weight.grad.abs().sum() > 0 for h in find_routers(model))


def test_reentrant_checkpointing_is_refused_not_silently_ignored():
    model = make_model("qwen3_moe")
    prior = _prior(model)
    model.train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    batch = make_batch()
    with make_method("anchor_kl").attach(model, prior) as method:
        model(**batch, use_cache=False)
        with pytest.raises(RuntimeError, match=r"carry no gradient.*use_reentrant=False"):
            method.router_loss(batch["attention_mask"])


def _anchor_weight_loss_and_grads(model, prior, batch, strength=0.3):
    """anchor_weight's term of one training forward and the router gradients it gives."""
    with make_method("anchor_weight", strength=strength).attach(model, prior) as method:
        model(**batch, use_cache=False)
        loss = method.router_loss(batch["attention_mask"])
        loss.backward()
    return loss.detach(), [h.module.weight.grad.clone() for h in find_routers(model)]


@pytest.mark.parametrize("arch_name", ["qwen3_moe", "deepseek_v3"])
def test_anchor_weight_from_the_forward_equals_the_weight_formula(arch_name):
    """Taken inside the router hook (where FSDP has the full weight), the term and its gradient
    are exactly strength * sum_l ||W_l - W0_l||^2 computed from the parameters directly, with
    and without (non-reentrant) gradient checkpointing."""
    model = make_model(arch_name)
    prior = _prior(model)
    perturb_routers(model)
    model.train()
    direct = copy.deepcopy(model)
    total = sum(
        (h.module.weight.float() - w0.float()).pow(2).sum()
        for h, w0 in zip(find_routers(direct), prior.base_weights, strict=True)
    )
    (0.3 * total).backward()
    want = [h.module.weight.grad for h in find_routers(direct)]
    batch = make_batch()
    loss, grads = _anchor_weight_loss_and_grads(copy.deepcopy(model), prior, batch)
    assert loss > 0 and torch.equal(loss, (0.3 * total).detach())
    assert all(torch.equal(g, w) for g, w in zip(grads, want, strict=True))
    model.activation_checkpointing_enable()  # the hook fires again on recompute
    loss_ckpt, grads_ckpt = _anchor_weight_loss_and_grads(model, prior, batch)
    assert torch.equal(loss_ckpt, loss)
    assert all(torch.equal(g, w) for g, w in zip(grads_ckpt, want, strict=True))


def test_anchor_weight_never_reads_the_weight_after_the_forward():
    """After the forward an FSDP-sharded router holds only its shard (here: a stand-in tensor of
    another shape); the loss must come from what the hook saw."""
    model = make_model("qwen3_moe")
    prior = _prior(model)
    perturb_routers(model)
    model.train()
    batch = make_batch()
    with make_method("anchor_weight").attach(model, prior) as method:
        model(**batch)
        want = method.router_loss(batch["attention_mask"]).detach()
        for h in find_routers(model):
            h.module.weight = torch.nn.Parameter(torch.zeros(1, h.hidden_size))
        assert torch.equal(method.router_loss(batch["attention_mask"]).detach(), want)
    assert want > 0


def test_anchor_weight_needs_a_forward_with_gradients():
    model = make_model("qwen3_moe")
    prior = _prior(model)
    model.train()
    with make_method("anchor_weight").attach(model, prior) as method:
        with pytest.raises(RuntimeError, match="no routed forward"):
            method.router_loss()
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": True}
        )
        model(**make_batch(), use_cache=False)
        with pytest.raises(RuntimeError, match=r"carry no gradient.*use_reentrant=False"):
            method.router_loss()
