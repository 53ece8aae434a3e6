"""The routing a `RouterSpec` describes, bit for bit the library's: a router's handle
(`RouterHandle`: the module and its description), routing as a description says (`route_spec`,
`route`), the router logits along the library's dtype path, the routing distribution by kind, and
the output adapters between a router's own output and (logits, weights, indices).

rpb.router.check checks descriptions with these functions and rpb.routing (which re-exports the
public ones) routes with them; this module imports neither, so the two form no import circle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rpb.router.spec import RouterSpec, UnsupportedRouter

__all__ = [
    "Registered",
    "RouterHandle",
    "build_output",
    "handle_selection_scores",
    "parse_output",
    "route",
    "route_spec",
    "router_logits",
    "routing_log_probs",
    "routing_probs",
    "selection_scores",
]

# What a router class is registered as: a description, candidates (the first that reproduces the
# module is used) or a refusal.
Registered = RouterSpec | UnsupportedRouter | tuple[RouterSpec, ...]


# --------------------------------------------------------------------------- handles


def _get_path(module: nn.Module, parent: nn.Module | None, path: str | None) -> Any:
    if path is None:
        return None
    obj: Any = module
    if path.startswith("../"):
        obj, path = parent, path[3:]
        if obj is None:
            return None
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


_MISSING = object()


def _attr(module: nn.Module, value: Any, default: Any = _MISSING) -> Any:
    """A setting's value: itself, or the router attribute it names."""
    if not isinstance(value, str):
        return value
    found = getattr(module, value, default)
    if found is _MISSING:
        raise ValueError(f"router class {type(module).__name__} has no attribute {value!r}")
    return found


@dataclass(frozen=True)
class RouterHandle:
    """One MoE router of a model."""

    moe_layer: int  # ordinal among MoE layers (the index of every per-layer list in rpb)
    decoder_layer: int  # index of the decoder layer that holds it
    name: str
    module: nn.Module = field(repr=False)
    kind: str
    num_experts: int
    top_k: int
    hidden_size: int
    spec: RouterSpec = field(repr=False)
    parent: nn.Module | None = field(default=None, repr=False, compare=False)

    @property
    def weight(self) -> Tensor:
        """The router weight [E, H] (wherever the family keeps it)."""
        return _get_path(self.module, self.parent, self.spec.weight)

    @property
    def router_bias(self) -> Tensor | None:
        """The bias inside the router logits, z = W h + b (gpt_oss), else None."""
        return _get_path(self.module, self.parent, self.spec.router_bias)

    @property
    def correction_bias(self) -> Tensor | None:
        """The live correction (expert) bias [E] added to the scores for selection, else None."""
        bias = _get_path(self.module, self.parent, self.spec.correction_bias)
        return None if bias is None else bias.reshape(-1)

    @property
    def has_correction_bias(self) -> bool:
        return self.spec.correction_bias is not None


def unsupported_router_error(cls: type, reason: str) -> ValueError:
    return ValueError(f"router class {cls.__name__} is not supported by rpb: {reason}")


def make_handle(
    name: str, module: nn.Module, parent: nn.Module | None, spec: RouterSpec, ordinal: int, d: int
) -> RouterHandle:
    cls = type(module)
    weight = _get_path(module, parent, spec.weight)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise unsupported_router_error(
            cls, f"no [experts, hidden] weight at {spec.weight!r} (RouterSpec.weight)"
        )
    rows = int(weight.shape[0])
    n_experts = rows if spec.num_experts is None else getattr(module, spec.num_experts, rows)
    if not isinstance(n_experts, int) or n_experts != rows:
        # e.g. zero-compute experts: more logit columns than routed experts
        raise unsupported_router_error(
            cls, f"its weight has {rows} rows but {spec.num_experts} is {n_experts}"
        )
    top_k = getattr(module, spec.top_k, None)
    if not isinstance(top_k, int):
        raise unsupported_router_error(
            cls, f"no integer top-k at attribute {spec.top_k!r} (RouterSpec.top_k)"
        )
    return RouterHandle(
        moe_layer=ordinal,
        decoder_layer=d,
        name=name,
        module=module,
        kind=spec.kind,
        num_experts=rows,
        top_k=top_k,
        hidden_size=int(weight.shape[1]),
        spec=spec,
        parent=parent,
    )


# --------------------------------------------------------------------------- routing functions


def _scores(spec: RouterSpec, logits: Tensor) -> Tensor:
    if spec.score == "softmax":
        return F.softmax(logits, dim=-1, dtype=torch.float)
    return logits.float().sigmoid() if spec.score_float32 else logits.sigmoid()


def _selection_base(
    spec: RouterSpec, logits: Tensor, scores: Tensor | None, bias: Tensor | None
) -> Tensor:
    """The score a selection bias is added to: softmax routers without a correction bias rank
    by their logits (a large bias would saturate the softmax into ties; the ranking is the same
    otherwise); everything else by the score (+ correction bias) the library ranks."""
    if spec.order == "topk_score" or (spec.score == "softmax" and bias is None):
        return logits.float()
    assert scores is not None
    return scores if bias is None else scores + bias.to(scores.device)


def _group_limit(choice: Tensor, n_group: int, topk_group: int, score: str, fill: float) -> Tensor:
    n_experts = choice.shape[-1]
    grouped = choice.view(-1, n_group, n_experts // n_group)
    if score == "top2_sum":
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    else:
        group_scores = grouped.max(dim=-1).values
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = (
        group_mask.unsqueeze(-1).expand(-1, n_group, n_experts // n_group).reshape(-1, n_experts)
    )
    return choice.masked_fill(~score_mask.bool(), fill)


def _unless_zero(selection_bias: Tensor, native: Tensor, biased: Tensor) -> Tensor:
    """The biased selection, except for tokens whose selection bias is all zero: they keep the
    library's own. Ranking logits rather than softmax scores, or filling masked groups with -inf,
    agrees with the library except where its scores tie exactly (near-ties, saturated or
    near-uniform softmax), which the library breaks by position (docs/records/reliability.md,
    section 13)."""
    zero = (selection_bias == 0).all(dim=-1, keepdim=True)
    return torch.where(zero, native, biased)


def route_spec(
    spec: RouterSpec,
    logits: Tensor,
    top_k: int,
    *,
    correction_bias: Tensor | None = None,
    groups: tuple[int, int] | None = None,
    normalise: bool | None = None,
    norm_eps: float | None = None,
    scaling: float | None = None,
    input_dtype: torch.dtype | None = None,
    logit_bias: Tensor | None = None,
    selection_bias: Tensor | None = None,
    forced_indices: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Route `logits` [T, E] as `spec` describes -> (logits, weights [T, k], indices [T, k]).

    Attribute-valued settings of `spec` are given resolved (`groups` = (n_group, topk_group) or
    None, `normalise`, `norm_eps`, `scaling`). `logit_bias` is added to the logits before
    everything; `selection_bias` only to the selection score; `forced_indices` [T, k] replaces
    the selection. Without biases this is, operation for operation, the library's routing.
    """
    if logit_bias is not None:
        logits = logits + logit_bias.to(logits.dtype)
    bias = None if correction_bias is None else correction_bias.reshape(-1).to(logits.device)
    if spec.order == "score_topk":
        scores = _scores(spec, logits)
        if forced_indices is not None:
            indices = forced_indices
        else:
            choice = scores if bias is None else scores + bias
            if groups is not None:
                choice = _group_limit(
                    choice, groups[0], groups[1], spec.group_score, spec.group_fill
                )
            indices = torch.topk(choice, top_k, dim=-1, sorted=spec.sorted)[1]
            if selection_bias is not None:
                choice = _selection_base(spec, logits, scores, bias) + selection_bias
                if groups is not None:  # a bias may be negative: masked experts must stay out
                    choice = _group_limit(choice, groups[0], groups[1], spec.group_score, -math.inf)
                biased = torch.topk(choice, top_k, dim=-1, sorted=spec.sorted)[1]
                indices = _unless_zero(selection_bias, indices, biased)
        gates = scores + bias if spec.correction_in_weights and bias is not None else scores
        weights = gates.gather(1, indices)
    else:
        if forced_indices is not None:
            indices = forced_indices
        else:
            indices = torch.topk(logits, top_k, dim=-1)[1]
            if selection_bias is not None:
                biased = torch.topk(logits.float() + selection_bias, top_k, dim=-1)[1]
                indices = _unless_zero(selection_bias, indices, biased)
        top = logits.gather(1, indices)
        if spec.score == "softmax":
            weights = F.softmax(top, dim=-1, dtype=top.dtype)
        elif spec.output == "scores_logits":
            # Llama-4 takes the sigmoid of its dense [T, E] scores (-inf off the top-k). CPU
            # kernels round a tensor's scalar remainder differently from its vector body, so only
            # the same layout gives the same bits.
            dense = torch.full_like(logits, -math.inf).scatter(1, indices, top)
            weights = dense.float().sigmoid().to(logits.dtype).gather(1, indices)
        else:
            weights = top.float().sigmoid().to(logits.dtype)
    do_norm = spec.normalise if normalise is None else normalise
    if do_norm is True:
        total = weights.sum(dim=-1, keepdim=True)
        eps = float(spec.norm_eps if norm_eps is None else norm_eps)
        if spec.norm_clamp:
            weights = weights / torch.clamp(total, min=eps)
        else:
            weights = weights / (total + eps if eps else total)
    factor = spec.scaling if scaling is None else scaling
    if factor is not None and not isinstance(factor, str):
        weights = weights * factor
    if spec.weights_dtype == "logits":
        weights = weights.to(logits.dtype)
    elif spec.weights_dtype == "input":
        weights = weights.to(input_dtype or logits.dtype)
    return logits, weights, indices


UNSET = object()


def _settings(handle: RouterHandle) -> dict[str, Any]:
    """The spec's attribute-valued settings, read from the live router."""
    spec, m = handle.spec, handle.module
    groups = None
    if spec.groups is True or (
        isinstance(spec.groups, tuple) and getattr(m, spec.groups[0], None) == spec.groups[1]
    ):
        groups = (int(getattr(m, spec.group_attrs[0])), int(getattr(m, spec.group_attrs[1])))
    return {
        "groups": groups,
        "normalise": bool(_attr(m, spec.normalise, False)),  # absent flag: no renormalisation
        "norm_eps": float(_attr(m, spec.norm_eps)),
        "scaling": None if spec.scaling is None else float(_attr(m, spec.scaling)),
    }


def route(
    handle: RouterHandle,
    logits: Tensor,
    *,
    correction_bias: Any = UNSET,
    logit_bias: Tensor | None = None,
    selection_bias: Tensor | None = None,
    forced_indices: Tensor | None = None,
    input_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Route `logits` [T, E] the way `handle`'s router does (its live settings).

    `correction_bias` overrides the router's own correction bias (e.g. the base's); routers
    without one ignore it. `input_dtype`: the dtype of the router's input, for families whose
    gate weights follow it (default: the logits' dtype).
    """
    bias = handle.correction_bias if correction_bias is UNSET else correction_bias
    if not handle.has_correction_bias:
        bias = None
    return route_spec(
        handle.spec,
        logits,
        handle.top_k,
        correction_bias=bias,
        input_dtype=input_dtype,
        logit_bias=logit_bias,
        selection_bias=selection_bias,
        forced_indices=forced_indices,
        **_settings(handle),
    )


def router_logits(
    spec: RouterSpec,
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    like: Tensor,
) -> Tensor:
    """z = W h (+ b) computed along the library's dtype path, so z0 == z bitwise when W == W0;
    `like` is the router's own logits (their dtype follows autocast and the model's dtype)."""
    h = hidden.reshape(-1, weight.shape[-1])
    if bias is not None:
        bias = bias.to(h.device)  # the prior's b0 lives on the CPU
    if spec.linear_float32:
        return F.linear(h.float(), weight.float(), None if bias is None else bias.float())
    if spec.logits_float32:  # linear in the compute dtype, then cast to float32
        dtype = (
            torch.get_autocast_dtype(h.device.type)
            if torch.is_autocast_enabled(h.device.type)
            else h.dtype
        )
    else:
        dtype = like.dtype
    z = F.linear(h.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    return z.float() if spec.logits_float32 else z


def selection_scores(kind: str, logits: Tensor, correction_bias: Tensor | None = None) -> Tensor:
    """A router's native selection score [T, E] (float32) by kind: the logits for softmax
    routers (they rank like log p), sigmoid(logits) (+ correction bias) otherwise."""
    if kind == "softmax":
        return logits.float()
    scores = logits.float().sigmoid()
    return scores if correction_bias is None else scores + correction_bias.to(scores.device)


def handle_selection_scores(
    handle: RouterHandle, logits: Tensor, correction_bias: Tensor | None
) -> Tensor:
    """The score `handle`'s router ranks experts by [T, E] (float32), what a selection bias is
    added to: logits, or the (softmax/sigmoid) score plus the correction bias."""
    spec = handle.spec
    bias = (
        correction_bias.reshape(-1)
        if handle.has_correction_bias and correction_bias is not None
        else None
    )
    scores = None if spec.order == "topk_score" else _scores(spec, logits.float())
    return _selection_base(spec, logits, scores, bias).float()


def routing_probs(kind: str, logits: Tensor) -> Tensor:
    """Routing distribution [T, E] (float32): softmax, or sigmoid scores normalised to sum to 1."""
    if kind == "softmax":
        return F.softmax(logits, dim=-1, dtype=torch.float)
    scores = logits.float().sigmoid()
    return scores / scores.sum(dim=-1, keepdim=True)


def routing_log_probs(kind: str, logits: Tensor) -> Tensor:
    """log of `routing_probs`, computed stably in log space (for KL terms with gradients)."""
    if kind == "softmax":
        return F.log_softmax(logits, dim=-1, dtype=torch.float)
    log_scores = F.logsigmoid(logits.float())
    return log_scores - torch.logsumexp(log_scores, dim=-1, keepdim=True)


# --------------------------------------------------------------------------- output adapters


def parse_output(spec: RouterSpec, output: Any, top_k: int) -> tuple[Tensor, Tensor, Tensor]:
    """A router's native output -> (logits [T, E], weights [T, k], indices [T, k])."""
    if spec.output == "triple":
        logits, weights, indices = output
        return logits, weights, indices
    if spec.output == "scores_logits":  # Llama-4: dense [T, E] gate scores, 0 off the top-k
        dense, logits = output
        # Read the experts from the scores, not the logits: an earlier hook may have steered them.
        weights, indices = torch.topk(dense, top_k, dim=1)
        return logits, weights, indices
    # JetMoE: (index_sorted_experts, batch_index, batch_gates, expert_size, logits)
    order, _, batch_gates, expert_size, logits = output
    t, n_experts = logits.shape
    flat_gates = batch_gates.new_empty(t * top_k)
    flat_gates[order] = batch_gates
    # expert_size is the host list JetMoE's router made: copied from pinned memory without
    # blocking, and with the output size given, repeat_interleave needs no device read.
    sizes = torch.tensor(expert_size, pin_memory=logits.device.type == "cuda")
    sorted_experts = torch.repeat_interleave(
        torch.arange(n_experts, device=logits.device),
        sizes.to(logits.device, non_blocking=True),
        output_size=t * top_k,
    )
    flat_idx = torch.empty(t * top_k, dtype=torch.long, device=logits.device)
    flat_idx[order] = sorted_experts
    return logits, flat_gates.view(t, top_k), flat_idx.view(t, top_k)


def build_output(spec: RouterSpec, logits: Tensor, weights: Tensor, indices: Tensor) -> Any:
    """(logits, weights, indices) -> the router's own output form, built as the library does."""
    if spec.output == "triple":
        return logits, weights, indices
    if spec.output == "scores_logits":
        dense = torch.zeros_like(logits).scatter(1, indices, weights.to(logits.dtype))
        return dense, logits
    t, n_experts = logits.shape
    k = indices.shape[1]
    gates = torch.zeros(t, n_experts, dtype=weights.dtype, device=weights.device)
    expert_size = gates.scatter(1, indices, 1).long().sum(0).tolist()
    _, order = indices.flatten().sort(0)
    batch_index = order.div(k, rounding_mode="trunc")
    return order, batch_index, weights.flatten()[order], expert_size, logits
