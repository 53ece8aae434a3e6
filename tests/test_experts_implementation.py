"""transformers' experts implementations against eager, per supported architecture: one training
step's logits and gradients agree within float tolerance, with a router method attached (its hooks
change what the experts receive). The pipeline's choice is the config key
models.<m>.experts_implementation (docs/performance.md); null keeps transformers' default, which
is grouped_mm in transformers 5.x."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, make_batch, make_model

from rpb.methods import make_method
from rpb.pipeline.training import experts_kwargs, new_base_model
from rpb.prior import extract_prior

# Each kernel transformers 5.x ships for the CPU (deepgemm and sonicmoe are CUDA-only).
IMPLEMENTATIONS = ["grouped_mm", "batched_mm"]


def _step(model: torch.nn.Module, implementation: str, method: str):
    """Logits and parameter gradients of one training step (task loss + router term)."""
    model.set_experts_implementation(implementation)
    model.train()
    batches = [make_batch(batch=3, seq=10, pad=2, seed=s) for s in range(2)]
    prior = extract_prior(
        model, batches, model_id="t", revision="r", corpus_hash="0" * 64, progress=False
    )
    batch = batches[0]
    with make_method(method).attach(model, prior) as attached:
        out = model(**batch)
        loss = out.loss + attached.router_loss(attention_mask=batch["attention_mask"])
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_training_step_matches_eager(arch: str, implementation: str) -> None:
    logits_eager, grads_eager = _step(make_model(arch), "eager", "rpb")
    logits, grads = _step(make_model(arch), implementation, "rpb")
    torch.testing.assert_close(logits, logits_eager, rtol=1e-5, atol=1e-5)
    assert grads.keys() == grads_eager.keys()
    # Every expert weight got a gradient (the kernels really ran the experts).
    assert any("experts" in name for name in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_eager[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_config_key_reaches_the_model(tmp_path) -> None:
    from rpb.pipeline.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(tmp_path / "tok")
    arch = {"num_hidden_layers": 2, "n_routed_experts": 4, "num_experts_per_tok": 2}
    eager = new_base_model("deepseek_v3", arch, tokenizer, seed=0, experts_implementation="eager")
    default = new_base_model("deepseek_v3", arch, tokenizer, seed=0)
    assert eager.config._experts_implementation == "eager"
    assert default.config._experts_implementation == "grouped_mm"  # transformers' own default
    assert experts_kwargs(None) == {}
    # The same random initialisation whatever runs the experts.
    for (name, a), (_, b) in zip(
        eager.state_dict().items(), default.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
