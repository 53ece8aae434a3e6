"""Training of the pipeline's jobs: tiny-base pretraining and post-training with a router method.

Both stages run the library's loop (rpb.posttraining.run_training: transformers' Trainer with the
attached method's term, checkpoints, resume, MLflow logs), and post-training its one setup,
`rpb.posttraining.posttrain_model`, which `rpb finetune` runs too. What is the pipeline's own is
here: the testbed's corpora tokenized, a random tiny base, the tokens its bases never saw in
pretraining, and each job's `train_history.json`. Pretraining is simply `lbl` from a random
initialisation with a full-sequence loss; post-training is any method from the base with an
answer-only loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    TrainerCallback,
)

from rpb.architectures import build_config
from rpb.eval_routing import load_model
from rpb.jsonl import load_jsonl
from rpb.method_config import MethodConfig
from rpb.methods import make_method
from rpb.numerics import numeric_path
from rpb.pipeline.data import DOMAIN_TOKENS, PRETRAIN_DOMAINS, SPECIAL_TOKENS, vocabulary
from rpb.pipeline.preemption import PreemptionCallback
from rpb.pipeline.tokenizer import encode
from rpb.posttraining import (
    CHECKPOINT_STATE,
    IGNORE_INDEX,
    CheckpointStateCallback,
    RightPadCollator,
    RouterMethodTrainer,
    RoutingDriftCallback,
    TokenizedExamples,
    experts_kwargs,
    is_main_process,
    last_complete_checkpoint,
    posttrain_model,
    remove_checkpoints,
    run_training,
    write_json,
)
from rpb.prior import RouterPrior
from rpb.train_spec import CONFIG_SETTING, TrainSpec

# The library's names the pipeline's modules, tests and experiments reach through this module.
__all__ = [
    "CHECKPOINT_STATE",
    "CONFIG_SETTING",
    "IGNORE_INDEX",
    "CheckpointStateCallback",
    "RightPadCollator",
    "RouterMethodTrainer",
    "RoutingDriftCallback",
    "TokenizedExamples",
    "TrainSpec",
    "experts_kwargs",
    "is_main_process",
    "last_complete_checkpoint",
    "new_base_model",
    "posttrain",
    "pretrain",
    "run_training",
    "tokenize_pretraining",
    "tokenize_prompt_completion",
    "unseen_token_ids",
]


def tokenize_pretraining(
    path: Path, tokenizer: PreTrainedTokenizerBase, max_length: int
) -> TokenizedExamples:
    """Full-sequence LM examples: every token of `text` + EOS is a target."""
    rows = load_jsonl(path, required_keys=("text",))
    eos = tokenizer.eos_token_id
    examples = []
    for row in rows:
        ids = [
            *tokenizer(row["text"], add_special_tokens=False)["input_ids"][: max_length - 1],
            eos,
        ]
        examples.append({"input_ids": ids, "labels": list(ids)})
    return TokenizedExamples(examples)


def tokenize_prompt_completion(
    path: Path, tokenizer: PreTrainedTokenizerBase, max_length: int
) -> TokenizedExamples:
    """Answer-only examples: loss on `completion` + EOS, never on the prompt."""
    rows = load_jsonl(path, required_keys=("prompt", "completion"))
    eos = tokenizer.eos_token_id
    examples = []
    for line, row in enumerate(rows, start=1):
        prompt = encode(tokenizer, row["prompt"], f"{path}:{line}")
        answer = [*encode(tokenizer, row["completion"], f"{path}:{line}"), eos]
        ids = (prompt + answer)[:max_length]
        labels = ([IGNORE_INDEX] * len(prompt) + answer)[:max_length]
        examples.append({"input_ids": ids, "labels": labels})
    return TokenizedExamples(examples)


def new_base_model(
    model_type: str,
    architecture: dict[str, Any],
    tokenizer: PreTrainedTokenizerBase,
    seed: int,
    experts_implementation: str | None = None,
) -> PreTrainedModel:
    """A randomly initialised base of the given transformers MoE architecture."""
    config = build_config(
        model_type,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        **architecture,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, **experts_kwargs(experts_implementation)
    )


def pretrain(
    *,
    model_type: str,
    architecture: dict[str, Any],
    tokenizer_dir: Path,
    corpus: Path,
    spec: TrainSpec,
    lbl_coef: float,
    out_dir: Path,
    experts_implementation: str | None = None,
) -> dict[str, Any]:
    """Pretrain a tiny base on the domain mixture with a load-balancing loss, like a real base."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = new_base_model(
        model_type, architecture, tokenizer, spec.torch_seed, experts_implementation
    )
    model.train()
    dataset = tokenize_pretraining(corpus, tokenizer, spec.max_length)
    method = make_method("lbl", strength=lbl_coef).attach(model)
    history = run_training(
        model, tokenizer, dataset, method, spec, out_dir, save_to=out_dir / "model"
    )
    summary = {
        "final": history[-1] if history else {},
        "spec": spec.record(),
        "numeric_path": numeric_path(),
    }
    if is_main_process():
        write_json(out_dir / "train_history.json", {"history": history, **summary})
        remove_checkpoints(out_dir / "checkpoints")
    PartialState().wait_for_everyone()
    return summary


def posttrain(
    *,
    base_dir: Path,
    prior_path: Path | None,
    corpus: Path,
    method: MethodConfig,
    spec: TrainSpec,
    out_dir: Path,
    trust_remote_code: bool = False,
    experts_implementation: str | None = None,
    callbacks: Sequence[TrainerCallback] = (),
    save_model: bool = True,
) -> dict[str, Any]:
    """Post-train a base on a prompt/completion corpus with one router method attached.

    `trust_remote_code` applies to the tokenizer only (Moonlight's); the model always loads with
    transformers' own class. `experts_implementation` picks transformers' experts kernel (None:
    its default). Every rank of a multi-process launch calls this; the main process writes the
    outputs while the others wait. `callbacks` join the Trainer's (e.g. dev-accuracy
    readings); `save_model` false keeps no model (for runs that need only their readings).
    """
    tokenizer = AutoTokenizer.from_pretrained(base_dir, trust_remote_code=trust_remote_code)
    torch.manual_seed(spec.torch_seed)
    # A steered folder (rpb.eval_routing) as base: its weights, routing with its saved routers.
    model = load_model(
        base_dir, steer=False, dtype=torch.float32, **experts_kwargs(experts_implementation)
    )
    dataset = tokenize_prompt_completion(corpus, tokenizer, spec.max_length)
    prior = RouterPrior.load(prior_path) if prior_path else None
    history = posttrain_model(
        model,
        tokenizer,
        dataset,
        method.build(),
        spec,
        out_dir,
        prior=prior,
        new_token_ids=unseen_token_ids(tokenizer, dataset) if spec.trainable == "moe" else (),
        save_to=out_dir / "model" if save_model else None,
        # A signal (Slurm's warning before the time limit, a cancel) saves and exits to requeue.
        callbacks=[*callbacks, PreemptionCallback()],
    )
    summary = {
        "final": history[-1] if history else {},
        "spec": spec.record(),
        "method": method.to_dict(),
        "numeric_path": numeric_path(),
    }
    if is_main_process():
        write_json(out_dir / "train_history.json", {"history": history, **summary})
        remove_checkpoints(out_dir / "checkpoints")
    PartialState().wait_for_everyone()
    return summary


def unseen_token_ids(tokenizer: PreTrainedTokenizerBase, dataset: TokenizedExamples) -> list[int]:
    """Ids of the tokens in `dataset` that the tiny bases never saw in pretraining: the
    post-training tasks' own template tokens (the generator declares each pretraining domain's
    alphabet, rpb.pipeline.data.DOMAIN_TOKENS). With a tokenizer that is not the tiny testbed's (a
    real checkpoint's) there are none: every embedding row is trunk."""
    seen = {t for d in PRETRAIN_DOMAINS for t in DOMAIN_TOKENS[d]} | set(SPECIAL_TOKENS)
    vocab = tokenizer.get_vocab()
    if set(vocab) != set(vocabulary()):
        return []
    used = {i for ex in dataset.examples for i in ex["input_ids"]}
    return sorted(vocab[t] for t in vocab if t not in seen and vocab[t] in used)
