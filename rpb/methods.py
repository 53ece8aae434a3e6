"""The router post-training methods (docs/design.md, section 3) behind one small interface.

    method = make_method("rpb", strength=1.0, **options)
    method.attach(model, prior)            # installs a RouterControl; also a context manager
    loss = out.loss + method.router_loss(attention_mask=batch.get("attention_mask"))
    method.set_progress(step, total_steps) # before each step: rpb_anneal's schedule
    method.on_step_end()                   # advances rpb_adaptive's bias; no-op otherwise
    stats = method.routing_stats()         # per-layer drift of the latest forward
    method.detach()

Conventions: all per-token terms are means over non-padding tokens; anchor_logit and anchor_kl
average over MoE layers (so a strength means the same at 27 or 48 layers), anchor_weight sums over
layers as written in docs/design.md. Base logits z0 are a fixed target (no gradient flows through
them).
Drift statistics describe the live router's *own* routing (what it does at evaluation, without any
training-time bias), so a selection bias cannot hide router drift.

Each method states what reaches the router weight (`gradient_path`, docs/methods.md):
"selection_only" (the router-weight gradient equals plain fine-tuning's under the same expert
selection: the method only chooses experts), "moves_router" (a loss term or biased gate weights
add to it), "plain" (`none`) or "none" (the live router gets no gradient).
"""

from __future__ import annotations

import logging
import math
import warnings
from functools import partial
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from rpb.coactivation import mean_kl, topk_overlap, usage_entropy
from rpb.prior import RouterPrior
from rpb.routing import RouterControl, RouterRecord, routing_log_probs, routing_probs
from rpb.specs import FAMILY_STRENGTH, MethodSpec, check_method, method_spec

__all__ = [
    "DEEPSEEK_V3_AUX_LOSS_ALPHA",
    "GRADIENT_PATHS",
    "METHODS",
    "RouterMethod",
    "family_lbl_coefficient",
    "make_method",
    "own_router_loss_message",
    "sequence_lbl",
    "switch_lbl",
]

log = logging.getLogger(__name__)

METHODS: dict[str, type[RouterMethod]] = {}

# What reaches the router weight under each method (RouterMethod.gradient_path).
GRADIENT_PATHS = ("plain", "selection_only", "moves_router", "none")


def _register(cls: type[RouterMethod]) -> type[RouterMethod]:
    """Register a method class under its name; its strength and options come from its
    `rpb.specs.METHOD_SPECS` entry (the one place the config check reads them too)."""
    spec = method_spec(cls.name)
    cls.spec = spec
    cls.uses_strength = spec.uses_strength
    cls.needs_prior = spec.needs_prior
    METHODS[cls.name] = cls
    return cls


def make_method(name: str, strength: float | str | None = None, **options: Any) -> RouterMethod:
    """Instantiate a registered method; `strength` None means the method's default (its
    rpb.specs entry). `lbl` also takes strength="family": the coefficient the model's family was
    pretrained with, read from the model's config when the method is attached
    (`family_lbl_coefficient`). Strength and options are checked as a MethodConfig's are
    (rpb.specs.check_method; `rpb.method_config.MethodConfig(...).build()` comes here)."""
    if name not in METHODS:
        raise ValueError(f"unknown router method {name!r} (known: {', '.join(METHODS)})")
    return METHODS[name](strength, **options)


def switch_lbl(
    probs: list[Tensor], indices: list[Tensor], num_experts: int, mask: Tensor | None = None
) -> Tensor:
    """Switch-Transformer load-balancing loss pooled over layers exactly as transformers'
    `load_balancing_loss_func` pools it: E * sum_e f_e * P_e, with f_e the fraction of top-k
    assignments (summing to k) and P_e the mean routing probability, over all layers' tokens."""
    device = probs[0].device
    assigned = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for p, idx in zip(probs, indices, strict=True):
        m = torch.ones(p.shape[0], device=device) if mask is None else mask.to(device).float()
        k = idx.shape[-1]
        assigned = assigned.scatter_add(0, idx.reshape(-1), m.repeat_interleave(k))
        prob_sum = prob_sum + (p.float() * m.unsqueeze(-1)).sum(0)
        rows = rows + m.sum()
    return (assigned / rows * (prob_sum / rows)).sum() * num_experts


# sequence_lbl's boolean-mask selection, per MoE layer: forward nonzero + backward index_put.
SEQUENCE_LBL_WAITS_PER_LAYER = 2


def sequence_lbl(
    probs: list[Tensor], indices: list[Tensor], num_experts: int, mask: Tensor
) -> Tensor:
    """DeepSeek-V3's sequence-wise balance loss, summed over layers (times alpha it is what
    Moonlight's `aux_loss_alpha` weights, per MoE layer, with `seq_aux`).

    Per layer and per sequence of T non-padding tokens: f_i = E / (K T) * (number of the
    sequence's top-K selections that are expert i), P_i = mean over the sequence's tokens of the
    normalised score of expert i, loss = sum_i f_i P_i; averaged over the sequences with at least
    one token, summed over layers. `probs` [B*S, E] per layer (rows summing to 1), `indices`
    [B*S, K], `mask` [B, S] (1 = token, 0 = padding)."""
    batch, seq = mask.shape
    device = probs[0].device
    m = mask.to(device).float()
    n_tokens = m.sum(1)
    has_tokens = n_tokens > 0
    total = torch.zeros((), dtype=torch.float32, device=device)
    for p, idx in zip(probs, indices, strict=True):
        if p.shape[0] != batch * seq:
            raise ValueError(f"routed {p.shape[0]} tokens, attention_mask has {batch * seq}")
        k = idx.shape[-1]
        counts = torch.zeros(batch, num_experts, dtype=torch.float32, device=device)
        counts = counts.scatter_add(1, idx.reshape(batch, seq * k), m.repeat_interleave(k, dim=1))
        f = counts * num_experts / (k * n_tokens.clamp_min(1)).unsqueeze(-1)
        mean_p = (p.float().reshape(batch, seq, -1) * m.unsqueeze(-1)).sum(1)
        mean_p = mean_p / n_tokens.clamp_min(1).unsqueeze(-1)
        total = total + (f * mean_p).sum(-1)[has_tokens].mean()
    return total


# Where a family's config keeps the coefficient of its own load-balancing loss, by router kind:
# transformers' softmax MoE configs (router_aux_loss_coef), DeepSeek-V3's and Moonlight's released
# config.json (aux_loss_alpha, kept by transformers as an attribute), JetMoE (aux_loss_coef).
_LBL_COEF_ATTRS: dict[str, tuple[str, ...]] = {
    "deepseek_v3": ("aux_loss_alpha", "router_aux_loss_coef", "aux_loss_coef"),
    "softmax": ("router_aux_loss_coef", "aux_loss_coef", "aux_loss_alpha"),
    "sigmoid": ("router_aux_loss_coef", "aux_loss_coef", "aux_loss_alpha"),
}
# DeepSeek-V3's aux_loss_alpha when the config does not carry it: the value of DeepSeek-V3's and
# Moonlight's released configs (with seq_aux). transformers' DeepseekV3Config has no such field,
# as transformers trains no auxiliary loss for the family.
DEEPSEEK_V3_AUX_LOSS_ALPHA = 0.001


def family_lbl_coefficient(config: Any, kind: str) -> float:
    """The load-balancing coefficient `config`'s family was pretrained with, for routers of
    `kind` (what `make_method("lbl", strength="family")` uses): `router_aux_loss_coef` for the
    softmax families (Qwen2/3-MoE 0.001, OLMoE 0.01, Mixtral 0.001 by default), `aux_loss_alpha`
    for DeepSeek-V3 / Moonlight (DEEPSEEK_V3_AUX_LOSS_ALPHA when the config has none). A
    multimodal config is read through its text config. Raises if the family names none."""
    configs = [config]
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    if text is not None and text is not config:
        configs.append(text)
    attrs = _LBL_COEF_ATTRS.get(kind, _LBL_COEF_ATTRS["softmax"])
    for attr in attrs:
        for cfg in configs:
            value = getattr(cfg, attr, None)
            if isinstance(value, int | float) and not isinstance(value, bool):
                if not math.isfinite(value) or value < 0:
                    raise ValueError(f"lbl strength 'family': config.{attr} = {value} is not >= 0")
                return float(value)
    if kind == "deepseek_v3":
        return DEEPSEEK_V3_AUX_LOSS_ALPHA
    model_type = getattr(config, "model_type", type(config).__name__)
    raise ValueError(
        f"lbl strength 'family': the {model_type} config has none of {', '.join(attrs)}; "
        "pass the coefficient as a number"
    )


def own_router_loss_message(model: Any, method: str) -> str:
    """The one line saying the model's own load-balancing loss was turned off for `method`."""
    what = (
        "lbl's term is that loss, counted once (strength 'family' takes the model's own "
        "coefficient)"
        if method == "lbl"
        else f"the {method} method's term is the only router term (method lbl adds the family's "
        "own load-balancing loss)"
    )
    return (
        f"turned off {type(model).__name__}'s own load-balancing loss (output_router_logits) "
        f"during training: {what}"
    )


def turn_off_own_router_loss(model: Any) -> bool:
    """Set `output_router_logits` off on `model`'s config and text config (transformers then adds
    no load-balancing loss of its own to `out.loss`); whether any was on."""
    config = getattr(model, "config", None)
    configs = [config]
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    if text is not None and text is not config:
        configs.append(text)
    on = [c for c in configs if getattr(c, "output_router_logits", False)]
    for c in on:
        c.output_router_logits = False
    return bool(on)


class RouterMethod:
    """Base class and the `none` method: plain fine-tuning, no router term, no steering."""

    name: ClassVar[str] = "none"
    # Whether the router hooks record ||W - W0||^2 (RouterControl's `weight_distance`).
    needs_weight_distance: ClassVar[bool] = False
    # Set by `_register` from the method's rpb.specs entry: the spec (strength default and
    # limit, options), whether it takes a strength, whether `attach` needs a router prior.
    spec: ClassVar[MethodSpec]
    needs_prior: ClassVar[bool] = False
    uses_strength: ClassVar[bool] = False

    def __init__(self, strength: float | None = None, **options: Any) -> None:
        # The one check of a method's strength and options (a MethodConfig built here passes
        # them checked already, and gets them back as they are).
        strength, self.options = check_method(self.name, strength, options)
        self.strength = 0.0 if strength is None else float(strength)
        self.progress = 0.0  # share of training done (set_progress)
        self.control: RouterControl | None = None
        self.prior: RouterPrior | None = None
        self.model: nn.Module | None = None
        self._mask: Tensor | None = None
        # Whether attach turned the model's own load-balancing loss off (output_router_logits).
        self.turned_off_own_router_loss = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(strength={self.strength}, options={self.options})"

    # -- lifecycle

    def attach(self, model: nn.Module, prior: RouterPrior | None = None) -> RouterMethod:
        """Install router hooks on `model` (a prior enables base-relative terms and stats)."""
        if self.control is not None:
            raise RuntimeError(f"method {self.name!r} is already attached; detach() it first")
        if self.needs_prior and prior is None:
            raise ValueError(f"method {self.name!r} needs a router prior: attach(model, prior)")
        if prior is not None:
            prior.check_compatible(model)
        self.model, self.prior = model, prior
        self.control = RouterControl(
            model,
            base_weights=prior.base_weights if prior is not None else None,
            base_correction_bias=prior.correction_bias if prior is not None else None,
            base_router_bias=prior.router_bias if prior is not None else None,
            keep_at_eval=bool(self.options.get("keep_bias_at_eval", False)),
            weight_distance=self.needs_weight_distance,
        )
        self._install()
        # One router term: a checkpoint whose config has output_router_logits on would add its
        # own load-balancing loss to out.loss beside the method's term (with lbl, the same term
        # twice), whatever the training loop. Off from here on, with one warning; a trainer that
        # is asked to keep it (TRL's SFTConfig(router_aux_loss_coef=...)) turns it back on.
        self.turned_off_own_router_loss = turn_off_own_router_loss(model)
        if self.turned_off_own_router_loss:
            log.warning("rpb: %s", own_router_loss_message(model, self.name))
        return self

    def detach(self) -> None:
        """Remove the hooks; the model routes natively again."""
        if self.control is not None:
            self.control.remove()
        self.control = self.model = self.prior = None

    def __enter__(self) -> RouterMethod:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def _install(self) -> None:
        """Set routing policies on `self.control` (steering methods override this)."""

    # -- per step

    def router_loss(self, attention_mask: Tensor | None = None) -> Tensor:
        """The method's scalar router term for the latest forward (weighted by strength)."""
        control = self._attached()
        self._mask = attention_mask
        return self._loss(control, attention_mask)

    def _loss(self, control: RouterControl, attention_mask: Tensor | None) -> Tensor:
        return torch.zeros((), device=next(self.model.parameters()).device)

    def on_step_end(self) -> None:
        """Called after each optimizer step."""

    def set_progress(self, step: int, total_steps: int) -> None:
        """Called before each optimizer step with the steps done so far and the run's total
        (rpb_anneal's schedule reads it; stateless otherwise, so resuming needs nothing)."""
        if total_steps <= 0 or not 0 <= step <= total_steps:
            raise ValueError(f"set_progress: step {step} of {total_steps} is out of range")
        self.progress = step / total_steps

    # A method whose strength scales a term (or pull) on the router moves it when strength > 0.
    adds_router_term = False

    @property
    def gradient_path(self) -> str:
        """What reaches the router weight (one of GRADIENT_PATHS; docs/methods.md)."""
        return "moves_router" if self.adds_router_term and self.strength > 0 else "plain"

    def host_waits_per_moe_layer(self) -> int:
        """How many times per MoE layer a training step of this method (attached) makes the host
        wait for the accelerator on purpose, beyond the model's own: 0 for every method but lbl's
        sequence-wise loss (`sequence_lbl`). The one allowance tests/test_no_sync.py (CPU and CUDA)
        and bench/gpu_check.py's `syncs` both read."""
        return 0

    def state_dict(self) -> dict[str, Tensor]:
        """Training state to checkpoint beside the model (empty for stateless methods)."""
        return {}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore `state_dict()` after attach (e.g. when resuming a run)."""
        if state:
            raise ValueError(f"method {self.name!r} has no state, got keys {sorted(state)}")

    def routing_stats(self, attention_mask: Tensor | None = None) -> dict[str, float]:
        """Drift of the live router's own routing in the latest forward, per MoE layer and mean.

        Keys `layer{i}/usage_entropy` (normalised to [0, 1]) and, with a prior,
        `layer{i}/kl_to_base` (mean KL(p0 || p), nats) and `layer{i}/topk_overlap_with_base`;
        `mean/<stat>` averages over layers. Without `attention_mask`, the one last given to
        `router_loss` is used if it matches the forward's tokens.
        """
        control = self._attached()
        records = self._records(control)
        if attention_mask is not None:
            flat = _token_mask(records, attention_mask)
        elif self._mask is not None:  # None if it was the mask of another batch shape
            flat = _flat_mask(self._mask, records[0].logits.shape[0])
        else:
            flat = None
        stats: dict[str, float] = {}
        per_stat: dict[str, list[float]] = {}
        with torch.no_grad():
            for rec in records:
                kind = control.handles[rec.layer].kind
                live = control.live_topk(rec)
                sel = live if flat is None else live[flat.to(live.device).bool()]
                usage = torch.bincount(sel.reshape(-1), minlength=rec.logits.shape[-1])
                values = {"usage_entropy": float(usage_entropy(usage.cpu().numpy()))}
                if rec.base_logits is not None:
                    p = routing_probs(kind, rec.logits.detach())
                    p0 = routing_probs(kind, rec.base_logits)
                    values["kl_to_base"] = mean_kl(p0, p, mask=flat)
                    values["topk_overlap_with_base"] = topk_overlap(
                        live, control.base_topk(rec), mask=flat
                    )
                for key, v in values.items():
                    stats[f"layer{rec.layer}/{key}"] = v
                    per_stat.setdefault(key, []).append(v)
        for key, vs in per_stat.items():
            stats[f"mean/{key}"] = sum(vs) / len(vs)
        return stats

    # -- helpers

    def _attached(self) -> RouterControl:
        if self.control is None:
            raise RuntimeError(f"method {self.name!r} is not attached to a model")
        return self.control

    @staticmethod
    def _records(control: RouterControl) -> list[RouterRecord]:
        if any(r is None for r in control.records):
            raise RuntimeError("no routed forward recorded yet: run the model after attach()")
        return control.records  # type: ignore[return-value]

    def _grad_records(self, control: RouterControl) -> list[RouterRecord]:
        """Records for a differentiable term; refuses logits cut off from the router weights."""
        records = self._records(control)
        if torch.is_grad_enabled() and any(
            h.weight.requires_grad and not r.logits.requires_grad
            for h, r in zip(control.handles, records, strict=True)
        ):
            # e.g. reentrant gradient checkpointing runs the first forward under no_grad
            raise RuntimeError(
                f"router logits of the latest forward carry no gradient, so {self.name!r} would "
                "silently do nothing; use gradient checkpointing with use_reentrant=False"
            )
        return records


def _flat_mask(attention_mask: Tensor, n_tokens: int) -> Tensor | None:
    """Float [T] token weights from a [B, S] mask, or None if its size does not match."""
    if attention_mask.numel() != n_tokens:
        return None
    return attention_mask.reshape(-1).float()


def _masked_mean(values: Tensor, mask: Tensor | None) -> Tensor:
    if mask is None:
        return values.mean()
    mask = mask.to(values.device)
    return (values * mask).sum() / mask.sum().clamp_min(1)


def _sum_over_ranks(counts: Tensor) -> Tensor:
    """`counts` summed over the ranks of an initialised torch.distributed group (else as is)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return counts
    # A NCCL-only group reduces CUDA tensors only; gloo (alone or beside NCCL) takes CPU ones.
    on_cuda = "gloo" not in str(dist.get_backend()) and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    total = counts.to(device, copy=True)
    dist.all_reduce(total)
    return total.to(counts.device)


def _on_device(copies: dict[str, Tensor], host: dict[str, Tensor], device: torch.device) -> None:
    """Fill `copies` with `host`'s tensors on `device`, copied once per device: a copy from the
    host in every forward would make the host wait for the device (issue 46)."""
    first = next(iter(copies.values()), None)
    if first is None or first.device != device:
        copies.update({key: t.to(device) for key, t in host.items()})


def _token_mask(records: list[RouterRecord], attention_mask: Tensor | None) -> Tensor | None:
    if attention_mask is None:
        return None
    n = records[0].logits.shape[0]
    flat = _flat_mask(attention_mask, n)
    if flat is None:
        raise ValueError(
            f"attention_mask has {attention_mask.numel()} tokens, the latest forward routed {n}"
        )
    return flat


@_register
class NoneMethod(RouterMethod):
    """`none`: plain supervised fine-tuning with a trainable router."""


@_register
class LBL(RouterMethod):
    """`lbl`: the load-balancing loss each family was pretrained with, coefficient = strength.

    `pooling: auto` (default) picks the family's own: softmax families call transformers'
    `load_balancing_loss_func` (Switch loss with counts pooled over every layer's tokens; the same
    function in every transformers MoE family that has one); DeepSeek-V3/Moonlight use
    DeepSeek-V3's sequence-wise auxiliary loss per layer (`sequence_lbl`: f_i = E/(K T) x count,
    P_i the mean normalised sigmoid score, per sequence, summed over layers), so the strength means
    what Moonlight's `aux_loss_alpha` means. `pooling: pooled` forces the pooled formula (on
    normalised sigmoid scores and the selected experts for DeepSeek-V3), `per_layer` the
    sequence-wise one (on softmax probabilities for softmax routers). The per-layer loss needs
    sequence boundaries: without an attention_mask the batch shape of the latest forward is used.

    The term is computed from rpb's router hooks, so it is there whatever the model's config
    says: transformers adds its own loss only when `output_router_logits` is on, and never for
    DeepSeek-V3. Default strength 0.001 = Qwen3-MoE's router_aux_loss_coef and Moonlight's
    aux_loss_alpha; strength="family" takes the model's own coefficient at attach
    (`family_lbl_coefficient`: e.g. OLMoE's 0.01).
    """

    name = "lbl"

    def __init__(self, strength: float | str | None = None, **options: Any) -> None:
        # "family" is resolved from the model's config in attach; until then the spec default.
        self.family_strength = strength == FAMILY_STRENGTH
        super().__init__(None if self.family_strength else strength, **options)

    def __repr__(self) -> str:
        if self.family_strength and self.control is None:
            return f"{type(self).__name__}(strength='family', options={self.options})"
        return super().__repr__()

    adds_router_term = True

    def pooling_for(self, kind: str) -> str:
        """The formula used on routers of `kind` ("per_layer" or "pooled")."""
        if self.options["pooling"] != "auto":
            return self.options["pooling"]
        return "per_layer" if kind == "deepseek_v3" else "pooled"

    def host_waits_per_moe_layer(self) -> int:
        """DeepSeek-V3's sequence-wise loss (`pooling` per_layer) averages over the sequences
        that have tokens by selecting them with a boolean mask: a nonzero in the forward and its
        index_put in the backward, two waits per MoE layer. A masked sum over every sequence is
        the same number but not the same bits once a micro-batch holds a sequence with no token
        (another summation order), so the wait stays and every CPU result keeps its bits (issue
        46). The pooled formulas make none."""
        kind = self._attached().handles[0].kind
        return SEQUENCE_LBL_WAITS_PER_LAYER if self.pooling_for(kind) == "per_layer" else 0

    def _install(self) -> None:
        config = getattr(self.model, "config", None)
        if self.family_strength:
            try:
                self.strength = family_lbl_coefficient(config, self._attached().handles[0].kind)
            except ValueError:
                self.detach()  # refused: leave the model without rpb's hooks
                raise
        # Warned at the first router_loss, not here: attach turns the model's own loss off, so
        # only a flag set on again after attach (by hand, or a trainer asked to keep it) warns.
        self._warned_own = False
        self._batch_shape: tuple[int, int] | None = None
        self._shape_hook = self.model.register_forward_pre_hook(
            self._record_shape, with_kwargs=True
        )

    def _record_shape(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        for x in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args[:1]):
            if isinstance(x, Tensor) and x.dim() >= 2:
                self._batch_shape = (int(x.shape[0]), int(x.shape[1]))
                return

    def detach(self) -> None:
        hook = getattr(self, "_shape_hook", None)
        if hook is not None:
            hook.remove()
            self._shape_hook = None
        super().detach()

    def _warn_if_counted_twice(self) -> None:
        # With output_router_logits on, transformers' forward of a family that has an aux loss
        # already adds coef x its balancing loss to out.loss when labels are given.
        config = getattr(self.model, "config", None)
        has_own = any(
            hasattr(config, a) for a in ("router_aux_loss_coef", "aux_loss_coef")
        ) and bool(getattr(config, "output_router_logits", False))
        if has_own and self.strength > 0 and not self._warned_own:
            self._warned_own = True
            warnings.warn(
                "lbl: model.config.output_router_logits is True, so transformers' forward also "
                "adds its own load-balancing term to out.loss when labels are given; adding "
                "router_loss() counts it twice (set config.output_router_logits = False)",
                stacklevel=4,
            )

    def _loss(self, control: RouterControl, attention_mask: Tensor | None) -> Tensor:
        self._warn_if_counted_twice()
        records = self._grad_records(control)
        handle = control.handles[0]
        _token_mask(records, attention_mask)  # same size check as every other term
        if self.pooling_for(handle.kind) == "per_layer":
            if attention_mask is None:
                if self._batch_shape is None:
                    raise ValueError("lbl per_layer: pass attention_mask (sequence boundaries)")
                attention_mask = torch.ones(self._batch_shape, device=records[0].logits.device)
            loss = sequence_lbl(
                [routing_probs(handle.kind, r.logits) for r in records],
                [r.indices for r in records],
                handle.num_experts,
                attention_mask.reshape(-1, attention_mask.shape[-1]),
            )
        elif handle.kind == "softmax":
            loss = load_balancing_loss_func(
                tuple(r.logits for r in records), handle.num_experts, handle.top_k, attention_mask
            )
        else:
            loss = switch_lbl(
                [routing_probs(handle.kind, r.logits) for r in records],
                [r.indices for r in records],
                handle.num_experts,
                _token_mask(records, attention_mask),
            )
        return self.strength * loss


class _SelectionBiasMethod(RouterMethod):
    """Shared option handling of the RPB family (bias applied by the router hooks)."""

    @property
    def gradient_path(self) -> str:
        # A selection bias only chooses experts; a logit bias also changes the gate weights.
        if self.options.get("bias_on", "selection") == "selection" or self.strength == 0:
            return "selection_only"
        return "moves_router"

    def _install(self) -> None:
        for layer in range(self._attached().num_layers):
            self._set_bias(layer, self._bias)

    def _bias(self, record: RouterRecord) -> Tensor:
        raise NotImplementedError

    def _set_bias(self, layer: int, fn: Any) -> None:
        key = (
            "selection_bias"
            if self.options.get("bias_on", "selection") == "selection"
            else "logit_bias"
        )
        self._attached().set_policy(layer, **{key: fn})


@_register
class RPB(_SelectionBiasMethod):
    """`rpb`: select experts by top-k of s + strength * s0 (s0 the base router's native selection
    score on the same hidden state); gate weights from the live router.

    `bias_on: logits` instead adds strength * z0 (base logits, both router kinds) to the live
    logits, which also moves the gate weights. `keep_bias_at_eval` keeps the bias in eval mode.
    """

    name = "rpb"

    def _bias(self, record: RouterRecord) -> Tensor:
        control = self._attached()
        if self.options["bias_on"] == "selection":
            return self.strength * control.base_scores(record)
        return self.strength * record.base_logits


@_register
class RPBMarginal(_SelectionBiasMethod):
    """`rpb_marginal`: rpb's bias with the per-token base distribution p0 replaced by its corpus
    mean pi_l (read off during prior extraction; clamped at 1e-9), in the units of the router's
    selection score. Softmax routers rank on logits, which are log p + a per-token constant, so
    the bias is strength * log pi. DeepSeek-V3 ranks on sigmoid scores s = p * sum_j s_j, so the
    bias is strength * pi * sum_j s0_j (the token's base score mass; rpb's own bias is
    strength * p0 * sum_j s0_j). `bias_on: logits` adds strength * log pi to the logits of
    either kind."""

    name = "rpb_marginal"

    def _install(self) -> None:
        control = self._attached()
        self._pi = self.prior.mean_probs.float().clamp_min(1e-9)
        self._log_pi = torch.log(self._pi)
        self._copies: dict[str, Tensor] = {}
        for layer in range(control.num_layers):
            self._set_bias(layer, partial(self._layer_bias, layer))

    def _layer_bias(self, layer: int, record: RouterRecord) -> Tensor:
        _on_device(self._copies, {"pi": self._pi, "log_pi": self._log_pi}, record.logits.device)
        kind = self._attached().handles[layer].kind
        if self.options["bias_on"] == "selection" and kind == "deepseek_v3":
            mass = record.base_logits.float().sigmoid().sum(-1, keepdim=True)
            return self.strength * self._copies["pi"][layer] * mass
        return self.strength * self._copies["log_pi"][layer]


@_register
class RPBInterp(RouterMethod):
    """`rpb_interp`: the router's forward logits pulled toward the base's,
    z + strength * stopgrad(z0 - z), strength (lambda) in [0, 1]. The forward value is
    (1 - lambda) z + lambda z0, so both selection and gate weights follow it and the step-0
    function is the base's; the gradient reaching z is the task gradient at the interpolated
    routing (d/dz is the identity), so the router keeps training. A training-time device like
    every RPB reading: dropped at evaluation unless `keep_bias_at_eval`."""

    name = "rpb_interp"

    adds_router_term = True

    def _install(self) -> None:
        self._attached().set_policy(logit_bias=self._pull)

    def _pull(self, record: RouterRecord) -> Tensor:
        return self.strength * (record.base_logits - record.logits.detach())


def anneal_factor(progress: float, schedule: str) -> float:
    """Share of the bias left at `progress` in [0, 1]: 1 at the start, 0 at the end."""
    progress = min(max(progress, 0.0), 1.0)
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


@_register
class RPBAnneal(RPB):
    """`rpb_anneal`: rpb's bias (selection or, with `bias_on: logits`, logits) at strength
    lambda * a(t), a decaying from 1 at the first step to 0 at the end of training (`schedule`
    linear or cosine, over the run's optimizer steps, set by `set_progress`). The router
    evaluated is the one trained with it: by the last steps the bias is near 0, so there is no
    train/eval mismatch and nothing to keep at evaluation."""

    name = "rpb_anneal"

    @property
    def current_strength(self) -> float:
        return self.strength * anneal_factor(self.progress, self.options["schedule"])

    def _bias(self, record: RouterRecord) -> Tensor:
        control = self._attached()
        base = (
            control.base_scores(record)
            if self.options["bias_on"] == "selection"
            else record.base_logits
        )
        return self.current_strength * base


@_register
class RPBCoact(_SelectionBiasMethod):
    """`rpb_coact`: a per-token bias toward the experts that co-activate, in the base's
    co-activation graph, with the token's other base choices. With C_l the base's co-activation
    counts on the post-training corpus (prior extraction) and M[j, e] = C[j, e] / C[j, j] the
    share of tokens routed to j that also chose e (diagonal 0), the bias of expert e on a token
    whose base top-k (on its current hidden state) is B is strength * mean over j in B, j != e of
    M[j, e]: a value in [0, 1], the selection score's units for sigmoid routers. Selection only
    by default, like `rpb`; dropped at evaluation unless `keep_bias_at_eval`."""

    name = "rpb_coact"

    def _install(self) -> None:
        counts = self.prior.coactivation.double()
        diag = torch.diagonal(counts, dim1=-2, dim2=-1)
        share = counts / diag.clamp_min(1).unsqueeze(-1)
        share.diagonal(dim1=-2, dim2=-1).zero_()
        self._share = share.float()  # [L, E, E], row j: P(e | j)
        self._copies: dict[str, Tensor] = {}
        super()._install()

    def _bias(self, record: RouterRecord) -> Tensor:
        control = self._attached()
        chosen = control.base_topk(record)  # [T, k]
        _on_device(self._copies, {"share": self._share}, record.logits.device)
        share = self._copies["share"][record.layer]
        total = share[chosen].sum(1)  # [T, E]: sum over the token's base choices j of M[j, e]
        in_base = torch.zeros_like(total).scatter_(1, chosen, 1.0)
        others = (chosen.shape[-1] - in_base).clamp_min(1)  # M[e, e] = 0 drops j = e
        return self.strength * total / others


@_register
class RPBAdaptive(RouterMethod):
    """`rpb_adaptive`: per-expert selection bias b_l (start 0), updated after each optimizer step
    like DeepSeek-V3's aux-loss-free bias, b += update_rate * sign(u_prior - u_live), pulling live
    expert usage toward the base's usage distribution instead of uniform. The applied bias is
    strength * b. update_rate 0.001 is DeepSeek-V3's; softmax logits may want more. Under
    multi-process training the usage counts are summed over the ranks before each update, so every
    rank keeps the same bias.

    Where the bias lives (`bias_in`): `correction_bias` (the `auto` choice on DeepSeek-V3) writes
    the router's own `e_score_correction_bias` = base bias + strength * b after every update, as
    DeepSeek-V3 keeps its own, so it is saved with the model and kept at evaluation;
    `selection_bias` (`auto` on softmax routers, which have no such buffer) is a hook bias,
    dropped at evaluation unless `keep_bias_at_eval`."""

    name = "rpb_adaptive"

    @property
    def gradient_path(self) -> str:
        return "selection_only"

    def _install(self) -> None:
        control = self._attached()
        n_experts = control.handles[0].num_experts
        self.bias = torch.zeros(control.num_layers, n_experts)
        self._target = self.prior.usage_probs.float()
        self._pending = torch.zeros(control.num_layers, n_experts, dtype=torch.float64)
        self._counted = False  # whether router_loss counted usage since the last update
        self._device: torch.device | None = None  # where the state was last moved
        kind = control.handles[0].kind
        where = self.options["bias_in"]
        if where == "auto":
            where = "correction_bias" if kind == "deepseek_v3" else "selection_bias"
        if where == "correction_bias" and kind != "deepseek_v3":
            raise ValueError(
                f"rpb_adaptive bias_in: correction_bias needs a DeepSeek-V3 router, not {kind}"
            )
        self.bias_in = where
        if where == "selection_bias":
            for layer in range(control.num_layers):
                control.set_policy(layer, selection_bias=partial(self._layer_bias, layer))

    def _to_device(self, device: torch.device) -> None:
        """Keep the bias, the target and the usage counts where the routers run (moved once,
        also after the model is moved): the update then never waits for the device."""
        if self._device == device:
            return
        self._device = device
        self.bias = self.bias.to(device)
        self._target = self._target.to(device)
        # float64 keeps integer counts exact; MPS has no float64.
        dtype = torch.float32 if device.type == "mps" else torch.float64
        self._pending = self._pending.to(device, dtype)

    def _layer_bias(self, layer: int, record: RouterRecord) -> Tensor:
        self._to_device(record.logits.device)
        return self.strength * self.bias[layer]

    def _write_correction_bias(self) -> None:
        """The routers' e_score_correction_bias = base bias + strength * b (idempotent)."""
        control = self._attached()
        self._to_device(control.handles[0].correction_bias.device)
        with torch.no_grad():
            for handle in control.handles:
                live = handle.correction_bias
                base = control.base_correction_bias(handle.moe_layer, live.device)
                value = base.float() + self.strength * self.bias[handle.moe_layer]
                live.copy_(value.to(dtype=live.dtype))

    def _usage(self, records: list[RouterRecord], mask: Tensor | None) -> Tensor:
        self._to_device(records[0].indices.device)
        out = torch.zeros_like(self._pending)
        for rec in records:
            # Padding weighted 0 and counts scattered, where selecting tokens by the mask and
            # `bincount` would both wait for the device to size their output; the counts are
            # the same integers.
            n_tokens, k = rec.indices.shape
            if mask is None:
                weight = torch.ones(n_tokens * k, dtype=out.dtype, device=out.device)
            else:
                weight = (mask.to(out.device) != 0).to(out.dtype).repeat_interleave(k)
            out[rec.layer].scatter_add_(0, rec.indices.reshape(-1).to(out.device), weight)
        return out

    def _loss(self, control: RouterControl, attention_mask: Tensor | None) -> Tensor:
        # Accumulate the actual (biased) usage of every micro-batch until the optimizer step.
        records = self._records(control)
        usage = self._usage(records, _token_mask(records, attention_mask))  # may move _pending
        self._pending += usage
        self._counted = True
        return super()._loss(control, attention_mask)

    def state_dict(self) -> dict[str, Tensor]:
        return {"bias": self.bias.detach().cpu().clone()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        if set(state) != {"bias"} or state["bias"].shape != self.bias.shape:
            raise ValueError(f"rpb_adaptive state must be {{'bias': {tuple(self.bias.shape)}}}")
        self.bias.copy_(state["bias"])
        if self.bias_in == "correction_bias":
            self._write_correction_bias()

    def on_step_end(self) -> None:
        control = self._attached()
        usage = self._pending
        if not self._counted and all(r is not None for r in control.records):
            # router_loss was not called: use the latest forward, unmasked
            usage = self._usage(self._records(control), None)
        # Every rank must apply the same update, from the usage of the whole global batch:
        # otherwise each drifts to its own bias and the ranks route differently.
        usage = _sum_over_ranks(usage)
        live = usage / usage.sum(-1, keepdim=True).clamp_min(1)
        step = self.options["update_rate"] * torch.sign(self._target - live.float())
        # No routed token yet: no update. Decided on the device, so the host never waits.
        self.bias += torch.where(usage.sum() > 0, step, 0.0)
        self._pending.zero_()
        self._counted = False
        if self.bias_in == "correction_bias":
            self._write_correction_bias()


@_register
class AnchorWeight(RouterMethod):
    """`anchor_weight`: strength * sum_l ||W_l - W0_l||^2 (summed over layers). Default 0.01:
    for RMS-normalised hidden states E_h||(W - W0) h||^2 ~ ||W - W0||_F^2, so this matches
    anchor_logit's default per layer.

    Each layer's term is taken by the router hook during the forward (`weight_sq_dist`), where
    FSDP has the full weight; after the forward a sharded model holds only a shard of it.
    """

    name = "anchor_weight"
    needs_weight_distance = True

    adds_router_term = True

    def _loss(self, control: RouterControl, attention_mask: Tensor | None) -> Tensor:
        total = None
        for record in self._grad_records(control):
            term = record.weight_sq_dist
            total = term if total is None else total + term.to(total.device)
        return self.strength * total


@_register
class AnchorLogit(RouterMethod):
    """`anchor_logit`: strength * mean over layers of the mean over non-pad tokens of
    ||z - z0||^2. Default 0.01: near the base, KL(p0||p) ~ ||dz||^2 / (2E) for a flat router, so
    0.01 is roughly anchor_kl's 1.0 at E = 64."""

    name = "anchor_logit"

    adds_router_term = True

    def _loss(self, control: RouterControl, attention_mask: Tensor | None) -> Tensor:
        records = self._grad_records(control)
        mask = _token_mask(records, attention_mask)
        terms = [
            _masked_mean((r.logits.float() - r.base_logits.float()).pow(2).sum(-1), mask)
            for r in records
        ]
        return self.strength * torch.stack(terms).mean()


@_register
class AnchorKL(RouterMethod):
    """`anchor_kl`: strength * mean over layers of the mean over non-pad tokens of KL(p0 || p).
    Default 1.0: KL is in nats like the LM loss."""

    name = "anchor_kl"

    adds_router_term = True

    def _loss(self, control: RouterControl, attention_mask: Tensor | None) -> Tensor:
        records = self._grad_records(control)
        mask = _token_mask(records, attention_mask)
        terms = []
        for r in records:
            kind = control.handles[r.layer].kind
            log_p = routing_log_probs(kind, r.logits)
            log_p0 = routing_log_probs(kind, r.base_logits)
            kl = F.kl_div(log_p, log_p0, reduction="none", log_target=True).sum(-1)
            terms.append(_masked_mean(kl, mask))
        return self.strength * torch.stack(terms).mean()


@_register
class Hard(RouterMethod):
    """`hard`: experts = the base router's own top-k on the current hidden state (the
    lambda -> infinity limit of rpb); gate weights from the live router at those experts, or
    with `gate_from: base` from the base router (then the live router gets no gradient).

    `keep_bias_at_eval` defaults to True here: a model trained with base routing is evaluated
    with base routing (the C6 arm). `keep_bias_at_eval: false` is the lambda -> infinity arm with
    rpb's protocol: trained with base selection, evaluated with its own router, like every other
    point of rpb's softness curve.
    """

    name = "hard"

    @property
    def gradient_path(self) -> str:
        return "none" if self.options["gate_from"] == "base" else "selection_only"

    def _install(self) -> None:
        control = self._attached()
        if self.options["gate_from"] == "base":
            control.set_policy(use_base_logits=True)
        else:
            control.set_policy(forced_indices=control.base_topk)
