"""rpb.trainer: one optimizer step is the same at every gradient accumulation (loss, logged terms,
updated weights), the router term of a batch statistic is the token-weighted mean of its
micro-batches, the logged drift is `routing_stats` of the step's batch, the expert load counts the
experts tokens were sent to on non-padding tokens only, every logger receives the metrics, and the
trainer steps the method exactly once per optimizer step with its own callback."""

from __future__ import annotations

import ast
import copy
import functools
import logging
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import make_batch, make_model, perturb_routers
from transformers import TrainerCallback, TrainingArguments

from rpb.methods import make_method
from rpb.prior import RouterPrior, extract_prior
from rpb.trainer import RouterMethodTrainer, RoutingDriftCallback, console_logs

# One optimizer step over 8 examples: per_device batch 8 / GA, plain SGD at lr 1 with no clipping
# (clipping would hide a gradient scaled by the accumulation steps).
EFFECTIVE_BATCH = 8
# Lengths whose micro-batches hold different numbers of tokens at GA 2 and 4, so a router term
# weighted per micro-batch instead of per token would show.
LENGTHS = [3, 11, 5, 9, 4, 12, 6, 7]
METHOD_OPTIONS = {"lbl": {"strength": 0.5}, "anchor_kl": {"strength": 1.0}}


def tiny_examples(lengths: list[int], seed: int = 0) -> list[dict[str, list[int]]]:
    """Causal-LM examples of the given lengths, token ids in the tiny models' vocabulary."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        ids = torch.randint(3, 64, (n,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": ids})
    return rows


def collate(batch: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Right padding (pad id 0, label -100, mask 0)."""
    width = max(len(ex["input_ids"]) for ex in batch)
    out = {
        "input_ids": torch.zeros(len(batch), width, dtype=torch.long),
        "labels": torch.full((len(batch), width), -100, dtype=torch.long),
        "attention_mask": torch.zeros(len(batch), width, dtype=torch.long),
    }
    for row, ex in enumerate(batch):
        n = len(ex["input_ids"])
        out["input_ids"][row, :n] = torch.tensor(ex["input_ids"])
        out["labels"][row, :n] = torch.tensor(ex["labels"])
        out["attention_mask"][row, :n] = 1
    return out


def step_args(out: Path, batch: int, ga: int = 1, steps: int = 1, **more: Any) -> TrainingArguments:
    """Deterministic Trainer settings: data in order, SGD, constant lr, no clipping, CPU."""
    return TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=ga,
        learning_rate=more.pop("learning_rate", 1.0),
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        logging_steps=more.pop("logging_steps", 1),
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        train_sampling_strategy="sequential",
        disable_tqdm=more.pop("disable_tqdm", True),
        **more,
    )


@functools.cache
def _base_and_prior() -> tuple[torch.nn.Module, RouterPrior]:
    """A tiny Qwen3-MoE, its router prior, then routers moved away from the base (as after some
    fine-tuning), so anchor terms, drift and rpb's steering are all non-zero."""
    model = make_model("qwen3_moe")
    prior = extract_prior(
        model,
        [make_batch(seed=s) for s in range(2)],
        model_id="tiny",
        revision="r0",
        corpus_hash="0",
        progress=False,
    )
    perturb_routers(model)
    return model, prior


def fresh(name: str, **options: Any) -> tuple[torch.nn.Module, Any]:
    """A copy of the perturbed base in training mode with method `name` attached."""
    base, prior = _base_and_prior()
    model = copy.deepcopy(base).train()
    opts = {**METHOD_OPTIONS.get(name, {}), **options}
    return model, make_method(name, **opts).attach(model, prior)


def train(
    name: str, examples: list, out: Path, batch: int, ga: int = 1, steps: int = 1, **more: Any
) -> tuple[RouterMethodTrainer, torch.nn.Module]:
    callbacks = more.pop("callbacks", None)
    shares = more.pop("log_expert_shares", True)
    model, method = fresh(name, **more.pop("options", {}))
    trainer = RouterMethodTrainer(
        model=model,
        args=step_args(out, batch, ga, steps, **more),
        train_dataset=examples,
        data_collator=collate,
        router_method=method,
        callbacks=callbacks,
        log_expert_shares=shares,
    )
    with method:
        trainer.train()
    return trainer, model


def _train_logs(trainer: RouterMethodTrainer) -> list[dict[str, float]]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("name", ["none", "lbl", "rpb", "anchor_kl"])
def test_gradient_accumulation_gives_the_same_step(name: str, tmp_path: Path) -> None:
    """Same effective batch at GA 1, 2 and 4: the same logged loss and terms and the same
    weights after the optimizer step. The old trainer summed the micro-batch means (a loss and
    gradient GA times too large). lbl is a batch statistic, so its micro-batches repeat one pair
    of examples (each micro-batch then has the whole batch's statistics); the others get
    examples of different lengths."""
    examples = tiny_examples(LENGTHS[:2]) * 4 if name == "lbl" else tiny_examples(LENGTHS)
    runs = {}
    for ga in (1, 2, 4):
        trainer, model = train(name, examples, tmp_path / f"ga{ga}", EFFECTIVE_BATCH // ga, ga)
        (log,) = _train_logs(trainer)
        (entry,) = trainer.router_history
        runs[ga] = (log, entry, [p.detach().clone() for p in model.parameters()])
    log1, entry1, weights1 = runs[1]
    base = _base_and_prior()[0]
    assert any(not torch.equal(w, p) for w, p in zip(weights1, base.parameters(), strict=True))
    assert log1["loss"] == pytest.approx(entry1["task_loss"] + entry1["router_loss"], rel=1e-6)
    if name in ("lbl", "anchor_kl"):
        assert entry1["router_loss"] > 0.01
    else:
        assert entry1["router_loss"] == 0
    for ga in (2, 4):
        log, entry, weights = runs[ga]
        assert log["loss"] == pytest.approx(log1["loss"], rel=1e-5), ga
        assert log["grad_norm"] == pytest.approx(log1["grad_norm"], rel=1e-4), ga
        assert entry["task_loss"] == pytest.approx(entry1["task_loss"], rel=1e-5), ga
        assert entry["router_loss"] == pytest.approx(entry1["router_loss"], rel=1e-5, abs=1e-9)
        for got, want in zip(weights, weights1, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_batch_statistic_is_the_token_weighted_mean_of_micro_batches(tmp_path: Path) -> None:
    """lbl's logged term under GA 2 is sum_m n_m * lbl(m) / sum_m n_m over the micro-batches'
    non-padding tokens n_m, computed here by hand from two forwards."""
    examples = tiny_examples(LENGTHS)
    trainer, _ = train("lbl", examples, tmp_path, batch=4, ga=2)
    model, method = fresh("lbl")
    terms, tokens = [], []
    with method, torch.no_grad():
        for part in (examples[:4], examples[4:]):
            batch = collate(part)
            model(**batch)
            terms.append(float(method.router_loss(batch["attention_mask"])))
            tokens.append(float(batch["attention_mask"].sum()))
    assert tokens[0] != tokens[1] and terms[0] != pytest.approx(terms[1])
    want = (terms[0] * tokens[0] + terms[1] * tokens[1]) / sum(tokens)
    assert trainer.router_history[0]["router_loss"] == pytest.approx(want, rel=1e-6)


def test_logged_drift_is_routing_stats_of_the_step(tmp_path: Path) -> None:
    """At GA 1 the logged drift equals `routing_stats` of the same batch (before the update);
    at GA 4 it still covers the whole step's batch, not the last micro-batch."""
    examples = tiny_examples(LENGTHS)
    model, method = fresh("rpb")
    batch = collate(examples)
    with method, torch.no_grad():
        model(**batch)
        want = method.routing_stats(batch["attention_mask"])
    assert want["mean/kl_to_base"] > 0.01 and want["mean/topk_overlap_with_base"] < 1
    for ga in (1, 4):
        trainer, _ = train("rpb", examples, tmp_path / f"ga{ga}", EFFECTIVE_BATCH // ga, ga)
        (entry,) = trainer.router_history
        drift = {k: v for k, v in entry.items() if k in want}
        assert drift.keys() == want.keys()
        for key, value in want.items():
            assert drift[key] == pytest.approx(value, rel=1e-6, abs=1e-9), (ga, key)


def test_expert_load_counts_dispatched_non_padding_tokens(tmp_path: Path) -> None:
    """Tokens are forced onto experts 0 and 1, padding onto 2 and 3: the load shows experts 0-1
    at half each and six dead experts (padding not counted); usage entropy still describes the
    router's own (unforced) choice."""
    examples = tiny_examples(LENGTHS)
    flat = collate(examples)["attention_mask"].reshape(-1).bool()

    def forced(record: Any) -> torch.Tensor:
        tokens = torch.tensor([0, 1]).expand(flat.shape[0], 2)
        return torch.where(flat.unsqueeze(1), tokens, tokens + 2)

    model, method = fresh("none")
    method.control.set_policy(forced_indices=forced)
    trainer = RouterMethodTrainer(
        model=model,
        args=step_args(tmp_path, EFFECTIVE_BATCH),
        train_dataset=examples,
        data_collator=collate,
        router_method=method,
    )
    with method:
        trainer.train()
    (entry,) = trainer.router_history
    for layer in range(2):
        shares = [entry[f"layer{layer}/load/expert{e}"] for e in range(8)]
        assert shares == [0.5, 0.5, 0, 0, 0, 0, 0, 0]
        assert entry[f"layer{layer}/dead_experts"] == 6
        assert entry[f"layer{layer}/max_load_ratio"] == 4.0  # 0.5 / (1/8)
        assert 0.5 < entry[f"layer{layer}/usage_entropy"] < 1.0  # not log(2)/log(8)
    assert entry["mean/dead_experts"] == 6


class _Recorder(TrainerCallback):
    """Stands for any logger configured with report_to: keeps what on_log receives."""

    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append({**logs, "step": state.global_step})


def test_every_logger_receives_the_metrics_and_the_last_step(tmp_path: Path) -> None:
    """Metrics arrive through Trainer.log at each logging step and at the last step even when it
    is not a multiple of logging_steps; losses are interval means summing to the Trainer's loss;
    the history keeps the pipeline's keys."""
    recorder = _Recorder()
    trainer, _ = train(
        "anchor_kl",
        tiny_examples(LENGTHS * 2),
        tmp_path,
        batch=2,
        ga=2,
        steps=3,
        learning_rate=0.1,
        logging_steps=2,
        callbacks=[recorder],
    )
    logs = [entry for entry in recorder.logs if "loss" in entry]
    assert [entry["step"] for entry in logs] == [2, 3]
    assert [entry["step"] for entry in trainer.router_history] == [2, 3]
    for log, entry in zip(logs, trainer.router_history, strict=True):
        for key in ("task_loss", "router_loss", "layer1/kl_to_base", "mean/topk_overlap_with_base"):
            assert log[key] == entry[key], key
        assert {"layer0/load/expert7", "layer0/dead_experts", "mean/max_load_ratio"} <= log.keys()
        assert log["loss"] == pytest.approx(log["task_loss"] + log["router_loss"], rel=1e-6)
        assert entry["lr"] == log["learning_rate"] == 0.1
    quiet, _ = train("none", tiny_examples(LENGTHS), tmp_path / "q", 8, log_expert_shares=False)
    keys = set(quiet.router_history[0])
    assert not any("/load/" in k for k in keys) and "layer0/max_load_ratio" in keys


def test_console_logs_keep_the_summaries_and_the_worst_layer() -> None:
    logs = {
        "loss": 1.0,
        "task_loss": 0.9,
        "layer0/load/expert0": 0.5,
        "layer0/max_load_ratio": 1.5,
        "layer0/dead_experts": 0.0,
        "layer1/max_load_ratio": 3.0,
        "layer1/dead_experts": 2.0,
        "layer1/kl_to_base": 0.1,
        "mean/max_load_ratio": 2.25,
    }
    assert console_logs(logs) == {
        "loss": 1.0,
        "task_loss": 0.9,
        "mean/max_load_ratio": 2.25,
        "max/max_load_ratio": 3.0,
        "max/dead_experts": 2.0,
    }
    assert console_logs({"loss": 1.0}) == {"loss": 1.0}


@pytest.mark.parametrize("tqdm", [False, True], ids=["printer", "progress_bar"])
def test_the_console_line_summarises_the_layers_and_loggers_get_every_share(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tqdm: bool
) -> None:
    """The line the Trainer prints (PrinterCallback, or the progress bar's) has no per-layer
    entry but the worst layer's load; a logger (`on_log`) and the history get every share."""
    recorder = _Recorder()
    trainer, _ = train(
        "rpb",
        tiny_examples(LENGTHS),
        tmp_path,
        batch=4,
        steps=2,
        learning_rate=0.1,
        callbacks=[recorder],
        disable_tqdm=not tqdm,
    )
    printed = [
        ast.literal_eval(line)
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("{") and "'task_loss'" in line
    ]
    assert len(printed) == 2
    for line, entry in zip(printed, trainer.router_history, strict=True):
        assert not any(k.startswith("layer") for k in line), sorted(line)
        assert {"loss", "router_loss", "mean/kl_to_base", "mean/dead_experts"} <= line.keys()
        worst = max(entry[f"layer{i}/max_load_ratio"] for i in range(2))
        assert float(line["max/max_load_ratio"]) == pytest.approx(worst, rel=1e-3)
    shares = {f"layer{i}/load/expert{e}" for i in range(2) for e in range(8)}
    assert all(shares <= log.keys() for log in recorder.logs if "loss" in log)
    assert all(shares <= entry.keys() for entry in trainer.router_history)


def test_trainer_steps_the_method_once_per_optimizer_step(tmp_path: Path) -> None:
    """The trainer attaches its own callback: rpb_anneal's progress is set before every
    optimizer step and the method's update runs once per step, not per micro-batch."""
    model, method = fresh("rpb_anneal", schedule="linear")
    seen: list[tuple[str, float]] = []
    set_progress, on_step_end = method.set_progress, method.on_step_end
    method.set_progress = lambda s, n: (seen.append(("progress", s / n)), set_progress(s, n))
    method.on_step_end = lambda: (seen.append(("end", 0.0)), on_step_end())
    trainer = RouterMethodTrainer(
        model=model,
        args=step_args(tmp_path, 2, ga=2, steps=2, learning_rate=0.01),
        train_dataset=tiny_examples(LENGTHS),
        data_collator=collate,
        router_method=method,
    )
    with method:
        trainer.train()
    assert seen == [("progress", 0.0), ("end", 0.0), ("progress", 0.5), ("end", 0.0)]
    assert sum(isinstance(cb, RoutingDriftCallback) for cb in trainer.callback_handler.callbacks)


def test_callback_takes_the_trainer_plainly() -> None:
    method = make_method("rpb_anneal", schedule="linear")
    callback = RoutingDriftCallback(SimpleNamespace(router_method=method))
    callback.on_step_begin(None, SimpleNamespace(global_step=15, max_steps=20), None)
    assert method.progress == 0.75 and method.current_strength == pytest.approx(0.25)


@pytest.mark.parametrize("name", ["lbl", "anchor_kl"])
def test_one_router_term_when_the_checkpoint_asks_for_its_own_lbl(
    name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A config with output_router_logits on would add the model's own load-balancing loss to
    the task loss beside the method's term (lbl's counted twice): the trainer turns it off with
    one warning, and the step is the one of a checkpoint without the flag."""
    runs = {}
    for flagged in (False, True):
        model, method = fresh(name)
        model.config.output_router_logits = flagged
        caplog.clear()
        with caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = RouterMethodTrainer(
                model=model,
                args=step_args(tmp_path / str(flagged), 4, steps=2),
                train_dataset=tiny_examples(LENGTHS[:8]),
                data_collator=collate,
                router_method=method,
            )
            with method:
                trainer.train()
        ours = [r.getMessage() for r in caplog.records if r.name == "rpb.trainer"]
        assert len(ours) == (1 if flagged else 0)
        assert not [w for w in caught if "counts it twice" in str(w.message)]
        if flagged:
            assert "\n" not in ours[0] and "own load-balancing loss" in ours[0]
            assert ("counted once" in ours[0]) == (name == "lbl")
            assert ("method lbl adds" in ours[0]) == (name != "lbl")  # not "use lbl" to lbl
        assert model.config.output_router_logits is False
        runs[flagged] = (_train_logs(trainer), [p.detach().clone() for p in model.parameters()])
    (plain, plain_weights), (flagged_logs, flagged_weights) = runs[False], runs[True]
    for a, b in zip(plain, flagged_logs, strict=True):
        assert b["router_loss"] > 0
        assert b["task_loss"] == a["task_loss"] and b["router_loss"] == a["router_loss"]
        assert b["loss"] == pytest.approx(b["task_loss"] + b["router_loss"], rel=1e-6)
    assert all(torch.equal(p, q) for p, q in zip(plain_weights, flagged_weights, strict=True))


def test_bad_wiring_is_refused(tmp_path: Path) -> None:
    model, method = fresh("none")
    kwargs = {"args": step_args(tmp_path, 2), "train_dataset": tiny_examples([3, 4])}
    with pytest.raises(ValueError, match="not attached"):
        RouterMethodTrainer(model=model, router_method=make_method("none"), **kwargs)
    with pytest.raises(ValueError, match="another model"):
        RouterMethodTrainer(model=make_model("qwen3_moe"), router_method=method, **kwargs)
    with pytest.raises(ValueError, match="its own RoutingDriftCallback"):
        RouterMethodTrainer(
            model=model,
            router_method=method,
            callbacks=[RoutingDriftCallback(SimpleNamespace(router_method=method))],
            **kwargs,
        )
    method.detach()


@pytest.mark.slow  # a fresh interpreter importing torch and transformers
def test_library_module_stays_light() -> None:
    """rpb.trainer is for users' training scripts: no tracking, workflow, evaluation or TRL
    import."""
    code = (
        "import sys, rpb.trainer; "
        "print(sorted(m for m in ('mlflow', 'snakemake', 'lm_eval', 'matplotlib', 'trl') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_training_reexports_the_library_trainer() -> None:
    """The pipeline's rpb.pipeline.training hands out the same classes as the library's
    rpb.trainer."""
    import rpb.pipeline.training

    assert rpb.pipeline.training.RouterMethodTrainer is RouterMethodTrainer
    assert rpb.pipeline.training.RoutingDriftCallback is RoutingDriftCallback
