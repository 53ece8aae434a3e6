"""Tiny configs and random models of the transformers MoE families that rpb routes.

`build_config` returns transformers' own config class for a model type with tiny defaults (any
field can be overridden, so the same call builds the tiny testbed bases and paper-shaped test
models); `random_model` instantiates one deterministically with non-trivial routing. The pipeline
pretrains tiny bases of the first five (`PRETRAIN_MODEL_TYPES`); the others exist so every
registered family is tested on a model of its own config class.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from rpb.router_specs import routed_model_types

__all__ = [
    "PRETRAIN_MODEL_TYPES",
    "SUPPORTED_MODEL_TYPES",
    "TINY_MODEL_TYPES",
    "build_config",
    "random_model",
]

_COMMON: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# Per family: the expert-count key differs, and each family's expert FFN width lives in a
# different field (OLMoE and Mixtral size experts with `intermediate_size`).
_FAMILY: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,  # as Qwen3-30B-A3B
        "router_aux_loss_coef": 0.001,
    },
    "qwen2_moe": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "router_aux_loss_coef": 0.001,
    },
    "olmoe": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
        "router_aux_loss_coef": 0.01,
    },
    "mixtral": {
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
        "router_jitter_noise": 0.0,
        "router_aux_loss_coef": 0.001,
    },
    # Moonlight-16B-A3B's routing: sigmoid scores + correction bias (noaux_tc), one group,
    # renormalised top-k weights scaled by 2.446, 2 shared experts, first layer dense. Three layers
    # by default so that, with layer 0 dense, the tiny model still has two MoE layers.
    "deepseek_v3": {
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 2,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.446,
        "q_lora_rank": None,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "num_mtp_layers": 0,
    },
}

PRETRAIN_MODEL_TYPES: tuple[str, ...] = tuple(_FAMILY)

# The other families: two layers, 8 experts, top-2, every layer MoE; hybrid families get one
# layer of each kind. Values are the tiny ones; each family's own routing options are kept at
# their defaults unless the routing path needs exercising (groups, scaling).
_HEAD8 = {"head_dim": 8}
_FAMILY.update(
    {
        "glm4_moe": {
            **_HEAD8,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "first_k_dense_replace": 0,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 1.5,
        },
        "dots1": {
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "first_k_dense_replace": 0,
            "n_group": 1,
            "topk_group": 1,
        },
        "qwen3_next": {
            **_HEAD8,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "layer_types": ["linear_attention", "full_attention"],
            "linear_num_value_heads": 2,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
        },
        "flex_olmo": {"num_experts": 8, "num_experts_per_tok": 2},
        "qwen3_5_moe_text": {
            **_HEAD8,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "layer_types": ["linear_attention", "full_attention"],
            "linear_num_value_heads": 2,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
        },
        "minimax": {
            **_HEAD8,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "layer_types": ["full_attention", "full_attention"],
        },
        # DeepSeek-V2's group-limited greedy selection with routed scaling.
        "deepseek_v2": {
            "num_key_value_heads": 4,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "first_k_dense_replace": 0,
            # One group of four out of two: the group limit changes many tokens' top-2.
            "topk_method": "group_limited_greedy",
            "n_group": 2,
            "topk_group": 1,
            "routed_scaling_factor": 1.5,
            "q_lora_rank": None,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
        },
        "gpt_oss": {
            **_HEAD8,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "layer_types": ["full_attention", "sliding_attention"],
        },
        "ernie4_5_moe": {
            "moe_num_experts": 8,
            "moe_k": 2,
            "moe_intermediate_size": 32,
            "moe_layer_start_index": 0,
        },
        "granitemoe": {"num_local_experts": 8, "num_experts_per_tok": 2},
        "hunyuan_v1_moe": {**_HEAD8, "num_experts": 8, "moe_topk": 2},
        "jetmoe": {"num_local_experts": 8, "num_experts_per_tok": 2, "kv_channels": 8},
        "llama4_text": {
            **_HEAD8,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "interleave_moe_layer_step": 1,
            "intermediate_size_mlp": 64,
        },
        "lfm2_moe": {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "num_dense_layers": 0,
            "layer_types": ["full_attention", "conv"],
            "routed_scaling_factor": 1.5,
        },
        "glm4_moe_lite": {
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "mlp_layer_types": ["sparse", "sparse"],
            "n_group": 1,
            "topk_group": 1,
            "kv_lora_rank": 16,
            "q_lora_rank": None,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
            "num_key_value_heads": 4,
        },
        "exaone_moe": {
            **_HEAD8,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "mlp_layer_types": ["sparse", "sparse"],
            "layer_types": ["full_attention", "full_attention"],
            "n_group": 1,
            "topk_group": 1,
        },
        "solar_open": {
            **_HEAD8,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 0,
            "n_group": 1,
            "topk_group": 1,
        },
        "kimi_linear": {
            **_HEAD8,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "mlp_layer_types": ["sparse", "sparse"],
            "layer_types": ["full_attention", "full_attention"],
            "kv_lora_rank": 16,
            "q_lora_rank": None,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
            "num_key_value_heads": 4,
        },
        "granitemoeshared": {
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": 32,
        },
        "jamba": {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "expert_layer_period": 1,
            "expert_layer_offset": 0,
            "attn_layer_period": 1,
            "attn_layer_offset": 0,
        },
        "minimax_m2": {**_HEAD8, "num_local_experts": 8, "num_experts_per_tok": 2},
        "hy_v3": {
            **_HEAD8,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "mlp_layer_types": ["sparse", "sparse"],
            "router_scaling_factor": 1.5,
        },
        "phimoe": {"num_local_experts": 8, "num_experts_per_tok": 2},  # refused by rpb.routing
    }
)

# Every model type with a tiny config (phimoe only to show that rpb refuses it); those rpb routes.
TINY_MODEL_TYPES: tuple[str, ...] = tuple(_FAMILY)
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(t for t in _FAMILY if t in routed_model_types())

# Fields the modelling code reads (getattr with a fallback) that the config class does not declare.
# Qwen3-30B-A3B sets head_dim 128 while hidden_size / num_attention_heads is 64.
_READ_BY_MODEL: dict[str, set[str]] = {
    "qwen3_moe": {"head_dim"},
    "qwen2_moe": {"head_dim"},
}


def _known_keys(config_cls: type[PretrainedConfig]) -> set[str]:
    keys = (
        {f.name for f in dataclasses.fields(config_cls)}
        if dataclasses.is_dataclass(config_cls)
        else set()
    )
    for alias, target in getattr(config_cls, "attribute_map", {}).items():
        keys.update((alias, target))
    return keys | {"attn_implementation"}


def build_config(model_type: str, **overrides: Any) -> PretrainedConfig:
    """transformers' config for `model_type` with tiny defaults; `overrides` replace any field."""
    if model_type not in _FAMILY:
        raise ValueError(
            f"unsupported model_type {model_type!r} (supported: {', '.join(TINY_MODEL_TYPES)})"
        )
    config_cls = CONFIG_MAPPING[model_type]
    known = _known_keys(config_cls) | _READ_BY_MODEL.get(model_type, set())
    # transformers configs accept any keyword silently; a typo would build the wrong model.
    unknown = sorted(k for k in overrides if k not in known)
    if unknown:
        raise ValueError(f"unknown {model_type} config field(s): {', '.join(unknown)}")
    return config_cls(**{**_COMMON, **_FAMILY[model_type], **overrides})


def random_model(
    model_type: str,
    seed: int = 0,
    *,
    router_std: float | None = None,
    correction_bias_std: float = 0.05,
    **overrides: Any,
) -> PreTrainedModel:
    """A deterministic randomly initialised float32 causal LM in eval mode.

    Router weights are redrawn with std `router_std` (default 1/sqrt(hidden), so logits are O(1)
    and routing is far from uniform), and DeepSeek-V3 correction biases (zeros by default) get
    N(0, `correction_bias_std`) values so the biased selection path is exercised; so do router
    logit biases (gpt_oss) and other families' correction biases. The global RNG is left untouched.
    """
    from rpb.routing import find_routers  # local: routing imports nothing from here

    config = build_config(model_type, **overrides)
    std = router_std if router_std is not None else 1.0 / math.sqrt(config.hidden_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for handle in find_routers(model):
                handle.weight.normal_(0.0, std)
                for bias in (handle.router_bias, handle.correction_bias):
                    if bias is not None:
                        bias.normal_(0.0, correction_bias_std)
    return model.eval()
