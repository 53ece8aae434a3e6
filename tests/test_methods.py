"""rpb.methods: the step-0 invariant, each router term against a hand computation, LBL against
transformers and DeepSeek-V3's formula, hard as the lambda -> infinity limit of rpb, the RPB
readings, what reaches the router weight under every method, and the drift statistics."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from conftest import SOFTMAX_ARCHS, make_batch, make_model, perturb_routers
from method_variants import STEP0_EXACT
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from rpb.methods import GRADIENT_PATHS, METHODS, anneal_factor, make_method, switch_lbl
from rpb.prior import extract_prior
from rpb.routing import RouterControl, find_routers
from rpb.specs import METHOD_SPECS


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
        "rpb_interp",
        "rpb_anneal",
        "rpb_coact",
        "rpb_adaptive",
        "anchor_weight",
        "anchor_logit",
        "anchor_kl",
        "hard",
    }
    assert make_method("rpb").strength == 1.0 and make_method("lbl").strength == 0.001
    with pytest.raises(ValueError, match="unknown router method 'rbp'"):
        make_method("rbp")
    with pytest.raises(ValueError, match=r"^option bias of method 'rpb': unknown option of"):
        make_method("rpb", bias="logits")
    with pytest.raises(ValueError, match=r"^option bias_on of method 'rpb': 'gates' is not one"):
        make_method("rpb", bias_on="gates")
    with pytest.raises(
        ValueError, match=r"^option keep_bias_at_eval of method 'rpb': 'yes' is not true or false"
    ):
        make_method("rpb", keep_bias_at_eval="yes")
    with pytest.raises(ValueError, match=r"^strength of method 'anchor_kl': -1\.0 is not a"):
        make_method("anchor_kl", strength=-1.0)
    with pytest.raises(ValueError, match="'hard' takes no strength"):
        make_method("hard", strength=5.0)
    with pytest.raises(ValueError, match=r"'rpb_interp' takes at most 1.0 \(got 1.5\)"):
        make_method("rpb_interp", strength=1.5)
    with pytest.raises(ValueError, match="option pooling of method 'lbl': 'global' is not one of"):
        make_method("lbl", pooling="global")
    with pytest.raises(ValueError, match="option schedule of method 'rpb_anneal': 'step' is not"):
        make_method("rpb_anneal", schedule="step")


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


@pytest.mark.parametrize("name", list(METHODS))
def test_a_method_trains_without_a_prior_exactly_when_its_spec_needs_none(name, tiny_batch):
    """`MethodSpec.needs_prior` (what the config check reads to refuse a permuted prior that
    would change nothing) matches what the method does: one without it trains with no prior."""
    model = make_model("qwen3_moe").train()
    if METHOD_SPECS[name].needs_prior:
        with pytest.raises(ValueError, match=f"method '{name}' needs a router prior"):
            make_method(name).attach(model)
        return
    with make_method(name).attach(model) as method:
        loss = model(**tiny_batch).loss + method.router_loss()
    assert torch.isfinite(loss)


@pytest.mark.parametrize(("name", "options"), STEP0_EXACT)
def test_step0_outputs_equal_the_base(tiny_model, tiny_prior, tiny_batch, name, options):
    tiny_model.train()  # steering applies in training mode
    ref = tiny_model(**tiny_batch)
    keys = list(tiny_model.state_dict())
    options = dict(options)
    strength = options.pop("strength", None)
    with make_method(name, strength, **options).attach(tiny_model, tiny_prior) as method:
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
    ("name", "options"),
    [
        ("rpb", {"bias_on": "logits", "keep_bias_at_eval": False}),
        ("rpb_marginal", {"strength": 5.0}),
        ("rpb_coact", {"strength": 5.0}),
    ],
)
def test_methods_that_change_step0_routing_do(tiny_model, tiny_prior, tiny_batch, name, options):
    # The control for the invariant above: these variants are allowed to, and do, differ.
    ref_eval = tiny_model(**tiny_batch).logits
    ref_train = tiny_model.train()(**tiny_batch).logits
    options = dict(options)
    strength = options.pop("strength", None)
    with make_method(name, strength, **options).attach(tiny_model, tiny_prior):
        assert not torch.equal(tiny_model(**tiny_batch).logits, ref_train)
        tiny_model.eval()  # the bias is a training-time device (rpb's: when told so)
        assert torch.equal(tiny_model(**tiny_batch).logits, ref_eval)


def test_keep_bias_at_eval(tiny_model, tiny_prior, tiny_batch):
    ref = tiny_model(**tiny_batch).logits  # eval mode
    with make_method("rpb", bias_on="logits", keep_bias_at_eval=False).attach(
        tiny_model, tiny_prior
    ):
        assert torch.equal(tiny_model(**tiny_batch).logits, ref)
    # rpb keeps its bias at evaluation by default (table 1's reading); its variants do not.
    for options in ({}, {"keep_bias_at_eval": True}):
        with make_method("rpb", bias_on="logits", **options).attach(tiny_model, tiny_prior):
            assert not torch.equal(tiny_model(**tiny_batch).logits, ref)
    with make_method("rpb_marginal", 5.0, bias_on="logits").attach(tiny_model, tiny_prior):
        assert torch.equal(tiny_model(**tiny_batch).logits, ref)


@pytest.mark.parametrize("name", ["none", "rpb", "lbl", "anchor_kl"])
def test_attach_turns_the_models_own_lbl_off(name, caplog):
    """A checkpoint with output_router_logits on adds its own load-balancing loss to out.loss
    (the README's plain loop adds the method's term on top): attach turns it off for every
    method, with one warning naming the flag, so out.loss is the plain cross-entropy."""
    import logging

    import torch.nn.functional as F

    base = make_model("qwen3_moe")
    model = copy.deepcopy(base)
    model.config.output_router_logits = True
    batch = make_batch(pad=0)

    def ce(logits):
        shifted = batch["labels"][:, 1:].reshape(-1)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), shifted)

    with torch.no_grad():
        own = model(**batch)
    assert own.aux_loss > 0 and not torch.allclose(own.loss, ce(own.logits))  # the premise
    prior = _prior(base) if METHOD_SPECS[name].needs_prior else None
    with caplog.at_level(logging.WARNING, logger="rpb.methods"):
        method = make_method(name).attach(model, prior)
    with method, torch.no_grad():
        out = model(**batch)
        assert model.config.output_router_logits is False and out.aux_loss is None
        assert torch.equal(out.loss, ce(out.logits))
        assert torch.allclose(out.logits, own.logits, atol=1e-6)  # step 0: the base's function
    (line,) = [r.getMessage() for r in caplog.records]
    assert "output_router_logits" in line and "own load-balancing loss" in line
    caplog.clear()
    with make_method(name).attach(model, prior):  # already off: nothing to say
        pass
    assert caplog.records == []


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


@pytest.mark.parametrize(("pooling", "uniform"), [("pooled", 2.0), ("per_layer", 2.0 * 1.0)])
def test_lbl_on_deepseek_uses_normalised_sigmoid_scores(pooling, uniform):
    model = make_model("deepseek_v3")
    model.train()
    batch = make_batch()
    with make_method("lbl", strength=1.0, pooling=pooling).attach(model) as method:
        model(**batch)
        loss = method.router_loss(batch["attention_mask"])
        loss.backward()
        assert all(h.module.weight.grad.abs().sum() > 0 for h in find_routers(model))
        with torch.no_grad():
            for h in find_routers(model):
                h.module.weight.zero_()
        model(**batch)
        # Uniform scores: pooled, E * sum_e f_e / E = sum_e f_e = k (= 2); per layer and
        # sequence, sum_i (E/(kT) count_i) / E = 1, summed over the 2 MoE layers.
        assert method.router_loss(batch["attention_mask"]).item() == pytest.approx(uniform)


def _deepseek_seq_aux_by_hand(model, batch, alpha):
    """DeepSeek-V3's sequence-wise balance loss written out with loops, per MoE layer and per
    sequence over its non-padding tokens, from router inputs captured without rpb's hooks."""
    routers = find_routers(model)
    hidden = _router_inputs(model, batch)
    mask = batch["attention_mask"]
    n_seq, seq = mask.shape
    total = 0.0
    for h, x in zip(routers, hidden, strict=True):
        gate = h.module
        with torch.no_grad():
            _, _, idx = gate(x)  # the library's own selection (with its correction bias)
        scores = torch.sigmoid(x.float() @ gate.weight.detach().float().T)
        scores = scores / scores.sum(-1, keepdim=True)
        n_exp, k = h.num_experts, h.top_k
        per_seq = []
        for b in range(n_seq):
            rows = [b * seq + t for t in range(seq) if mask[b, t]]
            count = torch.zeros(n_exp)
            for r in rows:
                for e in idx[r].tolist():
                    count[e] += 1
            f = n_exp / (k * len(rows)) * count
            p = torch.stack([scores[r] for r in rows]).mean(0)
            per_seq.append(float((f * p).sum()))
        total += sum(per_seq) / len(per_seq)
    return alpha * total


@pytest.mark.parametrize("arch_name", ["deepseek_v3", "deepseek_v3_grouped"])
def test_lbl_on_deepseek_is_deepseek_v3s_sequence_aux_loss(arch_name):
    model = make_model(arch_name)
    perturb_routers(model, scale=1.0)  # non-uniform scores, so f and P both matter
    model.train()
    batch = make_batch(batch=3, seq=8, pad=3)
    batch["attention_mask"][0, 6:] = 0  # a second padded row of another length
    want = _deepseek_seq_aux_by_hand(model, batch, alpha=0.01)
    method = make_method("lbl", strength=0.01)
    assert method.pooling_for("deepseek_v3") == "per_layer"
    assert method.pooling_for("softmax") == "pooled"
    with method.attach(model):
        model(**batch)
        got = method.router_loss(batch["attention_mask"])
        assert got.item() == pytest.approx(want, rel=1e-5)
        pooled = make_method("lbl", strength=0.01, pooling="pooled")
    # Padding is masked: the same sequences without their padding give the same loss.
    short = {k: v[:1, :6] for k, v in batch.items()}
    with make_method("lbl", strength=0.01).attach(model) as m:
        model(**short)
        one = m.router_loss(short["attention_mask"]).item()
        model(input_ids=short["input_ids"])  # no mask: one sequence per row, no padding
        assert m.router_loss().item() == pytest.approx(one, rel=1e-6)
    assert one == pytest.approx(_deepseek_seq_aux_by_hand(model, short, 0.01), rel=1e-5)
    with pooled.attach(model):
        model(**batch)
        assert pooled.router_loss(batch["attention_mask"]).item() != pytest.approx(want, rel=1e-3)


# Each built-in family's own load-balancing coefficient: (config attribute, its default).
FAMILY_LBL = {
    "qwen3_moe": ("router_aux_loss_coef", 0.001),
    "qwen2_moe": ("router_aux_loss_coef", 0.001),
    "olmoe": ("router_aux_loss_coef", 0.01),
    "mixtral": ("router_aux_loss_coef", 0.001),
    "deepseek_v3": ("aux_loss_alpha", 0.001),  # DeepSeek-V3's / Moonlight's config.json
}


def _family_lbl_model(model_type: str, output_router_logits: bool):
    from family_models import family_model

    model = family_model(model_type)
    perturb_routers(model, scale=1.0)  # far from uniform, so counts and probabilities both matter
    model.config.output_router_logits = output_router_logits
    return model


def _captured_router_logits(model, batch):
    """Every router's logits (its output's first element) on `batch`, by plain forward hooks on
    the router modules of a model no rpb method is attached to."""
    seen = []
    hooks = [
        h.module.register_forward_hook(lambda m, a, out: seen.append(out[0].detach()))
        for h in find_routers(model)
    ]
    with torch.no_grad():
        out = model(**batch)
    for hk in hooks:
        hk.remove()
    return tuple(seen), out


@pytest.mark.parametrize("output_router_logits", [True, False])
@pytest.mark.parametrize("model_type", [f for f in FAMILY_LBL if f != "deepseek_v3"])
def test_lbl_is_each_softmax_familys_own_loss_whatever_output_router_logits(
    model_type, output_router_logits
):
    """lbl on a softmax family = the family's own modelling module's load_balancing_loss_func on
    the router logits (pooled over layers, padding masked), times the family's coefficient,
    whether or not the config asks transformers to return router logits (transformers itself then
    drops the term: no aux_loss)."""
    import importlib

    model = _family_lbl_model(model_type, output_router_logits)
    own_lbl = importlib.import_module(type(model).__module__).load_balancing_loss_func
    attr, default = FAMILY_LBL[model_type]
    assert getattr(type(model.config)(), attr) == default  # transformers' own default
    batch = make_batch(batch=3, seq=8, pad=3)
    batch["attention_mask"][0, 5:] = 0  # padded rows of two lengths
    logits, out = _captured_router_logits(model, batch)
    n_experts, k = find_routers(model)[0].num_experts, find_routers(model)[0].top_k
    ref = own_lbl(logits, n_experts, k, batch["attention_mask"])
    if output_router_logits:  # transformers' term, on the logits it returns, is the same
        assert torch.allclose(out.aux_loss, ref, rtol=0, atol=1e-7)
        assert all(torch.equal(a, b) for a, b in zip(out.router_logits, logits, strict=True))
    else:
        assert out.aux_loss is None and out.router_logits is None
    setattr(model.config, attr, 0.037)  # the coefficient is read from the config, not a table
    method = make_method("lbl", strength="family")
    assert repr(method) == "LBL(strength='family', options={'pooling': 'auto'})"
    method.attach(model)
    # attach turns the model's own loss off; a flag set on again after it is warned about.
    assert model.config.output_router_logits is False
    assert method.turned_off_own_router_loss is output_router_logits
    model.config.output_router_logits = output_router_logits
    with method, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert method.strength == 0.037
        for _ in range(2):  # warned once, at the first router_loss
            model(**batch)
            got = method.router_loss(batch["attention_mask"])
    twice = [w for w in caught if "counts it twice" in str(w.message)]
    assert len(twice) == (1 if output_router_logits else 0)
    assert torch.allclose(got, 0.037 * ref, rtol=1e-6, atol=0)
    # The padding matters here, so a term that ignored the mask would not match.
    assert not torch.allclose(own_lbl(logits, n_experts, k, None), ref, rtol=1e-4)
    setattr(model.config, attr, default)
    model.config.output_router_logits = False
    with make_method("lbl", strength="family").attach(model) as method:
        assert method.strength == default


@pytest.mark.parametrize("output_router_logits", [True, False])
def test_lbl_on_deepseek_v3_is_its_sequence_aux_loss_at_its_alpha(output_router_logits):
    """DeepSeek-V3: transformers computes no auxiliary loss at all (out.aux_loss is None even with
    output_router_logits); lbl is DeepSeek-V3's sequence-wise loss per layer, by hand, at the
    config's aux_loss_alpha, or 0.001 (the released configs' value) when the config has none."""
    model = _family_lbl_model("deepseek_v3", output_router_logits)
    assert not hasattr(model.config, "aux_loss_alpha")  # transformers' config has no such field
    batch = make_batch(batch=3, seq=8, pad=3)
    batch["attention_mask"][0, 6:] = 0
    with torch.no_grad():
        out = model(**batch)
    assert out.aux_loss is None
    want = _deepseek_seq_aux_by_hand(model, batch, alpha=1.0)
    with make_method("lbl", strength="family").attach(model) as method:
        assert method.strength == FAMILY_LBL["deepseek_v3"][1]
        model(**batch)
        got = method.router_loss(batch["attention_mask"])
        assert got.item() == pytest.approx(0.001 * want, rel=1e-5)
    model.config.aux_loss_alpha = 0.0003  # a Moonlight / DeepSeek-V3 checkpoint's own value
    with make_method("lbl", strength="family").attach(model) as method:
        assert method.strength == 0.0003
        model(**batch)
        assert method.router_loss(batch["attention_mask"]).item() == pytest.approx(
            0.0003 * want, rel=1e-5
        )


def test_lbl_family_strength_needs_a_family_coefficient():
    from family_models import family_model

    from rpb.methods import family_lbl_coefficient

    with pytest.raises(ValueError, match="'famly' is neither a number >= 0 nor 'family'"):
        make_method("lbl", strength="famly")
    with pytest.raises(ValueError, match="is a strength of 'lbl' only; give 'anchor_kl' a number"):
        make_method("anchor_kl", strength="family")  # only lbl knows a family's coefficient
    model = family_model("hunyuan_v1_moe")  # a softmax family whose config names no coefficient
    method = make_method("lbl", strength="family")
    with pytest.raises(ValueError, match="hunyuan_v1_moe config has none of router_aux_loss_coef"):
        method.attach(model)
    assert method.control is None  # refused before anything stays hooked
    assert not any(h.module._forward_hooks for h in find_routers(model))
    # A multimodal config's coefficient lives in its text config.
    from transformers import Llama4Config

    config = Llama4Config(text_config={"router_aux_loss_coef": 0.02})
    assert family_lbl_coefficient(config, "sigmoid") == 0.02


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


# --- the RPB readings -------------------------------------------------------------------------


@pytest.mark.parametrize("arch_name", ["qwen3_moe", "deepseek_v3"])
def test_rpb_interp_forward_is_the_base_at_lambda_1_yet_the_router_trains(arch_name):
    base = make_model(arch_name)
    prior = _prior(base)
    model = make_model(arch_name)
    perturb_routers(model, scale=2.0)
    model.train()
    batch = make_batch()
    want = base.train()(**batch).logits
    drifted = model(**batch).logits
    with make_method("rpb_interp", strength=1.0).attach(model, prior) as method:
        out = model(**batch)
        # (1 - 1) z + 1 z0 up to float rounding of z + (z0 - z)
        assert torch.allclose(out.logits, want, atol=1e-5)
        assert not torch.allclose(drifted, want, atol=1e-3), "the drift must matter"
        out.loss.backward()
        assert all(h.module.weight.grad.abs().sum() > 0 for h in find_routers(model))
        for rec in method.control.records:  # selection follows the interpolated logits
            assert torch.equal(rec.indices, method.control.base_topk(rec))
    model.zero_grad()
    with make_method("rpb_interp", strength=0.5).attach(model, prior) as method:
        model(**batch)
        rec = method.control.records[0]
        mixed = method.control.policies[0].logit_bias(rec) + rec.logits
        assert torch.allclose(mixed, 0.5 * rec.logits + 0.5 * rec.base_logits, atol=1e-6)
        assert not method.control.policies[0].logit_bias(rec).requires_grad  # stopgrad


def test_anneal_schedules():
    assert [anneal_factor(p, "linear") for p in (0.0, 0.25, 1.0)] == [1.0, 0.75, 0.0]
    assert anneal_factor(0.5, "cosine") == pytest.approx(0.5)
    assert anneal_factor(0.0, "cosine") == 1.0 and anneal_factor(1.0, "cosine") == 0.0
    method = make_method("rpb_anneal", strength=4.0, schedule="linear")
    method.set_progress(30, 40)
    assert method.current_strength == pytest.approx(1.0)
    with pytest.raises(ValueError, match="step 41 of 40 is out of range"):
        method.set_progress(41, 40)


def test_rpb_anneal_starts_as_rpb_and_ends_as_none():
    base = make_model("deepseek_v3")
    prior = _prior(base)
    model = make_model("deepseek_v3")
    perturb_routers(model, scale=2.0)
    model.train()
    batch = make_batch()

    def picks(name, strength=None, progress=None):
        with make_method(name, strength).attach(model, prior) as m:
            if progress is not None:
                m.set_progress(*progress)
            model(**batch)
            return [r.indices for r in m.control.records]

    rpb, none = picks("rpb", 1e3), picks("none")
    assert any(not torch.equal(a, b) for a, b in zip(rpb, none, strict=True))
    assert all(map(torch.equal, picks("rpb_anneal", 1e3, (0, 10)), rpb))
    assert all(map(torch.equal, picks("rpb_anneal", 1e3, (10, 10)), none))


def test_trainer_callback_sets_the_progress():
    from types import SimpleNamespace

    from rpb.trainer import RoutingDriftCallback

    method = make_method("rpb_anneal", schedule="linear")
    callback = RoutingDriftCallback(SimpleNamespace(router_method=method))
    callback.on_step_begin(None, SimpleNamespace(global_step=15, max_steps=20), None)
    assert method.progress == 0.75 and method.current_strength == pytest.approx(0.25)


def test_rpb_coact_bias_by_hand():
    model = make_model("qwen3_moe")
    prior = _prior(model)
    counts = torch.zeros(2, 8, 8, dtype=torch.long)
    counts[:, 0, 0], counts[:, 0, 5], counts[:, 0, 6] = 10, 4, 2  # P(5|0) = .4, P(6|0) = .2
    counts[:, 1, 1], counts[:, 1, 5] = 20, 10  # P(5|1) = .5
    prior.coactivation = counts
    model.train()
    with make_method("rpb_coact", strength=3.0).attach(model, prior) as method:
        model(**make_batch())
        rec = method.control.records[0]
        base = method.control.base_topk(rec)
        bias = method.control.policies[0].selection_bias(rec)
        for t in range(base.shape[0]):
            chosen = set(base[t].tolist())
            for e in range(8):
                others = [j for j in chosen if j != e]
                share = [counts[0, j, e].item() / max(counts[0, j, j].item(), 1) for j in others]
                want = 3.0 * sum(share) / len(others)
                assert bias[t, e].item() == pytest.approx(want, abs=1e-6), (t, e)


def test_rpb_marginal_on_sigmoid_routers_is_in_score_units():
    model = make_model("deepseek_v3")
    prior = _prior(model)
    model.train()
    with make_method("rpb_marginal", strength=2.0).attach(model, prior) as method:
        model(**make_batch())
        for rec in method.control.records:
            bias = method.control.policies[rec.layer].selection_bias(rec)
            mass = rec.base_logits.float().sigmoid().sum(-1, keepdim=True)
            assert torch.allclose(bias, 2.0 * prior.mean_probs[rec.layer].float() * mass)
            # Same scale as the selection score it is added to (sigmoid scores, not nats).
            assert bias.sum(-1).allclose(2.0 * mass.squeeze(-1), rtol=1e-4)
            assert (bias >= 0).all() and bias.max() < 2.0
    with make_method("rpb_marginal", bias_on="logits").attach(model, prior) as method:
        model(**make_batch())
        rec = method.control.records[0]
        log_pi = prior.mean_probs[0].float().clamp_min(1e-9).log()
        assert torch.allclose(method.control.policies[0].logit_bias(rec), log_pi)


def test_rpb_adaptive_on_deepseek_moves_the_correction_bias_kept_at_eval(tmp_path):
    from transformers import AutoModelForCausalLM

    model = make_model("deepseek_v3")
    prior = _prior(model)
    prior.usage = torch.zeros(2, 8, dtype=torch.long)
    prior.usage[:, 0] = 10
    base_bias = [h.correction_bias.clone() for h in find_routers(model)]
    model.train()
    batch = make_batch()
    with make_method("rpb_adaptive", strength=2.0, update_rate=0.5).attach(model, prior) as m:
        assert m.bias_in == "correction_bias" and not any(p.active for p in m.control.policies)
        model(**batch)
        m.router_loss(batch["attention_mask"])
        m.on_step_end()
        for h, b0 in zip(find_routers(model), base_bias, strict=True):
            assert torch.equal(h.correction_bias, b0 + 2.0 * m.bias[h.moe_layer])
        assert (m.bias[:, 0] == 0.5).all()
        state = m.state_dict()
    # Detached, saved and reloaded, the model keeps routing with it (as DeepSeek-V3 keeps its own).
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for h, b0 in zip(find_routers(reloaded), base_bias, strict=True):
        assert torch.equal(h.correction_bias, b0 + 2.0 * state["bias"][h.moe_layer])
    with pytest.raises(ValueError, match="correction_bias needs a DeepSeek-V3 router"):
        make_method("rpb_adaptive", bias_in="correction_bias").attach(
            make_model("qwen3_moe"), _prior(make_model("qwen3_moe"))
        )


# --- what reaches the router weight ----------------------------------------------------------

# Every method (and the variants that change its gradient path) with the path it documents.
GRADIENT_CASES = [
    ("none", None, {}, "plain"),
    ("lbl", 0.1, {}, "moves_router"),
    ("lbl", 0.1, {"pooling": "pooled"}, "moves_router"),
    ("rpb", 2.0, {}, "selection_only"),
    ("rpb", 2.0, {"bias_on": "logits"}, "moves_router"),
    ("rpb_marginal", 2.0, {}, "selection_only"),
    ("rpb_marginal", 2.0, {"bias_on": "logits"}, "moves_router"),
    ("rpb_interp", 0.5, {}, "moves_router"),
    ("rpb_anneal", 2.0, {}, "selection_only"),
    ("rpb_anneal", 2.0, {"bias_on": "logits"}, "moves_router"),
    ("rpb_coact", 2.0, {}, "selection_only"),
    ("rpb_adaptive", 2.0, {}, "selection_only"),
    ("anchor_weight", 1.0, {}, "moves_router"),
    ("anchor_logit", 1.0, {}, "moves_router"),
    ("anchor_kl", 1.0, {}, "moves_router"),
    ("hard", None, {}, "selection_only"),
    ("hard", None, {"keep_bias_at_eval": False}, "selection_only"),
    ("hard", None, {"gate_from": "base"}, "none"),
]


def test_every_method_has_a_gradient_case():
    assert {case[0] for case in GRADIENT_CASES} == set(METHODS)
    assert {case[3] for case in GRADIENT_CASES} == set(GRADIENT_PATHS)


@pytest.mark.parametrize("arch_name", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize(("name", "strength", "options", "path"), GRADIENT_CASES)
def test_what_reaches_the_router_weight(arch_name, name, strength, options, path):
    """Under each method, the router-weight gradient of task loss + router term, against plain
    fine-tuning's with the method's own expert selection forced: equal (bit for bit) where the
    method only chooses experts, different where it claims to move the router, absent for
    gate_from: base. Routers are perturbed so z != z0 and every bias matters."""
    base = make_model(arch_name)
    prior = _prior(base)
    model = make_model(arch_name)
    perturb_routers(model, scale=2.0)
    model.train()
    batch = make_batch()
    method = make_method(name, strength, **options)
    assert method.gradient_path == path
    with method.attach(model, prior):
        if name == "rpb_adaptive":  # a learned bias that changes the selection
            method.load_state_dict({"bias": torch.randn(method.bias.shape).sign() * 0.3})
        out = model(**batch)
        (out.loss + method.router_loss(batch["attention_mask"])).backward()
        chosen = [r.indices.clone() for r in method.control.records]
        grads = [h.module.weight.grad for h in find_routers(model)]
        grads = [None if g is None else g.clone() for g in grads]
    model.zero_grad(set_to_none=True)
    with RouterControl(model) as control:  # plain fine-tuning, the same experts
        for layer, idx in enumerate(chosen):
            control.set_policy(layer, forced_indices=idx)
        model(**batch).loss.backward()
        plain = [h.module.weight.grad for h in find_routers(model)]
    if path == "none":
        assert all(g is None or not g.any() for g in grads)
        return
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    same = all(torch.equal(g, p) for g, p in zip(grads, plain, strict=True))
    if path in ("plain", "selection_only"):
        assert same, f"{name} {options}: documented as {path}, yet its gradient differs"
    else:
        assert not same, f"{name} {options}: claims to move the router, yet adds no gradient"


def test_config_check_knows_the_new_methods_limits():
    """The config's parse (`MethodEntry.parse`, which check_config runs once) knows the limits."""
    from rpb.pipeline.plan import MethodEntry

    MethodEntry.parse("rpb_interp", {"strength": 1.0})
    MethodEntry.parse("rpb_linf", {"kind": "hard", "options": {"keep_bias_at_eval": False}})
    MethodEntry.parse("lbl", {"options": {"pooling": "per_layer"}})
    with pytest.raises(ValueError, match=r"methods.mix.strength: 'rpb_interp' takes at most"):
        MethodEntry.parse("mix", {"kind": "rpb_interp", "strength": 2.0})
    with pytest.raises(ValueError, match=r"options.schedule: 'step' is not one of"):
        MethodEntry.parse("rpb_anneal", {"options": {"schedule": "step"}})


def test_pooled_lbl_is_far_weaker_than_per_layer_at_moonlights_shape():
    """Why the family's own formula matters (docs/methods.md): at Moonlight's shape (E = 64,
    K = 6, 26 MoE layers) on random sigmoid routers, counts pooled over layers give about K / L of
    the per-layer loss and a far smaller balancing gradient on any one layer."""
    from rpb.methods import sequence_lbl
    from rpb.routing import routing_probs

    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(4 * 64, 64, generator=g).requires_grad_() for _ in range(26)]
    picks = [z.detach().sigmoid().topk(6, -1)[1] for z in logits]
    mask = torch.ones(4, 64)
    probs = [routing_probs("deepseek_v3", z) for z in logits]
    pooled = switch_lbl(probs, picks, 64, mask.reshape(-1))
    per_layer = sequence_lbl(probs, picks, 64, mask)
    assert (pooled / per_layer).item() == pytest.approx(6 / 26, rel=0.1)
    grad_pooled = torch.autograd.grad(pooled, logits[0], retain_graph=True)[0].norm()
    grad_layer = torch.autograd.grad(per_layer, logits[0])[0].norm()
    assert (grad_pooled / grad_layer).item() < 0.1
