"""TRL's SFTTrainer with an rpb router method attached (the only module of rpb that imports trl).

    method = make_method("rpb", strength=1.0).attach(model, prior)
    trainer = RouterMethodSFTTrainer(
        model=model, args=SFTConfig(...), train_dataset=ds, processing_class=tok,
        router_method=method,
    )
    trainer.train()

Everything `rpb.trainer.RouterMethodTrainer` does (the router term weighted for gradient
accumulation, the method's per-step state, rpb's metrics in every log) on top of SFTTrainer's own
loss and metrics (`entropy`, `mean_token_accuracy`, `num_tokens`): the task loss is SFTTrainer's
`compute_loss`, so its completion-only / assistant-only masking, its loss types and its metrics
are unchanged.

One router term: SFTTrainer turns on a MoE model's own load-balancing loss whenever the model
config declares a coefficient (Qwen3-MoE's `router_aux_loss_coef=0.001`, for instance). Beside an
rpb method that would be a second router term the user did not choose (or, with `lbl`, the same
one counted twice), so unless `SFTConfig.router_aux_loss_coef` is set explicitly it is turned
off, with one warning saying how to keep it. An explicit non-zero `router_aux_loss_coef` keeps
it, added to the method's term.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import PreTrainedModel
from trl import SFTConfig, SFTTrainer

from rpb.methods import RouterMethod
from rpb.trainer import RouterMethodTrainerMixin

__all__ = ["RouterMethodSFTTrainer"]

log = logging.getLogger(__name__)


class RouterMethodSFTTrainer(RouterMethodTrainerMixin, SFTTrainer):
    """SFTTrainer whose loss is SFTTrainer's own plus the attached router method's term.

    `model` must be the loaded model `router_method` is attached to (not a hub id); `args` an
    `SFTConfig` (or None for SFTTrainer's default). Label smoothing and `compute_loss_func` are
    refused: with them SFTTrainer runs a second, gradient-free forward whose routing would replace
    the one the router term needs.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        args: SFTConfig | None = None,
        *more: Any,
        router_method: RouterMethod,
        **kwargs: Any,
    ) -> None:
        if not isinstance(model, PreTrainedModel):
            raise TypeError(
                "RouterMethodSFTTrainer needs the loaded model router_method is attached to, "
                f"not {type(model).__name__}"
            )
        if args is None:
            args = SFTConfig(output_dir=f"{type(model).__name__}-SFT")
        elif not isinstance(args, SFTConfig):
            raise TypeError(
                "RouterMethodSFTTrainer: args must be an SFTConfig (its router_aux_loss_coef "
                "decides the model's own load-balancing loss)"
            )
        if args.label_smoothing_factor > 0 or kwargs.get("compute_loss_func") is not None:
            raise ValueError(
                "RouterMethodSFTTrainer: label smoothing and compute_loss_func are not supported "
                "(SFTTrainer then runs a second forward that replaces the routing the router "
                "term is computed from)"
            )
        text_config = model.config.get_text_config()
        own_coef = getattr(text_config, "router_aux_loss_coef", None)
        if (
            args.router_aux_loss_coef is None
            and hasattr(text_config, "output_router_logits")
            and own_coef
        ):
            args.router_aux_loss_coef = 0.0
            log.warning(
                "rpb: turned off %s's own load-balancing loss (router_aux_loss_coef=%s) so that "
                "the %r method's term is the only router term; to keep it as well, set "
                "SFTConfig(router_aux_loss_coef=%s)",
                type(model).__name__,
                own_coef,
                router_method.name,
                own_coef,
            )
        super().__init__(model, args, *more, router_method=router_method, **kwargs)
        if own_coef is not None and args.router_aux_loss_coef == 0.0:
            # SFTTrainer wrote 0.0 into the config; the checkpoint keeps the architecture's own
            # coefficient (inert while output_router_logits is off).
            text_config.router_aux_loss_coef = own_coef
