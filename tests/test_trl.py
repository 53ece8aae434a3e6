"""rpb.trl: TRL's SFTTrainer with a router method on a tiny random Qwen3-MoE and an in-memory
dataset. The model's own load-balancing loss goes off with one warning (and stays on when asked
for), SFTTrainer's metrics and rpb's both reach the logs, and one optimizer step is the same at
gradient accumulation 1 and 2. Skipped only where trl is not installed."""

from __future__ import annotations

import copy
import functools
import logging
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

import torch
from conftest import perturb_routers
from datasets import Dataset
from transformers import TrainingArguments
from trl import SFTConfig, SFTTrainer

from rpb.architectures import random_model
from rpb.methods import make_method
from rpb.pipeline.tokenizer import build_tokenizer
from rpb.prior import RouterPrior, extract_prior
from rpb.trainer import RouterMethodTrainerMixin
from rpb.trl import RouterMethodSFTTrainer

SFT_METRICS = ("entropy", "mean_token_accuracy", "num_tokens")
RPB_METRICS = ("task_loss", "router_loss", "layer0/kl_to_base", "layer1/load/expert0")
# Sums of different digit counts: prompts and completions of different lengths.
ROWS = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in (3, 47, 120, 9) for b in (5, 68)]


@functools.cache
def _world() -> tuple[Any, torch.nn.Module, RouterPrior]:
    """The testbed tokenizer, a tiny random Qwen3-MoE over its vocabulary (which declares
    router_aux_loss_coef 0.001, as Qwen3-30B-A3B does), and its router prior on the rows."""
    tok = build_tokenizer()
    model = random_model(
        "qwen3_moe",
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    texts = [r["prompt"] + r["completion"] for r in ROWS]
    batch = dict(tok(texts, return_tensors="pt", padding=True))
    prior = extract_prior(
        model, [batch], model_id="tiny", revision="r0", corpus_hash="0", progress=False
    )
    return tok, model, prior


def _sft(
    out: Path, name: str, *, perturbed: bool = False, **settings: Any
) -> tuple[RouterMethodSFTTrainer, torch.nn.Module]:
    tok, base, prior = _world()
    model = copy.deepcopy(base).train()
    if perturbed:
        perturb_routers(model)
    method = make_method(name).attach(model, prior)
    args = SFTConfig(
        output_dir=str(out),
        max_steps=settings.pop("max_steps", 2),
        per_device_train_batch_size=settings.pop("batch", 4),
        learning_rate=settings.pop("learning_rate", 1e-2),
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        train_sampling_strategy="sequential",
        **settings,
    )
    trainer = RouterMethodSFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(ROWS),
        processing_class=tok,
        router_method=method,
    )
    with method:
        trainer.train()
    return trainer, model


def _logs(trainer: RouterMethodSFTTrainer) -> list[dict[str, float]]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def test_sft_turns_the_models_lbl_off_and_logs_both_metric_sets(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        trainer, model = _sft(tmp_path, "rpb")
    warned = [r.getMessage() for r in caplog.records if r.name == "rpb.trl"]
    assert len(warned) == 1 and "\n" not in warned[0]
    assert (
        "router_aux_loss_coef=0.001" in warned[0]
        and "SFTConfig(router_aux_loss_coef=0.001)" in (warned[0])
    )
    # Off for training; the checkpoint keeps the architecture's own coefficient.
    assert model.config.output_router_logits is False
    assert model.config.router_aux_loss_coef == 0.001
    logs = _logs(trainer)
    assert [entry["step"] for entry in logs] == [1, 2]
    for entry in logs:
        assert set(SFT_METRICS + RPB_METRICS) <= entry.keys()
        assert "aux_loss" not in entry
        assert entry["router_loss"] == 0  # rpb steers; no router term
        assert entry["loss"] == pytest.approx(entry["task_loss"], rel=1e-6)
    assert [h["step"] for h in trainer.router_history] == [1, 2]
    base = _world()[1]
    assert any(
        not torch.equal(p, q) for p, q in zip(model.parameters(), base.parameters(), strict=True)
    )


def test_sft_keeps_the_models_lbl_when_asked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        trainer, model = _sft(tmp_path, "lbl", max_steps=1, router_aux_loss_coef=0.001)
    assert not [r for r in caplog.records if r.name == "rpb.trl"]
    assert model.config.output_router_logits is True
    (entry,) = _logs(trainer)
    assert entry["aux_loss"] > 0 and entry["router_loss"] > 0
    assert entry["loss"] == pytest.approx(entry["task_loss"] + entry["router_loss"], rel=1e-6)


class MySFT(RouterMethodTrainerMixin, SFTTrainer):
    """The mixin on a Trainer subclass by hand, as the mixin's docstring invites."""


def test_a_hand_made_sft_trainer_turns_the_models_lbl_off_too(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SFTTrainer turns the model's own load-balancing loss on; without RouterMethodSFTTrainer's
    own handling, the mixin turns it off with one warning, so lbl's term is counted once."""
    tok, base, prior = _world()
    model = copy.deepcopy(base).train()
    method = make_method("lbl").attach(model, prior)
    args = SFTConfig(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        train_sampling_strategy="sequential",
    )
    with caplog.at_level(logging.WARNING):
        trainer = MySFT(
            model=model,
            args=args,
            train_dataset=Dataset.from_list(ROWS),
            processing_class=tok,
            router_method=method,
        )
        with method:
            trainer.train()
    warned = [r.getMessage() for r in caplog.records if r.name.startswith("rpb")]
    assert len(warned) == 1 and "counted once" in warned[0]
    assert model.config.output_router_logits is False and not trainer.aux_loss_enabled
    (entry,) = _logs(trainer)
    assert "aux_loss" not in entry and entry["router_loss"] > 0
    assert entry["loss"] == pytest.approx(entry["task_loss"] + entry["router_loss"], rel=1e-6)
    # The task loss is the SFT loss alone: the same as under RouterMethodSFTTrainer, which
    # turns it off before SFTTrainer starts.
    reference, _ = _sft(tmp_path / "ref", "lbl", max_steps=1)
    assert entry["task_loss"] == _logs(reference)[0]["task_loss"]


def test_sft_gradient_accumulation_gives_the_same_step(tmp_path: Path) -> None:
    """SFTTrainer normalises its loss over the accumulated batch and rpb weights anchor_kl's
    term per token to match: GA 2 of 2 examples is one step over the same 4 (float32: SFTConfig
    defaults to bf16 autocast, whose rounding would hide nothing but blur everything)."""
    runs = {}
    for ga, batch in ((1, 4), (2, 2)):
        trainer, model = _sft(
            tmp_path / f"ga{ga}",
            "anchor_kl",
            perturbed=True,
            max_steps=1,
            batch=batch,
            gradient_accumulation_steps=ga,
            learning_rate=1.0,
            optim="sgd",
            max_grad_norm=0.0,
            lr_scheduler_type="constant",
            bf16=False,
        )
        (entry,) = _logs(trainer)
        runs[ga] = (entry, [p.detach().clone() for p in model.parameters()])
    (one, w1), (two, w2) = runs[1], runs[2]
    assert one["router_loss"] > 0.01
    for key in ("loss", "task_loss", "router_loss", "mean_token_accuracy"):
        assert two[key] == pytest.approx(one[key], rel=1e-5), key
    for got, want in zip(w2, w1, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_sft_refuses_what_it_cannot_honour(tmp_path: Path) -> None:
    tok, base, prior = _world()
    model = copy.deepcopy(base)
    method = make_method("none").attach(model, prior)
    common = {"train_dataset": Dataset.from_list(ROWS), "processing_class": tok}
    with pytest.raises(TypeError, match="must be an SFTConfig"):
        RouterMethodSFTTrainer(
            model, TrainingArguments(str(tmp_path)), router_method=method, **common
        )
    smoothing = SFTConfig(str(tmp_path), label_smoothing_factor=0.1, report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match="label smoothing"):
        RouterMethodSFTTrainer(model, smoothing, router_method=method, **common)
    method.detach()
