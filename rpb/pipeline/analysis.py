"""Routing analysis of whole models: prior extraction over a corpus, and the co-activation and
drift analysis of a post-trained model against its base on one fixed probe set.

Both the model and its base are run on the *identical* probe inputs (docs/design.md, section 10: a
probe that differs from the reference biases every NMI and cosine). Drift against the base router
(top-k overlap, KL) is measured on the live model's own hidden states, with the frozen base router
weights from the prior, so it isolates what happened to the router.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from rpb.artifacts import save_safetensors, sha256_of, write_text
from rpb.coactivation import CoactivationCounter, mean_kl, summarize_layers, topk_overlap
from rpb.eval_routing import (
    attach_eval_routing,
    eval_routing_spec,
    load_for_inference,
)
from rpb.pipeline.data import load_jsonl
from rpb.pipeline.tokenizer import encode
from rpb.prior import RouterPrior, extract_prior
from rpb.routing import RouterControl, routing_probs

log = logging.getLogger(__name__)


def text_batches(
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    batch_size: int,
    source: str = "text",
) -> list[dict[str, torch.Tensor]]:
    """Right-padded batches of whole texts (+ EOS), as the models saw text in training.
    `source` names where the texts came from, for errors (item i is reported as source:i+1)."""
    batches = []
    eos = tokenizer.eos_token_id
    for start in range(0, len(texts), batch_size):
        ids = [
            [*encode(tokenizer, text, f"{source}:{start + i + 1}"), eos]
            for i, text in enumerate(texts[start : start + batch_size])
        ]
        width = max(len(row) for row in ids)
        input_ids = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for r, row in enumerate(ids):
            input_ids[r, : len(row)] = torch.tensor(row)
            mask[r, : len(row)] = 1
        batches.append({"input_ids": input_ids, "attention_mask": mask})
    return batches


def corpus_texts(path: Path) -> list[str]:
    """Full texts (prompt + completion) of a post-training corpus."""
    return [r["prompt"] + r["completion"] for r in load_jsonl(path, ("prompt", "completion"))]


def probe_texts(eval_dir: Path, tasks: Sequence[str], limit: int) -> list[str]:
    """The fixed probe set: the first `limit` items (prompt + target) of each task, in order."""
    texts = []
    for task in tasks:
        rows = load_jsonl(Path(eval_dir) / f"{task}.jsonl", ("prompt", "target"))
        texts += [r["prompt"] + r["target"] for r in rows[:limit]]
    return texts


def extract_prior_from_corpus(
    model_dir: Path,
    corpus: Path,
    out: Path,
    *,
    model_id: str,
    batch_size: int = 128,
    trust_remote_code: bool = False,
    experts_implementation: str | None = None,
) -> RouterPrior:
    """Run the base over a post-training corpus once and write its router prior to `out`."""
    tokenizer, model = load_for_inference(
        model_dir,
        trust_remote_code=trust_remote_code,
        experts_implementation=experts_implementation,
    )
    batches = text_batches(tokenizer, corpus_texts(corpus), batch_size, source=str(corpus))
    prior = extract_prior(
        model,
        batches,
        model_id=model_id,
        revision=str(model_dir),
        corpus_hash=sha256_of(corpus),
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    prior.save(out)
    return prior


def routing_pass(
    model: torch.nn.Module,
    batches: Sequence[dict[str, torch.Tensor]],
    prior: RouterPrior | None = None,
    desc: str = "routing",
) -> dict[str, Any]:
    """Co-activation counts of `model` on `batches`, and its drift from the base router if given.

    Drift (per MoE layer, token-weighted over non-pad tokens): top-k overlap of the live selection
    with the base router's selection on the same hidden state, and KL(p0 || p).
    """
    control = RouterControl(
        model,
        base_weights=prior.base_weights if prior is not None else None,
        base_correction_bias=prior.correction_bias if prior is not None else None,
        base_router_bias=prior.router_bias if prior is not None else None,
    )
    n_layers = control.num_layers
    counter = CoactivationCounter(n_layers, control.handles[0].num_experts)
    overlap = torch.zeros(n_layers, dtype=torch.float64)
    kl = torch.zeros(n_layers, dtype=torch.float64)
    tokens = 0
    model.eval()
    device = model.get_input_embeddings().weight.device
    with control, torch.no_grad():
        for batch in tqdm(batches, desc=desc, leave=False):
            control.clear_records()
            model(**{k: v.to(device) for k, v in batch.items()})
            mask = batch["attention_mask"].reshape(-1).bool().to(device)
            n = int(mask.sum())
            tokens += n
            for i, rec in enumerate(control.records):
                counter.update(i, rec.indices, mask=mask)
                if prior is None:
                    continue
                kind = control.handles[i].kind
                overlap[i] += n * topk_overlap(rec.indices, control.base_topk(rec), mask=mask)
                p = routing_probs(kind, rec.logits)
                p0 = routing_probs(kind, rec.base_logits)
                kl[i] += n * mean_kl(p0, p, mask=mask)
    drift = None
    if prior is not None:
        drift = {
            "topk_overlap_with_base": (overlap / tokens).tolist(),
            "kl_to_base": (kl / tokens).tolist(),
        }
    return {"counter": counter, "drift": drift, "tokens": tokens}


def analyze_model(
    *,
    model_dir: Path,
    base_dir: Path,
    prior_path: Path,
    eval_dir: Path,
    tasks: Sequence[str],
    limit: int,
    out_json: Path,
    trust_remote_code: bool = False,
    experts_implementation: str | None = None,
) -> dict[str, Any]:
    """Per-layer co-activation structure of a model, retention against its base, and drift.

    A model saved with evaluation-time routing (`hard`, `keep_bias_at_eval`; see
    rpb.eval_routing) is analysed with that routing attached, as lm-eval scores it: counts and
    drift describe the experts the model actually uses.
    """
    prior = RouterPrior.load(prior_path)
    load = {
        "trust_remote_code": trust_remote_code,
        "experts_implementation": experts_implementation,
    }
    tokenizer, model = load_for_inference(model_dir, **load)
    batches = text_batches(tokenizer, probe_texts(eval_dir, tasks, limit), batch_size=64)
    prior.check_compatible(model)
    steering = attach_eval_routing(model, model_dir)
    try:
        live = routing_pass(model, batches, prior, desc="model")
    finally:
        if steering is not None:
            steering.detach()
    if Path(model_dir).resolve() == Path(base_dir).resolve():
        reference = live["counter"]
    else:
        _, base = load_for_inference(base_dir, **load)
        reference = routing_pass(base, batches, None, desc="base")["counter"]
        del base
    rows = summarize_layers(live["counter"].counts.numpy(), reference.counts.numpy(), seed=0)
    layers = rows[:-1] if rows and rows[-1].get("layer") == "mean" else rows
    mean = dict(rows[-1]) if rows and rows[-1].get("layer") == "mean" else {}
    mean.pop("layer", None)
    for key, values in (live["drift"] or {}).items():
        for row, value in zip(layers, values, strict=True):
            row[key] = value
        mean[key] = float(sum(values) / len(values))
    routing = eval_routing_spec(model_dir)
    summary = {
        "model_dir": str(model_dir),
        "base_dir": str(base_dir),
        "eval_routing": routing.to_dict() if routing is not None else None,
        "probe": {"tasks": list(tasks), "limit": limit, "tokens": live["tokens"]},
        "layers": layers,
        "mean": mean,
    }
    write_text(out_json, json.dumps(summary, indent=2, default=float) + "\n")
    save_safetensors(
        {"counts": live["counter"].counts, "base_counts": reference.counts.clone()},
        out_json.with_suffix(".safetensors"),
    )
    log.info("analysis: %s", {k: round(float(v), 4) for k, v in mean.items()})
    return summary
