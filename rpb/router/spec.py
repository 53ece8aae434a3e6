"""How each transformers MoE router routes, described by a few orthogonal settings.

A `RouterSpec` says what a router's forward computes, so rpb can reproduce it bit-exactly and steer
it: the score function and its order relative to top-k, where the weight, a router (logit) bias
and a correction (expert) bias live, expert groups, normalisation, scaling, output dtype and the
shape of the router's output. rpb.families describes the families rpb knows with these;
`rpb.routing.register_router` adds others, and every description is checked against the module's
own forward before rpb routes with it (rpb.router.check).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["OUTPUTS", "RouterSpec", "UnsupportedRouter", "class_path", "describe"]

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


def _setting(value: object) -> str:
    return f"`{value}`" if isinstance(value, str) else f"{value:g}"


def describe(spec: RouterSpec) -> str:
    """One line saying what a described router computes (for docs/families.md's family table)."""
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
