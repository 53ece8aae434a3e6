"""The router self-check (rpb.router_check, run by rpb.routing on every router it finds): a wrong
description is refused in one line naming the class and what differs, the check picks the
settings that reproduce a module, describes a router class the registry has never seen, and a
bias the description cannot find is refused at the forward."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import make_batch
from family_models import family_model, family_prior
from torch import nn

from rpb.methods import make_method
from rpb.router_check import check_router
from rpb.routing import ROUTER_REGISTRY, RouterControl, find_routers, register_router

# family -> (a wrong description, what the one-line refusal must say)
WRONG = {
    "qwen3_5_moe_text": ({"normalise": "norm_topk_prob"}, r"gate weights differ \(max \|diff\| "),
    "gpt_oss": ({"router_bias": None}, r"router logits differ from the module's \(max \|diff\| "),
    "ernie4_5_moe": ({"correction_bias": None}, r"expert indices differ on \d+/64 probe tokens"),
    "deepseek_v2": ({"groups": False}, r"expert indices differ on \d+/64 probe tokens"),
    "granitemoe": ({"order": "score_topk"}, r"gate weights differ"),
    "minimax": ({"weights_dtype": "logits", "normalise": False}, r"gate weights differ"),
    "glm4_moe": ({"scaling": None}, r"gate weights differ"),
    "hunyuan_v1_moe": ({"weight": "weight"}, r"no \[experts, hidden\] weight at 'weight'"),
    "llama4_text": ({"output": "triple"}, r"forward or output does not fit"),
    "jetmoe": ({"output": "triple"}, r"forward or output does not fit"),
    "lfm2_moe": ({"norm_eps": 0.0}, r"gate weights differ"),
    # only visible in low precision: the probe also runs the router cast to bfloat16
    "minimax_m2": ({"score_float32": False}, r"gate weights .*\[bfloat16\]$"),
    "hy_v3": ({"scaling": None}, r"gate weights differ"),
}


@pytest.mark.parametrize("model_type", list(WRONG))
def test_a_wrong_description_is_refused_in_one_line(model_type, saved_registry):
    model = family_model(model_type)
    handle = find_routers(model)[0]
    changes, message = WRONG[model_type]
    cls = type(handle.module)
    register_router(cls, handle.spec.replace(**changes))
    with pytest.raises(ValueError) as err:
        find_routers(model)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"router class {cls.__name__}: ")
    assert re.search(message, msg), msg
    with pytest.raises(ValueError, match=message):
        make_method("rpb").attach(model, family_prior(model_type))


def test_the_check_picks_the_settings_that_reproduce_the_module(saved_registry):
    """The former flags a user had to guess: qwen3_5_moe renormalises unconditionally."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter

    model = family_model("qwen3_5_moe_text")
    register_router(Qwen3_5MoeTopKRouter, "softmax")  # flags left to the check
    assert find_routers(model)[0].spec.normalise is True
    register_router(Qwen3_5MoeTopKRouter, "softmax", always_normalise=False, float_weights=False)
    with pytest.raises(ValueError, match="Qwen3_5MoeTopKRouter: gate weights differ"):
        find_routers(model)


def test_an_unknown_router_class_is_described_by_the_check(saved_registry):
    """A router class the registry has never seen, with its weight under another name and a
    logit bias: register_router without a description tries the built-in ones (and weight
    locations) and keeps the one that reproduces the module."""

    class CustomGate(nn.Module):
        def __init__(self, hidden: int = 32, experts: int = 8, top_k: int = 2) -> None:
            super().__init__()
            self.w_gate = nn.Parameter(torch.randn(experts, hidden))
            self.bias = nn.Parameter(torch.zeros(experts))
            self.top_k, self.num_experts = top_k, experts

        def forward(self, hidden: torch.Tensor):
            logits = nn.functional.linear(hidden, self.w_gate, self.bias)
            probs = logits.softmax(-1, dtype=torch.float)
            top, idx = probs.topk(self.top_k, dim=-1)
            return logits, (top / top.sum(-1, keepdim=True)).to(logits.dtype), idx

    gate = CustomGate()
    register_router(CustomGate, example=gate)
    assert isinstance(ROUTER_REGISTRY[CustomGate], tuple)  # candidates; the check picks:
    chosen = find_routers(nn.ModuleDict({"gate": gate}))[0].spec
    assert (chosen.weight, chosen.router_bias, chosen.normalise) == ("w_gate", "bias", True)
    assert check_router(gate, chosen) is None
    with pytest.raises(ValueError, match=r"CustomGate: rpb's router logits differ"):
        check_router(gate, chosen.replace(router_bias=None))


def test_a_passed_in_bias_the_description_cannot_find_is_refused(saved_registry):
    """LFM2's block passes its expert bias to the router: a description pointing elsewhere would
    route the base (and everything outside the forward) without it."""
    model = family_model("lfm2_moe")
    handle = find_routers(model)[0]
    register_router(type(handle.module), handle.spec.replace(correction_bias="../no_such_bias"))
    with RouterControl(model), pytest.raises(ValueError, match=r"is passed a correction bias"):
        model(**make_batch())
