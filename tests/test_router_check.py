"""The router self-check (rpb.router.check, run by rpb.routing on every router it finds): a wrong
description is refused in one line naming the class and what differs, the check picks the
settings that reproduce a module, describes a router class the registry has never seen, and a
bias the description cannot find is refused at the forward. Its probe holds near-ties, extreme
norms and every small batch size, so sub-ulp differences that random probes miss are refused
(llama4's dense sigmoid), and a whole forward with a zero-bias policy is bit-identical to the
library's for every family (rpb.routing.check_zero_bias_forward)."""

from __future__ import annotations

import importlib
import math
import re

import pytest
import torch
from conftest import make_batch
from family_models import ROUTED_TYPES, family_model, family_prior
from torch import nn

from rpb.families import FAMILIES
from rpb.methods import make_method
from rpb.router.check import _probe_copy, _probe_rows, check_router, describe_router_class
from rpb.router.route import make_handle
from rpb.router.spec import RouterSpec
from rpb.routing import (
    ROUTER_REGISTRY,
    RouterControl,
    check_zero_bias_forward,
    find_routers,
    register_router,
)

# family -> (a wrong description, what the one-line refusal must say)
WRONG = {
    "qwen3_5_moe_text": ({"normalise": "norm_topk_prob"}, r"gate weights differ \(max \|diff\| "),
    "gpt_oss": ({"router_bias": None}, r"router logits differ from the module's \(max \|diff\| "),
    "ernie4_5_moe": ({"correction_bias": None}, r"expert indices differ on \d+/\d+ probe tokens"),
    "deepseek_v2": ({"groups": False}, r"expert indices differ on \d+/\d+ probe tokens"),
    "granitemoe": ({"order": "score_topk"}, r"expert indices differ .*near-tie"),
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
FAMILY = {"qwen3_5_moe_text": "qwen3_5_moe", "llama4_text": "llama4"}


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
    family = FAMILY.get(model_type, model_type)
    assert "\n" not in msg and msg.startswith(f"router class {cls.__name__} ({family}): ")
    assert re.search(message, msg), msg
    with pytest.raises(ValueError, match=message):
        make_method("rpb").attach(model, family_prior(model_type))


def test_every_family_is_named_by_its_router_class_folder():
    """rpb.router.check names a router class's family by the transformers folder it comes from
    (it imports no family table: rpb.families sits above it): so every built-in family is named
    after that folder, or its refusals would name another family."""
    for name, family in FAMILIES.items():
        module, _, cls_name = family.router.rpartition(".")
        router = getattr(importlib.import_module(module), cls_name)
        assert describe_router_class(router) == f"router class {cls_name} ({name})"


def test_the_check_picks_the_settings_that_reproduce_the_module(saved_registry):
    """Settings a user would have to guess, given as candidates: qwen3_5_moe renormalises
    unconditionally, which the check finds; the config-driven normalisation alone is refused."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter

    model = family_model("qwen3_5_moe_text")
    guesses = [
        RouterSpec(normalise=normalise, weights_dtype=dtype)
        for normalise in ("norm_topk_prob", True)
        for dtype in ("logits", "float32")
    ]
    register_router(Qwen3_5MoeTopKRouter, guesses)  # the check picks
    assert find_routers(model)[0].spec.normalise is True
    register_router(Qwen3_5MoeTopKRouter, guesses[0])
    with pytest.raises(ValueError, match=r"Qwen3_5MoeTopKRouter .*: gate weights differ"):
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
    with pytest.raises(ValueError, match=r"^router class CustomGate: rpb's router logits differ"):
        check_router(gate, chosen.replace(router_bias=None))


def test_a_passed_in_bias_the_description_cannot_find_is_refused(saved_registry):
    """LFM2's block passes its expert bias to the router: a description pointing elsewhere would
    route the base (and everything outside the forward) without it."""
    model = family_model("lfm2_moe")
    handle = find_routers(model)[0]
    register_router(type(handle.module), handle.spec.replace(correction_bias="../no_such_bias"))
    with RouterControl(model), pytest.raises(ValueError, match=r"is passed a correction bias"):
        model(**make_batch())


# --------------------------------------------------------------------------- the probe


def _ulp(x: torch.Tensor) -> torch.Tensor:
    return (torch.nextafter(x, torch.full_like(x, math.inf)) - x).abs()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "llama4_text", "lfm2_moe"])
def test_the_probe_holds_near_ties_and_extreme_norms(model_type):
    """Near-ties in what the library ranks (softmax: logits; DeepSeek-V3: sigmoid + correction
    bias; LFM2: a bias passed in; Llama-4: logits), at the top-k boundary; rows of norm far above
    and below the random rows', and a zero row."""
    handle = find_routers(family_base_copy(model_type))[0]
    clone = _probe_copy(handle.module)
    probe = make_handle("probe", clone, None, handle.spec, 0, 0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        probe.weight.copy_(torch.randn(probe.weight.shape, generator=g) / 8)
        bias = 0.1 * torch.randn(probe.num_experts, generator=g)
        if not handle.spec.correction_bias:
            bias = None
        hidden, rows = _probe_rows(probe, bias, g)
        # The scores of the probe's float32 rows, computed in float64: how close the ties were
        # built, whatever order a CPU's float32 kernels sum in (a float32 matmul's own rounding
        # moved llama4's near-zero logits by up to 10 of their ulp on some kernels).
        z = hidden.double() @ probe.weight.double().T
        ranked = z if handle.spec.order == "topk_score" else z.softmax(-1)
        if handle.spec.score == "sigmoid" and handle.spec.order == "score_topk":
            ranked = z.sigmoid() + bias.double()
    ties = torch.tensor([r == "near-tie" for r in rows])
    assert int(ties.sum()) >= 16
    top = ranked[ties].sort(-1, descending=True).values
    k = probe.top_k
    # the k-th and (k+1)-th (two rows in three) or the top two: within 4 float32 ulp of the
    # row's largest score (a difference a float32 forward can round either way)
    scale = 4 * _ulp(top.abs().amax(-1).float()).double()
    close = (top[:, k - 1] - top[:, k]).abs() <= scale
    close |= (top[:, 0] - top[:, 1]).abs() <= scale
    assert bool(close.all()), (top[:, k - 1] - top[:, k]).abs()
    norms = hidden.norm(dim=-1)
    typical = norms[torch.tensor([r == "random" for r in rows])].median()
    assert norms[torch.tensor([r == "large-norm" for r in rows])].min() > 100 * typical
    small = norms[torch.tensor([r == "small-norm" for r in rows])]
    assert small.max() < 1e-2 * typical and bool((small == 0).any())


def family_base_copy(model_type: str) -> nn.Module:
    return family_model(model_type)


class _LogitRankedGate(nn.Module):
    """Ranks experts by their logits, gates by the renormalised softmax: the same routing as a
    softmax top-k router except where softmax rounds two logits to one probability (near-ties,
    saturated or near-uniform scores), which random probes almost never hit."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 32) / math.sqrt(32))
        self.top_k, self.num_experts = 2, 8

    def forward(self, hidden: torch.Tensor):
        logits = nn.functional.linear(hidden, self.weight)
        probs = logits.softmax(-1, dtype=torch.float)
        idx = logits.topk(self.top_k, dim=-1)[1]
        w = probs.gather(1, idx)
        return logits, (w / w.sum(-1, keepdim=True)).to(logits.dtype), idx


def test_a_difference_only_at_ties_is_refused(saved_registry):
    gate = _LogitRankedGate()
    with pytest.raises(ValueError) as err:
        register_router(_LogitRankedGate, RouterSpec(normalise=True), example=gate)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("router class _LogitRankedGate: "), msg
    found = re.search(r"expert indices differ on \d+/\d+ probe tokens \(unbiased; (.*) rows", msg)
    assert found, msg
    # only the constructed rows show it
    assert set(found.group(1).split(", ")) <= {"near-tie", "large-norm", "small-norm"}, msg


def _sigmoid_rounds_by_position() -> bool:
    """Whether this CPU's sigmoid rounds some values differently in its scalar remainder loop
    than in its vector loop (what makes llama4's dense and gathered scores differ)."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 4
    whole = x.sigmoid()
    return any(not torch.equal(x[i : i + 1].sigmoid(), whole[i : i + 1]) for i in range(512))


class _GatheredSigmoidRouter(nn.Module):
    """Llama-4's router, except that it takes the sigmoid of the k chosen logits ([T, k]) rather
    than of its dense [T, E] scores: what rpb computed before, the same numbers up to the CPU's
    rounding of a tensor's remainder (1 ulp, in a few entries, at some batch sizes)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 32) / math.sqrt(32))
        self.top_k, self.num_experts = 2, 8

    def forward(self, hidden: torch.Tensor):
        logits = nn.functional.linear(hidden, self.weight)
        top, idx = logits.topk(self.top_k, dim=1)
        scores = torch.zeros_like(logits).scatter(1, idx, top.float().sigmoid().to(logits.dtype))
        return scores, logits


def test_a_sub_ulp_score_difference_is_refused_in_one_line(saved_registry):
    """The project's rule is bit-exact: a 1-ulp difference in one gate score is refused like any
    other, in one line naming the class, the difference and the batch size that shows it. (With
    the dense sigmoid of rpb.routing, llama4 itself reproduces exactly: see below.)"""
    if not _sigmoid_rounds_by_position():
        pytest.skip("this CPU's sigmoid rounds the same in its scalar and vector loops")
    from rpb.families import FAMILIES

    llama4 = FAMILIES["llama4"].routing
    gate = _GatheredSigmoidRouter()
    with pytest.raises(ValueError) as err:
        register_router(_GatheredSigmoidRouter, llama4, example=gate)
    msg = str(err.value)
    assert "\n" not in msg, msg
    assert re.fullmatch(
        r"router class _GatheredSigmoidRouter: gate scores differ \(max \|diff\| [0-9.e-]+ in "
        r"\d+/\d+ entries, unbiased; [a-z -]+(, [a-z -]+)* rows, \d+-token batch\) \[float32\]",
        msg,
    ), msg
    assert float(re.search(r"\|diff\| ([0-9.e-]+)", msg).group(1)) < 1e-6  # sub-ulp of O(1)


# --------------------------------------------------------------------------- whole forwards

# Batch shapes whose token counts leave scalar remainders in the CPU kernels (3x5, 1x8, 2x12,
# 3x8: the llama4 router's dense scores differed from rpb's gathered ones at three of them).
SHAPES = [(1, 8, 0), (3, 5, 0), (2, 12, 1), (3, 8, 1)]


@pytest.mark.parametrize("model_type", ROUTED_TYPES)
def test_a_zero_bias_forward_is_the_library_forward(model_type):
    model = family_model(model_type)
    for training in (True, False):
        model.train(training)
        for batch, seq, seed in SHAPES:
            inputs = make_batch(batch=batch, seq=seq, pad=0, seed=seed)
            assert check_zero_bias_forward(model, inputs, raise_error=False) is None


def test_a_zero_bias_forward_that_differs_is_reported_in_one_line(monkeypatch):
    """Steering that moves one gate weight by 1 ulp (as llama4's gathered sigmoid did) is
    reported in one line naming the router, the entries that differ and the model's logits."""
    import rpb.routing

    route = rpb.routing.route

    def off_by_one_ulp(*args, **kwargs):
        logits, weights, indices = route(*args, **kwargs)
        return logits, torch.nextafter(weights, torch.full_like(weights, math.inf)), indices

    model = family_model("qwen3_moe").train()
    find_routers(model)  # checked before the patch (the check routes with its own import)
    monkeypatch.setattr(rpb.routing, "route", off_by_one_ulp)
    inputs = make_batch()
    msg = check_zero_bias_forward(model, inputs, raise_error=False)
    assert msg is not None and "\n" not in msg
    assert re.fullmatch(
        r"a forward with a zero-bias policy differs from the library's: router class "
        r"Qwen3MoeTopKRouter \(qwen3_moe\) at model\.layers\.0\.mlp\.gate: output differs in "
        r"32/32 entries \(max \|diff\| [0-9.e-]+\); model logits max \|diff\| [0-9.e-]+",
        msg,
    ), msg
    with pytest.raises(ValueError, match=r"^a forward with a zero-bias policy differs"):
        check_zero_bias_forward(model, inputs)


# --------------------------------------------------------------------------- cohere2_moe


def _cohere2_moe(selection: str) -> nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.models.cohere2_moe.configuration_cohere2_moe import Cohere2MoeConfig
    from transformers.models.cohere2_moe.modeling_cohere2_moe import Cohere2MoeTopKRouter

    config = Cohere2MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        expert_selection_fn=selection,
        layer_types=["full_attention", "sliding_attention"],
        sliding_window=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, Cohere2MoeTopKRouter):
                    m.weight.normal_(0.0, 32**-0.5)
    return model


COHERE2_MOE = {
    # top-k of the logits, then a softmax over the k (in float32) or their sigmoids renormalised;
    # the gate weights in the input's dtype
    "softmax": RouterSpec(order="topk_score", weights_dtype="input"),
    "sigmoid": RouterSpec(
        kind="sigmoid",
        score="sigmoid",
        order="topk_score",
        normalise="norm_topk_prob",
        weights_dtype="input",
    ),
}


@pytest.mark.parametrize("selection", list(COHERE2_MOE))
def test_cohere2_moe_reproduces_exactly(selection, saved_registry):
    """cohere2_moe is held to the same rule as llama4: its description passes the check (near-
    ties, extreme norms, every small batch, bfloat16) and a zero-bias forward is bit-identical;
    the other selection's description is refused in one line naming the family."""
    from transformers.models.cohere2_moe.modeling_cohere2_moe import Cohere2MoeTopKRouter

    model = _cohere2_moe(selection)
    register_router(Cohere2MoeTopKRouter, COHERE2_MOE[selection])
    assert len(find_routers(model)) == 2
    for training in (True, False):
        model.train(training)
        for batch, seq, seed in SHAPES:
            inputs = make_batch(batch=batch, seq=seq, pad=0, seed=seed)
            assert check_zero_bias_forward(model, inputs, raise_error=False) is None
    other = next(s for k, s in COHERE2_MOE.items() if k != selection)
    register_router(Cohere2MoeTopKRouter, other)
    with pytest.raises(ValueError) as err:
        find_routers(model)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(
        "router class Cohere2MoeTopKRouter (cohere2_moe): gate weights differ (max |diff| "
    ), msg
