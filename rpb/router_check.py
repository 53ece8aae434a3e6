"""The self-check: a router description is used only once it reproduces the module's forward.

`check_router` runs a description (rpb.router_specs.RouterSpec) against a router module on a probe
batch, bit-exactly; `checked_spec` picks, among several candidate descriptions, the one that
reproduces the module, and caches the result per class and configuration. rpb.routing calls it
for every router it finds, so every method's attach, prior extraction and analysis is checked.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import Tensor, nn

from rpb.router_specs import RouterSpec, UnsupportedRouter
from rpb.routing import (
    Registered,
    RouterHandle,
    _make_handle,
    build_output,
    parse_output,
    route,
    router_logits,
)

__all__ = ["CHECKED", "check_router", "checked_spec"]

CHECKED: dict[tuple[Any, ...], RouterSpec] = {}
_PROBE_TOKENS = 64


def _signature(module: nn.Module, entry: Registered) -> tuple[Any, ...]:
    """What the check result depends on: class, description(s), dtypes, shapes and the
    attributes a description reads (not the weight values: the probe draws its own)."""
    specs = entry if isinstance(entry, tuple) else (entry,)
    attrs = set()
    for s in specs:
        if isinstance(s, RouterSpec):
            for v in (s.normalise, s.norm_eps, s.scaling, s.top_k, s.num_experts):
                if isinstance(v, str):
                    attrs.add(v)
            if isinstance(s.groups, tuple):
                attrs.add(s.groups[0])
            attrs.update(s.group_attrs)
    values = tuple((a, repr(getattr(module, a, None))) for a in sorted(attrs))
    tensors = tuple(
        (n, tuple(t.shape), t.dtype)
        for n, t in list(module.named_parameters()) + list(module.named_buffers())
    )
    return (type(module), entry, values, tensors)


def checked_spec(module: nn.Module, entry: Registered, parent: nn.Module | None) -> RouterSpec:
    """The description of `module` that reproduces its forward (cached), else a one-line error."""
    assert not isinstance(entry, UnsupportedRouter)
    key = _signature(module, entry)
    cached = CHECKED.get(key)
    if cached is not None:
        return cached
    candidates = entry if isinstance(entry, tuple) else (entry,)
    if len(candidates) > 1:
        candidates = _with_weight_paths(module, candidates)
    failures = []
    for spec in candidates:
        problem = check_router(module, spec, raise_error=False)
        if problem is None:
            CHECKED[key] = spec
            return spec
        failures.append(problem)
    name = type(module).__name__
    if len(candidates) == 1:
        raise ValueError(f"router class {name}: {failures[0]}")
    closest = max(failures, key=_progress)
    raise ValueError(
        f"router class {name}: none of {len(candidates)} candidate descriptions reproduces its "
        f"forward (closest: {closest}); describe it with a RouterSpec in register_router"
    )


# How far a candidate got through the check, to report the closest miss.
_STAGES = (
    "forward or output",
    "routing failed",
    "router logits differ",
    "dtype",
    "indices differ",
    "gate weights differ",
    "rebuilt",
)


def _progress(problem: str) -> int:
    return max((i + 1 for i, key in enumerate(_STAGES) if key in problem), default=0)


def _with_weight_paths(module: nn.Module, specs: tuple[RouterSpec, ...]) -> tuple[RouterSpec, ...]:
    """Candidates for a router whose weight is not where a description looks: every 2-D
    parameter as the weight (a description's other paths moved along when the weight is found
    under a prefix, e.g. a wrapped router), with and without the bias [E] beside it."""
    params = dict(module.named_parameters())
    out = []
    for spec in specs:
        if isinstance(params.get(spec.weight), Tensor):
            out.append(spec)
            continue
        for name, p in params.items():
            if p.dim() != 2:
                continue
            if name.endswith("." + spec.weight):
                prefix = name[: -len(spec.weight)]

                def moved(path: str | None, prefix: str = prefix) -> str | None:
                    return path if path is None or path.startswith("../") else prefix + path

                variants = [
                    spec.replace(
                        weight=name,
                        router_bias=moved(spec.router_bias),
                        correction_bias=moved(spec.correction_bias),
                    )
                ]
            else:
                variants = [spec.replace(weight=name)]
                bias = name.rsplit(".", 1)[0] + ".bias" if "." in name else "bias"
                if bias in params and tuple(params[bias].shape) == (p.shape[0],):
                    variants.append(spec.replace(weight=name, router_bias=bias))
            out.extend(v for v in variants if v not in out)
    return tuple(out) or specs


def _probe_copy(module: nn.Module) -> nn.Module:
    """A CPU copy of the router with plain tensors (works for sharded or meta weights too) and
    no hooks; the module itself is never run or modified."""
    memo: dict[int, Any] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        memo[id(t)] = torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
    clone = copy.deepcopy(module, memo)
    for sub in clone.modules():
        sub._forward_hooks.clear()
        sub._forward_pre_hooks.clear()
        # accelerate (device_map, offload) wraps `forward` per instance: use the class's own
        sub.__dict__.pop("forward", None)
        sub.__dict__.pop("_hf_hook", None)
        for store in (sub._parameters, sub._buffers):
            for key, t in list(store.items()):
                if t is not None:
                    fresh = torch.empty(tuple(t.shape), dtype=t.dtype)
                    store[key] = (
                        nn.Parameter(fresh, requires_grad=False)
                        if store is sub._parameters
                        else fresh
                    )
    return clone.eval()


def _max_diff(a: Tensor, b: Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    if not a.dtype.is_floating_point:
        return float((a != b).sum())  # number of differing entries
    return float((a.double() - b.double()).abs().nan_to_num(math.inf).max()) if a.numel() else 0.0


def _paired(indices: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    order = indices.argsort(dim=-1)
    return indices.gather(1, order), weights.gather(1, order)


def check_router(
    module: nn.Module, spec: RouterSpec, *, seed: int = 0, raise_error: bool = True
) -> str | None:
    """Run `spec`'s routing against `module`'s own forward on a probe batch, bit-exactly.

    A copy of the module gets random weights and biases (so ties and zero-initialised weights
    cannot hide a difference); rpb's logits, gate weights, indices and dtypes must equal the
    module's exactly, unbiased and with zero logit/selection biases, and the output adapter must
    rebuild the module's own output. Returns None if all match, else (or raises) a one-line
    description naming the field that differs and the maximum difference.
    """
    problem = _check(module, spec, seed)
    if problem is not None and raise_error:
        raise ValueError(f"router class {type(module).__name__}: {problem}")
    return problem


def _one_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def _check(module: nn.Module, spec: RouterSpec, seed: int) -> str | None:
    try:
        clone = _probe_copy(module)
    except Exception as err:  # an exotic module that cannot be copied
        return f"it could not be copied for the probe ({_one_line(err)})"
    try:
        handle = _make_handle("probe", clone, None, spec, 0, 0)
    except ValueError as e:
        return str(e)
    g = torch.Generator().manual_seed(seed)
    weight = handle.weight
    e, hdim = handle.num_experts, handle.hidden_size
    with torch.no_grad():
        for t in list(clone.parameters()) + list(clone.buffers()):
            if t.dtype.is_floating_point:
                t.copy_(0.1 * torch.randn(t.shape, generator=g))
        weight.copy_(torch.randn(weight.shape, generator=g) / math.sqrt(hdim))
        hidden = torch.randn(_PROBE_TOKENS, hdim, generator=g)
        kwargs = {}
        if spec.correction_bias_arg is not None:
            kwargs[spec.correction_bias_arg] = 0.1 * torch.randn(e, generator=g)
        # The router's own dtype, and bfloat16 as a model cast to it would run: dtype paths
        # (where a cast happens) only show in low precision.
        dtypes = [weight.dtype] + ([torch.bfloat16] if weight.dtype == torch.float32 else [])
        for dtype in dtypes:
            if dtype != weight.dtype:
                clone = clone.to(dtype)
                handle = _make_handle("probe", clone, None, spec, 0, 0)
                if _native_fails(clone, hidden.to(dtype), kwargs):
                    continue  # the router itself does not run in this dtype
            # Both modes: a router that samples while training (or otherwise changes) fails.
            for training in (False, True):
                clone.train(training)
                with torch.random.fork_rng(devices=[]):
                    problem = _compare(clone, handle, spec, hidden.to(dtype), kwargs)
                if problem is not None:
                    where = [str(dtype).removeprefix("torch.")] + (["training"] if training else [])
                    return f"{problem} [{', '.join(where)}]"
    return None


def _native_fails(clone: nn.Module, hidden: Tensor, kwargs: dict[str, Tensor]) -> bool:
    try:
        clone(hidden, **kwargs)
    except Exception:
        return True
    return False


def _compare(
    clone: nn.Module,
    handle: RouterHandle,
    spec: RouterSpec,
    hidden: Tensor,
    kwargs: dict[str, Tensor],
) -> str | None:
    try:
        native = clone(hidden, **kwargs)
        logits, w_ref, i_ref = parse_output(spec, native, handle.top_k)
    except Exception as err:  # the module's own forward or its output shape
        return f"its forward or output does not fit the description ({_one_line(err)})"
    bias = kwargs.get(spec.correction_bias_arg or "", handle.correction_bias)
    z = router_logits(spec, hidden, handle.weight, handle.router_bias, logits)
    if z.dtype != logits.dtype or not torch.equal(z, logits):
        return (
            f"rpb's router logits differ from the module's (max |diff| "
            f"{_max_diff(z, logits):.3g}, dtype {z.dtype} vs {logits.dtype}; "
            "RouterSpec.weight, router_bias, linear_float32, logits_float32)"
        )
    zeros = torch.zeros(handle.num_experts)
    variants: list[tuple[str, dict[str, Any]]] = [
        ("unbiased", {}),
        ("zero selection bias", {"selection_bias": zeros}),
        ("zero logit and selection bias", {"logit_bias": zeros, "selection_bias": zeros}),
    ]
    ref_i, ref_w = _paired(i_ref, w_ref)
    for label, extra in variants:
        try:
            _, w, i = route(handle, logits, correction_bias=bias, input_dtype=hidden.dtype, **extra)
        except Exception as err:  # e.g. a group count that does not divide the experts
            return f"rpb's routing failed on it ({_one_line(err)})"
        if w.dtype != w_ref.dtype:
            return (
                f"gate weights dtype {w.dtype} vs the module's {w_ref.dtype} ({label}; "
                "RouterSpec.weights_dtype)"
            )
        got_i, got_w = _paired(i, w)
        if not torch.equal(got_i, ref_i):
            n_bad = int((got_i != ref_i).any(-1).sum())
            return f"expert indices differ on {n_bad}/{len(ref_i)} probe tokens ({label})"
        if not torch.equal(got_w, ref_w):
            return f"gate weights differ (max |diff| {_max_diff(got_w, ref_w):.3g}, {label})"
        if not extra:
            rebuilt = build_output(spec, logits, w, i)
            if not _same_output(rebuilt, native):
                return (
                    f"rebuilt {spec.output!r} output differs from the module's (RouterSpec.output)"
                )
    return None


def _same_output(a: Any, b: Any) -> bool:
    xs, ys = _flat(a), _flat(b)
    if len(xs) != len(ys):
        return False
    for x, y in zip(xs, ys, strict=True):
        if isinstance(x, Tensor) != isinstance(y, Tensor):
            return False
        if isinstance(x, Tensor):
            if x.dtype != y.dtype or not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def _flat(output: Any) -> list[Any]:
    return list(output) if isinstance(output, tuple | list) else [output]
