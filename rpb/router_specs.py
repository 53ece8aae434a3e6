"""How each transformers MoE router routes, described by a few orthogonal settings.

A `RouterSpec` says what a router's forward computes, so rpb can reproduce it bit-exactly and steer
it: the score function and its order relative to top-k, where the weight, a router (logit) bias
and a correction (expert) bias live, expert groups, normalisation, scaling, output dtype and the
shape of the router's output. `BUILTIN_ROUTERS` describes the router classes of the transformers
families rpb knows (keyed by class path, so no modelling module is imported until a model uses
it); `rpb.routing.register_router` adds others, and every description is checked against the
module's own forward before rpb routes with it (rpb.router_check).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = [
    "BUILTIN_ROUTERS",
    "FAMILY_ROUTERS",
    "MODEL_TYPE_ALIASES",
    "OUTPUTS",
    "RouterSpec",
    "UnsupportedRouter",
    "class_path",
    "describe",
    "families_markdown",
    "routed_model_types",
    "supported_families",
]

OUTPUTS = ("triple", "scores_logits", "jetmoe")


@dataclass(frozen=True)
class RouterSpec:
    """What a router's forward computes. Strings naming an attribute are read from the router
    module at routing time (so one description serves every configuration of a class).

    Paths (`weight`, `router_bias`, `correction_bias`) are dotted attribute paths from the router
    module; a leading "../" starts from the module that holds the router (the MoE block).
    """

    # Routing distribution rpb uses for KL, LBL and the prior's mean probabilities:
    # "softmax" (softmax of the logits), "deepseek_v3" or "sigmoid" (normalised sigmoid scores).
    kind: str = "softmax"
    score: str = "softmax"  # "softmax" | "sigmoid"
    score_float32: bool = False  # sigmoid of the logits cast to float32 (softmax always is)
    # "score_topk": score all experts, select the top-k scores, gate = score at the chosen ones;
    # "topk_score": select the top-k logits, gate = score over those k logits only.
    order: str = "score_topk"
    weight: str = "weight"  # the [E, H] router weight
    router_bias: str | None = None  # a [E] bias inside the logits: z = W h + b (gpt_oss)
    linear_float32: bool = False  # logits = linear(h.float(), W.float()) (DeepSeek-style)
    logits_float32: bool = False  # logits cast to float32 after a linear in the input dtype
    correction_bias: str | None = None  # a bias added to the scores for selection
    correction_bias_arg: str | None = None  # forward argument that carries it, if passed in
    correction_in_weights: bool = False  # whether the gate weights include it too
    # Expert groups: True, False, or (attribute, value) = only when router.attribute == value.
    groups: bool | tuple[str, str] = False
    group_attrs: tuple[str, str] = ("num_group", "topk_group")
    group_score: str = "top2_sum"  # "top2_sum" | "max" of the selection scores per group
    group_fill: float = float("-inf")  # value given to experts of unselected groups
    sorted: bool = True  # topk(sorted=...) as the library calls it
    normalise: bool | str = False  # renormalise the k gate weights (str: a bool attribute)
    norm_eps: float | str = 0.0  # added to the sum (str: an attribute)
    norm_clamp: bool = False  # divide by clamp(sum, min=norm_eps) instead of sum + norm_eps
    scaling: float | str | None = None  # gate weights multiplied by this (str: an attribute)
    weights_dtype: str = "logits"  # "logits" | "float32" | "input" (the hidden states' dtype)
    output: str = "triple"  # "triple": (logits, weights, indices); see OUTPUTS
    top_k: str = "top_k"  # attribute holding k
    num_experts: str | None = "num_experts"  # attribute holding E (None: the weight's rows)
    parent: str | None = None  # only routers held by a module of this class name (jetmoe)

    def __post_init__(self) -> None:
        choices = {
            "kind": ("softmax", "deepseek_v3", "sigmoid"),
            "score": ("softmax", "sigmoid"),
            "order": ("score_topk", "topk_score"),
            "group_score": ("top2_sum", "max"),
            "weights_dtype": ("logits", "float32", "input"),
            "output": OUTPUTS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"RouterSpec.{name} must be one of {allowed}, got {getattr(self, name)!r}"
                )
        if self.order == "topk_score" and (self.correction_bias or self.groups):
            raise ValueError("RouterSpec: a correction bias or groups need order 'score_topk'")

    def replace(self, **changes: object) -> RouterSpec:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class UnsupportedRouter:
    """A router class rpb refuses, with the one-line reason."""

    reason: str


def class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# --------------------------------------------------------------------------- built-in families

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
# model_type -> (router class path, description or refusal). The README's family list and the
# pipeline's accepted `model_type`s are generated from this table.
FAMILY_ROUTERS: dict[str, tuple[str, RouterSpec | UnsupportedRouter]] = {
    "qwen3_moe": (f"{_M}.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter", _QWEN),
    "qwen2_moe": (f"{_M}.qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter", _QWEN),
    "olmoe": (f"{_M}.olmoe.modeling_olmoe.OlmoeTopKRouter", _QWEN),
    "mixtral": (f"{_M}.mixtral.modeling_mixtral.MixtralTopKRouter", _MIXTRAL),
    "deepseek_v3": (f"{_M}.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter", _DEEPSEEK_V3),
    "glm4_moe": (f"{_M}.glm4_moe.modeling_glm4_moe.Glm4MoeTopkRouter", _DEEPSEEK_V3),
    "dots1": (f"{_M}.dots1.modeling_dots1.Dots1TopkRouter", _DEEPSEEK_V3),
    "qwen3_next": (f"{_M}.qwen3_next.modeling_qwen3_next.Qwen3NextTopKRouter", _QWEN),
    "flex_olmo": (f"{_M}.flex_olmo.modeling_flex_olmo.FlexOlmoTopKRouter", _QWEN),
    "qwen3_5_moe": (
        f"{_M}.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeTopKRouter",
        _QWEN.replace(normalise=True),
    ),
    "minimax": (f"{_M}.minimax.modeling_minimax.MiniMaxTopKRouter", _MIXTRAL),
    "deepseek_v2": (f"{_M}.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter", _DEEPSEEK_V2),
    "gpt_oss": (f"{_M}.gpt_oss.modeling_gpt_oss.GptOssTopKRouter", _GPT_OSS),
    "ernie4_5_moe": (f"{_M}.ernie4_5_moe.modeling_ernie4_5_moe.Ernie4_5_MoeTopKRouter", _ERNIE),
    "granitemoe": (f"{_M}.granitemoe.modeling_granitemoe.GraniteMoeTopKRouter", _GRANITE),
    "hunyuan_v1_moe": (f"{_M}.hunyuan_v1_moe.modeling_hunyuan_v1_moe.HunYuanMoEV1Gate", _HUNYUAN),
    "jetmoe": (f"{_M}.jetmoe.modeling_jetmoe.JetMoeTopKGating", _JETMOE),
    "llama4": (f"{_M}.llama4.modeling_llama4.Llama4Router", _LLAMA4),
    "lfm2_moe": (f"{_M}.lfm2_moe.modeling_lfm2_moe.Lfm2MoeTopKRouter", _LFM2),
    "glm4_moe_lite": (
        f"{_M}.glm4_moe_lite.modeling_glm4_moe_lite.Glm4MoeLiteTopkRouter",
        _DEEPSEEK_V3,
    ),
    "exaone_moe": (f"{_M}.exaone_moe.modeling_exaone_moe.ExaoneMoeTopkRouter", _DEEPSEEK_V3),
    "solar_open": (f"{_M}.solar_open.modeling_solar_open.SolarOpenTopkRouter", _DEEPSEEK_V3),
    "kimi_linear": (f"{_M}.kimi_linear.modeling_kimi_linear.KimiLinearTopkRouter", _DEEPSEEK_V3),
    "granitemoeshared": (
        f"{_M}.granitemoeshared.modeling_granitemoeshared.GraniteMoeSharedTopKRouter",
        _GRANITE,
    ),
    "jamba": (f"{_M}.jamba.modeling_jamba.JambaTopKRouter", RouterSpec(weights_dtype="input")),
    "minimax_m2": (f"{_M}.minimax_m2.modeling_minimax_m2.MiniMaxM2TopKRouter", _SIGMOID_ARG_BIAS),
    "hy_v3": (f"{_M}.hy_v3.modeling_hy_v3.HYV3TopKRouter", _HY_V3),
    "phimoe": (
        f"{_M}.phimoe.modeling_phimoe.PhimoeTopKRouter",
        UnsupportedRouter(
            "its sparsemixer routing samples experts while training (Gumbel noise, a second "
            "masked pass), which a top-k selection bias cannot reproduce or steer"
        ),
    ),
}

# Other model_type spellings of a family (text-only configs of multimodal models).
MODEL_TYPE_ALIASES: dict[str, str] = {"llama4_text": "llama4", "qwen3_5_moe_text": "qwen3_5_moe"}

BUILTIN_ROUTERS: dict[str, RouterSpec | UnsupportedRouter] = {
    path: spec for path, spec in FAMILY_ROUTERS.values()
}


def supported_families() -> dict[str, str]:
    """model_type -> router class name of every built-in family rpb routes (refusals excluded)."""
    return {
        family: path.rsplit(".", 1)[1]
        for family, (path, spec) in FAMILY_ROUTERS.items()
        if isinstance(spec, RouterSpec)
    }


def routed_model_types() -> list[str]:
    """Every `config.model_type` rpb routes: the families and their other spellings."""
    families = supported_families()
    return list(families) + [a for a, f in MODEL_TYPE_ALIASES.items() if f in families]


def _setting(value: object) -> str:
    return f"`{value}`" if isinstance(value, str) else f"{value:g}"


def describe(spec: RouterSpec) -> str:
    """One line saying what a described router computes (for the README's family table)."""
    score = spec.score
    if spec.correction_bias is not None:
        path = spec.correction_bias
        where = f"`{path[3:]}` of the MoE block" if path.startswith("../") else f"`{path}`"
        via = "passed to the router; " if spec.correction_bias_arg else ""
        extra = " and weights" if spec.correction_in_weights else ""
        score += f" + correction bias {where} ({via}selection{extra})"
    if spec.order == "score_topk":
        steps = [score, "top-k"]
    else:
        steps = [
            "top-k of the logits",
            "softmax over the k" if spec.score == "softmax" else "sigmoid of each",
        ]
    if spec.groups:
        when = (
            f" if `{spec.groups[0]}` is {spec.groups[1]!r}"
            if isinstance(spec.groups, tuple)
            else ""
        )
        group = "sum of top-2" if spec.group_score == "top2_sum" else "max"
        steps[-1] = f"top-k within the best groups ({group}){when}"
    if spec.normalise is True:
        steps.append("renormalised")
    elif isinstance(spec.normalise, str):
        steps.append(f"renormalised if `{spec.normalise}`")
    if spec.normalise and spec.norm_eps:
        op = "clamped at" if spec.norm_clamp else "+"
        steps[-1] += f" (sum {op} {_setting(spec.norm_eps)})"
    if spec.scaling is not None:
        steps.append(f"× {_setting(spec.scaling)}")
    notes = []
    if spec.weight != "weight":
        notes.append(f"weight `{spec.weight}`")
    if spec.router_bias is not None:
        notes.append(f"logit bias `{spec.router_bias}` (in z0, the prior and anchor_weight)")
    if spec.output != "triple":
        notes.append(f"output adapter `{spec.output}`")
    if spec.parent is not None:
        notes.append(f"only under `{spec.parent}`")
    line = " → ".join(steps)
    return line + (f"; {', '.join(notes)}" if notes else "")


def families_markdown() -> str:
    """The README's "Supported MoE families" table, generated from `FAMILY_ROUTERS`."""
    rows = [
        "| `model_type` | router class | rpb kind | routing |",
        "|---|---|---|---|",
    ]
    refused = []
    for family, (path, spec) in FAMILY_ROUTERS.items():
        cls = path.rsplit(".", 1)[1]
        if isinstance(spec, UnsupportedRouter):
            refused.append(f"- `{family}` (`{cls}`) is refused: {spec.reason}.")
            continue
        aliases = [a for a, f in MODEL_TYPE_ALIASES.items() if f == family]
        names = ", ".join(f"`{n}`" for n in [family, *aliases])
        rows.append(f"| {names} | `{cls}` | {spec.kind} | {describe(spec)} |")
    return "\n".join([*rows, "", *refused]) + "\n"


def update_readme(path: str = "README.md") -> bool:
    """Rewrite the generated family table between the README's markers; True if it changed."""
    from pathlib import Path

    readme = Path(path)
    text = readme.read_text()
    start, end = "<!-- families:start -->\n", "<!-- families:end -->"
    head, rest = text.split(start, 1)
    tail = rest.split(end, 1)[1]
    new = head + start + families_markdown() + end + tail
    readme.write_text(new)
    return new != text


if __name__ == "__main__":  # python -m rpb.router_specs: refresh the README's family table
    print("README.md updated" if update_readme() else "README.md already up to date")
