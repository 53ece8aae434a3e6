"""Every MoE family rpb.families describes, on a tiny random model of its own config class
(tests/family_models.py): zero-bias equivalence, the step-0 invariant of every method, anchor
terms, hard routing, the prior, refusals of unsupported routers in one line, and the registry's
families in docs/families.md and the schema. The self-check's own refusals:
tests/test_router_check.py."""

from __future__ import annotations

import copy
import functools
import operator
from pathlib import Path

import pytest
import torch
import yaml
from conftest import make_batch
from family_models import ROUTED_TYPES, TINY_TYPE, family_base, family_model, family_prior
from method_variants import STEP0_EXACT
from torch import nn
from transformers import AutoModelForCausalLM

from rpb.architectures import (
    PRETRAIN_MODEL_TYPES,
    SUPPORTED_MODEL_TYPES,
    TINY_MODEL_TYPES,
    build_config,
)
from rpb.families import FAMILIES, MODEL_TYPE_ALIASES, families_markdown, routed_model_types
from rpb.methods import make_method
from rpb.pipeline.config_check import ConfigError, check_config
from rpb.prior import RouterPrior
from rpb.routing import (
    RouterControl,
    find_routers,
    parse_output,
    route,
)

ROOT = Path(__file__).resolve().parents[1]


def _perturb(model: nn.Module, seed: int = 1) -> None:
    """Move every router weight (and logit bias) away from the base, as fine-tuning would."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for h in find_routers(model):
            for t in (h.weight, h.router_bias):
                if t is not None:
                    t.add_(0.5 * t.std() * torch.randn(t.shape, generator=g))


def _paired(indices: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = indices.argsort(dim=-1)
    return indices.gather(1, order), weights.gather(1, order)


def _mask(indices: torch.Tensor, n_experts: int) -> torch.Tensor:
    return torch.zeros(indices.shape[0], n_experts, dtype=torch.bool).scatter(1, indices, True)


def _sent(spec, output, top_k: int) -> torch.Tensor:
    """[T, E] which experts a router's output sends each token to, read from the output itself
    (Llama-4's dense scores are nonzero exactly at the chosen experts)."""
    if spec.output == "scores_logits":
        return output[0] != 0
    logits, _, indices = parse_output(spec, output, top_k)
    return _mask(indices, logits.shape[1])


def test_every_registered_family_has_a_tinyfamily_model():
    assert set(TINY_TYPE.values()) <= set(TINY_MODEL_TYPES)
    assert sorted(SUPPORTED_MODEL_TYPES) == sorted(ROUTED_TYPES)
    assert set(PRETRAIN_MODEL_TYPES) < set(ROUTED_TYPES)


@pytest.mark.parametrize("model_type", ROUTED_TYPES)
def test_zero_bias_routing_is_the_library_routing(model_type):
    model = family_model(model_type).train()
    batch = make_batch()
    handles = find_routers(model)
    assert len(handles) == 2 and {(h.num_experts, h.top_k) for h in handles} == {(8, 2)}
    ref = model(**batch).logits
    base = [h.weight for h in handles]
    router_bias = [h.router_bias for h in handles]
    with RouterControl(model, base, base_router_bias=router_bias) as control:
        model(**batch)
        native = [(r.logits, r.weights, r.indices) for r in control.records]
        zeros = torch.zeros(8)
        control.set_policy(logit_bias=zeros, selection_bias=lambda r: torch.zeros_like(r.logits))
        out = model(**batch).logits
        for h, rec, (z, w, i) in zip(handles, control.records, native, strict=True):
            assert rec.steered and torch.equal(rec.base_logits, rec.logits)  # z0 == z at W == W0
            # rpb's routing of the library's logits is the library's routing, bit for bit
            arg = {} if rec.correction_bias is None else {"correction_bias": rec.correction_bias}
            _, w2, i2 = route(h, z, **arg)
            for got in (_paired(i2, w2), _paired(rec.indices, rec.weights)):
                assert all(torch.equal(a, b) for a, b in zip(got, _paired(i, w), strict=True))
    assert torch.equal(out, ref)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "granitemoe", "glm4_moe", "jetmoe"])
def test_zero_bias_routing_is_exact_in_bfloat16(model_type):
    model = family_model(model_type).to(torch.bfloat16).train()
    batch = make_batch()
    ref = model(**batch).logits
    handles = find_routers(model)
    base = [h.weight for h in handles]
    with RouterControl(model, base, base_router_bias=[h.router_bias for h in handles]) as control:
        control.set_policy(selection_bias=torch.zeros(8))
        out = model(**batch).logits
        assert all(torch.equal(r.base_logits, r.logits) for r in control.records)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("model_type", ROUTED_TYPES)
def test_step0_every_method_computes_the_base_outputs(model_type):
    model, prior, batch = family_model(model_type), family_prior(model_type), make_batch()
    for training in (True, False):
        model.train(training)
        ref = model(**batch).logits
        for name, options in STEP0_EXACT:
            with make_method(name, **options).attach(model, prior) as method:
                out = model(**batch).logits
                method.router_loss(batch["attention_mask"])
            assert torch.equal(out, ref), (name, options, training)


@pytest.mark.parametrize("model_type", ROUTED_TYPES)
def test_anchor_terms_are_zero_at_step0_and_pull_after_a_perturbation(model_type):
    model, prior, batch = family_model(model_type).train(), family_prior(model_type), make_batch()
    for name in ("anchor_weight", "anchor_logit", "anchor_kl"):
        with make_method(name).attach(model, prior) as method:
            model(**batch)
            assert method.router_loss(batch["attention_mask"]).item() == 0.0, name
    _perturb(model)
    for name in ("anchor_weight", "anchor_logit", "anchor_kl"):
        model.zero_grad()
        with make_method(name).attach(model, prior) as method:
            model(**batch)
            loss = method.router_loss(batch["attention_mask"])
            assert loss.item() > 0, name
            loss.backward()
        for h in find_routers(model):
            assert h.weight.grad is not None and h.weight.grad.abs().sum() > 0, name
            if h.router_bias is not None and name != "anchor_logit":
                assert h.router_bias.grad.abs().sum() > 0, name


@pytest.mark.parametrize("model_type", ROUTED_TYPES)
def test_hard_sends_exactly_the_base_top_k(model_type):
    model, prior, batch = family_model(model_type).train(), family_prior(model_type), make_batch()
    _perturb(model)
    base_handles = find_routers(family_base(model_type))
    seen = {}

    def spy(layer, module, args, kwargs, output):
        seen[layer] = (args[0] if args else next(iter(kwargs.values())), kwargs, args, output)

    with make_method("hard").attach(model, prior) as method:
        handles = method.control.handles
        # registered after rpb's hooks, so they see what the experts receive
        spies = [
            h.module.register_forward_hook(functools.partial(spy, i), with_kwargs=True)
            for i, h in enumerate(handles)
        ]
        model(**batch)
        moved = False
        for i, (h, bh) in enumerate(zip(handles, base_handles, strict=True)):
            hidden, kwargs, args, output = seen[i]
            sent = _sent(h.spec, output, h.top_k)
            with torch.no_grad():
                # the base router itself, natively, on the same input (incl. a forward-arg bias)
                own = _sent(bh.spec, bh.module(hidden, *args[1:], **kwargs), bh.top_k)
            assert torch.equal(sent, own), i
            live = method.control.live_topk(method.control.records[i])
            moved |= not torch.equal(_mask(live, own.shape[1]), own)
        for s in spies:
            s.remove()
    assert moved  # the perturbed live router would have chosen differently somewhere


@pytest.mark.parametrize("model_type", ["qwen3_moe", "llama4_text", "jetmoe"])
def test_a_second_control_records_what_the_first_one_sent(model_type):
    """Evaluation routing plus analysis hooks: the recorder must read the steered output."""
    model, batch = family_model(model_type).train(), make_batch()
    t = batch["input_ids"].numel()
    forced = (torch.arange(t)[:, None] * 3 + torch.arange(2)) % 8
    with RouterControl(model) as steer, RouterControl(model) as recorder:
        steer.set_policy(forced_indices=forced)
        model(**batch)
        for rec in recorder.records:
            assert torch.equal(rec.indices.sort(-1)[0], forced.sort(-1)[0])
            assert not rec.steered


@pytest.mark.parametrize("model_type", ROUTED_TYPES)
def test_prior_extraction_and_loading(model_type, tmp_path):
    model, prior = family_model(model_type), family_prior(model_type)
    handles = find_routers(model)
    assert prior.kind == handles[0].kind and prior.num_layers == 2
    for w, h in zip(prior.base_weights, handles, strict=True):
        assert torch.equal(w, h.weight.float())
    for field, attr in (("correction_bias", "correction_bias"), ("router_bias", "router_bias")):
        live = [getattr(h, attr) for h in handles]
        stored = getattr(prior, field)
        assert (stored is None) == (live[0] is None), field
        if stored is not None:
            assert all(torch.equal(a, b.float()) for a, b in zip(stored, live, strict=True))
    assert torch.allclose(prior.mean_probs.sum(-1), torch.ones(2))
    assert (prior.usage.sum(-1) == prior.n_tokens * prior.top_k).all()
    loaded = RouterPrior.load(prior.save(tmp_path / "prior.safetensors"))
    assert loaded.meta == prior.meta
    for name in ("base_weights", "correction_bias", "router_bias"):
        a, b = getattr(loaded, name), getattr(prior, name)
        assert (a is None) == (b is None) and all(
            torch.equal(x, y) for x, y in zip(a or [], b or [], strict=True)
        )
    loaded.check_compatible(model)


def test_a_router_bias_needs_the_base_bias():
    """gpt_oss: z0 = W0 h + b0; without b0, z0 would drop or misplace the bias silently."""
    model = family_model("gpt_oss")
    handles = find_routers(model)
    with pytest.raises(ValueError, match=r"GptOssTopKRouter\) has a logit bias: pass base_rou"):
        RouterControl(model, [h.weight for h in handles])


def test_unsupported_router_is_refused_in_one_line():
    model = AutoModelForCausalLM.from_config(build_config("phimoe"))
    for call in (
        lambda: find_routers(model),
        lambda: make_method("rpb").attach(model, family_prior("qwen3_moe")),
    ):
        with pytest.raises(ValueError) as err:
            call()
        msg = str(err.value)
        assert "\n" not in msg
        assert msg.startswith("router class PhimoeTopKRouter is not supported by rpb: ")
        assert "sparsemixer" in msg


def test_more_logit_columns_than_experts_is_refused():
    model = family_model("qwen3_moe")
    find_routers(model)[0].module.num_experts = 6  # e.g. zero-compute experts
    with pytest.raises(ValueError, match=r"Qwen3MoeTopKRouter .*weight has 8 rows but num_exp"):
        find_routers(model)


def test_families_page_lists_the_registry_families():
    readme = (ROOT / "docs" / "families.md").read_text()
    section = readme.split("<!-- families:start -->\n", 1)[1].split("<!-- families:end -->", 1)[0]
    assert section == families_markdown(), "refresh it with: python -m rpb.families"
    assert all(f"`{t}`" in section for t in routed_model_types())


def test_config_check_reads_the_model_types_from_the_registry():
    """Hub models may be of any family rpb routes, pretrained ones of the families marked
    `pretrain`; nothing else lists them (the schema leaves model_type a string)."""
    schema = ROOT / "workflow" / "schemas" / "config.schema.yaml"
    model = yaml.safe_load(schema.read_text())["$defs"]["model"]
    assert model["properties"]["model_type"]["type"] == "string"
    assert "enum" not in model["properties"]["model_type"]
    assert "model_type" not in str(model["allOf"])

    base = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())

    def config_with(*model_types: str, source: str = "hub") -> dict:
        """The default config plus one model entry per model type (`m0`, `m1`, ...)."""
        config = copy.deepcopy(base)
        hub = {"hf_id": "someone/some-moe", "revision": "0" * 40}
        for i, model_type in enumerate(model_types):
            config["models"][f"m{i}"] = (
                {"family": "A", "source": "hub", "model_type": model_type, **hub}
                if source == "hub"
                else {**base["models"]["tinyA"], "model_type": model_type, "architecture": {}}
            )
        return config

    check_config(config_with(*routed_model_types()), schema)
    check_config(config_with(*PRETRAIN_MODEL_TYPES, source="pretrain"), schema)
    with pytest.raises(ConfigError, match=r"^models\.m0\.model_type: 'phimoe' is not a family"):
        check_config(config_with("phimoe"), schema)
    with pytest.raises(
        ConfigError,
        match=r"^models\.m0\.model_type: 'gpt_oss' is not a family the pipeline pretrains",
    ):
        check_config(config_with("gpt_oss", source="pretrain"), schema)
    assert tuple(n for n, f in FAMILIES.items() if f.pretrain) == PRETRAIN_MODEL_TYPES


@pytest.mark.parametrize("model_type", ROUTED_TYPES)
def test_each_family_names_the_field_of_its_expert_count(model_type):
    """The config check's expert-count checks read `expert_count_key`: a wrong one would skip
    them silently. It must be the tiny config's own spelling (transformers also accepts aliases,
    which a config written the usual way never sets) and the field that sizes the routers."""
    family = FAMILIES[MODEL_TYPE_ALIASES.get(model_type, model_type)]
    key = family.expert_count_key
    assert key in family.tiny, key
    with torch.device("meta"):  # shapes only: no weights drawn
        model = AutoModelForCausalLM.from_config(build_config(model_type, **{key: 16}))
    router_class = family.router.rsplit(".", 1)[1]
    weights = [
        operator.attrgetter(family.routing.weight)(module)
        for module in model.modules()
        if type(module).__name__ == router_class
    ]
    assert weights and {weight.shape[0] for weight in weights} == {16}
