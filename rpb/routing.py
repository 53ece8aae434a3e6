"""Router control for transformers 5.x MoE models: find routers by class, route exactly as the
library does (optionally biased or forced), and hook every router to record and steer routing.

This module is how rpb controls routers, and the one users import from; what a router is lives in
rpb.router: each router class has a `RouterSpec` (rpb.router.spec) describing what its forward
computes, the routing it describes is rpb.router.route's (re-exported here), and before rpb routes
with a description it checks it against the module's own forward on a probe batch
(rpb.router.check), bit-exactly, with and without zero biases; a description that does not
reproduce the module is refused in one line. Here: the registry of router classes, finding the
routers of a model, and a forward hook on each that replaces its output with rpb's routing when a
policy steers it (the output adapters turn (logits, weights, indices) into whatever the router
returns: Llama-4's dense scores, JetMoE's expert-sorted tuple). `check_zero_bias_forward` checks
a whole model the same way: a forward steered by zero biases must be the library's.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from rpb.families import BUILTIN_ROUTERS, supported_families
from rpb.router.check import (
    CHECKED,
    as_output_list,
    checked_spec,
    describe_router_class,
    max_abs_diff,
)
from rpb.router.route import (
    UNSET,
    Registered,
    RouterHandle,
    build_output,
    handle_selection_scores,
    make_handle,
    parse_output,
    route,
    route_spec,
    router_logits,
    routing_log_probs,
    routing_probs,
    selection_scores,
    unsupported_router_error,
)
from rpb.router.spec import RouterSpec, UnsupportedRouter, class_path

__all__ = [
    "KINDS",
    "ROUTER_REGISTRY",
    "RouterControl",
    "RouterHandle",
    "RouterRecord",
    "RouterSpec",
    "RoutingPolicy",
    "check_zero_bias_forward",
    "find_routers",
    "register_router",
    "route",
    "route_spec",
    "routing_log_probs",
    "routing_probs",
    "selection_scores",
]

KINDS = ("softmax", "deepseek_v3", "sigmoid")

# User registrations (and the five original classes); built-in families are looked up by class
# path in rpb.families.BUILTIN_ROUTERS, so their modelling code is imported only when used.
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
    spec: RouterSpec | Sequence[RouterSpec] | None = None,
    *,
    example: nn.Module | None = None,
) -> None:
    """Teach rpb another router class.

    `spec` is a `RouterSpec`, several (the first that reproduces the module is used), or None:
    try every built-in description. The description is checked against the module's forward on
    the first router of this class rpb meets (or now, on `example`), and refused in one line if
    it does not reproduce it bit-exactly.
    """
    if spec is None:
        entry: Registered = _auto_candidates()
    elif isinstance(spec, RouterSpec):
        entry = spec
    else:
        entry = tuple(spec) if not isinstance(spec, str) else ()
        if not entry or not all(isinstance(s, RouterSpec) for s in entry):
            raise ValueError("register_router: spec must be a RouterSpec, a list of them or None")
    if example is not None and not isinstance(example, cls):
        raise ValueError(f"register_router: example is a {type(example).__name__}, not a {cls}")
    previous = ROUTER_REGISTRY.get(cls)
    ROUTER_REGISTRY[cls] = entry
    CHECKED.clear()
    if example is not None:
        try:
            checked_spec(example, entry, parent=None)
        except ValueError:  # a refused description is not left registered
            if previous is None:
                del ROUTER_REGISTRY[cls]
            else:
                ROUTER_REGISTRY[cls] = previous
            raise


def _entry_of(cls: type) -> Registered | None:
    for base in cls.__mro__:  # subclasses of a registered router route the same way
        if base in ROUTER_REGISTRY:
            return ROUTER_REGISTRY[base]
        spec = BUILTIN_ROUTERS.get(class_path(base))
        if spec is not None:
            return spec
    return None


# --------------------------------------------------------------------------- finding routers


def _decoder_layer_index(model: nn.Module, name: str, fallback: int) -> int:
    # The decoder layer is the element of the outermost ModuleList on the router's path.
    module = model
    for part in name.split("."):
        if isinstance(module, nn.ModuleList) and part.isdigit():
            return int(part)
        module = getattr(module, part)
    return fallback


def find_routers(model: nn.Module, *, check: bool = True) -> list[RouterHandle]:
    """Every registered router module of `model`, in module order, found by class.

    With `check` (the default) each router's description is first verified against the module's
    own forward (rpb.router.check; cached per class and configuration).
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
            raise unsupported_router_error(type(module), entry.reason)
        parent = parents.get(name)
        first = entry[0] if isinstance(entry, tuple) else entry
        if first.parent is not None and type(parent).__name__ != first.parent:
            continue  # the same class used outside an MoE block (JetMoE's attention experts)
        spec = checked_spec(module, entry, parent) if check else first
        ordinal = len(handles)
        handles.append(
            make_handle(
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
        # The base biases on the device (and dtype) they are used on, made once: a copy from the
        # host in every forward would make the host wait for the device (issue 46).
        self._bias_cache: dict[tuple[str, int, torch.dtype | None], Tensor] = {}
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

    def base_correction_bias(self, layer: int, device: torch.device | None = None) -> Tensor | None:
        """The base's correction bias of MoE layer `layer` (on `device`, copied there once)."""
        return self._bias_on("correction", layer, device)

    def base_router_bias(self, layer: int, device: torch.device | None = None) -> Tensor | None:
        """The base's router logit bias b0 of MoE layer `layer` (on `device`, copied once)."""
        return self._bias_on("router", layer, device)

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
        base = self._need_base(record)
        return handle_selection_scores(
            self.handles[record.layer], base, self._bias_on("correction", record.layer, base.device)
        )

    def base_topk(self, record: RouterRecord) -> Tensor:
        """The base router's own top-k [T, k] on the record's hidden state."""
        handle = self.handles[record.layer]
        with torch.no_grad():
            base = self._need_base(record)
            bias = self._bias_on("correction", record.layer, base.device)
            return route(handle, base, correction_bias=bias)[2]

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

    def _bias_on(
        self, which: str, layer: int, device: torch.device | None, dtype: torch.dtype | None = None
    ) -> Tensor | None:
        bias = (self._base_bias if which == "correction" else self._base_router_bias)[layer]
        if bias is None or device is None:
            return bias
        key = (which, layer, dtype)
        cached = self._bias_cache.get(key)
        if cached is None or cached.device != device:
            cached = bias.to(device=device, dtype=dtype or bias.dtype)
            self._bias_cache[key] = cached
        return cached

    def _live_bias(self, record: RouterRecord) -> Any:
        return UNSET if record.correction_bias is None else record.correction_bias

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
                    self._bias_on("router", layer, hidden.device),
                    logits,
                )
        record = RouterRecord(layer, logits, weights, indices, base_logits)
        record.correction_bias = arg_bias
        if self.weight_distance:
            w = handle.weight  # the full weight here, even when FSDP shards it between forwards
            dist = (w.float() - self._base_fp32(layer, w.device)).pow(2).sum()
            b = handle.router_bias
            b0 = None if b is None else self._bias_on("router", layer, b.device, torch.float32)
            if b is not None and b0 is not None:
                dist = dist + (b.float() - b0).pow(2).sum()
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
            # The base's own top-k (`hard`) is in range by construction: its range check would
            # read the indices on the host in every forward.
            own = policy.forced_indices == self.base_topk
            forced = self._check_forced(forced, layer, t, handle, check_range=not own)
        if policy.use_base_logits:
            source = self._need_base(record)
            bias = self._bias_on("correction", layer, source.device)
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
    def _check_forced(
        forced: Tensor, layer: int, t: int, handle: RouterHandle, check_range: bool = True
    ) -> Tensor:
        if forced.dtype.is_floating_point or tuple(forced.shape) != (t, handle.top_k):
            raise ValueError(
                f"forced_indices for MoE layer {layer} must be integer [{t}, {handle.top_k}], "
                f"got {forced.dtype} {tuple(forced.shape)}"
            )
        if (
            check_range
            and forced.device.type == "cpu"
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


# --------------------------------------------------------------------------- whole-model check


def check_zero_bias_forward(
    model: nn.Module, inputs: dict[str, Any], *, raise_error: bool = True
) -> str | None:
    """Run `model` on `inputs` as the library does and again with a zero logit and selection
    bias on every router (a RouterControl policy, active in either mode): every router's output
    and the model's logits must be bit-identical. The router check compares one router on its
    probe; this compares what a method's steering hands the experts in a whole forward, on the
    model's own hidden states and batch shape. Returns None, else (or raises) one line naming the
    first router that differs and the model logits' largest difference."""
    handles = find_routers(model)
    outputs: tuple[list[tuple[int, Any]], list[tuple[int, Any]]] = ([], [])

    def run(into: list[tuple[int, Any]]) -> Tensor:
        spies = [
            h.module.register_forward_hook(lambda m, a, out, i=i: into.append((i, out)))
            for i, h in enumerate(handles)
        ]
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)  # the same dropout masks in both runs
                out = model(**inputs)
        finally:
            for spy in spies:
                spy.remove()
        return out.logits if hasattr(out, "logits") else as_output_list(out)[0]

    def zeros(record: RouterRecord) -> Tensor:
        return torch.zeros_like(record.logits)

    ref = run(outputs[0])
    with RouterControl(model, keep_at_eval=True) as control:
        control.set_policy(logit_bias=zeros, selection_bias=zeros)
        got = run(outputs[1])  # spies registered after rpb's hooks: they see the steered output
    problem = f"model logits max |diff| {max_abs_diff(got, ref):.3g}"
    for (i, steered), (_, native) in zip(outputs[1], outputs[0], strict=True):
        differ = _output_difference(steered, native)
        if differ is not None:
            h = handles[i]
            problem = f"{describe_router_class(type(h.module))} at {h.name}: {differ}; {problem}"
            break
    else:
        if torch.equal(got, ref):
            return None
    problem = f"a forward with a zero-bias policy differs from the library's: {problem}"
    if raise_error:
        raise ValueError(problem)
    return problem


def _output_difference(a: Any, b: Any) -> str | None:
    """How router output `a` differs from `b` (entries and largest difference), or None."""
    for x, y in zip(as_output_list(a), as_output_list(b), strict=True):
        if not isinstance(x, Tensor):
            if x != y:
                return "output differs (RouterSpec.output)"
        elif x.dtype != y.dtype or not torch.equal(x, y):
            n_bad = int((x != y).sum()) if x.shape == y.shape else x.numel()
            worst = max_abs_diff(x, y)
            return f"output differs in {n_bad}/{x.numel()} entries (max |diff| {worst:.3g})"
    return None
