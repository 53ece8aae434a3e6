"""The self-check: a router description is used only once it reproduces the module's forward.

`check_router` runs a description (rpb.router.spec.RouterSpec) against a router module on a probe
batch, bit-exactly; `checked_spec` picks, among several candidate descriptions, the one that
reproduces the module, and caches the result per class and configuration. rpb.routing calls it
for every router it finds, so every method's attach, prior extraction and analysis is checked.
The check routes with rpb.router.route, never rpb.routing (which imports this module). The
whole-model check, a forward with a zero-bias policy on every router bit-identical to the
library's, is `rpb.routing.check_zero_bias_forward` (docs/records/reliability.md, section 13).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import Tensor, nn

from rpb.router.route import (
    Registered,
    RouterHandle,
    build_output,
    make_handle,
    parse_output,
    route,
    router_logits,
)
from rpb.router.spec import RouterSpec, UnsupportedRouter, class_path

__all__ = ["CHECKED", "check_router", "checked_spec"]

CHECKED: dict[tuple[Any, ...], RouterSpec] = {}


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
    name = describe_router_class(type(module))
    if len(candidates) == 1:
        raise ValueError(f"{name}: {failures[0]}")
    closest = max(failures, key=_progress)
    raise ValueError(
        f"{name}: none of {len(candidates)} candidate descriptions reproduces its "
        f"forward (closest: {closest}); describe it with a RouterSpec in register_router"
    )


# How far a candidate got through the check, to report the closest miss.
_STAGES = (
    "forward or output",
    "routing failed",
    "router logits differ",
    "dtype",
    "indices differ",
    "gate scores differ",
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


def max_abs_diff(a: Tensor, b: Tensor) -> float:
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

    A copy of the module gets random weights and biases (so zero-initialised weights cannot hide
    a difference). The probe holds random hidden states, rows moved so that two experts' scores
    are within a few ulp (near-ties), rows of very large and very small norm (saturated and
    near-uniform scores) and a zero row, and it runs as one batch and as every batch of 1 to 31
    tokens (CPU kernels compute a tensor's last few elements in a scalar loop that rounds
    differently from the vector loop, so a score computed on a tensor of another shape than the
    module's only differs there). rpb's logits, gate weights, indices and dtypes must equal the
    module's exactly, unbiased and with zero logit/selection biases, and the output adapter must
    rebuild the module's own output. Returns None if all match, else (or raises) a one-line
    description naming the field that differs, the maximum difference and the probe rows.
    """
    problem = _check(module, spec, seed)
    if problem is not None and raise_error:
        raise ValueError(f"{describe_router_class(type(module))}: {problem}")
    return problem


def describe_router_class(cls: type) -> str:
    """`router class X (family)`: the transformers model folder the class comes from
    (`qwen3_moe`, `cohere2_moe`), which is a built-in family's name (rpb.families names each
    family so; tests/test_router_check.py checks it), so this module needs no family table; just
    `router class X` for a class of one's own."""
    parts = class_path(cls).split(".")
    folder = parts[2] if parts[:2] == ["transformers", "models"] and len(parts) > 3 else None
    return f"router class {cls.__name__}" + (f" ({folder})" if folder else "")


def _one_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def _check(module: nn.Module, spec: RouterSpec, seed: int) -> str | None:
    try:
        clone = _probe_copy(module)
    except Exception as err:  # an exotic module that cannot be copied
        return f"it could not be copied for the probe ({_one_line(err)})"
    try:
        handle = make_handle("probe", clone, None, spec, 0, 0)
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
        kwargs = {}
        if spec.correction_bias_arg is not None:
            kwargs[spec.correction_bias_arg] = 0.1 * torch.randn(e, generator=g)
        bias = kwargs.get(spec.correction_bias_arg or "", handle.correction_bias)
        hidden, rows = _probe_rows(handle, bias, g)
        # The router's own dtype, and bfloat16 as a model cast to it would run: dtype paths
        # (where a cast happens) only show in low precision.
        dtypes = [weight.dtype] + ([torch.bfloat16] if weight.dtype == torch.float32 else [])
        for dtype in dtypes:
            if dtype != weight.dtype:
                clone = clone.to(dtype)
                handle = make_handle("probe", clone, None, spec, 0, 0)
                if _native_fails(clone, hidden.to(dtype), kwargs):
                    continue  # the router itself does not run in this dtype
            # Both modes: a router that samples while training (or otherwise changes) fails.
            for training in (False, True):
                clone.train(training)
                for n in (len(hidden), *_SMALL_BATCHES):
                    with torch.random.fork_rng(devices=[]):
                        problem = _compare(
                            clone, handle, spec, hidden[:n].to(dtype), rows[:n], kwargs
                        )
                    if problem is not None:
                        where = [str(dtype).removeprefix("torch.")]
                        where += ["training"] if training else []
                        if n != len(hidden):
                            problem = _amend(problem, f"{n}-token batch")
                        return f"{problem} [{', '.join(where)}]"
    return None


# The probe: random hidden states, near-ties, extreme norms and a zero row, shuffled together so
# that every small batch (its first n rows) mixes them.
_PROBE_TOKENS = 64  # random rows
_NEAR_TIE_ROWS = 24
_NORM_SCALES = (("large-norm", (1e3, 1e4)), ("small-norm", (1e-6, 1e-3, 0.0)))
_ROWS_PER_SCALE = 4
# Every batch size below 32: the widest CPU vector loop (2 x 16 float32 lanes) leaves a scalar
# remainder of up to 31 elements, so each row's scores land in the scalar loop at some size.
_SMALL_BATCHES = tuple(range(1, 32))


def _probe_rows(
    handle: RouterHandle, bias: Tensor | None, g: torch.Generator
) -> tuple[Tensor, list[str]]:
    """The probe's hidden states [N, H] (float32) and each row's group name."""
    hdim = handle.hidden_size
    random_rows = torch.randn(_PROBE_TOKENS, hdim, generator=g)
    ties = _near_ties(handle, bias, torch.randn(_NEAR_TIE_ROWS, hdim, generator=g))
    parts = [(random_rows, "random"), (ties, "near-tie")]
    for name, scales in _NORM_SCALES:
        for scale in scales:
            parts.append((scale * torch.randn(_ROWS_PER_SCALE, hdim, generator=g), name))
    hidden = torch.cat([p for p, _ in parts])
    rows = [name for p, name in parts for _ in range(len(p))]
    order = torch.randperm(len(hidden), generator=g)
    return hidden[order], [rows[i] for i in order.tolist()]


def _near_ties(handle: RouterHandle, bias: Tensor | None, hidden: Tensor) -> Tensor:
    """`hidden` [R, H] moved along W_a - W_b until experts a and b score the same (in float64;
    within a few ulp once rounded to the probe dtype): a and b are the k-th and (k+1)-th experts
    (a tie there decides the selection) for two rows in three, the top two for the others."""
    spec = handle.spec
    w = handle.weight.detach().double()
    b0 = handle.router_bias
    shift = 0.0 if b0 is None else b0.detach().double().reshape(-1)
    correction = 0.0 if bias is None else bias.detach().double().reshape(-1)

    def score(z: Tensor) -> Tensor:  # what the library ranks, from float64 logits
        if spec.order == "topk_score":
            return z
        s = z.softmax(-1) if spec.score == "softmax" else z.sigmoid()
        return s + correction

    h = hidden.double()
    z0 = h @ w.T + shift
    r = torch.arange(len(h))
    k, e = handle.top_k, handle.num_experts
    pos = torch.where(r % 3 == 2, 0, min(k, e - 1) - 1)
    ranked = score(z0).argsort(-1, descending=True)
    a, b = ranked[r, pos], ranked[r, pos + 1]
    d = w[a] - w[b]  # moving along d raises z_a - z_b, at rate |d|^2 per unit
    dz = d @ w.T  # the logits are linear in the step: z(t) = z0 + t dz

    def gap(t: Tensor) -> Tensor:
        s = score(z0 + t[:, None] * dz)
        return s[r, a] - s[r, b]

    # gap(0) >= 0; find t < 0 where it is negative, then bisect.
    hi = torch.zeros(len(h), dtype=torch.float64)
    lo = -(gap(hi) + 1e-3) / (d * d).sum(-1).clamp_min(1e-30)
    for _ in range(60):
        neg = gap(lo) < 0
        if bool(neg.all()):
            break
        lo = torch.where(neg, lo, 2 * lo)
    found = gap(lo) < 0
    for _ in range(100):
        mid = (lo + hi) / 2
        below = gap(mid) < 0
        lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
    t = torch.where(found, hi, torch.zeros_like(hi))
    return (h + t[:, None] * d).float()


def _amend(problem: str, note: str) -> str:
    """`problem` with `note` added inside its closing parenthesis (or after it)."""
    return f"{problem[:-1]}, {note})" if problem.endswith(")") else f"{problem} ({note})"


def _native_fails(clone: nn.Module, hidden: Tensor, kwargs: dict[str, Tensor]) -> bool:
    try:
        clone(hidden, **kwargs)
    except Exception:
        return True
    return False


def _groups(rows: list[str], bad: Tensor) -> str:
    """The probe groups of the rows flagged in `bad` [T], e.g. 'near-tie, large-norm'."""
    names = sorted({rows[i] for i in bad.nonzero().flatten().tolist()})
    return ", ".join(names) + " rows" if names else "all rows"


def _compare(
    clone: nn.Module,
    handle: RouterHandle,
    spec: RouterSpec,
    hidden: Tensor,
    rows: list[str],
    kwargs: dict[str, Tensor],
) -> str | None:
    """The first difference between rpb and the module on `hidden`, as `text (details)`."""
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
            f"{max_abs_diff(z, logits):.3g}, dtype {z.dtype} vs {logits.dtype}; "
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
        rebuilt = build_output(spec, logits, w, i)
        if spec.output == "scores_logits":
            # Dense scores are all the module returns: an expert chosen with score 0 (a
            # saturated sigmoid) is not observable, so compare what the experts receive.
            dense, ref = rebuilt[0], native[0]
            if not torch.equal(dense, ref):
                bad = (dense != ref).any(-1)
                return (
                    f"gate scores differ (max |diff| {max_abs_diff(dense, ref):.3g} in "
                    f"{int((dense != ref).sum())}/{dense.numel()} entries, {label}; "
                    f"{_groups(rows, bad)})"
                )
        got_i, got_w = _paired(i, w)
        if spec.output != "scores_logits" and not torch.equal(got_i, ref_i):
            bad = (got_i != ref_i).any(-1)
            return (
                f"expert indices differ on {int(bad.sum())}/{len(ref_i)} probe tokens "
                f"({label}; {_groups(rows, bad)})"
            )
        if spec.output != "scores_logits" and not torch.equal(got_w, ref_w):
            bad = (got_w != ref_w).any(-1)
            return (
                f"gate weights differ (max |diff| {max_abs_diff(got_w, ref_w):.3g}, {label}; "
                f"{_groups(rows, bad)})"
            )
        if not extra and not _same_output(rebuilt, native):
            return f"rebuilt {spec.output!r} output differs from the module's (RouterSpec.output)"
    return None


def _same_output(a: Any, b: Any) -> bool:
    xs, ys = as_output_list(a), as_output_list(b)
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


def as_output_list(output: Any) -> list[Any]:
    return list(output) if isinstance(output, tuple | list) else [output]
