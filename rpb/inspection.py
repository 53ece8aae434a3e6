"""`rpb inspect`: how far a fine-tune's routing moved from its base, and how much of its change
(its forgetting, on held-out domains) its routers carry, for any MoE checkpoint pair rpb routes.

    rpb inspect --base DIR --tuned DIR --data FILE.jsonl [--eval FILE.jsonl ...] --out DIR

1. **Routing drift** over `--data` (rpb.coactivation's metrics, measured as the pipeline's
   analysis measures them): per MoE layer, the top-k overlap of the tuned model's selection with
   the base router's on the tuned model's own hidden states and KL(base || tuned) of the two
   routing distributions there (so a layer whose router did not move reads overlap 1, KL 0,
   whatever moved before it); the relative change of the router weight; each model's expert
   usage over its own forward (normalised entropy, dead experts: never selected, overloaded
   experts: more than twice the uniform share of selections); and, with the `analysis` extra,
   the co-activation communities' NMI and ARI between base and tuned.
2. **Change priced by part** with `--eval` files (prompt/completion JSONL, one per domain): every
   cell of rpb.router_swap's factorial (base, tuned and the models that take some parts from
   each: routers / routed experts / trunk, or routers against the rest with `--parts routers`)
   scores each domain as the pipeline's evaluation does: the mean per-token log-likelihood of
   completion + EOS given the prompt (`ll_per_token`, nats), p(target) = exp(its sum) (percent)
   and exact match (percent: the completion and EOS are the greedy continuation under teacher
   forcing). `rpb.router_swap.decompose` splits each base-to-tuned change into main effects,
   interactions, Shapley values (adding up to the total) and put-back shares. A tuned model that
   keeps a method's routing at evaluation (`rpb finetune --method rpb` keeps its bias) is
   measured and scored as it is evaluated, and that routing goes with its routers: the cells
   that take the tuned routers route with it, those with the base's routers without it.
3. **Output** in `--out`: inspect.json (every number, the inputs' sha256 and rpb's version),
   inspect.md and inspect.html, a page with its plots drawn as inline SVG.

Memory: one model on the device at a time; the swapped cells are assembled on the CPU (the base
loaded there with the tuned model's parts copied in, from a CPU copy of the tuned model) and
moved to the device to be scored. The plots are SVG written here rather than matplotlib figures:
matplotlib is the pipeline extra's, not the library's, and a page with inline SVG is one file
that opens anywhere.

Torch and transformers are imported inside the functions that need them: building the parser
costs nothing.
"""

from __future__ import annotations

import argparse
import html
import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rpb.router_swap import PARTS, cells, decompose, factors

if TYPE_CHECKING:
    from torch import nn

    from rpb.prior import RouterPrior

log = logging.getLogger(__name__)

FORMAT = "rpb.inspect/1"
OUT_FILES = ("inspect.json", "inspect.md", "inspect.html")
# The scores of each cell and domain, with their units (the router-swap table's metrics).
METRICS = {
    "ll_per_token": "mean per-token log-likelihood of completion + EOS, nats",
    "p_target": "p(completion + EOS), percent",
    "exact_match": "completion + EOS is the greedy continuation, percent",
}
# The metric the page's decomposition bars show: on a tiny or a 30B model alike it moves where
# p(target) and exact match sit at zero.
PLOT_METRIC = "ll_per_token"
# An expert is overloaded when it takes more than this many times the uniform share (1/E).
OVERLOAD_FACTOR = 2.0
# --parts spellings: "experts" is short for the routed experts.
PART_ALIASES = {"experts": "routed_experts"}
DTYPES = ("auto", "float32", "bfloat16", "float16")


# --- inputs -----------------------------------------------------------------------------------


def check_checkpoint(path: Path, flag: str) -> str:
    """The model type of the checkpoint folder `path` (given as `flag`), checked before any weight
    loads: a missing folder, a folder without config.json and a family rpb does not route are
    refused in one line naming the flag and folder."""
    from rpb.eval_routing import base_config_dict
    from rpb.families import FAMILIES, routed_model_types
    from rpb.router.spec import UnsupportedRouter

    if not path.is_dir():
        raise FileNotFoundError(f"{flag} {path}: no such folder (a local checkpoint folder)")
    config = path / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{flag} {path}: not a checkpoint folder (no config.json)")
    try:
        model_type = base_config_dict(json.loads(config.read_text(encoding="utf-8")))["model_type"]
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError, KeyError, AttributeError) as err:
        raise ValueError(f"{config}: not a model config with a model_type ({err!r})") from None
    family = FAMILIES.get(model_type)
    if family is not None and isinstance(family.routing, UnsupportedRouter):
        raise ValueError(f"{flag} {path}: model type {model_type!r} is refused: "
                         f"{family.routing.reason}")  # fmt: skip
    if model_type not in routed_model_types():
        raise ValueError(
            f"{flag} {path}: model type {model_type!r} is not a MoE family rpb routes "
            f"(docs/families.md)"
        )
    return str(model_type)


def read_jsonl(path: Path, flag: str, *, pairs_only: bool) -> list[dict[str, str]]:
    """The records of a JSONL file as {"prompt", "completion", "where"} (a `{"text": ...}` record
    is all completion, with an empty prompt, where `pairs_only` is false; "where" is file:line).
    Blank lines are skipped; every error names file:line."""
    if not path.is_file():
        raise FileNotFoundError(f"{flag} {path}: no such file")
    wanted = "'prompt' and 'completion'" if pairs_only else "'text', or 'prompt' and 'completion'"
    records = []
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            where = f"{path}:{number}"
            try:
                text = raw.decode("utf-8")
                record = json.loads(text) if text.strip() else None
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise ValueError(f"{where}: not a UTF-8 JSON line ({err})") from None
            if record is None:
                continue
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            if "prompt" in record and "completion" in record:
                pair = {"prompt": record["prompt"], "completion": record["completion"]}
            elif "text" in record and not pairs_only:
                pair = {"prompt": "", "completion": record["text"]}
            else:
                raise ValueError(f"{where}: expected {wanted} fields, found {sorted(record)}")
            if not all(isinstance(v, str) for v in pair.values()):
                raise ValueError(f"{where}: the fields {sorted(pair)} must hold strings")
            records.append(pair | {"where": where})
    if not records:
        raise ValueError(f"{flag} {path}: no records (expected JSON lines with {wanted} fields)")
    return records


def _file_sha256(path: Path) -> str:
    from rpb.artifacts import sha256_of

    return sha256_of(path)


def folder_digests(folder: Path) -> dict[str, str]:
    """sha256 of each file of a checkpoint folder (config, weights, tokenizer, eval routing)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return {p.relative_to(folder).as_posix(): _file_sha256(p) for p in files}


def parse_parts(text: str) -> tuple[str, ...]:
    """`--parts`: a comma-separated list of routers, experts (routed_experts) and trunk."""
    names = [PART_ALIASES.get(p.strip(), p.strip()) for p in text.split(",") if p.strip()]
    try:
        factors(names)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give distinct names among routers, experts, trunk"
        ) from None
    return tuple(p for p in PARTS if p in names)


# --- batches ----------------------------------------------------------------------------------


@dataclass
class Example:
    """One record tokenized: `ids` and the position where its scored tokens start."""

    ids: list[int]
    start: int


def tokenize(
    records: Sequence[Mapping[str, str]], tokenizer: Any, max_length: int, source: str
) -> list[Example]:
    """Prompt (with the tokenizer's own special tokens) + completion + EOS per record. A long
    example keeps its last `max_length` tokens (the prompt is cut, the completion kept); a record
    whose completion alone is longer is left out with a warning."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"{source}: the tokenizer has no EOS token; set eos_token in its config")
    examples, dropped = [], 0
    for record in records:
        try:  # tokenizers raises its own types
            prompt = list(tokenizer(record["prompt"], add_special_tokens=True)["input_ids"])
            answer = tokenizer(record["completion"], add_special_tokens=False)["input_ids"]
        except Exception as err:
            raise ValueError(f"{record['where']}: cannot tokenize the record ({err})") from None
        answer = [*answer, eos]
        ids = (prompt + answer)[-max_length:]
        start = len(ids) - len(answer)
        if start < 1 and record["prompt"]:
            dropped += 1
            continue
        # A text record scores every token after the first (nothing predicts the first).
        examples.append(Example(ids, max(start, 1)))
    if dropped:
        log.warning("%s: %d completions longer than --max-length left out", source, dropped)
    if not examples:
        raise ValueError(f"{source}: no record fits --max-length {max_length}")
    return examples


def batches_of(examples: Sequence[Example], batch_size: int, pad_id: int) -> list[dict[str, Any]]:
    """Right-padded batches: input_ids, attention_mask, and each row's scored span."""
    import torch

    out = []
    for first in range(0, len(examples), batch_size):
        rows = examples[first : first + batch_size]
        width = max(len(r.ids) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row.ids)] = torch.tensor(row.ids)
            mask[i, : len(row.ids)] = 1
        spans = [(r.start, len(r.ids)) for r in rows]
        out.append({"input_ids": ids, "attention_mask": mask, "spans": spans})
    return out


# --- models -----------------------------------------------------------------------------------


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_checkpoint(folder: Path, dtype: str, device: str = "cpu") -> nn.Module:
    """The model of `folder` in eval mode, routing with its saved routers alone, on `device`."""
    import torch

    from rpb.eval_routing import load_model

    kind = "auto" if dtype == "auto" else getattr(torch, dtype)
    return load_model(folder, steer=False, dtype=kind, device_map=device).eval()


def _device_of(model: nn.Module) -> Any:
    return model.get_input_embeddings().weight.device


def score_examples(
    model: nn.Module, batches: Sequence[Mapping[str, Any]], desc: str, progress: bool = True
) -> dict[str, float]:
    """One domain's scores (METRICS) of `model`: item means over the batches' examples."""
    import torch
    from tqdm.auto import tqdm

    device = _device_of(model)
    per_token, p_target, greedy = [], [], []
    with torch.no_grad():
        for batch in tqdm(batches, desc=desc, leave=False, disable=not progress):
            ids = batch["input_ids"].to(device)
            logits = model(input_ids=ids, attention_mask=batch["attention_mask"].to(device)).logits
            for row, (start, end) in enumerate(batch["spans"]):
                # Position t's logits predict token t + 1.
                scores = logits[row, start - 1 : end - 1].float().log_softmax(-1)
                target = ids[row, start:end]
                ll = scores.gather(-1, target.unsqueeze(-1)).double().sum().item()
                per_token.append(ll / (end - start))
                p_target.append(math.exp(ll))
                greedy.append(bool((scores.argmax(-1) == target).all()))
    n = len(per_token)
    return {
        "ll_per_token": sum(per_token) / n,
        "p_target": 100.0 * sum(p_target) / n,
        "exact_match": 100.0 * sum(greedy) / n,
    }


def base_routing(
    model: nn.Module, batches: Sequence[Mapping[str, Any]], data_sha256: str, name: str
) -> RouterPrior:
    """The base's router prior over the batches: its router weights, usage and co-activation."""
    from rpb.prior import extract_prior

    inputs = [{k: b[k] for k in ("input_ids", "attention_mask")} for b in batches]
    return extract_prior(model, inputs, model_id=name, revision="local", corpus_hash=data_sha256)


def tuned_routing(
    model: nn.Module, batches: Sequence[Mapping[str, Any]], prior: RouterPrior, progress: bool
) -> dict[str, Any]:
    """The tuned model's usage and co-activation over the batches, and per layer its token-weighted
    top-k overlap with the base router and KL(base || tuned) on its own hidden states."""
    import torch
    from tqdm.auto import tqdm

    from rpb.coactivation import CoactivationCounter, mean_kl, topk_overlap
    from rpb.routing import RouterControl, routing_probs

    prior.check_compatible(model)
    control = RouterControl(
        model,
        base_weights=prior.base_weights,
        base_correction_bias=prior.correction_bias,
        base_router_bias=prior.router_bias,
    )
    layers = control.num_layers
    counter = CoactivationCounter(layers, prior.num_experts)
    sums = {"overlap": torch.zeros(layers, dtype=torch.float64), "kl": torch.zeros(layers).double()}
    tokens = 0
    device = _device_of(model)
    with control, torch.no_grad():
        for batch in tqdm(batches, desc="tuned routing", leave=False, disable=not progress):
            control.clear_records()
            mask = batch["attention_mask"].to(device)
            model(input_ids=batch["input_ids"].to(device), attention_mask=mask)
            keep = mask.reshape(-1).bool()
            n = int(keep.sum())
            tokens += n
            for layer, record in enumerate(control.records):
                here = keep.to(record.indices.device)
                counter.update(layer, record.indices, mask=here)
                base_top = control.base_topk(record)
                sums["overlap"][layer] += n * topk_overlap(record.indices, base_top, mask=here)
                p_base = routing_probs(prior.kind, record.base_logits)
                p_tuned = routing_probs(prior.kind, record.logits)
                sums["kl"][layer] += n * mean_kl(p_base, p_tuned, mask=here)
    weight_change = [
        float((h.weight.detach().float().cpu() - w).norm() / w.norm().clamp_min(1e-30))
        for h, w in zip(control.handles, prior.base_weights, strict=True)
    ]
    return {
        "counter": counter,
        "topk_overlap": (sums["overlap"] / tokens).tolist(),
        "kl_to_base": (sums["kl"] / tokens).tolist(),
        "router_weight_change": weight_change,
    }


# --- drift summary ----------------------------------------------------------------------------


def usage_summary(usage: Any) -> dict[str, list]:
    """Per layer of usage counts [L, E]: normalised entropy, dead and overloaded experts, and the
    usage shares themselves."""
    import numpy as np

    from rpb.coactivation import usage_entropy

    counts = np.asarray(usage, dtype=np.float64)
    shares = counts / counts.sum(-1, keepdims=True)
    experts = counts.shape[-1]
    return {
        "entropy": [float(v) for v in usage_entropy(counts)],
        "dead": [int(v) for v in (counts == 0).sum(-1)],
        "overloaded": [int(v) for v in (shares > OVERLOAD_FACTOR / experts).sum(-1)],
        "shares": shares.tolist(),
    }


def community_rows(tuned_counts: Any, base_counts: Any) -> tuple[list[dict] | None, str | None]:
    """rpb.coactivation.summarize_layers of tuned against base (without the mean row), or None
    and the reason when the `analysis` extra (networkx, scikit-learn) is not installed."""
    from rpb.coactivation import summarize_layers

    try:
        rows = summarize_layers(tuned_counts, base_counts, seed=0)
    except ImportError as err:
        log.warning("co-activation communities left out: %s", err)
        return None, str(err)
    return rows[:-1], None


def drift_layers(
    prior: RouterPrior, tuned: Mapping[str, Any]
) -> tuple[list[dict[str, Any]], str | None]:
    """One row per MoE layer (drift, router weight change, both models' usage and communities),
    and why the communities are left out (None when they are not)."""
    base_usage = usage_summary(prior.usage.numpy())
    tuned_usage = usage_summary(tuned["counter"].usage.numpy())
    communities, note = community_rows(tuned["counter"].counts.numpy(), prior.coactivation.numpy())
    rows = []
    for layer in range(prior.num_layers):
        row: dict[str, Any] = {
            "layer": layer,
            "decoder_layer": prior.decoder_layers[layer],
            "topk_overlap": tuned["topk_overlap"][layer],
            "kl_to_base": tuned["kl_to_base"][layer],
            "router_weight_change": tuned["router_weight_change"][layer],
        }
        for side, usage in (("base", base_usage), ("tuned", tuned_usage)):
            row |= {f"{side}_{k}": usage[k][layer] for k in ("entropy", "dead", "overloaded")}
        if communities is not None:
            found = communities[layer]
            row |= {
                "community_nmi": found["community_nmi"],
                "community_ari": found["community_ari"],
                "coact_cosine": found["coact_cosine"],
                "tuned_communities": found["n_communities"],
            }
        rows.append(row)
    return rows, note


def mean_row(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Every numeric column's mean over layers (NaN left out)."""
    keys = [k for k in rows[0] if k not in ("layer", "decoder_layer")]
    out = {}
    for key in keys:
        values = [float(r[key]) for r in rows if r[key] is not None and not math.isnan(r[key])]
        out[key] = sum(values) / len(values) if values else math.nan
    return out


# --- the factorial ----------------------------------------------------------------------------


def decomposition(
    scores: Mapping[str, Mapping[str, Mapping[str, float]]], parts: Sequence[str]
) -> dict[str, dict[str, dict[str, float]]]:
    """domain -> metric -> rpb.router_swap.decompose of the cells' scores (cell -> domain ->
    metric -> score)."""
    names = list(factors(parts))
    taken = cells(parts)
    domains = next(iter(scores.values()))
    return {
        domain: {
            metric: decompose({taken[c]: scores[c][domain][metric] for c in taken}, names)
            for metric in METRICS
        }
        for domain in domains
    }


def score_cells(
    base_dir: Path,
    tuned_dir: Path,
    evals: Mapping[str, Sequence[Mapping[str, Any]]],
    parts: Sequence[str],
    *,
    dtype: str,
    device: str,
    known: Mapping[str, Mapping[str, Mapping[str, float]]],
    progress: bool = True,
) -> dict[str, dict[str, dict[str, float]]]:
    """cell -> domain -> METRICS for every cell of the factorial over `parts`. `known` holds the
    cells already scored (base and tuned, from their drift passes); each other cell is the base
    loaded on the CPU with the tuned model's parts of the factors it takes copied in (from one
    CPU copy of the tuned model), then scored on `device`. A tuned model that keeps a method's
    routing at evaluation (rpb.eval_routing) lends it with its routers: the cells that take the
    tuned routers route as the tuned model is evaluated."""
    from tqdm.auto import tqdm

    from rpb.eval_routing import attach_eval_routing
    from rpb.router_swap import swap_parts

    groups = factors(parts)
    (routers,) = [f for f, held in groups.items() if "routers" in held]
    out = {cell: dict(known[cell]) for cell in known}
    todo = {cell: taken for cell, taken in cells(parts).items() if cell not in known}
    if not todo:
        return out
    donor = load_checkpoint(tuned_dir, dtype)
    for cell, taken in tqdm(todo.items(), desc="swap cells", disable=not progress):
        model = load_checkpoint(base_dir, dtype)
        swap_parts(model, donor, [p for f in taken for p in groups[f]])
        model.to(device)
        steering = attach_eval_routing(model, tuned_dir) if routers in taken else None
        out[cell] = {
            domain: score_examples(model, batches, f"{cell}: {domain}", progress)
            for domain, batches in evals.items()
        }
        if steering is not None:
            steering.detach()
        del model
    return out


# --- the whole command --------------------------------------------------------------------------


def domain_names(paths: Sequence[Path]) -> list[str]:
    """Each eval file's domain: its stem, numbered where two files share one."""
    stems = [p.stem for p in paths]
    return [s if stems.count(s) == 1 else f"{s}_{i + 1}" for i, s in enumerate(stems)]


def checked_inputs(
    base_dir: Path, tuned_dir: Path, data: Path, evals: Sequence[Path]
) -> tuple[str, list[dict[str, str]], dict[str, list[dict[str, str]]]]:
    """The model type of the two checkpoints, the --data records and each --eval domain's
    records, every input checked (in one line each) before any model loads."""
    from rpb.eval_routing import eval_routing_spec

    base_type = check_checkpoint(base_dir, "--base")
    tuned_type = check_checkpoint(tuned_dir, "--tuned")
    if base_type != tuned_type:
        raise ValueError(
            f"--tuned {tuned_dir}: model type {tuned_type!r}, the base's is {base_type!r}; "
            "inspect a fine-tune against the base it was tuned from"
        )
    if eval_routing_spec(base_dir) is not None:
        raise ValueError(
            f"--base {base_dir}: keeps a method's routing at evaluation (eval_routing/); a base "
            "routes natively: give the checkpoint the fine-tune started from"
        )
    data_records = read_jsonl(data, "--data", pairs_only=False)
    eval_records = {
        name: read_jsonl(path, "--eval", pairs_only=True)
        for name, path in zip(domain_names(evals), evals, strict=True)
    }
    return base_type, data_records, eval_records


def inspect_models(
    base_dir: Path,
    tuned_dir: Path,
    data: Path,
    out: Path,
    *,
    evals: Sequence[Path] = (),
    parts: Sequence[str] = PARTS,
    device: str = "auto",
    dtype: str = "auto",
    batch_size: int = 8,
    max_length: int = 1024,
    progress: bool = True,
) -> dict[str, Any]:
    """Measure `tuned_dir` against `base_dir` (module docstring) and write OUT_FILES to `out`;
    return inspect.json's content. Bad input fails in one line before any model loads."""
    import torch
    from transformers import AutoTokenizer

    import rpb
    from rpb.eval_routing import attach_eval_routing, eval_routing_spec

    base_dir, tuned_dir, data, out = Path(base_dir), Path(tuned_dir), Path(data), Path(out)
    evals = [Path(path) for path in evals]
    model_type, data_records, eval_records = checked_inputs(base_dir, tuned_dir, data, evals)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: is a file; give a folder for the outputs")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype}: one of {', '.join(DTYPES)}")
    device = resolve_device(device)
    parts = tuple(parts)
    factors(parts)  # unknown parts: one line
    steered = eval_routing_spec(tuned_dir)

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    pad_id = tokenizer.pad_token_id
    pad_id = tokenizer.eos_token_id if pad_id is None else pad_id
    data_batches = batches_of(
        tokenize(data_records, tokenizer, max_length, str(data)), batch_size, pad_id
    )
    eval_batches = {
        name: batches_of(tokenize(records, tokenizer, max_length, str(path)), batch_size, pad_id)
        for (name, records), path in zip(eval_records.items(), evals, strict=True)
    }
    data_sha = _file_sha256(data)

    def scored(model: nn.Module, who: str) -> dict[str, dict[str, float]]:
        return {
            name: score_examples(model, batches, f"{who}: {name}", progress)
            for name, batches in eval_batches.items()
        }

    # One model on the device at a time: the base, then the tuned model, then each swap cell.
    model = load_checkpoint(base_dir, dtype, device)
    prior = base_routing(model, data_batches, data_sha, str(base_dir))
    known = {"base": scored(model, "base")}
    del model
    model = load_checkpoint(tuned_dir, dtype, device)
    # Drift and scores as the tuned model is evaluated (with the routing it keeps, if any).
    steering = attach_eval_routing(model, tuned_dir)
    try:
        tuned = tuned_routing(model, data_batches, prior, progress)
        known["trained"] = scored(model, "tuned")
    finally:
        if steering is not None:
            steering.detach()
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()

    layers, community_note = drift_layers(prior, tuned)
    result: dict[str, Any] = {
        "format": FORMAT,
        "rpb_version": rpb.__version__,
        "inputs": {
            "base": {"path": str(base_dir), "sha256": folder_digests(base_dir)},
            "tuned": {"path": str(tuned_dir), "sha256": folder_digests(tuned_dir)},
            "data": {
                "path": str(data),
                "sha256": data_sha,
                "records": len(data_records),
                "tokens": prior.n_tokens,
            },
            "eval": [
                {
                    "domain": name,
                    "path": str(path),
                    "sha256": _file_sha256(path),
                    "records": len(eval_records[name]),
                }
                for name, path in zip(eval_records, evals, strict=True)
            ],
        },
        "settings": {
            "model_type": model_type,
            "parts": list(parts),
            "device": device,
            "dtype": dtype,
            "batch_size": batch_size,
            "max_length": max_length,
            "tuned_eval_routing": steered.to_dict() if steered is not None else None,
        },
        "model": {
            "moe_layers": prior.num_layers,
            "experts": prior.num_experts,
            "top_k": prior.top_k,
            "routing": prior.kind,
        },
        "drift": {
            "layers": layers,
            "mean": mean_row(layers),
            "communities": "computed" if community_note is None else community_note,
            "overload_factor": OVERLOAD_FACTOR,
        },
        "usage": {
            "base": usage_summary(prior.usage.numpy())["shares"],
            "tuned": usage_summary(tuned["counter"].usage.numpy())["shares"],
        },
        "decomposition": None,
    }
    if eval_batches:
        scores = score_cells(
            base_dir, tuned_dir, eval_batches, parts,
            dtype=dtype, device=device, known=known, progress=progress,
        )  # fmt: skip
        result["decomposition"] = {
            "factors": {f: list(p) for f, p in factors(parts).items()},
            "cells": {cell: sorted(taken) for cell, taken in cells(parts).items()},
            "metrics": METRICS,
            "scores": scores,
            "effects": decomposition(scores, parts),
        }
    write_outputs(result, out)
    return result


def _finite(value: Any) -> Any:
    """`value` with NaN and infinities as None, so inspect.json is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_outputs(result: Mapping[str, Any], out: Path) -> None:
    """inspect.json, inspect.md and inspect.html of `result` in `out`, each written atomically."""
    from rpb.artifacts import write_text

    out.mkdir(parents=True, exist_ok=True)
    clean = _finite(result)
    write_text(out / "inspect.json", json.dumps(clean, indent=2, allow_nan=False) + "\n")
    write_text(out / "inspect.md", markdown(clean))
    write_text(out / "inspect.html", page(clean))


# --- inspect.md -------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:.3e}"
    return str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return lines


DRIFT_COLUMNS = {
    "layer": "MoE layer",
    "topk_overlap": "top-k overlap",
    "kl_to_base": "KL to base",
    "router_weight_change": "router change",
    "base_entropy": "base entropy",
    "tuned_entropy": "tuned entropy",
    "base_dead": "base dead",
    "tuned_dead": "tuned dead",
    "base_overloaded": "base overl.",
    "tuned_overloaded": "tuned overl.",
    "community_nmi": "community NMI",
    "coact_cosine": "co-act. cosine",
}


def _drift_columns(layers: Sequence[Mapping[str, Any]]) -> list[str]:
    return [c for c in DRIFT_COLUMNS if c in layers[0]]


def _summary_lines(result: Mapping[str, Any]) -> list[str]:
    inputs, model, mean = result["inputs"], result["model"], result["drift"]["mean"]
    lines = [
        f"`{inputs['tuned']['path']}` against its base `{inputs['base']['path']}` "
        f"({result['settings']['model_type']}: {model['moe_layers']} MoE layers of "
        f"{model['experts']} experts, top-{model['top_k']}, {model['routing']} routing), over "
        f"{inputs['data']['records']} records ({inputs['data']['tokens']} tokens) of "
        f"`{inputs['data']['path']}`.",
        "",
        f"Mean over layers: top-k overlap with the base router {_fmt(mean['topk_overlap'])}, "
        f"KL(base || tuned) {_fmt(mean['kl_to_base'])} nats, relative router weight change "
        f"{_fmt(mean['router_weight_change'])}"
        + (
            f", co-activation community NMI {_fmt(mean['community_nmi'])}."
            if "community_nmi" in mean
            else f". Communities: {result['drift']['communities']}."
        ),
    ]
    return lines


def effect_label(key: str) -> str:
    """A row name of the decomposition table for a key of rpb.router_swap.decompose."""
    if key == "total":
        return "total (tuned - base)"
    for prefix, what in (
        ("shapley_share_", "Shapley share"),
        ("shapley_", "Shapley value"),
        ("put_back_share_", "put-back share"),
        ("put_back_", "put back"),
        ("main_", "main effect"),
    ):
        if key.startswith(prefix):
            return f"{key.removeprefix(prefix)}: {what}"
    return key.removeprefix("interaction_").replace("_x_", " x ")


def decomposition_rows(per_metric: Mapping[str, Mapping[str, float]]) -> list[list[Any]]:
    """One domain's decomposition as rows: the effect, then its value under each metric."""
    keys = list(next(iter(per_metric.values())))
    return [[effect_label(k), *(per_metric[m][k] for m in per_metric)] for k in keys]


def _factor_lines(dec: Mapping[str, Any]) -> list[str]:
    units = "; ".join(f"{m}: {unit}" for m, unit in METRICS.items())
    lines = [f"Scores per cell ({units}) and the change split by part (rpb.router_swap)."]
    rest = {f: p for f, p in dec["factors"].items() if list(p) != [f]}
    if rest:
        lines[0] += " " + "; ".join(f"{f} = {' + '.join(p)}" for f, p in rest.items()) + "."
    return lines


def markdown(result: Mapping[str, Any]) -> str:
    """inspect.md: the summary, the per-layer drift table and each domain's decomposition."""
    layers = result["drift"]["layers"]
    columns = _drift_columns(layers)
    lines = ["# rpb inspect", "", *_summary_lines(result), "", "## Routing drift per MoE layer", ""]
    lines += _table([DRIFT_COLUMNS[c] for c in columns], [[r[c] for c in columns] for r in layers])
    lines += [
        "",
        "Top-k overlap and KL: the tuned model's routing against the base router's on the tuned "
        "model's own hidden states. Entropy: of expert usage, normalised by log E. Dead: experts "
        f"never selected; overloaded: above {result['drift']['overload_factor']:g}x the uniform "
        "share.",
    ]
    dec = result["decomposition"]
    if dec is None:
        lines += ["", "No --eval files: the change was not priced by part."]
        return "\n".join(lines) + "\n"
    lines += ["", "## The change by part", "", *_factor_lines(dec)]
    for domain, per_metric in dec["effects"].items():
        lines += ["", f"### {domain}", ""]
        lines += _table(
            ["cell", *METRICS],
            [[c, *(dec["scores"][c][domain][m] for m in METRICS)] for c in dec["cells"]],
        )
        lines += ["", *_table(["effect", *per_metric], decomposition_rows(per_metric))]
    return "\n".join(lines) + "\n"


# --- inspect.html -----------------------------------------------------------------------------

STYLE = """<style>
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; font-size: 14px;
  margin: 1.2em; color: #1f2328; max-width: 80em; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.4em; } h3 { font-size: 1em; }
table { border-collapse: collapse; margin: 0.4em 0 1em; }
th, td { border: 1px solid #d0d7de; padding: 3px 7px; }
th { background: #f6f8fa; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 0.6em 0 1.2em; } figcaption { color: #57606a; max-width: 60em; }
svg text { font: 11px system-ui, sans-serif; fill: #1f2328; }
</style>"""
COLORS = ("#0969da", "#cf222e", "#1a7f37", "#8250df", "#bc4c00", "#57606a")


def _esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _scale(lo: float, hi: float, size: float) -> Callable[[float], float]:
    span = hi - lo if hi > lo else 1.0
    return lambda v: (v - lo) / span * size


def bar_chart(
    groups: Sequence[str],
    series: Mapping[str, Sequence[float | None]],
    *,
    title: str,
    height: int = 180,
) -> str:
    """Grouped vertical bars: one group per label of `groups`, one bar per series, zero line and
    the value range on the axis."""
    values = [v for vals in series.values() for v in vals if v is not None]
    lo, hi = min([0.0, *values]), max([0.0, *values])
    if hi == lo:
        hi = lo + 1.0
    n = max(len(series), 1)
    # Wide groups where there are few of them (two domains, two layers), narrow where many.
    group_w = max(14 * n + 8, min(30 * n + 20, 600 // max(len(groups), 1)))
    left, top, bottom = 56, 22, 34
    legend_w = sum(30 + 7 * len(name) for name in series)
    width = max(left + group_w * len(groups) + 10, left + legend_w)
    y = _scale(lo, hi, height)
    zero = top + height - y(0.0)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{top + height + bottom}"'
        f' role="img" aria-label="{_esc(title)}">',
        f'<text x="{left}" y="14">{_esc(title)}</text>',
        f'<line x1="{left}" x2="{left + group_w * len(groups)}" y1="{zero:.1f}" '
        f'y2="{zero:.1f}" stroke="#57606a"/>',
        f'<text x="{left - 4}" y="{top + 4}" text-anchor="end">{_fmt(hi, 3)}</text>',
        f'<text x="{left - 4}" y="{top + height}" text-anchor="end">{_fmt(lo, 3)}</text>',
    ]
    bar_w = (group_w - 8) / n
    for g, label in enumerate(groups):
        x0 = left + g * group_w + 4
        for s, (name, vals) in enumerate(series.items()):
            v = vals[g]
            if v is None:
                continue
            y_top = top + height - y(max(v, 0.0))
            h = abs(y(v) - y(0.0))
            parts.append(
                f'<rect x="{x0 + s * bar_w:.1f}" y="{y_top:.1f}" width="{bar_w - 1:.1f}" '
                f'height="{max(h, 0.5):.1f}" fill="{COLORS[s % len(COLORS)]}">'
                f"<title>{_esc(name)} {_esc(label)}: {_fmt(v)}</title></rect>"
            )
        parts.append(
            f'<text x="{x0 + (group_w - 8) / 2:.1f}" y="{top + height + 14}" '
            f'text-anchor="middle">{_esc(label)}</text>'
        )
    legend_x = left
    for s, name in enumerate(series):
        parts.append(
            f'<rect x="{legend_x}" y="{top + height + 22}" width="10" height="10" '
            f'fill="{COLORS[s % len(COLORS)]}"/>'
            f'<text x="{legend_x + 14}" y="{top + height + 31}">{_esc(name)}</text>'
        )
        legend_x += 30 + 7 * len(name)
    return "\n".join([*parts, "</svg>"])


def usage_heatmap(shares: Sequence[Sequence[float]], title: str) -> str:
    """Layers (rows) by experts (columns), coloured by log2 of the usage share over uniform:
    blue below it, red above, white at it; dead experts grey."""
    layers, experts = len(shares), len(shares[0])
    cell = max(4, min(32, 640 // experts))
    width = max(40 + cell * experts + 10, 7 * len(title) + 50, 460)
    left, top = 40, 22
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{top + cell * layers + 20}" role="img" aria-label="{_esc(title)}">',
        f'<text x="{left}" y="14">{_esc(title)}</text>',
    ]
    for layer, row in enumerate(shares):
        parts.append(
            f'<text x="{left - 4}" y="{top + cell * layer + cell - 2}" text-anchor="end">'
            f"{layer}</text>"
        )
        for expert, share in enumerate(row):
            if share <= 0:
                color = "#d0d7de"
            else:
                t = max(-1.0, min(1.0, math.log2(share * experts) / 2))  # +-2 = 4x
                fade = int(255 * (1 - abs(t)))
                color = f"rgb(255,{fade},{fade})" if t > 0 else f"rgb({fade},{fade},255)"
            parts.append(
                f'<rect x="{left + cell * expert}" y="{top + cell * layer}" width="{cell}" '
                f'height="{cell}" fill="{color}"><title>layer {layer} expert {expert}: '
                f"{100 * share:.2f}%</title></rect>"
            )
    parts.append(f'<text x="{left}" y="{top + cell * layers + 14}">experts 0..{experts - 1}</text>')
    return "\n".join([*parts, "</svg>"])


def _code_spans(text: str) -> str:
    """Escaped text with its `code` spans (the summary marks paths with backticks)."""
    pieces = _esc(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(pieces))


def _html_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="num">{_esc(_fmt(v))}</td>'
            if isinstance(v, (int, float)) or v is None
            else f"<td>{_esc(v)}</td>"
            for v in row
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _figure(svg: str, caption: str) -> str:
    return f"<figure>{svg}<figcaption>{_esc(caption)}</figcaption></figure>"


def page(result: Mapping[str, Any]) -> str:
    """inspect.html: the summary, the plots (drift per layer, usage per expert, the change by
    part as bars) and the tables of inspect.md."""
    layers = result["drift"]["layers"]
    labels = [str(r["layer"]) for r in layers]
    body = [
        "<h1>rpb inspect</h1>",
        *(f"<p>{_code_spans(line)}</p>" for line in _summary_lines(result) if line),
        "<h2>Routing drift per MoE layer</h2>",
        _figure(
            bar_chart(
                labels,
                {
                    "1 - top-k overlap": [1 - r["topk_overlap"] for r in layers],
                    "KL(base||tuned)": [r["kl_to_base"] for r in layers],
                    "router weight change": [r["router_weight_change"] for r in layers],
                },
                title="drift per MoE layer (0: the base's routing)",
            ),
            "Per MoE layer: the share of top-k choices that differ from the base router's on the "
            "tuned model's hidden states, KL of the routing distributions (nats) and the router "
            "weight's relative change ||W - W0|| / ||W0||.",
        ),
    ]
    if "community_nmi" in layers[0]:
        body.append(
            _figure(
                bar_chart(
                    labels,
                    {
                        "community NMI": [r["community_nmi"] for r in layers],
                        "co-activation cosine": [r["coact_cosine"] for r in layers],
                    },
                    title="co-activation structure kept (1: the base's)",
                ),
                "NMI of the tuned and base co-activation communities (Louvain) and the cosine of "
                "their co-activation counts, per MoE layer.",
            )
        )
    columns = _drift_columns(layers)
    body.append(
        _html_table([DRIFT_COLUMNS[c] for c in columns], [[r[c] for c in columns] for r in layers])
    )
    body += [
        "<h2>Expert usage</h2>",
        _figure(
            usage_heatmap(result["usage"]["base"], "base: usage share per expert")
            + usage_heatmap(result["usage"]["tuned"], "tuned: usage share per expert"),
            "Share of top-k selections each expert receives over --data, per MoE layer (rows), "
            "against the uniform share 1/E: blue below it, red above (4x saturates), grey for a "
            "dead expert; hover a cell for its share.",
        ),
    ]
    dec = result["decomposition"]
    if dec is None:
        body.append("<h2>The change by part</h2><p>No --eval files: not priced by part.</p>")
    else:
        names = list(dec["factors"])
        domains = list(dec["effects"])
        body += [
            "<h2>The change by part</h2>",
            *(f"<p>{_esc(line)}</p>" for line in _factor_lines(dec)),
            f"<p>Bars: {_esc(METRICS[PLOT_METRIC])}: each factor's Shapley value (they add up to "
            "the total change) and its put-back effect (putting the base's part back into the "
            "tuned model), per --eval domain.</p>",
            _figure(
                bar_chart(
                    domains,
                    {
                        "total": [dec["effects"][d][PLOT_METRIC]["total"] for d in domains],
                        **{
                            f"Shapley {f}": [
                                dec["effects"][d][PLOT_METRIC][f"shapley_{f}"] for d in domains
                            ]
                            for f in names
                        },
                    },
                    title=f"change tuned - base by part ({PLOT_METRIC})",
                ),
                "The total change and its split into the factors' Shapley values.",
            ),
            _figure(
                bar_chart(
                    domains,
                    {
                        f"put back {f}": [
                            dec["effects"][d][PLOT_METRIC][f"put_back_{f}"] for d in domains
                        ]
                        for f in names
                    },
                    title=f"putting the base's part back into the tuned model ({PLOT_METRIC})",
                ),
                "v(tuned with the base's part) - v(tuned): what putting each part back undoes.",
            ),
        ]
        for domain in domains:
            body.append(f"<h3>{_esc(domain)}</h3>")
            body.append(
                _html_table(
                    ["cell", *METRICS],
                    [[c, *(dec["scores"][c][domain][m] for m in METRICS)] for c in dec["cells"]],
                )
            )
            per_metric = dec["effects"][domain]
            body.append(_html_table(["effect", *per_metric], decomposition_rows(per_metric)))
    inputs = result["inputs"]
    provenance = [
        ["rpb", result["rpb_version"]],
        ["--data sha256", inputs["data"]["sha256"]],
        *(["--eval " + e["domain"] + " sha256", e["sha256"]] for e in inputs["eval"]),
    ]
    body += ["<h2>Inputs</h2>", _html_table(["what", "value"], provenance),
             "<p>Every number and every file's sha256: inspect.json.</p>"]  # fmt: skip
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>rpb inspect</title>{STYLE}</head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


# --- the command line -------------------------------------------------------------------------

EPILOG = """\
example:
  rpb inspect --base ./Qwen3-30B-A3B --tuned ./qwen3-sft --data probe.jsonl \\
      --eval math.jsonl --eval code.jsonl --out ./inspect

--data: {"text": ...} or {"prompt": ..., "completion": ...} lines, the texts routing drift is
measured on. --eval: {"prompt": ..., "completion": ...} lines, one file per domain; each is
scored on base, tuned and every swap cell, and the change split by part. OUT receives
inspect.json, inspect.md and inspect.html (docs/library.md, "Inspecting a fine-tune").
"""


def add_inspect(sub: Any) -> argparse.ArgumentParser:
    """Register `rpb inspect` on the `rpb` subparsers `sub`; return its parser."""
    p = sub.add_parser(
        "inspect",
        help="how far a fine-tune's routing moved from its base, and what each part carries",
        description="Routing drift of a fine-tuned MoE checkpoint against its base over a JSONL\n"
        "file, and with --eval its change per domain split by part (routers, routed experts,\n"
        "trunk) by the factorial part swap; writes inspect.json, inspect.md and inspect.html.",
        epilog=EPILOG,
        # Each default is in its flag's help (%(default)s), so the plain formatter serves.
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(func=cmd_inspect)
    p.add_argument("--base", type=Path, required=True, metavar="DIR", help="the base checkpoint")
    p.add_argument(
        "--tuned", type=Path, required=True, metavar="DIR", help="its fine-tuned checkpoint"
    )
    p.add_argument(
        "--data", type=Path, required=True, metavar="FILE", help="JSONL texts to measure drift on"
    )
    p.add_argument(
        "--eval",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="prompt/completion JSONL of one domain (repeatable)",
    )
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="folder for the outputs")
    p.add_argument(
        "--parts",
        type=parse_parts,
        default="routers,experts,trunk",
        metavar="LIST",
        help="the factors of the swap: routers (against the rest) or routers,experts,trunk "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--device", default="auto", help="torch device (default: %(default)s, cuda if available)"
    )
    p.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="(default: %(default)s, as saved)"
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=8,
        metavar="N",
        help="examples per forward (default: %(default)s)",
    )
    p.add_argument(
        "--max-length",
        type=int,
        default=1024,
        metavar="N",
        help="tokens per example, the last kept (default: %(default)s)",
    )
    return p


def cmd_inspect(args: argparse.Namespace) -> None:
    """`rpb inspect`: inspect_models with the flags."""
    for flag in ("batch_size", "max_length"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 1")
    flags = ("parts", "device", "dtype", "batch_size", "max_length")
    settings = {flag: getattr(args, flag) for flag in flags}
    inspect_models(args.base, args.tuned, args.data, args.out, evals=args.eval, **settings)
    log.info("rpb inspect: wrote %s in %s", ", ".join(OUT_FILES), args.out)
