"""rpb.routing: router discovery, bit-exact routing functions and the RouterControl hooks."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, make_batch, make_model
from torch import nn

from rpb.architectures import build_config, random_model
from rpb.routing import (
    RouterControl,
    find_routers,
    route,
    routing_log_probs,
    routing_probs,
    selection_scores,
)


def _hidden(handle, t: int = 24, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, handle.hidden_size, generator=g)


def _paired(indices: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # DeepSeek-V3 uses topk(sorted=False): compare after sorting, keeping weights with indices.
    order = indices.argsort(dim=-1)
    return indices.gather(1, order), weights.gather(1, order)


def _experts_of(model: nn.Module, handle) -> nn.Module:
    return model.get_submodule(handle.name.rsplit(".", 1)[0]).experts


def test_find_routers(tiny_model, arch):
    handles = find_routers(tiny_model)
    deepseek = ARCHS[arch][0] == "deepseek_v3"
    # DeepSeek-V3's first layer is dense (first_k_dense_replace=1), so MoE ordinals are shifted.
    assert [h.decoder_layer for h in handles] == ([1, 2] if deepseek else [0, 1])
    assert [h.moe_layer for h in handles] == [0, 1]
    assert all(h.name.endswith("mlp.gate") for h in handles)
    assert {(h.kind, h.num_experts, h.top_k, h.hidden_size) for h in handles} == {
        ("deepseek_v3" if deepseek else "softmax", 8, 2, 32)
    }


def test_find_routers_rejects_a_model_without_routers():
    with pytest.raises(ValueError, match="no MoE router found in Sequential"):
        find_routers(nn.Sequential(nn.Linear(4, 4)))


def test_build_config_rejects_unknown_type_and_field():
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        build_config("llama")
    with pytest.raises(ValueError, match="num_expert"):
        build_config("qwen3_moe", num_expert=4)
    cfg = build_config("deepseek_v3", n_routed_experts=16, num_local_experts=16)
    assert cfg.n_routed_experts == 16 and cfg.first_k_dense_replace == 1


def test_random_model_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b = random_model("deepseek_v3", seed=3), random_model("deepseek_v3", seed=3)
    assert torch.equal(torch.rand(1), before)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not a.training
    bias = find_routers(a)[0].module.e_score_correction_bias
    assert bias.abs().sum() > 0  # non-trivial correction bias
    assert not torch.equal(
        sa[next(iter(sa))], random_model("deepseek_v3", seed=4).state_dict()[next(iter(sa))]
    )


def test_zero_bias_reproduces_library_routing(tiny_model, arch):
    for handle in find_routers(tiny_model):
        h = _hidden(handle, seed=handle.moe_layer)
        with torch.no_grad():
            lib_logits, lib_w, lib_i = handle.module(h)
        e = handle.num_experts
        for kwargs in (
            {},
            {"selection_bias": torch.zeros(e)},
            {"logit_bias": torch.zeros(e), "selection_bias": torch.zeros(h.shape[0], e)},
        ):
            logits, w, i = route(handle, lib_logits, **kwargs)
            assert torch.equal(logits, lib_logits)
            got_i, got_w = _paired(i, w)
            ref_i, ref_w = _paired(lib_i, lib_w)
            assert torch.equal(got_i, ref_i), kwargs
            assert torch.equal(got_w, ref_w), kwargs  # bit-exact, paired with the same experts
            assert w.dtype == lib_w.dtype


def test_grouped_deepseek_selection_is_group_limited():
    model = make_model("deepseek_v3_grouped")
    handle = find_routers(model)[0]
    h = _hidden(handle, t=64)
    logits, _, lib_i = handle.module(h)
    plain = selection_scores("deepseek_v3", logits, handle.correction_bias).topk(2)[1]
    # The group limit must matter on some tokens, or the equivalence test above proves little.
    differs = (plain.sort(-1)[0] != lib_i.sort(-1)[0]).any(-1)
    assert differs.any()
    _, _, i = route(handle, logits, selection_bias=torch.zeros(8))
    assert torch.equal(i.sort(-1)[0], lib_i.sort(-1)[0])


def test_routing_probs_and_log_probs():
    z = torch.randn(5, 8)
    assert torch.allclose(routing_probs("softmax", z), z.softmax(-1))
    s = z.sigmoid()
    assert torch.allclose(routing_probs("deepseek_v3", z), s / s.sum(-1, keepdim=True))
    for kind in ("softmax", "deepseek_v3"):
        assert torch.allclose(routing_log_probs(kind, z).exp(), routing_probs(kind, z), atol=1e-6)


def test_attached_control_leaves_model_outputs_bit_identical(tiny_model, tiny_batch):
    base = [h.module.weight for h in find_routers(tiny_model)]
    for training in (False, True):
        tiny_model.train(training)
        ref = tiny_model(**tiny_batch).logits
        with RouterControl(tiny_model, base) as control:
            control.set_policy(selection_bias=lambda rec: torch.zeros_like(rec.logits))
            out = tiny_model(**tiny_batch).logits
            assert all(r.steered == training for r in control.records)
            # z0 is computed on the router's own input with the library's dtype path.
            assert all(torch.equal(r.base_logits, r.logits) for r in control.records)
        assert torch.equal(out, ref)


def test_bias_changes_selection_and_router_still_gets_gradients(tiny_model, tiny_batch):
    tiny_model.train()
    with RouterControl(tiny_model) as control:
        tiny_model(**tiny_batch)
        native = [r.indices.sort(-1)[0] for r in control.records]
        bias = torch.zeros(8)
        bias[[5, 6]] = 100.0  # experts 5, 6 share a group in the grouped DeepSeek variant
        control.set_policy(selection_bias=bias)
        loss = tiny_model(**tiny_batch).loss
        for rec, nat in zip(control.records, native, strict=True):
            assert (rec.indices.sort(-1)[0] == torch.tensor([5, 6])).all()
            assert not torch.equal(rec.indices.sort(-1)[0], nat)
        loss.backward()
    for handle in find_routers(tiny_model):
        assert handle.module.weight.grad is not None
        assert handle.module.weight.grad.abs().sum() > 0


def test_logit_bias_moves_gate_weights(tiny_model):
    handle = find_routers(tiny_model)[0]
    logits, _, _ = handle.module(_hidden(handle))
    forced = torch.tensor([[0, 1]]).expand(logits.shape[0], 2)
    bias = torch.zeros(8)
    bias[0] = 1.0
    _, w_plain, _ = route(handle, logits, forced_indices=forced)
    biased_logits, w_biased, _ = route(handle, logits, logit_bias=bias, forced_indices=forced)
    assert torch.equal(biased_logits, logits + bias)
    assert (w_biased[:, 0] > w_plain[:, 0]).all()


def test_forced_indices_are_what_the_experts_receive(tiny_model, tiny_batch):
    tiny_model.train()
    received = {}

    def spy(layer):
        def hook(module, args, kwargs):
            received[layer] = (args[1].clone(), args[2].clone())

        return hook

    handles = find_routers(tiny_model)
    spies = [
        _experts_of(tiny_model, h).register_forward_pre_hook(spy(h.moe_layer), with_kwargs=True)
        for h in handles
    ]
    t = tiny_batch["input_ids"].numel()
    forced = (torch.arange(t)[:, None] * 3 + torch.arange(2)) % 8
    with RouterControl(tiny_model) as control:
        control.set_policy(forced_indices=forced)
        tiny_model(**tiny_batch)
        for h, rec in zip(handles, control.records, strict=True):
            idx, w = received[h.moe_layer]
            assert torch.equal(idx, forced)
            assert torch.equal(w, rec.weights)
            # Gate weights come from the live router at the forced experts.
            z = rec.logits.detach()
            if h.kind == "softmax":
                g = z.softmax(-1).gather(1, forced)
                norm = getattr(h.module, "norm_topk_prob", True)  # Mixtral always normalises
            else:
                g, norm = z.sigmoid().gather(1, forced), True
            g = g / g.sum(-1, keepdim=True) if norm else g
            g = g * getattr(h.module, "routed_scaling_factor", 1.0)
            assert torch.allclose(w.detach(), g)
    for s in spies:
        s.remove()


def test_bad_forced_indices_and_base_weights_are_rejected(tiny_model, tiny_batch):
    tiny_model.train()
    with RouterControl(tiny_model) as control:
        control.set_policy(forced_indices=torch.zeros(3, 2, dtype=torch.long))
        with pytest.raises(ValueError, match="forced_indices for MoE layer 0 must be integer"):
            tiny_model(**tiny_batch)
        control.set_policy(forced_indices=torch.full((16, 2), 9))
        with pytest.raises(ValueError, match=r"out of range \[0, 8\)"):
            tiny_model(**tiny_batch)
    with pytest.raises(ValueError, match="base_weights has 1 layers, model has 2"):
        RouterControl(tiny_model, [torch.zeros(8, 32)])
    with pytest.raises(ValueError, match=r"base_weights\[1\] has shape \(8, 16\)"):
        RouterControl(tiny_model, [torch.zeros(8, 32), torch.zeros(8, 16)])


def test_policy_applies_only_in_training_unless_keep_at_eval(tiny_model, tiny_batch):
    bias = torch.zeros(8)
    bias[[5, 6]] = 100.0
    for keep in (False, True):
        with RouterControl(tiny_model, keep_at_eval=keep) as control:
            control.set_policy(selection_bias=bias)
            tiny_model.eval()
            tiny_model(**tiny_batch)
            rec = control.records[0]
            assert rec is not None  # recording always works
            assert rec.steered == keep
            assert (rec.indices.sort(-1)[0] == torch.tensor([5, 6])).all().item() == keep


def test_state_dict_unchanged_and_hooks_removed(tiny_model):
    keys = list(tiny_model.state_dict())
    handles = find_routers(tiny_model)
    control = RouterControl(tiny_model, [h.module.weight * 2 for h in handles])
    assert list(tiny_model.state_dict()) == keys
    assert all(len(h.module._forward_hooks) == 1 for h in handles)
    control.remove()
    assert list(tiny_model.state_dict()) == keys
    assert all(len(h.module._forward_hooks) == 0 for h in handles)


@pytest.mark.parametrize("arch_name", ["qwen3_moe", "deepseek_v3_grouped"])
def test_hooks_survive_gradient_checkpointing(arch_name):
    model = make_model(arch_name)
    model.train()
    enable = getattr(model, "activation_checkpointing_enable", None) or (
        model.gradient_checkpointing_enable
    )
    enable()
    calls = []
    bias = torch.zeros(8)
    bias[[5, 6]] = 100.0

    def counted(rec):
        calls.append(rec.layer)
        return bias

    batch = make_batch()
    with RouterControl(model, [h.module.weight for h in find_routers(model)]) as control:
        control.set_policy(selection_bias=counted)
        loss = model(**batch, use_cache=False).loss
        assert calls == [0, 1]
        loss.backward()
        assert sorted(calls) == [0, 0, 1, 1]  # the recompute fired the hooks again
        assert all((r.indices.sort(-1)[0] == torch.tensor([5, 6])).all() for r in control.records)
    for h in find_routers(model):
        assert h.module.weight.grad is not None and h.module.weight.grad.abs().sum() > 0


def test_weight_distance_is_recorded_in_the_forward(tiny_model, tiny_batch):
    """||W - W0||^2 per router, from the weight the forward used, only when asked for."""
    handles = find_routers(tiny_model)
    base = [h.module.weight.detach() + 0.1 * (i + 1) for i, h in enumerate(handles)]
    with RouterControl(tiny_model, base) as control:
        tiny_model(**tiny_batch)
        assert all(r.weight_sq_dist is None for r in control.records)
    with RouterControl(tiny_model, base, weight_distance=True) as control:
        tiny_model(**tiny_batch)
        for i, (rec, h) in enumerate(zip(control.records, handles, strict=True)):
            assert rec.weight_sq_dist.requires_grad
            expect = torch.tensor(0.01 * (i + 1) ** 2 * h.module.weight.numel())
            assert torch.allclose(rec.weight_sq_dist.detach(), expect, rtol=1e-4)
    with pytest.raises(ValueError, match="weight_distance needs base_weights"):
        RouterControl(tiny_model, weight_distance=True)


def test_build_config_accepts_head_dim_where_the_model_reads_it(tmp_path):
    """Qwen3-30B-A3B's head_dim (128) is twice hidden_size / num_attention_heads (64); the config
    class does not declare it but the attention reads it, so it must reach the model."""
    from transformers import AutoConfig

    model = random_model("qwen3_moe", num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    attn = model.model.layers[0].self_attn
    assert attn.head_dim == 32 and tuple(attn.q_proj.weight.shape) == (64, 32)
    assert model(torch.tensor([[3, 4, 5]])).logits.shape == (1, 3, 64)
    model.config.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).head_dim == 32
    with pytest.raises(ValueError, match="unknown olmoe config field"):
        build_config("olmoe", head_dim=32)  # its q/k norms assume hidden_size: not supported


class _NoisyGate(nn.Module):
    """Qwen-style softmax top-k router that, while training, selects on noisy probabilities:
    a sampling router no top-k description reproduces."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 32))
        self.top_k, self.num_experts, self.norm_topk_prob = 2, 8, True

    def forward(self, hidden: torch.Tensor):
        logits = torch.nn.functional.linear(hidden, self.weight)
        probs = logits.softmax(-1, dtype=torch.float)
        choice = probs + torch.rand_like(probs) if self.training else probs
        idx = choice.topk(2, dim=-1)[1]
        w = probs.gather(1, idx)
        return logits, (w / w.sum(-1, keepdim=True)).to(logits.dtype), idx


def test_a_router_that_samples_while_training_is_refused(saved_registry):
    from rpb.routing import RouterSpec, register_router

    gate = _NoisyGate()
    with pytest.raises(
        ValueError,
        match=r"^router class _NoisyGate: expert indices differ .* \[float32, training\]$",
    ):
        register_router(_NoisyGate, RouterSpec(normalise="norm_topk_prob"), example=gate)


def test_register_router_rejects_what_is_not_a_description(saved_registry):
    from rpb.routing import RouterSpec, register_router

    for spec in ("softmax", [], [RouterSpec(), "softmax"]):
        with pytest.raises(ValueError, match="spec must be a RouterSpec, a list of them or None"):
            register_router(_NoisyGate, spec)
    with pytest.raises(
        ValueError, match=r"RouterSpec.score must be one of \('softmax', 'sigmoid'\)"
    ):
        RouterSpec(score="relu")
    with pytest.raises(ValueError, match="example is a Linear"):
        register_router(_NoisyGate, RouterSpec(), example=nn.Linear(2, 2))


def test_route_spec_with_settings_given_routes_like_the_library(tiny_model, arch):
    """route_spec with the router's settings passed in (not read from a handle) is the library's
    routing: the description alone for softmax routers, DeepSeek-V3's groups, normalisation,
    scaling and correction bias as arguments."""
    from rpb.routing import RouterSpec, route_spec

    handle = find_routers(tiny_model)[0]
    h = _hidden(handle)
    with torch.no_grad():
        logits, lib_w, lib_i = handle.module(h)
    m = handle.module
    if handle.kind == "softmax":
        mixtral = ARCHS[arch][0] == "mixtral"
        spec = RouterSpec(
            normalise=mixtral or m.norm_topk_prob,
            weights_dtype="float32" if mixtral else "logits",
        )
        out = route_spec(spec, logits, 2)
    else:
        out = route_spec(
            handle.spec,
            logits,
            2,
            correction_bias=m.e_score_correction_bias,
            groups=(m.num_group, m.topk_group),
            normalise=m.norm_topk_prob,
            scaling=m.routed_scaling_factor,
        )
    got_i, got_w = _paired(out[2], out[1])
    ref_i, ref_w = _paired(lib_i, lib_w)
    assert torch.equal(got_i, ref_i) and torch.equal(got_w, ref_w)
