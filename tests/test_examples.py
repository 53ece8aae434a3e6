"""examples/: each script runs offline as a user would run it (its own process, the repository
root as working directory), exits 0 and prints the method's metrics for every step; with
`--model` it trains a checkpoint directory instead of the built-in tiny model. rpb_minimal.py,
which does not import rpb, extracts the library's prior, routes as the library's `rpb` and
`rpb_marginal` do and trains to the library's parameters, bit for bit."""

from __future__ import annotations

import copy
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# script -> a method that gives it a non-zero router term or steering, and whether it needs trl
EXAMPLES = {
    "plain_loop.py": ("lbl", False),
    "trainer.py": ("anchor_kl", False),
    "trl_sft.py": ("rpb", True),
}
METRICS = ("task_loss", "router_loss", "mean/kl_to_base", "mean/topk_overlap_with_base")
# End to end: each test marked slow runs an example script in its own interpreter, training a
# model. The tests of examples/rpb_minimal.py against the library run in-process, in the unit tier.
slow = pytest.mark.slow


def run_example(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def step_lines(stdout: str) -> list[dict[str, float]]:
    """The `step N key=value ...` lines the examples print, as dicts."""
    lines = [line for line in stdout.splitlines() if re.match(r"step \d+ ", line)]
    return [{k: float(v) for k, v in re.findall(r"(\S+)=(\S+)", line)} for line in lines]


@slow
@pytest.mark.parametrize("script", list(EXAMPLES))
def test_example_runs_and_prints_the_metrics(script: str) -> None:
    method, needs_trl = EXAMPLES[script]
    if needs_trl:
        pytest.importorskip("trl")
    proc = run_example(script, "--steps", "3", "--method", method)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{method} on 2 routers of Qwen3MoeForCausalLM" in proc.stdout
    steps = step_lines(proc.stdout)
    assert len(steps) == 3, proc.stdout[-2000:]
    for entry in steps:
        assert set(METRICS) <= entry.keys()
    if method in ("lbl", "anchor_kl"):  # terms that are positive once the router has moved
        assert steps[-1]["router_loss"] > 0
    # The routing moved away from the base while training.
    assert steps[-1]["mean/kl_to_base"] > 0 or steps[-1]["mean/topk_overlap_with_base"] < 1


@slow
def test_rpb_shows_its_drift_first_and_a_zero_router_term() -> None:
    """rpb steers selection and has no loss term: router_loss is 0 at every step, and the
    drift, which does move, comes first on each line."""
    proc = run_example("plain_loop.py", "--steps", "3", "--method", "rpb")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = step_lines(proc.stdout)
    assert len(steps) == 3 and all(entry["router_loss"] == 0 for entry in steps)
    assert all(next(iter(entry)).startswith("mean/") for entry in steps)
    assert steps[-1]["mean/kl_to_base"] > 0 or steps[-1]["mean/topk_overlap_with_base"] < 1


@slow
def test_example_trains_a_checkpoint_directory(tmp_path: Path) -> None:
    from rpb.architectures import random_model
    from rpb.pipeline.tokenizer import build_tokenizer

    tok = build_tokenizer(tmp_path)
    # Three MoE layers where the built-in model has two: the script says which it trained.
    model = random_model(
        "qwen3_moe", num_hidden_layers=3, vocab_size=len(tok), pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(tmp_path)
    proc = run_example("trainer.py", "--model", str(tmp_path), "--steps", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rpb on 3 routers of Qwen3MoeForCausalLM" in proc.stdout
    steps = step_lines(proc.stdout)
    assert len(steps) == 2 and set(METRICS) <= steps[0].keys()


@slow
def test_the_readme_loop_runs_as_it_is(tmp_path: Path) -> None:
    """README's "Use the method in your own training" loop is complete: saved as a file and run
    in a fresh interpreter, it trains two steps, prints the drift from the base each step and
    writes the prior (it names nothing it does not define)."""
    from test_light_install import _readme_library_snippet

    script = tmp_path / "loop.py"
    script.write_text(_readme_library_snippet())
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = [line for line in proc.stdout.splitlines() if "mean/kl_to_base" in line]
    assert [line.split()[0] for line in printed] == ["0", "1"], proc.stdout
    assert (tmp_path / "prior.safetensors").is_file()


# --------------------------------------------------------------------------- rpb_minimal.py


def load_minimal():
    """examples/rpb_minimal.py as a module (its script part runs only as __main__)."""
    spec = importlib.util.spec_from_file_location(
        "rpb_minimal", ROOT / "examples" / "rpb_minimal.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


minimal = load_minimal()
# rpb_minimal's --marginal -> the library method it is
MINIMAL_METHODS = {False: "rpb", True: "rpb_marginal"}
STRENGTH = 1.5  # not 1, so a strength dropped or applied twice shows


def tiny_base(model_type: str = "qwen3_moe") -> torch.nn.Module:
    from rpb.architectures import random_model

    return random_model(model_type, seed=0)


def moved_routers(base: torch.nn.Module) -> torch.nn.Module:
    """A copy of `base` whose routers have moved away from the base's, as during post-training:
    there z0 != z, so the bias changes the selection."""
    model = copy.deepcopy(base)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in minimal.find_routers(model):
            router.weight.add_(
                0.5 * router.weight.std() * torch.randn(router.weight.shape, generator=g)
            )
    return model


def renormalises_top_k(model: torch.nn.Module) -> bool:
    return all(router.norm_topk_prob for router in minimal.find_routers(model))


def test_the_minimal_example_does_not_import_rpb() -> None:
    source = (ROOT / "examples" / "rpb_minimal.py").read_text()
    assert not re.search(r"^\s*(from|import)\s+rpb\b", source, re.MULTILINE)


def test_the_minimal_prior_is_the_librarys() -> None:
    from rpb.prior import extract_prior

    base = tiny_base()
    data = minimal.batches(3, base.config.vocab_size, seed=1)
    assert any(bool((b["attention_mask"] == 0).any()) for b in data)  # padding is skipped
    ours = minimal.extract_prior(base, data)
    library = extract_prior(base, data, progress=False)
    assert len(ours["base_weights"]) == library.num_layers == 2
    for w, w0 in zip(ours["base_weights"], library.base_weights, strict=True):
        assert torch.equal(w, w0)
    assert torch.equal(ours["mean_probs"], library.mean_probs)
    assert torch.equal(ours["usage"], library.usage)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("marginal", [False, True], ids=list(MINIMAL_METHODS.values()))
@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe"])
def test_the_minimal_example_routes_as_the_librarys_method(
    model_type: str, marginal: bool, training: bool
) -> None:
    """On the same moved routers: every router's gate weights and experts, the model's logits and
    loss are the library's method's, bit for bit; the library's router term is 0 (the example
    adds none); and the routing is not the native one where the bias is on (rpb keeps it at
    evaluation, rpb_marginal drops it). The tiny Qwen3-MoE renormalises its top-k gate weights,
    the tiny Qwen2-MoE does not."""
    from rpb.methods import make_method
    from rpb.prior import extract_prior

    base = tiny_base(model_type)
    assert renormalises_top_k(base) == (model_type == "qwen3_moe")
    data = minimal.batches(2, base.config.vocab_size, seed=1)
    prior = extract_prior(base, data, progress=False)
    model = moved_routers(base).train(training)
    batch = minimal.batches(1, base.config.vocab_size, seed=3)[0]
    routers = minimal.find_routers(model)

    def forward(attached: list | None = None) -> tuple[Any, list]:
        seen: list = []  # spies after the method's hooks see the routing the experts got
        spies = [r.register_forward_hook(lambda m, a, out: seen.append(out)) for r in routers]
        with torch.no_grad():
            out = model(**batch)
        for hook in spies + (attached or []):
            hook.remove()
        return out, seen

    _, native_routing = forward()
    ours, our_routing = forward(
        minimal.attach_rpb(model, minimal.extract_prior(base, data), STRENGTH, marginal)
    )
    method = make_method(MINIMAL_METHODS[marginal], strength=STRENGTH).attach(model, prior)
    with torch.no_grad():
        theirs = model(**batch)
        assert float(method.router_loss(attention_mask=batch["attention_mask"])) == 0.0
    records = method.control.records
    method.detach()
    for (_, weights, experts), record in zip(our_routing, records, strict=True):
        assert torch.equal(experts, record.indices)
        assert torch.equal(weights, record.weights)
    assert torch.equal(ours.logits, theirs.logits) and torch.equal(ours.loss, theirs.loss)
    steered = training or not marginal
    moved = any(
        not torch.equal(a[2], b[2]) for a, b in zip(our_routing, native_routing, strict=True)
    )
    assert moved == steered


@pytest.mark.parametrize("marginal", [False, True], ids=list(MINIMAL_METHODS.values()))
def test_the_minimal_example_trains_as_the_library(marginal: bool) -> None:
    """Three AdamW steps from the same moved routers on the same batches: the example's loop
    and the library's (examples/plain_loop.py's: method attached, out.loss + router_loss) end at
    the same parameters, bit for bit, and not at plain fine-tuning's."""
    from rpb.methods import RouterMethod, make_method
    from rpb.prior import extract_prior

    base = tiny_base()
    prior_data = minimal.batches(2, base.config.vocab_size, seed=1)
    data = minimal.batches(3, base.config.vocab_size, seed=2)
    start = moved_routers(base)
    ours = copy.deepcopy(start)
    minimal.train(
        ours, minimal.extract_prior(base, prior_data), data, strength=STRENGTH, marginal=marginal
    )

    def library_loop(model: torch.nn.Module, method: RouterMethod) -> torch.nn.Module:
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # the example's default lr
        with method.attach(model, extract_prior(base, prior_data, progress=False)):
            for step, batch in enumerate(data):
                method.set_progress(step, len(data))
                out = model(**batch)
                (out.loss + method.router_loss(attention_mask=batch["attention_mask"])).backward()
                optimizer.step()
                optimizer.zero_grad()
                method.on_step_end()
        return model

    method = make_method(MINIMAL_METHODS[marginal], strength=STRENGTH)
    theirs = dict(library_loop(copy.deepcopy(start), method).named_parameters())
    plain = dict(library_loop(copy.deepcopy(start), make_method("none")).named_parameters())
    for name, param in ours.named_parameters():
        assert torch.equal(param, theirs[name]), name
    router = "model.layers.0.mlp.gate.weight"
    assert not torch.equal(theirs[router], dict(start.named_parameters())[router])
    assert any(not torch.equal(p, plain[n]) for n, p in ours.named_parameters())


@slow
def test_the_minimal_example_runs_as_a_script() -> None:
    proc = run_example("rpb_minimal.py", "--steps", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rpb on 2 routers" in proc.stdout
    losses = [line["loss"] for line in step_lines(proc.stdout)]
    assert len(losses) == 3 and all(0 < loss < 10 for loss in losses), proc.stdout
