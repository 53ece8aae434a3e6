"""Router control for transformers 5.x MoE models: find routers by class, route exactly as the
library does (optionally biased or forced), and hook every router to record and steer routing.

In transformers 5.x every MoE router (`mlp.gate`) returns `(router_logits, top_k_weights,
top_k_indices)` and the experts consume exactly that tuple, so a forward hook that returns a
replacement tuple is all it takes to bias or force routing. The routing functions below reproduce
the library's routers bit-exactly when no bias is given (tested per architecture).
"""

from __future__ import annotations

from collections.abc import Callable
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

__all__ = [
    "KINDS",
    "ROUTER_REGISTRY",
    "RouterControl",
    "RouterHandle",
    "RouterKind",
    "RouterRecord",
    "RoutingPolicy",
    "find_routers",
    "register_router",
    "route",
    "route_deepseek_v3",
    "route_softmax",
    "routing_log_probs",
    "routing_probs",
    "selection_scores",
]

KINDS = ("softmax", "deepseek_v3")


@dataclass(frozen=True)
class RouterKind:
    """How a router class routes: its kind plus the small numeric quirks of its family."""

    kind: str
    # Mixtral renormalises the top-k weights unconditionally (it has no norm_topk_prob).
    always_normalise: bool = False
    # Mixtral returns float32 weights; Qwen/OLMoE cast them back to the logits' dtype.
    float_weights: bool = False


ROUTER_REGISTRY: dict[type[nn.Module], RouterKind] = {
    Qwen3MoeTopKRouter: RouterKind("softmax"),
    Qwen2MoeTopKRouter: RouterKind("softmax"),
    OlmoeTopKRouter: RouterKind("softmax"),
    MixtralTopKRouter: RouterKind("softmax", always_normalise=True, float_weights=True),
    DeepseekV3TopkRouter: RouterKind("deepseek_v3"),
}


def register_router(
    cls: type[nn.Module], kind: str, *, always_normalise: bool = False, float_weights: bool = False
) -> None:
    """Teach rpb another router class (its forward must follow the 5.x router contract)."""
    if kind not in KINDS:
        raise ValueError(f"unknown routing kind {kind!r} (known: {', '.join(KINDS)})")
    ROUTER_REGISTRY[cls] = RouterKind(kind, always_normalise, float_weights)


def _kind_of(cls: type) -> RouterKind | None:
    for base in cls.__mro__:  # subclasses of a registered router route the same way
        if base in ROUTER_REGISTRY:
            return ROUTER_REGISTRY[base]
    return None


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
    spec: RouterKind = field(repr=False)

    @property
    def correction_bias(self) -> Tensor | None:
        """DeepSeek-V3's live `e_score_correction_bias` (None for softmax routers)."""
        return getattr(self.module, "e_score_correction_bias", None)


def _decoder_layer_index(model: nn.Module, name: str, fallback: int) -> int:
    # The decoder layer is the element of the outermost ModuleList on the router's path.
    module = model
    for part in name.split("."):
        if isinstance(module, nn.ModuleList) and part.isdigit():
            return int(part)
        module = getattr(module, part)
    return fallback


def find_routers(model: nn.Module) -> list[RouterHandle]:
    """Every registered router module of `model`, in module order, found by class."""
    handles: list[RouterHandle] = []
    for name, module in model.named_modules():
        spec = _kind_of(type(module))
        if spec is None:
            continue
        weight = module.weight
        ordinal = len(handles)
        handles.append(
            RouterHandle(
                moe_layer=ordinal,
                decoder_layer=_decoder_layer_index(model, name, ordinal),
                name=name,
                module=module,
                kind=spec.kind,
                num_experts=int(getattr(module, "num_experts", weight.shape[0])),
                top_k=int(module.top_k),
                hidden_size=int(getattr(module, "hidden_dim", weight.shape[1])),
                spec=spec,
            )
        )
    if not handles:
        known = ", ".join(sorted(c.__name__ for c in ROUTER_REGISTRY))
        raise ValueError(
            f"no MoE router found in {type(model).__name__} (known router classes: {known}; "
            "add others with rpb.routing.register_router)"
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
    """Softmax top-k routing (Qwen2/3-MoE, OLMoE, Mixtral) -> (logits, weights, indices).

    `logit_bias` is added to the logits before everything; `selection_bias` only to the
    selection score (the logits); `forced_indices` [T, k] replaces the selection. Gate weights are
    always the (biased-logit) softmax at the chosen experts.
    """
    if logit_bias is not None:
        logits = logits + logit_bias.to(logits.dtype)
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    if forced_indices is not None:
        indices = forced_indices
    elif selection_bias is None:
        indices = torch.topk(probs, top_k, dim=-1)[1]  # exactly the library's selection
    else:
        # Rank by biased logits, not softmax(biased logits): a large bias would saturate the
        # softmax into ties, and softmax is monotone so the ranking is the same otherwise.
        indices = torch.topk(logits.float() + selection_bias, top_k, dim=-1)[1]
    weights = probs.gather(1, indices)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not float_weights:
        weights = weights.to(logits.dtype)
    return logits, weights, indices


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
    """DeepSeek-V3 sigmoid/noaux_tc routing -> (logits, weights, indices).

    Selection is top-k of sigmoid(logits) + correction_bias (+ `selection_bias`) within the
    `topk_group` best groups of that same sum; weights are the sigmoid scores at the chosen
    experts, renormalised and scaled as the library does.
    """
    if logit_bias is not None:
        logits = logits + logit_bias.to(logits.dtype)
    scores = logits.sigmoid()
    if forced_indices is not None:
        indices = forced_indices
    else:
        choice = scores + correction_bias
        if selection_bias is not None:
            choice = choice + selection_bias
        n_experts = choice.shape[-1]
        group_scores = choice.view(-1, n_group, n_experts // n_group).topk(2, dim=-1)[0].sum(-1)
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = (
            group_mask.unsqueeze(-1)
            .expand(-1, n_group, n_experts // n_group)
            .reshape(-1, n_experts)
        )
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        indices = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, indices)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * routed_scaling_factor
    return logits, weights, indices


_DEFAULT = object()


def route(
    handle: RouterHandle,
    logits: Tensor,
    *,
    correction_bias: Any = _DEFAULT,
    logit_bias: Tensor | None = None,
    selection_bias: Tensor | None = None,
    forced_indices: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Route `logits` [T, E] the way `handle`'s router does (its live settings).

    `correction_bias` overrides a DeepSeek-V3 router's own `e_score_correction_bias` (e.g. the
    base's); it is ignored for softmax routers.
    """
    m = handle.module
    if handle.kind == "softmax":
        return route_softmax(
            logits,
            handle.top_k,
            norm_topk_prob=handle.spec.always_normalise
            or bool(getattr(m, "norm_topk_prob", False)),
            float_weights=handle.spec.float_weights,
            logit_bias=logit_bias,
            selection_bias=selection_bias,
            forced_indices=forced_indices,
        )
    bias = handle.correction_bias if correction_bias is _DEFAULT else correction_bias
    return route_deepseek_v3(
        logits,
        handle.top_k,
        correction_bias=bias.to(logits.device),
        n_group=m.num_group,
        topk_group=m.topk_group,
        norm_topk_prob=m.norm_topk_prob,
        routed_scaling_factor=m.routed_scaling_factor,
        logit_bias=logit_bias,
        selection_bias=selection_bias,
        forced_indices=forced_indices,
    )


def selection_scores(kind: str, logits: Tensor, correction_bias: Tensor | None = None) -> Tensor:
    """A router's native selection score [T, E] (float32): the logits for softmax routers (they
    rank like log p), sigmoid(logits) + correction bias for DeepSeek-V3."""
    if kind == "softmax":
        return logits.float()
    scores = logits.float().sigmoid()
    return scores if correction_bias is None else scores + correction_bias.to(scores.device)


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


# --------------------------------------------------------------------------- control hooks


@dataclass
class RouterRecord:
    """What one router saw and did in the latest forward (tokens flattened to T = batch * seq)."""

    layer: int
    logits: Tensor  # [T, E] live router logits z = W h, as the library computed them (with grad)
    weights: Tensor  # [T, k] gate weights the experts received
    indices: Tensor  # [T, k] experts the tokens were sent to
    base_logits: Tensor | None  # [T, E] z0 = W0 h on the same input (no grad), if a base is set
    steered: bool = False  # whether a policy replaced the router's output
    # ||W - W0||_F^2 in float32 (with grad), taken inside the forward where FSDP has the full W;
    # only with RouterControl(weight_distance=True).
    weight_sq_dist: Tensor | None = None


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

    `base_weights` (one [E, H] tensor per MoE layer) enables base logits z0 = W0 h on the router's
    own input; they live on this object, never on the model, so state_dict keys are unchanged.
    For DeepSeek-V3 the base correction bias defaults to the routers' biases at construction.
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
        self._base_bias = [None if b is None else b.detach().clone() for b in self._base_bias]
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
    def has_base(self) -> bool:
        return self._base is not None

    @property
    def base_weights(self) -> list[Tensor] | None:
        return self._base

    def base_correction_bias(self, layer: int) -> Tensor | None:
        return self._base_bias[layer]

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

    def clear_policy(self, layer: int | None = None) -> None:
        for i in self._layers(layer):
            self.policies[i] = RoutingPolicy()

    def clear_records(self) -> None:
        self.records = [None] * self.num_layers

    def base_scores(self, record: RouterRecord) -> Tensor:
        """The base router's native selection score s0 [T, E] on the record's hidden state."""
        return selection_scores(
            self.handles[record.layer].kind,
            self._need_base(record),
            self._base_bias[record.layer],
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
            return route(self.handles[record.layer], record.logits.detach())[2]

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
        output: tuple[Tensor, Tensor, Tensor],
    ) -> tuple[Tensor, Tensor, Tensor] | None:
        handle = self.handles[layer]
        logits, weights, indices = output
        base_logits = None
        if self._base is not None:
            hidden = args[0] if args else next(iter(kwargs.values()))
            with torch.no_grad():
                # Same dtype path as the library's logits, so z0 == z bitwise when W == W0.
                h = hidden.reshape(-1, handle.hidden_size).to(logits.dtype)
                base_logits = F.linear(h, self._base_on(layer, logits))
        record = RouterRecord(layer, logits, weights, indices, base_logits)
        if self.weight_distance:
            w = module.weight  # the full weight here, even when FSDP shards it between forwards
            record.weight_sq_dist = (w.float() - self._base_fp32(layer, w.device)).pow(2).sum()
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
            out = route(
                handle,
                self._need_base(record),
                correction_bias=self._base_bias[layer],
                logit_bias=logit_bias,
                selection_bias=selection_bias,
                forced_indices=forced,
            )
        else:
            out = route(
                handle,
                logits,
                logit_bias=logit_bias,
                selection_bias=selection_bias,
                forced_indices=forced,
            )
        record.weights, record.indices, record.steered = out[1], out[2], True
        return out

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
