"""Router control for transformers 5.x MoE models: find routers by class, route exactly as the
library does (optionally biased or forced), and hook every router to record and steer routing.

Each router class has a `RouterSpec` (rpb.router_specs) describing what its forward computes.
A forward hook on the router replaces its output with rpb's routing when a policy steers it; the
output adapters turn (logits, weights, indices) into whatever the router returns (Llama-4's dense
scores, JetMoE's expert-sorted tuple). Before rpb routes with a description, rpb checks
it against the module's own forward on a probe batch (rpb.router_check), bit-exactly, with and
without zero biases; a description that does not reproduce the module is refused in one line.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from rpb.router_specs import (
    BUILTIN_ROUTERS,
    RouterSpec,
    UnsupportedRouter,
    class_path,
    supported_families,
)

__all__ = [
    "KINDS",
    "ROUTER_REGISTRY",
    "RouterControl",
    "RouterHandle",
    "RouterKind",
    "RouterRecord",
    "RouterSpec",
    "RoutingPolicy",
    "find_routers",
    "register_router",
    "route",
    "route_deepseek_v3",
    "route_softmax",
    "route_spec",
    "routing_log_probs",
    "routing_probs",
    "selection_scores",
]

KINDS = ("softmax", "deepseek_v3", "sigmoid")
_LEGACY_KINDS = ("softmax", "deepseek_v3")


@dataclass(frozen=True)
class RouterKind:
    """The former two-kind description, kept for `register_router(cls, kind, ...)` callers."""

    kind: str
    always_normalise: bool = False
    float_weights: bool = False

    def to_spec(self) -> RouterSpec:
        if self.kind == "deepseek_v3":
            return BUILTIN_ROUTERS[class_path(DeepseekV3TopkRouter)]  # type: ignore[return-value]
        return RouterSpec(
            normalise=True if self.always_normalise else "norm_topk_prob",
            weights_dtype="float32" if self.float_weights else "logits",
        )


Registered = RouterSpec | UnsupportedRouter | tuple[RouterSpec, ...]

# User registrations (and the five original classes); built-in families are looked up by class
# path in rpb.router_specs.BUILTIN_ROUTERS, so their modelling code is imported only when used.
ROUTER_REGISTRY: dict[type[nn.Module], Registered] = {
    cls: BUILTIN_ROUTERS[class_path(cls)]  # type: ignore[misc]
    for cls in (
        Qwen3MoeTopKRouter,
        Qwen2MoeTopKRouter,
        OlmoeTopKRouter,
        MixtralTopKRouter,
        DeepseekV3TopkRouter,
    )
}


def _auto_candidates() -> tuple[RouterSpec, ...]:
    """Every distinct built-in description, each with the plausible weight dtypes and
    normalisations: what `register_router(cls)` tries when the user gives no description."""
    seen: list[RouterSpec] = []
    for spec in BUILTIN_ROUTERS.values():
        if not isinstance(spec, RouterSpec):
            continue
        variants = [spec]
        if spec.order == "score_topk":
            variants += [
                spec.replace(normalise=n, weights_dtype=d)
                for n in ("norm_topk_prob", True, False)
                for d in ("logits", "float32", "input")
            ]
        for v in variants:
            if v not in seen:
                seen.append(v)
    return tuple(seen)


def register_router(
    cls: type[nn.Module],
    kind: str | RouterSpec | Sequence[RouterSpec] | None = None,
    *,
    always_normalise: bool | None = None,
    float_weights: bool | None = None,
    example: nn.Module | None = None,
) -> None:
    """Teach rpb another router class.

    `kind` is a `RouterSpec` (or several: the first that reproduces the module is used), one of
    the former kinds "softmax"/"deepseek_v3" (with `always_normalise`/`float_weights`; a flag left
    None is chosen by the self-check), or None: try every built-in description. The description
    is checked against the module's forward on the first router of this class rpb meets (or now,
    on `example`), and refused in one line if it does not reproduce it bit-exactly.
    """
    if kind is None:
        entry: Registered = _auto_candidates()
    elif isinstance(kind, RouterSpec):
        entry = kind
    elif isinstance(kind, str):
        if kind not in _LEGACY_KINDS:
            raise ValueError(
                f"unknown routing kind {kind!r} (known: {', '.join(_LEGACY_KINDS)}; "
                "or pass a RouterSpec)"
            )
        if kind == "deepseek_v3" or (always_normalise is not None and float_weights is not None):
            entry = RouterKind(kind, bool(always_normalise), bool(float_weights)).to_spec()
        else:
            entry = tuple(
                RouterKind(kind, a, f).to_spec()
                for a in ((always_normalise,) if always_normalise is not None else (False, True))
                for f in ((float_weights,) if float_weights is not None else (False, True))
            )
    else:
        entry = tuple(kind)
        if not entry or not all(isinstance(s, RouterSpec) for s in entry):
            raise ValueError("register_router: kind must be a RouterSpec, a list of them or None")
    if example is not None and not isinstance(example, cls):
        raise ValueError(f"register_router: example is a {type(example).__name__}, not a {cls}")
    previous = ROUTER_REGISTRY.get(cls)
    ROUTER_REGISTRY[cls] = entry
    _forget_checks()
    if example is not None:
        try:
            checked_spec(example, entry, parent=None)
        except ValueError:  # a refused description is not left registered
            if previous is None:
                del ROUTER_REGISTRY[cls]
            else:
                ROUTER_REGISTRY[cls] = previous
            raise


def checked_spec(module: nn.Module, entry: Registered, parent: nn.Module | None) -> RouterSpec:
    from rpb.router_check import checked_spec as check  # the check routes with this module

    return check(module, entry, parent)


def _forget_checks() -> None:
    from rpb.router_check import CHECKED

    CHECKED.clear()


def _entry_of(cls: type) -> Registered | None:
    for base in cls.__mro__:  # subclasses of a registered router route the same way
        if base in ROUTER_REGISTRY:
            entry = ROUTER_REGISTRY[base]
            # a RouterKind put straight into the registry, as the former API allowed
            return entry.to_spec() if isinstance(entry, RouterKind) else entry
        spec = BUILTIN_ROUTERS.get(class_path(base))
        if spec is not None:
            return spec
    return None


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


def _decoder_layer_index(model: nn.Module, name: str, fallback: int) -> int:
    # The decoder layer is the element of the outermost ModuleList on the router's path.
    module = model
    for part in name.split("."):
        if isinstance(module, nn.ModuleList) and part.isdigit():
            return int(part)
        module = getattr(module, part)
    return fallback


def _refuse(cls: type, reason: str) -> ValueError:
    return ValueError(f"router class {cls.__name__} is not supported by rpb: {reason}")


def _make_handle(
    name: str, module: nn.Module, parent: nn.Module | None, spec: RouterSpec, ordinal: int, d: int
) -> RouterHandle:
    cls = type(module)
    weight = _get_path(module, parent, spec.weight)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise _refuse(cls, f"no [experts, hidden] weight at {spec.weight!r} (RouterSpec.weight)")
    rows = int(weight.shape[0])
    n_experts = rows if spec.num_experts is None else getattr(module, spec.num_experts, rows)
    if not isinstance(n_experts, int) or n_experts != rows:
        # e.g. zero-compute experts: more logit columns than routed experts
        raise _refuse(cls, f"its weight has {rows} rows but {spec.num_experts} is {n_experts}")
    top_k = getattr(module, spec.top_k, None)
    if not isinstance(top_k, int):
        raise _refuse(cls, f"no integer top-k at attribute {spec.top_k!r} (RouterSpec.top_k)")
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


def find_routers(model: nn.Module, *, check: bool = True) -> list[RouterHandle]:
    """Every registered router module of `model`, in module order, found by class.

    With `check` (the default) each router's description is first verified against the module's
    own forward (rpb.router_check; cached per class and configuration).
    """
    handles: list[RouterHandle] = []
    parents: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        for child_name, _child in module.named_children():
            parents[f"{name}.{child_name}" if name else child_name] = module
        entry = _entry_of(type(module))
        if entry is None:
            continue
        if isinstance(entry, UnsupportedRouter):
            raise _refuse(type(module), entry.reason)
        parent = parents.get(name)
        first = entry[0] if isinstance(entry, tuple) else entry
        if first.parent is not None and type(parent).__name__ != first.parent:
            continue  # the same class used outside an MoE block (JetMoE's attention experts)
        spec = checked_spec(module, entry, parent) if check else first
        ordinal = len(handles)
        handles.append(
            _make_handle(
                name, module, parent, spec, ordinal, _decoder_layer_index(model, name, ordinal)
            )
        )
    if not handles:
        known = ", ".join(sorted(c.__name__ for c in ROUTER_REGISTRY))
        raise ValueError(
            f"no MoE router found in {type(model).__name__} (known router classes: {known} and "
            f"those of the families {', '.join(supported_families())}; add others with "
            "rpb.routing.register_router)"
        )
    return handles


# --------------------------------------------------------------------------- routing functions


def route_softmax(
    logits: Tensor,
    top_k: int,
    *,
    norm_topk_prob: bool,
    float_weights: bool = False,
    logit_bias: Tensor | None = None,
    selection_bias: Tensor | None = None,
    forced_indices: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax top-k routing (Qwen2/3-MoE, OLMoE, Mixtral) -> (logits, weights, indices)."""
    spec = RouterSpec(
        normalise=norm_topk_prob, weights_dtype="float32" if float_weights else "logits"
    )
    return route_spec(
        spec,
        logits,
        top_k,
        logit_bias=logit_bias,
        selection_bias=selection_bias,
        forced_indices=forced_indices,
    )


def route_deepseek_v3(
    logits: Tensor,
    top_k: int,
    *,
    correction_bias: Tensor,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    logit_bias: Tensor | None = None,
    selection_bias: Tensor | None = None,
    forced_indices: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """DeepSeek-V3 sigmoid/noaux_tc routing -> (logits, weights, indices)."""
    spec = BUILTIN_ROUTERS[class_path(DeepseekV3TopkRouter)]
    assert isinstance(spec, RouterSpec)
    return route_spec(
        spec.replace(normalise=norm_topk_prob, scaling=routed_scaling_factor),
        logits,
        top_k,
        correction_bias=correction_bias,
        groups=(n_group, topk_group),
        logit_bias=logit_bias,
        selection_bias=selection_bias,
        forced_indices=forced_indices,
    )


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
    near-uniform softmax), which the library breaks by position (docs/reliability.md, 13)."""
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


_DEFAULT = object()


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
    correction_bias: Any = _DEFAULT,
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
    bias = handle.correction_bias if correction_bias is _DEFAULT else correction_bias
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
    sorted_experts = torch.repeat_interleave(
        torch.arange(n_experts, device=logits.device),
        torch.tensor(expert_size, device=logits.device),
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


# --------------------------------------------------------------------------- control hooks


@dataclass
class RouterRecord:
    """What one router saw and did in the latest forward (tokens flattened to T = batch * seq)."""

    layer: int
    logits: Tensor  # [T, E] live router logits z = W h (+ b), as the library computed them
    weights: Tensor  # [T, k] gate weights the experts received
    indices: Tensor  # [T, k] experts the tokens were sent to
    base_logits: Tensor | None  # [T, E] z0 = W0 h (+ b0) on the same input (no grad), if set
    steered: bool = False  # whether a policy replaced the router's output
    # ||W - W0||_F^2 (+ ||b - b0||^2 for a router logit bias) in float32 (with grad), taken inside
    # the forward where FSDP has the full W; only with RouterControl(weight_distance=True).
    weight_sq_dist: Tensor | None = None
    # The correction bias the router received as a forward argument (lfm2-style), if any.
    correction_bias: Tensor | None = field(default=None, repr=False)


PolicyValue = Tensor | Callable[[RouterRecord], Tensor] | None


@dataclass
class RoutingPolicy:
    """Per-layer steering; each value is a tensor or a callable of the layer's RouterRecord."""

    logit_bias: PolicyValue = None
    selection_bias: PolicyValue = None
    forced_indices: PolicyValue = None
    use_base_logits: bool = False  # route (weights and selection) on z0 instead of z

    @property
    def active(self) -> bool:
        return self.use_base_logits or any(
            v is not None for v in (self.logit_bias, self.selection_bias, self.forced_indices)
        )


class RouterControl:
    """Forward hooks on every router: record routing, optionally bias or force it.

    `base_weights` (one [E, H] tensor per MoE layer) enables base logits z0 = W0 h (+ b0) on the
    router's own input; they live on this object, never on the model, so state_dict keys are
    unchanged. The base correction bias (`base_correction_bias`) defaults to the routers' own at
    construction; a router logit bias b0 (gpt_oss) must come with base_weights
    (`base_router_bias`), since the live one stops being the base's once training moves it.
    Policies apply only to routers in training mode unless `keep_at_eval`; recording always runs.
    Under gradient checkpointing the hooks fire again on recompute and simply overwrite records.

    `weight_distance` also records ||W - W0||^2 per router in its forward. Outside the forward a
    sharded model's router weight is only this rank's shard (an FSDP2 DTensor, an FSDP1 flat
    view); inside it FSDP has gathered the full weight, and the term's gradient reaches the
    gathered parameter before FSDP reduce-scatters it.
    """

    def __init__(
        self,
        model: nn.Module,
        base_weights: list[Tensor] | None = None,
        *,
        base_correction_bias: list[Tensor | None] | None = None,
        base_router_bias: list[Tensor | None] | None = None,
        keep_at_eval: bool = False,
        weight_distance: bool = False,
    ) -> None:
        self.handles = find_routers(model)
        self.keep_at_eval = keep_at_eval
        if weight_distance and base_weights is None:
            raise ValueError("weight_distance needs base_weights (the W0 to measure from)")
        self.weight_distance = weight_distance
        n = len(self.handles)
        self._base: list[Tensor] | None = None
        if base_weights is not None:
            if len(base_weights) != n:
                raise ValueError(f"base_weights has {len(base_weights)} layers, model has {n}")
            for h, w in zip(self.handles, base_weights, strict=True):
                if tuple(w.shape) != (h.num_experts, h.hidden_size):
                    raise ValueError(
                        f"base_weights[{h.moe_layer}] has shape {tuple(w.shape)}, "
                        f"router {h.name} needs {(h.num_experts, h.hidden_size)}"
                    )
            self._base = [w.detach().clone() for w in base_weights]
        if base_correction_bias is not None and len(base_correction_bias) != n:
            raise ValueError(
                f"base_correction_bias has {len(base_correction_bias)} layers, not {n}"
            )
        self._base_bias: list[Tensor | None] = [
            (
                base_correction_bias[i]
                if base_correction_bias is not None and base_correction_bias[i] is not None
                else h.correction_bias
            )
            for i, h in enumerate(self.handles)
        ]
        self._base_bias = [
            None if b is None else b.detach().reshape(-1).clone() for b in self._base_bias
        ]
        if base_router_bias is not None and len(base_router_bias) != n:
            raise ValueError(f"base_router_bias has {len(base_router_bias)} layers, not {n}")
        self._base_router_bias: list[Tensor | None] = []
        for i, h in enumerate(self.handles):
            given = base_router_bias[i] if base_router_bias is not None else None
            live = h.router_bias
            if given is not None and live is None:
                raise ValueError(f"base_router_bias[{i}] given but router {h.name} has no bias")
            if given is None and live is not None and base_weights is not None:
                # z0 = W0 h + b0 needs the base's b0; the live one would silently be wrong
                # once training has moved it.
                raise ValueError(
                    f"router {h.name} ({type(h.module).__name__}) has a logit bias: pass "
                    "base_router_bias (the prior's router_bias) with base_weights"
                )
            b = given if given is not None else live
            self._base_router_bias.append(None if b is None else b.detach().clone())
        # Forward-argument positions of correction biases passed into the router (lfm2-style).
        self._bias_arg: list[tuple[str, int] | None] = [_arg_position(h) for h in self.handles]
        self._base_cache: dict[int, Tensor] = {}
        self._base_fp32_cache: dict[int, Tensor] = {}
        self.records: list[RouterRecord | None] = [None] * n
        self.policies: list[RoutingPolicy] = [RoutingPolicy() for _ in range(n)]
        self._hooks = [
            h.module.register_forward_hook(partial(self._hook, i), with_kwargs=True)
            for i, h in enumerate(self.handles)
        ]

    @property
    def num_layers(self) -> int:
        return len(self.handles)

    @property
    def base_weights(self) -> list[Tensor] | None:
        return self._base

    def base_correction_bias(self, layer: int) -> Tensor | None:
        return self._base_bias[layer]

    def base_router_bias(self, layer: int) -> Tensor | None:
        return self._base_router_bias[layer]

    def set_policy(
        self,
        layer: int | None = None,
        *,
        logit_bias: PolicyValue = None,
        selection_bias: PolicyValue = None,
        forced_indices: PolicyValue = None,
        use_base_logits: bool = False,
    ) -> None:
        """Replace the policy of one MoE layer (or of all, if `layer` is None)."""
        if use_base_logits and self._base is None:
            raise ValueError("use_base_logits needs base_weights")
        for i in self._layers(layer):
            self.policies[i] = RoutingPolicy(
                logit_bias, selection_bias, forced_indices, use_base_logits
            )

    def clear_records(self) -> None:
        self.records = [None] * self.num_layers

    def base_scores(self, record: RouterRecord) -> Tensor:
        """The base router's native selection score s0 [T, E] on the record's hidden state."""
        return handle_selection_scores(
            self.handles[record.layer], self._need_base(record), self._base_bias[record.layer]
        )

    def base_topk(self, record: RouterRecord) -> Tensor:
        """The base router's own top-k [T, k] on the record's hidden state."""
        handle = self.handles[record.layer]
        with torch.no_grad():
            return route(
                handle, self._need_base(record), correction_bias=self._base_bias[record.layer]
            )[2]

    def live_topk(self, record: RouterRecord) -> Tensor:
        """The live router's own unbiased top-k [T, k] (what it selects without any policy)."""
        if not record.steered:
            return record.indices
        with torch.no_grad():
            return route(
                self.handles[record.layer],
                record.logits.detach(),
                correction_bias=self._live_bias(record),
            )[2]

    def remove(self) -> None:
        """Remove every hook; the model routes natively again."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def __enter__(self) -> RouterControl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # -- internals

    def _layers(self, layer: int | None) -> range:
        if layer is None:
            return range(self.num_layers)
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"MoE layer {layer} out of range [0, {self.num_layers})")
        return range(layer, layer + 1)

    def _need_base(self, record: RouterRecord) -> Tensor:
        if record.base_logits is None:
            raise ValueError("base logits are unavailable: RouterControl was built without base")
        return record.base_logits

    def _base_on(self, layer: int, like: Tensor) -> Tensor:
        # Moved lazily so one control serves a model that is later moved or cast.
        cached = self._base_cache.get(layer)
        if cached is None or cached.device != like.device or cached.dtype != like.dtype:
            cached = self._base[layer].to(device=like.device, dtype=like.dtype)
            self._base_cache[layer] = cached
        return cached

    def _live_bias(self, record: RouterRecord) -> Any:
        return _DEFAULT if record.correction_bias is None else record.correction_bias

    def _base_fp32(self, layer: int, device: torch.device) -> Tensor:
        # A cache of its own: `_base_on` follows the logits' dtype (bf16 under autocast).
        cached = self._base_fp32_cache.get(layer)
        if cached is None or cached.device != device:
            cached = self._base[layer].to(device=device, dtype=torch.float32)
            self._base_fp32_cache[layer] = cached
        return cached

    def _resolve(self, value: PolicyValue, record: RouterRecord) -> Tensor | None:
        return value(record) if callable(value) else value

    def _hook(
        self,
        layer: int,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
    ) -> Any:
        handle = self.handles[layer]
        spec = handle.spec
        logits, weights, indices = parse_output(spec, output, handle.top_k)
        hidden = args[0] if args else next(iter(kwargs.values()))
        arg_bias = None
        if self._bias_arg[layer] is not None:
            name, pos = self._bias_arg[layer]
            arg_bias = kwargs.get(name, args[pos] if len(args) > pos else None)
            if arg_bias is not None and handle.correction_bias is None:
                # the base's bias (and any routing outside this forward) would be missing
                raise ValueError(
                    f"router {handle.name} ({type(module).__name__}) is passed a correction bias "
                    f"but RouterSpec.correction_bias {handle.spec.correction_bias!r} finds none"
                )
        base_logits = None
        if self._base is not None:
            with torch.no_grad():
                base_logits = router_logits(
                    spec,
                    hidden,
                    self._base_on(layer, logits),
                    self._base_router_bias[layer],
                    logits,
                )
        record = RouterRecord(layer, logits, weights, indices, base_logits)
        record.correction_bias = arg_bias
        if self.weight_distance:
            w = handle.weight  # the full weight here, even when FSDP shards it between forwards
            dist = (w.float() - self._base_fp32(layer, w.device)).pow(2).sum()
            b, b0 = handle.router_bias, self._base_router_bias[layer]
            if b is not None and b0 is not None:
                dist = dist + (b.float() - b0.to(b.device, torch.float32)).pow(2).sum()
            record.weight_sq_dist = dist
        self.records[layer] = record
        policy = self.policies[layer]
        if not policy.active or not (module.training or self.keep_at_eval):
            return None
        logit_bias = self._resolve(policy.logit_bias, record)
        selection_bias = self._resolve(policy.selection_bias, record)
        forced = self._resolve(policy.forced_indices, record)
        t = logits.shape[0]
        for name, bias in (("logit_bias", logit_bias), ("selection_bias", selection_bias)):
            if bias is not None and bias.shape[-1] != handle.num_experts:
                raise ValueError(
                    f"{name} for MoE layer {layer} has shape {tuple(bias.shape)}, "
                    f"needs [..., {handle.num_experts}]"
                )
        if forced is not None:
            forced = self._check_forced(forced, layer, t, handle)
        if policy.use_base_logits:
            source, bias = self._need_base(record), self._base_bias[layer]
        else:
            source, bias = logits, self._live_bias(record)
        out = route(
            handle,
            source,
            correction_bias=bias,
            logit_bias=logit_bias,
            selection_bias=selection_bias,
            forced_indices=forced,
            input_dtype=hidden.dtype,
        )
        record.weights, record.indices, record.steered = out[1], out[2], True
        return build_output(spec, *out)

    @staticmethod
    def _check_forced(forced: Tensor, layer: int, t: int, handle: RouterHandle) -> Tensor:
        if forced.dtype.is_floating_point or tuple(forced.shape) != (t, handle.top_k):
            raise ValueError(
                f"forced_indices for MoE layer {layer} must be integer [{t}, {handle.top_k}], "
                f"got {forced.dtype} {tuple(forced.shape)}"
            )
        if (
            forced.device.type == "cpu"
            and forced.numel()
            and (int(forced.min()) < 0 or int(forced.max()) >= handle.num_experts)
        ):
            raise ValueError(
                f"forced_indices for MoE layer {layer} out of range [0, {handle.num_experts})"
            )
        return forced.long()


def _arg_position(handle: RouterHandle) -> tuple[str, int] | None:
    name = handle.spec.correction_bias_arg
    if name is None:
        return None
    params = list(inspect.signature(handle.module.forward).parameters)
    if name not in params:
        raise ValueError(
            f"router class {type(handle.module).__name__}: its forward has no argument {name!r} "
            "(RouterSpec.correction_bias_arg)"
        )
    return name, params.index(name)
