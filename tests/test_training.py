"""Training on the real corpora with transformers' Trainer: pretraining lowers the loss, the saved
base loads offline (AutoModelForCausalLM and lm-eval's hf backend), post-training runs each method
from the same initial model with the same data order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rpb.eval_routing import eval_routing_spec, load_model
from rpb.method_config import MethodConfig
from rpb.pipeline.analysis import extract_prior_from_corpus
from rpb.pipeline.data import SIZE_PRESETS, write_corpora
from rpb.pipeline.evaluation import evaluate_model
from rpb.pipeline.tokenizer import build_tokenizer
from rpb.pipeline.training import TrainSpec, posttrain, pretrain

ARCH = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "kv_lora_rank": 16,
    "q_lora_rank": None,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "max_position_embeddings": 64,
}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("train")
    data = root / "data"
    write_corpora(data, seed=7, sizes=SIZE_PRESETS["smoke"])
    build_tokenizer(data / "tokenizer")
    out = root / "base"
    spec = TrainSpec(steps=60, batch_size=32, lr=3e-3, seed=0, log_every=5, max_length=32)
    pretrain(
        model_type="deepseek_v3",
        architecture=ARCH,
        tokenizer_dir=data / "tokenizer",
        corpus=data / "pretrain.jsonl",
        spec=spec,
        lbl_coef=0.001,
        out_dir=out,
    )
    prior = root / "prior.safetensors"
    extract_prior_from_corpus(out / "model", data / "post" / "math.jsonl", prior, model_id="t")
    return {"root": root, "data": data, "base": out, "prior": prior}


def test_pretraining_lowers_the_loss(base) -> None:
    import json

    history = json.loads((base["base"] / "train_history.json").read_text())["history"]
    losses = [h["task_loss"] for h in history]
    assert len(losses) >= 10
    # Mean of the last quarter clearly below the first logged loss (random init ~ log(124) = 4.8).
    tail = sum(losses[-len(losses) // 4 :]) / (len(losses) // 4)
    assert tail < 0.8 * losses[0], losses
    # The LBL term was really added (it is positive for any routing).
    assert all(h["router_loss"] > 0 for h in history)


def test_base_loads_offline_with_transformers_and_lm_eval(base) -> None:
    model = AutoModelForCausalLM.from_pretrained(base["base"] / "model")
    assert model.config.model_type == "deepseek_v3"
    result = evaluate_model(
        base["base"] / "model",
        base["data"] / "eval",
        ["addition"],
        base["root"] / "eval.json",
        base["root"] / "eval.work",
        limit=5,
        batch_size=8,
    )
    scores = result["tasks"]
    assert len(scores["rpb_addition"]["items"]) == 5
    assert 0.0 <= scores["rpb_addition"]["score"] <= 1.0
    assert scores["rpb_addition_ll"]["score"] < 0.0


def _router_weights(model_dir: Path) -> list[torch.Tensor]:
    model = load_model(model_dir, steer=False)  # hard's folder is a steered one (rpb_steered)
    return [m.weight.detach().clone() for n, m in model.named_modules() if n.endswith("mlp.gate")]


@pytest.mark.parametrize("method", ["none", "lbl", "rpb", "anchor_kl", "hard"])
def test_posttraining_each_method(base, method: str) -> None:
    out = base["root"] / f"post_{method}"
    spec = TrainSpec(steps=4, batch_size=8, lr=1e-3, seed=3, log_every=2, max_length=32)
    summary = posttrain(
        base_dir=base["base"] / "model",
        prior_path=base["prior"],
        corpus=base["data"] / "post" / "math.jsonl",
        method=MethodConfig(method),
        spec=spec,
        out_dir=out,
    )
    final = summary["final"]
    assert torch.isfinite(torch.tensor(final["task_loss"]))
    assert 0.0 <= final["mean/topk_overlap_with_base"] <= 1.0
    before, after = _router_weights(base["base"] / "model"), _router_weights(out / "model")
    assert len(before) == len(after) == 1  # one MoE layer (the first layer is dense)
    # The router stays trainable under every method.
    assert not torch.equal(before[0], after[0])
    # Only hard and rpb (its bias kept at evaluation by default) keep steering at evaluation, so
    # only their models carry their routing.
    kept = eval_routing_spec(out / "model")
    assert (kept.kind if kept else None) == (method if method in ("hard", "rpb") else None)
    # What it trained with, spelled as the value it was given (the default strength written in).
    history = json.loads((out / "train_history.json").read_text())
    assert history["method"] == MethodConfig(method).to_dict()


def test_same_seed_same_data_order(base) -> None:
    """Paired design: two runs with the same seed and method end bit-identical."""
    spec = TrainSpec(steps=3, batch_size=8, lr=1e-3, seed=5, log_every=1, max_length=32)
    finals = []
    for run in ("a", "b"):
        summary = posttrain(
            base_dir=base["base"] / "model",
            prior_path=base["prior"],
            corpus=base["data"] / "post" / "math.jsonl",
            method=MethodConfig("rpb"),
            spec=spec,
            out_dir=base["root"] / f"paired_{run}",
        )
        finals.append(summary["final"]["task_loss"])
    assert finals[0] == finals[1]


def _what_a_run_sees(base, monkeypatch, method: str, seed: int) -> tuple[str, list[str]]:
    """The digest of the model a post-training run starts from and of every batch it trains on,
    in order (recorded at the collator, which builds each batch the sampler hands out)."""
    import hashlib

    from rpb import posttraining as training  # the loop posttrain's setup runs

    batches: list[str] = []
    start: list[str] = []
    collate = training.RightPadCollator.__call__
    run_training = training.run_training

    def recording_collate(self, examples):
        batch = collate(self, examples)
        digest = hashlib.sha256(batch["input_ids"].numpy().tobytes())
        digest.update(batch["labels"].numpy().tobytes())
        batches.append(digest.hexdigest()[:16])
        return batch

    def recording_run(model, *args, **kwargs):
        digest = hashlib.sha256()
        for name, tensor in model.state_dict().items():
            digest.update(name.encode() + tensor.detach().numpy().tobytes())
        start.append(digest.hexdigest()[:16])
        return run_training(model, *args, **kwargs)

    monkeypatch.setattr(training.RightPadCollator, "__call__", recording_collate)
    monkeypatch.setattr(training, "run_training", recording_run)
    spec = TrainSpec(steps=3, batch_size=8, lr=1e-3, base=1, seed=seed, log_every=1, max_length=32)
    posttrain(
        base_dir=base["base"] / "model",
        prior_path=base["prior"],
        corpus=base["data"] / "post" / "math.jsonl",
        method=MethodConfig(method),
        spec=spec,
        out_dir=base["root"] / f"batches_{method}_{seed}",
        save_model=False,
    )
    monkeypatch.undo()
    return start[0], batches


def test_the_methods_of_one_run_start_alike_and_see_the_same_batches(base, monkeypatch) -> None:
    """Every paired interval rests on this (issue 56): for one run (base, seed), each method
    starts from the identical model and trains on the identical batches in the identical order;
    another seed of the same base gets other batches."""
    seen = {
        m: _what_a_run_sees(base, monkeypatch, m, seed=2) for m in ("none", "lbl", "rpb", "hard")
    }
    start, batches = seen["none"]
    assert len(batches) >= 3  # accelerate's loader fetches one batch ahead
    for method, (method_start, method_batches) in seen.items():
        assert method_start == start, method
        assert method_batches == batches, method
    assert _what_a_run_sees(base, monkeypatch, "none", seed=3)[1] != batches


def test_train_history_records_finetune_settings_only_when_set() -> None:
    """A pipeline run's `train_history.json` stays byte for byte what it was before `rpb
    finetune`'s settings joined TrainSpec (bench/compare_results.py compares it)."""
    plain = TrainSpec(steps=4, batch_size=2, lr=1e-3).record()
    assert not {"grad_accum", "eval_every", "report_to"} & set(plain)
    assert plain["steps"] == 4 and plain["save_every"] == 0
    tuned = TrainSpec(steps=4, batch_size=2, lr=1e-3, grad_accum=2, report_to="tensorboard")
    assert tuned.record()["grad_accum"] == 2 and tuned.record()["report_to"] == "tensorboard"
    assert "eval_every" not in tuned.record()


def test_a_post_training_run_records_its_base_and_seed_and_keeps_its_torch_seed() -> None:
    """A post-training spec names its run (base, seed); its torch seed is the one the run always
    had (rpb.specs.torch_seed). Without a base (pretraining, `rpb finetune`) the seed is the torch
    seed and the history records no base, as before."""
    run = TrainSpec(steps=4, batch_size=2, lr=1e-3, base=1, seed=2)
    assert run.torch_seed == 1002
    assert (run.record()["base"], run.record()["seed"]) == (1, 2)
    assert TrainSpec(steps=4, batch_size=2, lr=1e-3, base=0, seed=3).record()["base"] == 0
    pretraining = TrainSpec(steps=4, batch_size=2, lr=1e-3, seed=1234)
    assert pretraining.torch_seed == 1234 and "base" not in pretraining.record()


def test_the_warmup_is_a_ratio_of_the_steps_or_a_count_of_its_own() -> None:
    """The pipeline's config gives the warm-up as a ratio of the steps, `rpb finetune` as a count
    (issue 60: no longer turned into a ratio and back); a pipeline run's record has no
    `warmup_steps`, as before it existed."""
    from rpb.posttraining import _training_arguments

    ratio = TrainSpec(steps=30, batch_size=1, lr=1e-3, warmup_ratio=0.1)
    assert ratio.warmup == 3 and "warmup_steps" not in ratio.record()
    count = TrainSpec(steps=30, batch_size=1, lr=1e-3, warmup_ratio=0.1, warmup_steps=7)
    assert count.warmup == 7 and count.record()["warmup_steps"] == 7
    assert _training_arguments(count, Path("unused"), evaluate=False).warmup_steps == 7
    assert _training_arguments(ratio, Path("unused"), evaluate=False).warmup_steps == 3
