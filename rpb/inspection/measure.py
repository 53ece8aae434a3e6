"""`rpb inspect`'s measurements: its inputs checked, routing drift per layer, and every cell of the
factorial part swap scored and decomposed (rpb.inspection's docstring says what each is)."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rpb.artifacts import sha256_of
from rpb.inspection.outputs import METRICS, write_outputs
from rpb.router_swap import PARTS, cells, decompose, factors

if TYPE_CHECKING:
    from torch import nn

    from rpb.prior import RouterPrior

log = logging.getLogger(__name__)

FORMAT = "rpb.inspect/1"
OUT_FILES = ("inspect.json", "inspect.md", "inspect.html")
# An expert is overloaded when it takes more than this many times the uniform share (1/E).
OVERLOAD_FACTOR = 2.0
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


def folder_digests(folder: Path) -> dict[str, str]:
    """sha256 of each file of a checkpoint folder (config, weights, tokenizer, eval routing)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return {p.relative_to(folder).as_posix(): sha256_of(p) for p in files}


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
    data_sha = sha256_of(data)

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
                    "sha256": sha256_of(path),
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
