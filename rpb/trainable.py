"""Which parameters post-training updates, and how fast: parameter selections by role.

A MoE model's parameters fall into three parts, found by role, never by module name:

- `routers`: every router found by class (`rpb.routing.find_routers`), its weight and, for
  DeepSeek-V3, its `e_score_correction_bias`;
- `routed_experts`: the router's sibling in its MoE block that holds one slice per expert (fused
  `[E, ...]` tensors, or a ModuleList of E experts), which a shared expert or a dense MLP never
  does;
- `trunk`: everything else (attention, norms, embeddings, the output head, dense layers, shared
  experts).

The selections (`posttrain.trainable`):

- `all`: every parameter (the paper's setting);
- `moe`: the routed experts, the routers, and the embedding rows (and untied output-head rows) of
  the tokens the base never saw in pretraining, so that a post-training task written with new
  tokens can be learnt at all. The rest stays bitwise unchanged, or, with `trunk_lr_scale > 0`,
  is trained at that fraction of the learning rate (the damped-trunk arm);
- `routed_experts_and_routers`: the routed experts and routers only (new tokens' rows frozen at
  their random initialisation, which leaves a task written in new tokens unlearnable: kept for the
  earlier diagnostic runs).

A tensor that is only partly trainable (an embedding matrix with a few new rows) or trained at a
scaled rate (the damped trunk) is handled by `UpdateScaleCallback`: before each optimizer step it
keeps the tensor's values, after it the tensor becomes `before + scale * (after - before)` per row
(the kept rows copied back exactly when their scale is 0). For AdamW, whose update is linear in the
learning rate (decoupled weight decay included), that is exactly a per-row learning rate of
`scale * lr`; gradients of fully frozen rows are also zeroed, so they enter neither the optimizer's
moments nor gradient clipping.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedModel, TrainerCallback

from rpb.routing import find_routers
from rpb.specs import TRAINABLE

log = logging.getLogger(__name__)

PARTS = ("routers", "routed_experts", "trunk")


def parameter_parts(model: nn.Module) -> dict[str, str]:
    """Each parameter's and buffer's full name -> its part (`routers`, `routed_experts`,
    `trunk`). Raises when a router's MoE block does not hold exactly one routed-expert module."""
    modules = dict(model.named_modules())
    part: dict[str, str] = {}
    for handle in find_routers(model):
        for n, _ in handle.module.state_dict(keep_vars=True).items():
            part[f"{handle.name}.{n}"] = "routers"
        block_name = handle.name.rpartition(".")[0]
        experts = [
            (f"{block_name}.{child_name}" if block_name else child_name, child)
            for child_name, child in modules[block_name].named_children()
            if child is not handle.module and _holds_experts(child, handle.num_experts)
        ]
        if len(experts) != 1:
            raise ValueError(
                f"posttrain.trainable: found {len(experts)} routed-expert modules beside router "
                f"{handle.name} ({type(modules[block_name]).__name__}), need exactly one"
            )
        prefix, module = experts[0]
        for n, _ in module.state_dict(keep_vars=True).items():
            part[f"{prefix}.{n}"] = "routed_experts"
    for name, _ in model.state_dict(keep_vars=True).items():
        part.setdefault(name, "trunk")
    return part


def _holds_experts(module: nn.Module, num_experts: int) -> bool:
    """Whether `module` is a routed-experts container for `num_experts` experts."""
    if isinstance(module, nn.ModuleList):
        return len(module) == num_experts
    own = list(module.parameters(recurse=False))
    return bool(own) and all(p.dim() == 3 and p.shape[0] == num_experts for p in own)


@dataclass
class TrainableSelection:
    """What a selection made trainable: whole tensors, and tensors updated row by row or at a
    scaled rate (`row_scales`: parameter name -> per-row scale, shape [rows, 1])."""

    trainable: str
    names: list[str]
    row_scales: dict[str, torch.Tensor] = field(default_factory=dict)
    new_token_ids: list[int] = field(default_factory=list)

    def callback(self, model: nn.Module) -> UpdateScaleCallback | None:
        """The Trainer callback that applies `row_scales` (None when there is nothing to scale)."""
        return UpdateScaleCallback(model, self.row_scales) if self.row_scales else None


def select_trainable(
    model: PreTrainedModel,
    trainable: str,
    *,
    new_token_ids: Sequence[int] = (),
    trunk_lr_scale: float = 0.0,
) -> TrainableSelection:
    """Set `requires_grad` for selection `trainable` (one of TRAINABLE) and return what it chose.

    `new_token_ids` (selection `moe`): the tokens the base never saw in pretraining, whose input
    embedding rows (and output-head rows, when untied) train at the full rate. `trunk_lr_scale`
    (selection `moe`): the trunk's rate as a fraction of the learning rate, 0 for frozen. Under
    `moe` the returned selection's `callback(model)` must join the Trainer's callbacks.
    """
    if trainable not in TRAINABLE:
        raise ValueError(f"posttrain.trainable: {trainable!r} is not one of {list(TRAINABLE)}")
    if not 0.0 <= trunk_lr_scale <= 1.0:
        raise ValueError(f"posttrain.trunk_lr_scale: {trunk_lr_scale} is not in [0, 1]")
    if trunk_lr_scale and trainable != "moe":
        raise ValueError(
            f"posttrain.trunk_lr_scale: {trunk_lr_scale} needs posttrain.trainable: moe "
            f"(got {trainable!r})"
        )
    if new_token_ids and trainable != "moe":
        raise ValueError(f"new token rows are trained only under trainable: moe, not {trainable!r}")
    if trainable == "all":
        return TrainableSelection(trainable, [n for n, p in model.named_parameters()])
    parts = parameter_parts(model)
    params = dict(model.named_parameters())
    # Tied weights appear once in named_parameters; the rows go by tensor, whatever its names.
    row_tensors = _token_row_tensors(model) if trainable == "moe" else {}
    ids = sorted(set(new_token_ids))
    selection = TrainableSelection(trainable, [], new_token_ids=ids)
    for name, param in params.items():
        routed = parts[name] in ("routers", "routed_experts")
        if routed:
            param.requires_grad_(True)
        elif name in row_tensors and (ids or trunk_lr_scale > 0):
            rows = param.shape[0]
            if ids and max(ids) >= rows:
                raise ValueError(f"new token id {max(ids)} is outside {name} ({rows} rows)")
            scale = torch.full((rows, 1), float(trunk_lr_scale), dtype=param.dtype)
            scale[ids] = 1.0
            selection.row_scales[name] = scale
            param.requires_grad_(True)
        elif trunk_lr_scale > 0:
            selection.row_scales[name] = torch.full(
                (param.shape[0] if param.dim() else 1, 1), float(trunk_lr_scale), dtype=param.dtype
            )
            param.requires_grad_(True)
        else:
            param.requires_grad_(False)
        if param.requires_grad:
            selection.names.append(name)
    n_all = sum(p.numel() for p in params.values())
    n_full = sum(
        p.numel() for n, p in params.items() if p.requires_grad and n not in selection.row_scales
    )
    log.info(
        "trainable %s: %d of %d parameters at the full rate, %d new token rows, %d tensors scaled "
        "(trunk_lr_scale %g)",
        trainable,
        n_full,
        n_all,
        len(ids),
        len(selection.row_scales),
        trunk_lr_scale,
    )
    return selection


def _token_row_tensors(model: PreTrainedModel) -> dict[str, nn.Parameter]:
    """Parameters indexed by token id in their first dimension: the input embeddings and the
    output head (the same tensor when tied), by their names in `named_parameters`."""
    wanted = {id(model.get_input_embeddings().weight)}
    head = model.get_output_embeddings()
    if head is not None:
        wanted.add(id(head.weight))
    return {n: p for n, p in model.named_parameters() if id(p) in wanted}


class UpdateScaleCallback(TrainerCallback):
    """Scales each optimizer step's change of the selected tensors row by row (module docstring):
    rows with scale 0 are copied back exactly and their gradients zeroed."""

    def __init__(self, model: nn.Module, row_scales: dict[str, torch.Tensor]):
        params = dict(model.named_parameters())
        self.targets = [(params[n], s.to(params[n].device)) for n, s in row_scales.items()]
        self.before: list[torch.Tensor] = []
        self.hooks = [
            p.register_hook(_zero_frozen_rows(scale))
            for p, scale in self.targets
            if bool((scale == 0).any())
        ]

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.before = [p.detach().clone() for p, _ in self.targets]

    def on_optimizer_step(self, args, state, control, **kwargs):
        with torch.no_grad():
            for (param, scale), before in zip(self.targets, self.before, strict=True):
                view = param.view(param.shape[0], -1) if param.dim() else param.view(1, 1)
                old = before.view_as(view)
                moved = old + scale * (view - old)
                view.copy_(torch.where(scale == 0, old, moved))

    def remove(self) -> None:
        """Remove the gradient hooks (the model keeps training normally afterwards)."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []


def _zero_frozen_rows(scale: torch.Tensor):
    keep = (scale != 0).to(scale.dtype)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        shaped = keep.view(keep.shape[0], *([1] * (grad.dim() - 1))) if grad.dim() else keep[0, 0]
        return grad * shaped

    return hook
