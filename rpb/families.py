"""The transformers MoE families rpb knows, one description each.

A `Family` entry is everything rpb needs to support a family: its router class (by path, so no
modelling module is imported until a model uses it), what that router computes (a `RouterSpec`,
checked against the router's own forward before rpb routes with it, rpb.router.check) or why rpb
refuses it, and a tiny config of its own config class, on which the tests run every method
(rpb.architectures builds it). Adding a family is adding an entry to `FAMILIES`; the family table
of docs/families.md, the model types the pipeline accepts and the config check's expert-count
field all come from here. Pure data: importing it imports neither torch nor transformers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rpb.router.spec import RouterSpec, UnsupportedRouter, describe

__all__ = [
    "BUILTIN_ROUTERS",
    "FAMILIES",
    "MODEL_TYPE_ALIASES",
    "PRETRAIN_MODEL_TYPES",
    "Family",
    "families_markdown",
    "routed_model_types",
    "supported_families",
]


@dataclass(frozen=True)
class Family:
    """One transformers MoE family, keyed in `FAMILIES` by its `config.model_type`."""

    router: str  # class path of its router module
    routing: RouterSpec | UnsupportedRouter  # what the router computes, or why rpb refuses it
    # Its tiny config: fields of its transformers config class over rpb.architectures' common ones.
    tiny: Mapping[str, Any]
    expert_count_key: str = "num_experts"  # the config field holding the routed-expert count
    # The text config's model_type of a multimodal family: also accepted, and the tiny config's.
    text_model_type: str | None = None
    pretrain: bool = False  # the pipeline pretrains tiny bases of it (`source: pretrain`)
    # Fields its modelling code reads (getattr with a fallback) that the config class lacks.
    undeclared_fields: tuple[str, ...] = ()


_QWEN = RouterSpec(normalise="norm_topk_prob")  # softmax, top-k, optional renorm, logits dtype
_MIXTRAL = RouterSpec(normalise=True, weights_dtype="float32")
_DEEPSEEK_V3 = RouterSpec(
    kind="deepseek_v3",
    score="sigmoid",
    linear_float32=True,
    correction_bias="e_score_correction_bias",
    groups=True,
    sorted=False,
    normalise="norm_topk_prob",
    norm_eps=1e-20,
    scaling="routed_scaling_factor",
)
_DEEPSEEK_V2 = RouterSpec(
    linear_float32=True,
    groups=("topk_method", "group_limited_greedy"),
    group_score="max",
    group_fill=0.0,
    sorted=False,
    scaling="routed_scaling_factor",
    weights_dtype="float32",
)
_ERNIE = RouterSpec(
    linear_float32=True,
    correction_bias="moe_statics.e_score_correction_bias",
    normalise=True,
    norm_eps="norm_min",
    norm_clamp=True,
    weights_dtype="input",
)
_GPT_OSS = RouterSpec(order="topk_score", router_bias="bias")
_GRANITE = RouterSpec(order="topk_score", logits_float32=True, weights_dtype="input")
_HUNYUAN = RouterSpec(weight="wg.weight", normalise=True)
_JETMOE = RouterSpec(
    order="topk_score",
    weight="layer.weight",
    logits_float32=True,
    weights_dtype="input",
    output="jetmoe",
    parent="JetMoeMoE",  # its attention experts (JetMoeMoA) use the same gating class
)
_LLAMA4 = RouterSpec(kind="sigmoid", score="sigmoid", order="topk_score", output="scores_logits")
_LFM2 = RouterSpec(
    kind="sigmoid",
    score="sigmoid",
    correction_bias="../expert_bias",
    correction_bias_arg="expert_bias",
    normalise="norm_topk_prob",
    norm_eps=1e-6,
    scaling="routed_scaling_factor",
)

_SIGMOID_ARG_BIAS = RouterSpec(  # MiniMax-M2: the MoE block passes its bias to the router
    kind="sigmoid",
    score="sigmoid",
    score_float32=True,
    correction_bias="../e_score_correction_bias",
    correction_bias_arg="e_score_correction_bias",
    sorted=False,
    normalise=True,
    weights_dtype="float32",
)
_HY_V3 = _SIGMOID_ARG_BIAS.replace(
    score_float32=False, linear_float32=True, norm_eps=1e-20, scaling="router_scaling_factor"
)


_M = "transformers.models"

# Tiny configs: 8 experts, top-2, two layers, every layer MoE (hybrid families get one layer of
# each kind). The first five are the families the pipeline pretrains (docs/testbed.md); the others
# keep their own routing options at their defaults unless the routing path needs exercising
# (groups, scaling). Each family sizes its expert FFN in a field of its own (OLMoE and Mixtral:
# `intermediate_size`).
FAMILIES: dict[str, Family] = {
    "qwen3_moe": Family(
        router=f"{_M}.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter",
        routing=_QWEN,
        pretrain=True,
        undeclared_fields=("head_dim",),
        tiny={
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,  # as Qwen3-30B-A3B
            "router_aux_loss_coef": 0.001,
        },
    ),
    "qwen2_moe": Family(
        router=f"{_M}.qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter",
        routing=_QWEN,
        pretrain=True,
        undeclared_fields=("head_dim",),
        tiny={
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "router_aux_loss_coef": 0.001,
        },
    ),
    "olmoe": Family(
        router=f"{_M}.olmoe.modeling_olmoe.OlmoeTopKRouter",
        routing=_QWEN,
        pretrain=True,
        tiny={
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "router_aux_loss_coef": 0.01,
        },
    ),
    "mixtral": Family(
        router=f"{_M}.mixtral.modeling_mixtral.MixtralTopKRouter",
        routing=_MIXTRAL,
        expert_count_key="num_local_experts",
        pretrain=True,
        tiny={
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "router_jitter_noise": 0.0,
            "router_aux_loss_coef": 0.001,
        },
    ),
    "deepseek_v3": Family(
        router=f"{_M}.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter",
        routing=_DEEPSEEK_V3,
        expert_count_key="n_routed_experts",
        pretrain=True,
        # Moonlight-16B-A3B's routing: sigmoid scores + correction bias (noaux_tc), one group,
        # renormalised top-k weights scaled by 2.446, 2 shared experts, first layer dense. Three
        # layers so that, with layer 0 dense, the tiny model still has two MoE layers.
        tiny={
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
    ),
    "glm4_moe": Family(
        router=f"{_M}.glm4_moe.modeling_glm4_moe.Glm4MoeTopkRouter",
        routing=_DEEPSEEK_V3,
        expert_count_key="n_routed_experts",
        tiny={
            "head_dim": 8,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "first_k_dense_replace": 0,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 1.5,
        },
    ),
    "dots1": Family(
        router=f"{_M}.dots1.modeling_dots1.Dots1TopkRouter",
        routing=_DEEPSEEK_V3,
        expert_count_key="n_routed_experts",
        tiny={
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "first_k_dense_replace": 0,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
    "qwen3_next": Family(
        router=f"{_M}.qwen3_next.modeling_qwen3_next.Qwen3NextTopKRouter",
        routing=_QWEN,
        tiny={
            "head_dim": 8,
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
    ),
    "flex_olmo": Family(
        router=f"{_M}.flex_olmo.modeling_flex_olmo.FlexOlmoTopKRouter",
        routing=_QWEN,
        tiny={"num_experts": 8, "num_experts_per_tok": 2},
    ),
    "qwen3_5_moe": Family(
        router=f"{_M}.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeTopKRouter",
        routing=_QWEN.replace(normalise=True),
        text_model_type="qwen3_5_moe_text",
        tiny={
            "head_dim": 8,
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
    ),
    "minimax": Family(
        router=f"{_M}.minimax.modeling_minimax.MiniMaxTopKRouter",
        routing=_MIXTRAL,
        expert_count_key="num_local_experts",
        tiny={
            "head_dim": 8,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "layer_types": ["full_attention", "full_attention"],
        },
    ),
    # DeepSeek-V2's group-limited greedy selection with routed scaling.
    "deepseek_v2": Family(
        router=f"{_M}.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter",
        routing=_DEEPSEEK_V2,
        expert_count_key="n_routed_experts",
        tiny={
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
    ),
    "gpt_oss": Family(
        router=f"{_M}.gpt_oss.modeling_gpt_oss.GptOssTopKRouter",
        routing=_GPT_OSS,
        expert_count_key="num_local_experts",
        tiny={
            "head_dim": 8,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "layer_types": ["full_attention", "sliding_attention"],
        },
    ),
    "ernie4_5_moe": Family(
        router=f"{_M}.ernie4_5_moe.modeling_ernie4_5_moe.Ernie4_5_MoeTopKRouter",
        routing=_ERNIE,
        expert_count_key="moe_num_experts",
        tiny={
            "moe_num_experts": 8,
            "moe_k": 2,
            "moe_intermediate_size": 32,
            "moe_layer_start_index": 0,
        },
    ),
    "granitemoe": Family(
        router=f"{_M}.granitemoe.modeling_granitemoe.GraniteMoeTopKRouter",
        routing=_GRANITE,
        expert_count_key="num_local_experts",
        tiny={"num_local_experts": 8, "num_experts_per_tok": 2},
    ),
    "hunyuan_v1_moe": Family(
        router=f"{_M}.hunyuan_v1_moe.modeling_hunyuan_v1_moe.HunYuanMoEV1Gate",
        routing=_HUNYUAN,
        tiny={"head_dim": 8, "num_experts": 8, "moe_topk": 2},
    ),
    "jetmoe": Family(
        router=f"{_M}.jetmoe.modeling_jetmoe.JetMoeTopKGating",
        routing=_JETMOE,
        expert_count_key="num_local_experts",
        tiny={"num_local_experts": 8, "num_experts_per_tok": 2, "kv_channels": 8},
    ),
    "llama4": Family(
        router=f"{_M}.llama4.modeling_llama4.Llama4Router",
        routing=_LLAMA4,
        expert_count_key="num_local_experts",
        text_model_type="llama4_text",
        tiny={
            "head_dim": 8,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "interleave_moe_layer_step": 1,
            "intermediate_size_mlp": 64,
        },
    ),
    "lfm2_moe": Family(
        router=f"{_M}.lfm2_moe.modeling_lfm2_moe.Lfm2MoeTopKRouter",
        routing=_LFM2,
        tiny={
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "num_dense_layers": 0,
            "layer_types": ["full_attention", "conv"],
            "routed_scaling_factor": 1.5,
        },
    ),
    "glm4_moe_lite": Family(
        router=f"{_M}.glm4_moe_lite.modeling_glm4_moe_lite.Glm4MoeLiteTopkRouter",
        routing=_DEEPSEEK_V3,
        expert_count_key="n_routed_experts",
        tiny={
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
    ),
    "exaone_moe": Family(
        router=f"{_M}.exaone_moe.modeling_exaone_moe.ExaoneMoeTopkRouter",
        routing=_DEEPSEEK_V3,
        tiny={
            "head_dim": 8,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "mlp_layer_types": ["sparse", "sparse"],
            "layer_types": ["full_attention", "full_attention"],
            "n_group": 1,
            "topk_group": 1,
        },
    ),
    "solar_open": Family(
        router=f"{_M}.solar_open.modeling_solar_open.SolarOpenTopkRouter",
        routing=_DEEPSEEK_V3,
        expert_count_key="n_routed_experts",
        tiny={
            "head_dim": 8,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 0,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
    "kimi_linear": Family(
        router=f"{_M}.kimi_linear.modeling_kimi_linear.KimiLinearTopkRouter",
        routing=_DEEPSEEK_V3,
        tiny={
            "head_dim": 8,
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
    ),
    "granitemoeshared": Family(
        router=f"{_M}.granitemoeshared.modeling_granitemoeshared.GraniteMoeSharedTopKRouter",
        routing=_GRANITE,
        expert_count_key="num_local_experts",
        tiny={"num_local_experts": 8, "num_experts_per_tok": 2, "shared_intermediate_size": 32},
    ),
    "jamba": Family(
        router=f"{_M}.jamba.modeling_jamba.JambaTopKRouter",
        routing=RouterSpec(weights_dtype="input"),
        tiny={
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "expert_layer_period": 1,
            "expert_layer_offset": 0,
            "attn_layer_period": 1,
            "attn_layer_offset": 0,
        },
    ),
    "minimax_m2": Family(
        router=f"{_M}.minimax_m2.modeling_minimax_m2.MiniMaxM2TopKRouter",
        routing=_SIGMOID_ARG_BIAS,
        expert_count_key="num_local_experts",
        tiny={"head_dim": 8, "num_local_experts": 8, "num_experts_per_tok": 2},
    ),
    "hy_v3": Family(
        router=f"{_M}.hy_v3.modeling_hy_v3.HYV3TopKRouter",
        routing=_HY_V3,
        tiny={
            "head_dim": 8,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "mlp_layer_types": ["sparse", "sparse"],
            "router_scaling_factor": 1.5,
        },
    ),
    # DeepSeek-V3.2: DeepSeek-V3's router under sparse (indexer-selected) attention.
    "deepseek_v32": Family(
        router=f"{_M}.deepseek_v32.modeling_deepseek_v32.DeepseekV32TopkRouter",
        routing=_DEEPSEEK_V3,
        expert_count_key="n_routed_experts",
        tiny={
            "num_key_value_heads": 4,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 0,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 1.5,
            "q_lora_rank": 16,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
            "index_topk": 8,
            "index_head_dim": 8,
            "index_n_heads": 2,
        },
    ),
    "phimoe": Family(
        router=f"{_M}.phimoe.modeling_phimoe.PhimoeTopKRouter",
        routing=UnsupportedRouter(
            "its sparsemixer routing samples experts while training (Gumbel noise, a second "
            "masked pass), which a top-k selection bias cannot reproduce or steer"
        ),
        expert_count_key="num_local_experts",
        tiny={"num_local_experts": 8, "num_experts_per_tok": 2},
    ),
}


# Derived views of FAMILIES.
MODEL_TYPE_ALIASES: dict[str, str] = {
    family.text_model_type: name for name, family in FAMILIES.items() if family.text_model_type
}
BUILTIN_ROUTERS: dict[str, RouterSpec | UnsupportedRouter] = {
    family.router: family.routing for family in FAMILIES.values()
}
PRETRAIN_MODEL_TYPES: tuple[str, ...] = tuple(n for n, f in FAMILIES.items() if f.pretrain)


def supported_families() -> dict[str, str]:
    """model_type -> router class name of every built-in family rpb routes (refusals excluded)."""
    return {
        name: family.router.rsplit(".", 1)[1]
        for name, family in FAMILIES.items()
        if isinstance(family.routing, RouterSpec)
    }


def routed_model_types() -> list[str]:
    """Every `config.model_type` rpb routes: the families and their text configs' spellings."""
    families = supported_families()
    return list(families) + [a for a, f in MODEL_TYPE_ALIASES.items() if f in families]


def families_markdown() -> str:
    """docs/families.md's "Supported MoE families" table, generated from `FAMILIES`."""
    rows = [
        "| `model_type` | router class | rpb kind | routing |",
        "|---|---|---|---|",
    ]
    refused = []
    for name, family in FAMILIES.items():
        cls, spec = family.router.rsplit(".", 1)[1], family.routing
        if isinstance(spec, UnsupportedRouter):
            refused.append(f"- `{name}` (`{cls}`) is refused: {spec.reason}.")
            continue
        names = ", ".join(f"`{n}`" for n in [name, family.text_model_type] if n)
        rows.append(f"| {names} | `{cls}` | {spec.kind} | {describe(spec)} |")
    return "\n".join([*rows, "", *refused]) + "\n"


def update_readme(path: str = "docs/families.md") -> bool:
    """Rewrite the generated family table between the markers of docs/families.md (the manual's
    families page); True if it changed."""
    from pathlib import Path

    readme = Path(path)
    text = readme.read_text()
    start, end = "<!-- families:start -->\n", "<!-- families:end -->"
    head, rest = text.split(start, 1)
    tail = rest.split(end, 1)[1]
    new = head + start + families_markdown() + end + tail
    readme.write_text(new)
    return new != text


if __name__ == "__main__":  # python -m rpb.families: refresh docs/families.md's family table
    print("docs/families.md updated" if update_readme() else "docs/families.md already up to date")
