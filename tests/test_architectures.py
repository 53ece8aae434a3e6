"""rpb.architectures: tiny configs of every family (transformers' own classes, layered defaults,
aliases, refused typos) and random models (router redraws that change nothing else).

Already covered elsewhere: unknown type/field refusal and determinism (tests/test_routing.py),
head_dim where the model reads it (ibid.), two MoE layers of 8 experts top-2 per family and the
model-type lists against the registry (tests/test_families.py)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from rpb.architectures import (
    PRETRAIN_MODEL_TYPES,
    SUPPORTED_MODEL_TYPES,
    TINY_MODEL_TYPES,
    build_config,
    random_model,
)
from rpb.routing import find_routers


def test_type_lists_nest_in_order():
    assert PRETRAIN_MODEL_TYPES == ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v3")
    assert TINY_MODEL_TYPES[:5] == PRETRAIN_MODEL_TYPES
    assert tuple(t for t in TINY_MODEL_TYPES if t != "phimoe") == SUPPORTED_MODEL_TYPES
    assert len(set(TINY_MODEL_TYPES)) == len(TINY_MODEL_TYPES)


@pytest.mark.parametrize("model_type", TINY_MODEL_TYPES)
def test_every_tiny_config_is_transformers_own_class_with_the_tiny_defaults(model_type):
    config = build_config(model_type)
    assert type(config) is CONFIG_MAPPING[model_type]
    assert config.model_type == model_type
    assert (config.vocab_size, config.hidden_size, config.num_attention_heads) == (64, 32, 4)
    assert (config.pad_token_id, config.tie_word_embeddings) == (0, False)
    # Hybrid families list one kind per layer: the list must cover exactly the layers built.
    for key in ("layer_types", "mlp_layer_types"):
        kinds = getattr(config, key, None)
        if isinstance(kinds, list):
            assert len(kinds) == config.num_hidden_layers, key


def test_overrides_beat_family_defaults_which_beat_common_ones():
    assert build_config("qwen3_moe").num_hidden_layers == 2  # common
    assert build_config("deepseek_v3").num_hidden_layers == 3  # family (layer 0 is dense)
    assert build_config("deepseek_v3", num_hidden_layers=5).num_hidden_layers == 5
    assert build_config("olmoe", intermediate_size=48).intermediate_size == 48  # family key
    # An override is not remembered: the next call gets the defaults again.
    assert build_config("deepseek_v3").num_hidden_layers == 3
    assert build_config("olmoe").intermediate_size == 32


@pytest.mark.parametrize(
    ("model_type", "alias", "field"),
    [
        ("mixtral", "num_experts", "num_local_experts"),
        ("qwen3_moe", "num_local_experts", "num_experts"),
        ("deepseek_v3", "num_local_experts", "n_routed_experts"),
        ("ernie4_5_moe", "num_experts_per_tok", "moe_k"),
    ],
)
def test_an_alias_override_replaces_the_family_default(model_type, alias, field):
    """The family default sits under the real field name and the override under its alias: the
    override must still win."""
    assert getattr(build_config(model_type, **{alias: 4}), field) == 4


def test_unknown_fields_are_all_named_sorted_and_unsupported_types_list_the_supported():
    with pytest.raises(ValueError, match=r"^unknown mixtral config field\(s\): n_experts, topk$"):
        build_config("mixtral", topk=2, n_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError) as err:
        build_config("Qwen3_moe")
    assert str(err.value).startswith("unsupported model_type 'Qwen3_moe' (supported: qwen3_moe, ")
    assert all(t in str(err.value) for t in TINY_MODEL_TYPES)
    # attn_implementation is not a config field but every model accepts it.
    assert build_config("olmoe", attn_implementation="eager")._attn_implementation == "eager"


def test_random_model_builds_what_an_alias_asks_for():
    handles = find_routers(random_model("mixtral", num_experts=4, num_experts_per_tok=1))
    assert {(h.num_experts, h.top_k) for h in handles} == {(4, 1)}


def _router_params(model):
    return [h.weight for h in find_routers(model)]


def test_router_std_scales_the_router_draw_and_changes_nothing_else():
    a = random_model("qwen3_moe", seed=1, router_std=0.5)
    b = random_model("qwen3_moe", seed=1, router_std=1.0)
    for wa, wb in zip(_router_params(a), _router_params(b), strict=True):
        assert torch.equal(2 * wa, wb)  # the same normal draw, scaled
    routers = {id(w) for w in _router_params(a)}
    others_a = {n: p for n, p in a.named_parameters() if id(p) not in routers}
    others_b = dict(b.named_parameters())
    assert others_a and all(torch.equal(p, others_b[n]) for n, p in others_a.items())


def test_default_router_std_is_one_over_sqrt_hidden():
    for hidden in (32, 128):
        model = random_model("olmoe", hidden_size=hidden)
        weights = torch.cat([w.reshape(-1) for w in _router_params(model)])
        assert weights.mean().abs() < 0.2 / math.sqrt(hidden)
        assert weights.std().item() == pytest.approx(1 / math.sqrt(hidden), rel=0.15)


def test_correction_biases_are_drawn_with_the_given_std():
    def biases(**kw):
        return [h.correction_bias.clone() for h in find_routers(random_model("deepseek_v3", **kw))]

    zero = biases(correction_bias_std=0.0)
    assert all(not b.any() for b in zero)  # transformers' own init: zeros
    default, doubled = biases(), biases(correction_bias_std=0.1)
    assert all(b.abs().sum() > 0 for b in default)
    for b1, b2 in zip(default, doubled, strict=True):
        assert torch.allclose(2 * b1, b2)


def test_router_logit_biases_are_drawn_too():
    handles = find_routers(random_model("gpt_oss"))
    assert handles and all(
        h.router_bias is not None and h.router_bias.abs().sum() > 0 for h in handles
    )


def test_char_tokenizer_round_trips_and_fits_a_random_model() -> None:
    """The examples' tokenizer (no pipeline import): one token per character, `<eos>` one token,
    decode(encode(x)) == x, ids below len(tokenizer) so a random model of that vocabulary takes
    them, right padding with `<pad>`."""
    from rpb.architectures import char_tokenizer

    tok = char_tokenizer()
    text = "12+34=46<eos>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len("12+34=46") + 1 and ids[-1] == tok.eos_token_id == 1
    assert tok.decode(ids) == text and max(ids) < len(tok)
    batch = tok(["1+1=2", "10+10=20"], padding=True, return_tensors="pt")
    assert batch["input_ids"][0, -1].item() == tok.pad_token_id == 0
    with pytest.raises(Exception):  # noqa: B017 - no unknown token: a stray symbol is an error
        tok("abc", add_special_tokens=False)
