"""transformers' Trainer with an rpb router method attached.

    method = make_method("rpb", strength=1.0).attach(model, prior)
    trainer = RouterMethodTrainer(model=model, args=args, train_dataset=ds, router_method=method)
    trainer.train()
    trainer.router_history  # what was logged: losses, routing drift, expert load, lr

The trainer adds the method's router term to the task loss, steps the method's per-step state
(`RoutingDriftCallback`, which it attaches itself), and adds rpb's metrics to every training log,
so each logger configured by `report_to` receives them next to the Trainer's own `loss`.

Gradient accumulation and multi-process training: the task loss is the Trainer's own (normalised by
`num_items_in_batch`, the target tokens of the whole accumulated and, with
`average_tokens_across_devices`, global batch). The router term is a per-forward mean over
non-padding tokens, so each micro-batch's term is weighted by its share of the accumulated
batch's non-padding tokens (of every process when the Trainer averages tokens across devices). A
term that is a mean over tokens (anchor_logit, anchor_kl) or does not depend on the tokens
(anchor_weight) then equals its value on the whole batch at any accumulation and process count;
a batch statistic (the load-balancing loss) is the token-weighted mean of its micro-batches'
values, as if each micro-batch were its own batch.

Only torch, transformers and rpb's own modules are imported here: logging to an MLflow run
stays in `rpb.posttraining`, TRL's SFTTrainer in `rpb.trl`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel, Trainer, TrainerCallback
from transformers.trainer_callback import DefaultFlowCallback, PrinterCallback, ProgressCallback
from transformers.trainer_utils import IntervalStrategy

from rpb.coactivation import usage_entropy
from rpb.methods import RouterMethod, own_router_loss_message, turn_off_own_router_loss
from rpb.routing import RouterControl, routing_probs

__all__ = [
    "RouterMethodTrainer",
    "RouterMethodTrainerMixin",
    "RoutingDriftCallback",
    "RoutingMeter",
    "console_logs",
    "own_router_loss_message",
]

log = logging.getLogger(__name__)

# mean_kl's clamp (rpb.coactivation): a zero where the base has mass gives a large finite KL.
_KL_EPS = 1e-12

# A per-layer metric ("layer3/kl_to_base", "layer3/load/expert17"): E + 5 of them per MoE layer,
# thousands on a 48-layer, 128-expert model, too many for one console line.
_LAYER_KEY = re.compile(r"layer\d+/")
_WORST_LAYER_STATS = ("max_load_ratio", "dead_experts")


class RoutingMeter:
    """Running sums of what the router records show, over the non-padding tokens of each
    training micro-batch, so rpb's metrics describe whole optimizer steps and logging intervals
    instead of the last micro-batch, and reduce across processes by one sum.

    Drift (`usage_entropy`, `kl_to_base`, `topk_overlap_with_base`: the quantities of
    `RouterMethod.routing_stats`, on the live router's own selection) covers the latest optimizer
    step, every micro-batch and process: what the router does at the step that is logged. Expert
    load (the experts tokens were actually sent to, steering included) and the two loss terms
    cover the whole logging interval. Sums stay on the device until `collect`, so training pays no
    host synchronisation per micro-batch.
    """

    def __init__(self) -> None:
        self.steps = 0  # optimizer steps since the last collect
        # Whether this step's drift is measured (the callback turns it off for steps that will
        # not be logged: drift costs a few small ops per layer, the load count almost nothing).
        self.measure_drift = True
        self._sums: dict[str, Tensor] | None = None
        self._experts: list[int] = []
        self._has_base: list[bool] = []

    def state_dict(self) -> dict[str, Any]:
        """The interval's running sums: a checkpoint carries them, so a resumed run logs the
        interval it was killed in exactly as an uninterrupted one would."""
        sums = {k: v.detach().cpu().clone() for k, v in (self._sums or {}).items()}
        return {
            "steps": self.steps,
            "sums": sums,
            "experts": list(self._experts),
            "has_base": list(self._has_base),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self._sums = dict(state["sums"]) or None
        self._experts = list(state["experts"])
        self._has_base = list(state["has_base"])

    def _ensure(self, control: RouterControl, device: torch.device) -> dict[str, Tensor]:
        if self._sums is not None and self._sums["load"].device != device:
            self._sums = {k: v.to(device) for k, v in self._sums.items()}  # restored on the CPU
        if self._sums is None:
            self._experts = [h.num_experts for h in control.handles]
            self._has_base = [False] * control.num_layers
            n_layers, width = control.num_layers, max(self._experts)
            # float64 keeps integer counts exact; MPS has no float64.
            dtype = torch.float32 if device.type == "mps" else torch.float64
            shapes = {
                "loss": (2,),
                "load": (n_layers, width),
                "tokens": (n_layers,),
                "live": (n_layers, width),
                "kl": (n_layers,),
                "overlap": (n_layers,),
            }
            self._sums = {
                key: torch.zeros(shape, dtype=dtype, device=device) for key, shape in shapes.items()
            }
        return self._sums

    def add_losses(self, task: Tensor, router: Tensor) -> None:
        """Add one micro-batch's contributions to the step's loss (already scaled as the Trainer
        sums them: their sum over a step is the step's loss)."""
        if self._sums is not None:
            loss = self._sums["loss"]
            loss += torch.stack([task.detach().mean(), router.detach().mean()]).to(loss)

    @torch.no_grad()
    def add_routing(self, control: RouterControl, attention_mask: Tensor | None) -> None:
        """Count the latest forward's routing on its non-padding tokens (all tokens when the
        mask is absent or does not match the routed tokens, e.g. padding-free batches).

        Tokens are weighted by the mask instead of selected by it, and counts are scattered
        instead of `bincount`-ed: both would wait for the device to size their output."""
        if any(r is None for r in control.records):
            return
        sums = self._ensure(control, control.records[0].logits.device)
        device, dtype = sums["load"].device, sums["load"].dtype
        for rec in control.records:
            layer, n_experts = rec.layer, self._experts[rec.layer]
            n_tokens, k = rec.indices.shape
            if attention_mask is not None and attention_mask.numel() == n_tokens:
                weight = (attention_mask.reshape(-1) != 0).to(device=device, dtype=dtype)
            else:
                weight = torch.ones(n_tokens, device=device, dtype=dtype)
            per_choice = weight.repeat_interleave(k)
            sums["load"][layer, :n_experts].scatter_add_(
                0, rec.indices.reshape(-1).to(device), per_choice
            )
            if not self.measure_drift:
                continue
            live = control.live_topk(rec)
            sums["live"][layer, :n_experts].scatter_add_(0, live.reshape(-1).to(device), per_choice)
            sums["tokens"][layer] += weight.sum()
            if rec.base_logits is None:
                continue
            self._has_base[layer] = True
            kind = control.handles[layer].kind
            p = routing_probs(kind, rec.logits.detach()).double()
            p0 = routing_probs(kind, rec.base_logits).double().to(p.device)
            kl = torch.special.xlogy(p0, p0) - torch.special.xlogy(p0, p.clamp_min(_KL_EPS))
            sums["kl"][layer] += (kl.sum(-1).to(device, dtype) * weight).sum()
            base = control.base_topk(rec).to(live.device)
            shared = (live.unsqueeze(2) == base.unsqueeze(1)).any(dim=2).sum(-1)
            sums["overlap"][layer] += (shared.to(device, dtype) * weight).sum() / k

    def start_step(self, measure_drift: bool = True) -> None:
        """Forget the previous step's drift sums (the load and losses run over the interval);
        measure this step's drift only if `measure_drift`."""
        self.measure_drift = measure_drift
        if self._sums is not None:
            for key in ("tokens", "live", "kl", "overlap"):
                self._sums[key].zero_()

    def end_step(self) -> None:
        self.steps += 1

    def collect(
        self,
        reduce: Callable[[Tensor], Tensor] = lambda t: t,
        processes: int = 1,
        expert_shares: bool = True,
    ) -> dict[str, float]:
        """The metrics since the last collect (see docs/library.md), summed over processes by
        `reduce` (a sum across ranks; every rank must call it), then reset the interval.

        `task_loss` / `router_loss`: the two parts of the Trainer's logged `loss` (mean over the
        interval's steps and processes). Per MoE layer i: `layer{i}/usage_entropy`,
        `layer{i}/kl_to_base`, `layer{i}/topk_overlap_with_base` of the latest step;
        `layer{i}/load/expert{j}` (share of the interval's top-k assignments that went to expert
        j), `layer{i}/dead_experts` (experts with share 0), `layer{i}/max_load_ratio` (largest
        share over the mean share 1/E; 1 is perfect balance); `mean/<name>` averages over layers.
        """
        if self._sums is None or self.steps == 0:
            return {}
        sums = self._sums
        order = ("loss", "load", "tokens", "live", "kl", "overlap")
        packed = reduce(torch.cat([sums[k].reshape(-1) for k in order])).cpu()
        parts, offset = {}, 0
        for key in order:
            n = sums[key].numel()
            parts[key] = packed[offset : offset + n].reshape(sums[key].shape)
            offset += n
        loss = parts["loss"] / (processes * self.steps)
        metrics: dict[str, float] = {"task_loss": float(loss[0]), "router_loss": float(loss[1])}
        per_stat: dict[str, list[float]] = {}

        def put(layer: int, key: str, value: float) -> None:
            metrics[f"layer{layer}/{key}"] = value
            per_stat.setdefault(key, []).append(value)

        for layer, n_experts in enumerate(self._experts):
            tokens = float(parts["tokens"][layer])
            live = parts["live"][layer, :n_experts]
            if tokens > 0 and float(live.sum()) > 0:
                put(layer, "usage_entropy", float(usage_entropy(live.numpy())))
                if self._has_base[layer]:
                    put(layer, "kl_to_base", float(parts["kl"][layer]) / tokens)
                    put(layer, "topk_overlap_with_base", float(parts["overlap"][layer]) / tokens)
            load = parts["load"][layer, :n_experts]
            if float(load.sum()) > 0:
                share = load / load.sum()
                if expert_shares:
                    for expert, value in enumerate(share.tolist()):
                        metrics[f"layer{layer}/load/expert{expert}"] = value
                put(layer, "dead_experts", float((share == 0).sum()))
                put(layer, "max_load_ratio", float(share.max()) * n_experts)
        for key, values in per_stat.items():
            metrics[f"mean/{key}"] = sum(values) / len(values)
        for key in ("loss", "load"):
            sums[key].zero_()
        self.steps = 0
        return metrics


def console_logs(logs: Mapping[str, Any]) -> dict[str, Any]:
    """A training log as the console shows it: every entry but the per-layer ones, plus the
    worst layer's load (`max/max_load_ratio`, `max/dead_experts`: the largest over MoE layers).

    The `mean/` averages hide one collapsing layer, which the worst layer shows; the per-layer
    values and every expert's share stay in the log itself (`report_to` loggers, callbacks'
    `on_log`, `router_history`)."""
    short = {k: v for k, v in logs.items() if not _LAYER_KEY.match(k)}
    for stat in _WORST_LAYER_STATS:
        values = [v for k, v in logs.items() if _LAYER_KEY.match(k) and k.endswith(f"/{stat}")]
        if values:
            short[f"max/{stat}"] = max(values)
    return short


class _ConsoleProgressCallback(ProgressCallback):
    """The Trainer's progress bar, printing each log as `console_logs` summarises it."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        return super().on_log(args, state, control, logs=console_logs(logs or {}), **kwargs)


class _ConsolePrinterCallback(PrinterCallback):
    """The Trainer's log printer (`disable_tqdm=True`), printing `console_logs` of each log."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        return super().on_log(args, state, control, logs=console_logs(logs or {}), **kwargs)


class RoutingDriftCallback(TrainerCallback):
    """Steps the router method with the Trainer: its schedule before each optimizer step
    (`set_progress`, from the Trainer's own state, so a resumed run continues rpb_anneal where it
    stopped), its update after (`on_step_end`: rpb_adaptive's bias), and the trainer's
    `RoutingMeter` around both. It also asks for a log at the last step, so the run's final state
    is always in the logs.

    `RouterMethodTrainer` attaches one itself; this class is public for trainers built otherwise
    (any object with `router_method`, and optionally `routing_meter`).
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer.router_method.set_progress(state.global_step, state.max_steps)
        meter = getattr(self.trainer, "routing_meter", None)
        if meter is not None:
            meter.start_step(measure_drift=_will_log(args, state, state.global_step + 1))

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.router_method.on_step_end()
        meter = getattr(self.trainer, "routing_meter", None)
        if meter is not None:
            meter.end_step()
        if state.global_step >= state.max_steps and args.logging_strategy != IntervalStrategy.NO:
            control.should_log = True


def _will_log(args: Any, state: Any, step: int) -> bool:
    """Whether the Trainer will log at optimizer step `step` (DefaultFlowCallback's rule, plus
    the last step, which RoutingDriftCallback adds). Other strategies: assume every step."""
    if args.logging_strategy == IntervalStrategy.NO:
        return False
    if args.logging_strategy != IntervalStrategy.STEPS or step >= state.max_steps:
        return True
    every = state.logging_steps or args.logging_steps
    return bool((step == 1 and args.logging_first_step) or (every and step % every == 0))


def _count_tokens(batch: dict[str, Any]) -> Tensor | None:
    """Non-padding tokens of a collated batch: the attention mask's sum, else every token."""
    mask = batch.get("attention_mask")
    if isinstance(mask, Tensor) and mask.dim() == 2:
        return mask.sum()
    for key in ("input_ids", "inputs_embeds"):
        value = batch.get(key)
        if isinstance(value, Tensor) and value.dim() >= 2:
            return torch.tensor(value.shape[0] * value.shape[1], device=value.device)
    return None


def _check_attached(method: RouterMethod, model: Any) -> None:
    """Refuse, in one line, a method that would silently not act on the model being trained."""
    if not isinstance(method, RouterMethod):
        raise TypeError(f"router_method must be an rpb RouterMethod, got {type(method).__name__}")
    if method.control is None:
        raise ValueError(
            "router_method is not attached: call method.attach(model, prior) before building "
            "the trainer"
        )
    if model is None:
        raise ValueError(
            "the trainer needs model= (the model router_method is attached to); model_init is "
            "not supported"
        )
    if isinstance(model, nn.Module) and not any(m is method.model for m in model.modules()):
        raise ValueError("router_method is attached to another model than the one given here")


class RouterMethodTrainerMixin:
    """The Trainer behaviour rpb adds, for any `transformers.Trainer` subclass (placed before
    it in the bases: `class T(RouterMethodTrainerMixin, SomeTrainer)`; `rpb.trl` does this for
    TRL's SFTTrainer).

    `compute_loss` delegates the task loss to the parent class (so `num_items_in_batch` and
    everything the parent logs keep working) and adds the router term weighted by the
    micro-batch's share of the step's non-padding tokens (module docstring); evaluation losses are
    the task loss only. `log` adds rpb's metrics (`RoutingMeter.collect`) to every training log
    and appends them to `router_history`; the console's line summarises them (`console_logs`).
    `log_expert_shares=False` leaves out the per-expert shares (E values per layer) and keeps the
    per-layer load summaries.
    """

    router_method: RouterMethod
    router_history: list[dict[str, float]]
    routing_meter: RoutingMeter

    def __init__(
        self,
        *args: Any,
        router_method: RouterMethod,
        log_expert_shares: bool = True,
        **kwargs: Any,
    ) -> None:
        _check_attached(router_method, kwargs.get("model", args[0] if args else None))
        super().__init__(*args, **kwargs)
        self.router_method = router_method
        self.router_history = []
        self.routing_meter = RoutingMeter()
        self.log_expert_shares = log_expert_shares
        self._step_tokens: Tensor | None = None
        self._token_processes = 1
        callbacks = self.callback_handler.callbacks
        if any(isinstance(cb, RoutingDriftCallback) for cb in callbacks):
            raise ValueError(
                "RouterMethodTrainer attaches its own RoutingDriftCallback; do not pass one"
            )
        # Right after the Trainer's flow control, before the user's callbacks (which then see
        # the method's state of the step, e.g. rpb_adaptive's updated bias).
        flow = [i for i, cb in enumerate(callbacks) if isinstance(cb, DefaultFlowCallback)]
        callbacks.insert(flow[0] + 1 if flow else 0, RoutingDriftCallback(self))
        # The console prints a summary of each log; every other logger gets all of it. Exact
        # types only: a progress callback of the user's own stays as it is.
        for i, cb in enumerate(callbacks):
            if type(cb) is ProgressCallback:
                callbacks[i] = _ConsoleProgressCallback(max_str_len=cb.max_str_len)
            elif type(cb) is PrinterCallback:
                callbacks[i] = _ConsolePrinterCallback()
        self._turn_off_own_router_loss()

    def _turn_off_own_router_loss(self) -> None:
        """One router term: the model's own load-balancing loss goes off, with one warning.

        transformers adds `router_aux_loss_coef` x its own loss to `out.loss` when the config's
        `output_router_logits` is on (a checkpoint may ship it on; TRL's SFTTrainer turns it on),
        which beside the method's term is a second router term (with `lbl`, the same one counted
        twice). It stays only when the trainer's args ask for it by a non-zero
        `router_aux_loss_coef` (SFTConfig's field)."""
        if getattr(self.args, "router_aux_loss_coef", None):
            return
        turned_off = turn_off_own_router_loss(self.model)
        if not turned_off and not getattr(self, "aux_loss_enabled", False):
            return
        if getattr(self, "aux_loss_enabled", False):
            self.aux_loss_enabled = False  # TRL's SFTTrainer asks for router logits per batch
        log.warning("rpb: %s", own_router_loss_message(self.model, self.router_method.name))

    # -- loss

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        """The Trainer's prefetch of one optimizer step's micro-batches; also counts their
        non-padding tokens (over every process when the Trainer averages tokens across
        devices, as it does for `num_items_in_batch`), the router term's denominator."""
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        counts = [_count_tokens(b) for b in batch_samples]
        self._step_tokens, self._token_processes = None, 1
        if counts and all(c is not None for c in counts):
            total = torch.stack([c.to(device) for c in counts]).sum()
            if self.args.average_tokens_across_devices and self.args.world_size > 1:
                total = self.accelerator.gather(total).sum()
                self._token_processes = self.accelerator.num_processes
            self._step_tokens = total
        return batch_samples, num_items

    def _task_loss_is_scaled(self, num_items_in_batch: Any) -> bool:
        """Whether the Trainer takes the loss as already scaled for gradient accumulation (as
        `Trainer.training_step` decides it); otherwise it divides the loss by the number of
        accumulated micro-batches."""
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is not None:
            return bool(scaled)
        return bool(
            (self.model_accepts_loss_kwargs and num_items_in_batch is not None)
            or self.compute_loss_func is not None
        )

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Tensor | int | None = None,
    ) -> Tensor | tuple[Tensor, Any]:
        """The parent's loss plus the router term of this micro-batch, weighted by its share of
        the step's non-padding tokens so accumulated micro-batches (and processes) add up to the
        term of the whole batch; in evaluation, the parent's loss alone."""
        mask = inputs.get("attention_mask")
        mask = mask if isinstance(mask, Tensor) and mask.dim() == 2 else None
        tokens = _count_tokens(inputs)
        result = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        if not model.training:
            return result
        task_loss, outputs = result if return_outputs else (result, None)
        router_loss = self.router_method.router_loss(attention_mask=mask)
        divisor = 1
        if not self._task_loss_is_scaled(num_items_in_batch):
            divisor = getattr(self, "current_gradient_accumulation_steps", 1)
        if self._step_tokens is not None and tokens is not None:
            share = tokens.to(router_loss.device) * self._token_processes
            share = share / self._step_tokens.to(router_loss.device).clamp_min(1)
        else:  # outside the training loop's prefetch: the micro-batch is the whole batch
            share = torch.ones((), device=router_loss.device)
        router_part = share * router_loss
        loss = task_loss + router_part * divisor
        if self.router_method.control is not None:
            self.routing_meter.add_routing(self.router_method.control, mask)
        self.routing_meter.add_losses(task_loss / divisor, router_part)
        return (loss, outputs) if return_outputs else loss

    # -- logging

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add rpb's metrics to a training log (the one carrying the Trainer's `loss`); every
        process calls this, and the metrics are summed across them here."""
        if "loss" in logs and self.routing_meter.steps > 0:
            metrics = self.routing_meter.collect(
                lambda t: self.accelerator.reduce(t, reduction="sum"),
                self.accelerator.num_processes,
                self.log_expert_shares,
            )
            entry: dict[str, float] = {"step": self.state.global_step, **metrics}
            if "learning_rate" in logs:
                entry["lr"] = float(logs["learning_rate"])
            self.router_history.append(entry)
            logs.update(metrics)
        super().log(logs, start_time)

    # -- checkpoints

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        # transformers 5.x resumes with a plain load_state_dict of the checkpoint, which is in the
        # hub format save_pretrained writes (one tensor per expert), so fused MoE experts are
        # skipped with a warning and keep their pre-resume values (huggingface/transformers
        # #48805). from_pretrained applies the conversion; the tensors are then copied over.
        model = self.model if model is None else model
        if (
            self.is_fsdp_enabled
            or self.is_deepspeed_enabled
            or not isinstance(model, PreTrainedModel)
        ):
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        saved = type(model).from_pretrained(resume_from_checkpoint, dtype=model.dtype)
        model.load_state_dict(saved.state_dict(), strict=True)


class RouterMethodTrainer(RouterMethodTrainerMixin, Trainer):
    """`transformers.Trainer` whose loss is the task loss plus the attached router method's term,
    with rpb's routing metrics in its logs: `RouterMethodTrainer(..., router_method=method)`."""
