"""The router prior: what the base router is and how it routes the post-training corpus.

One inference pass over the corpus records, per MoE layer, the base router weight (and, where the
family has them, its correction bias and router logit bias), the mean routing distribution,
expert usage and co-activation counts. Saved as
one .safetensors file (tensors, with the metadata JSON in the safetensors header) plus a sidecar
.json for humans.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from tqdm.auto import tqdm

from rpb.artifacts import atomic_path, write_text
from rpb.coactivation import CoactivationCounter, usage_entropy
from rpb.routing import RouterControl, find_routers, routing_probs

__all__ = ["PRIOR_FORMAT", "RouterPrior", "extract_prior"]

PRIOR_FORMAT = "rpb.router_prior/1"
_META_KEY = "rpb_router_prior"
_META_FIELDS = (
    "model_id",
    "revision",
    "model_type",
    "corpus_hash",
    "n_tokens",
    "num_layers",
    "num_experts",
    "top_k",
    "hidden_size",
    "kind",
    "decoder_layers",
)


@dataclass
class RouterPrior:
    """Per-MoE-layer base routing facts (L layers, E experts, hidden size H)."""

    base_weights: list[Tensor]  # L x [E, H] float32
    correction_bias: list[Tensor] | None  # L x [E] float32 (DeepSeek-V3-style), else None
    mean_probs: Tensor  # [L, E] mean routing distribution over non-pad tokens
    usage: Tensor  # [L, E] int64 top-k selection counts
    coactivation: Tensor  # [L, E, E] int64, tokens selecting both i and j; diagonal = usage
    model_id: str
    revision: str
    model_type: str
    corpus_hash: str
    n_tokens: int
    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    kind: str
    decoder_layers: list[int] = field(default_factory=list)
    router_bias: list[Tensor] | None = None  # L x [E] float32: b in z = W h + b (gpt_oss)
    source: str | None = field(default=None, compare=False, repr=False)  # file it was loaded from

    def __post_init__(self) -> None:
        L, E, H = self.num_layers, self.num_experts, self.hidden_size
        problems = []
        if len(self.base_weights) != L:
            problems.append(f"{len(self.base_weights)} base weights for {L} layers")
        problems += [
            f"base_weights[{i}] shape {tuple(w.shape)} != {(E, H)}"
            for i, w in enumerate(self.base_weights)
            if tuple(w.shape) != (E, H)
        ]
        if self.correction_bias is not None and (
            len(self.correction_bias) != L or any(b.shape != (E,) for b in self.correction_bias)
        ):
            problems.append(f"correction_bias must be {L} tensors of shape ({E},)")
        if self.router_bias is not None and (
            len(self.router_bias) != L or any(b.shape != (E,) for b in self.router_bias)
        ):
            problems.append(f"router_bias must be {L} tensors of shape ({E},)")
        for name, shape in (
            ("mean_probs", (L, E)),
            ("usage", (L, E)),
            ("coactivation", (L, E, E)),
        ):
            if tuple(getattr(self, name).shape) != shape:
                problems.append(f"{name} shape {tuple(getattr(self, name).shape)} != {shape}")
        if problems:
            raise ValueError("inconsistent router prior: " + "; ".join(problems))

    @property
    def usage_probs(self) -> Tensor:
        """Usage as a distribution per layer [L, E] (sums to 1)."""
        u = self.usage.double()
        return (u / u.sum(-1, keepdim=True).clamp_min(1)).float()

    @property
    def meta(self) -> dict[str, Any]:
        """The metadata (format, provenance and shapes) stored in the file header and sidecar."""
        return {"format": PRIOR_FORMAT} | {k: getattr(self, k) for k in _META_FIELDS}

    def summary(self) -> dict[str, Any]:
        """How non-uniform the base routing is, per layer (for the sidecar and reports)."""
        probs = self.usage_probs
        return {
            "usage_entropy": [float(v) for v in usage_entropy(self.usage.numpy())],
            "max_usage_share": [float(v) for v in probs.max(-1).values],
            "min_usage_share": [float(v) for v in probs.min(-1).values],
        }

    def save(self, path: str | os.PathLike) -> Path:
        """Write `path` (.safetensors) and the sidecar `path.with_suffix(".json")` for humans."""
        path = Path(path)
        if path.suffix == ".json":
            raise ValueError(f"router prior path {path} must not end in .json (the sidecar's)")
        tensors = {"mean_probs": self.mean_probs, "usage": self.usage}
        tensors["coactivation"] = self.coactivation
        for i, w in enumerate(self.base_weights):
            tensors[f"base_weight.{i}"] = w
        for i, b in enumerate(self.correction_bias or []):
            tensors[f"correction_bias.{i}"] = b
        for i, b in enumerate(self.router_bias or []):
            tensors[f"router_bias.{i}"] = b
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        # Atomic and recorded (rpb.artifacts): a killed job or a full disk never leaves a
        # half-written prior behind, and a prior damaged later stops the next invocation.
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata={_META_KEY: json.dumps(self.meta)})
        sidecar = self.meta | {"summary": self.summary()}
        write_text(path.with_suffix(".json"), json.dumps(sidecar, indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> RouterPrior:
        """Read a prior written by `save`; a corrupt or foreign file raises ValueError naming it."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"router prior file not found: {path}")
        try:
            with safe_open(str(path), framework="pt") as f:
                raw = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise ValueError(f"corrupt or unreadable router prior file {path}: {e}") from e
        if _META_KEY not in raw:
            raise ValueError(f"{path} is not an rpb router prior (no '{_META_KEY}' metadata)")
        # A NaN or inf prior (a diverged base, a damaged file) would train experts that never
        # get selected again: refused here, before any job uses it.
        for name, tensor in tensors.items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                bad = int((~torch.isfinite(tensor)).sum())
                raise ValueError(
                    f"router prior file {path}: {name} holds {bad} non-finite value(s) (NaN or "
                    f"inf) of {tensor.numel()}: extract the prior again from a healthy model"
                )
        try:
            meta = json.loads(raw[_META_KEY])
            if meta.pop("format", None) != PRIOR_FORMAT:
                raise ValueError(f"unsupported format (expected {PRIOR_FORMAT})")
            n = meta["num_layers"]
            has_bias = "correction_bias.0" in tensors
            return cls(
                base_weights=[tensors[f"base_weight.{i}"] for i in range(n)],
                correction_bias=[tensors[f"correction_bias.{i}"] for i in range(n)]
                if has_bias
                else None,
                router_bias=[tensors[f"router_bias.{i}"] for i in range(n)]
                if "router_bias.0" in tensors
                else None,
                mean_probs=tensors["mean_probs"],
                usage=tensors["usage"],
                coactivation=tensors["coactivation"],
                **{k: meta[k] for k in _META_FIELDS},
                source=str(path),
            )
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"corrupt router prior file {path}: {e}") from e

    def check_compatible(self, model: nn.Module) -> None:
        """Raise a one-line ValueError naming every way `model` differs from this prior's base."""
        handles = find_routers(model)
        h = handles[0]
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        pairs = [
            ("model_type", self.model_type, model_type),
            ("MoE layers", self.num_layers, len(handles)),
            ("experts", self.num_experts, h.num_experts),
            ("top_k", self.top_k, h.top_k),
            ("hidden size", self.hidden_size, h.hidden_size),
            ("routing kind", self.kind, h.kind),
            ("router logit bias", self.router_bias is not None, h.router_bias is not None),
        ]
        bad = [
            f"{name} {ours!r} (prior) vs {theirs!r} (model)"
            for name, ours, theirs in pairs
            if ours != theirs
        ]
        if bad:
            raise ValueError(
                f"router prior {self.source or ''} of {self.model_id} does not match the model: "
                + "; ".join(bad)
            )


def _model_provenance(model: nn.Module) -> tuple[str, str]:
    """(model_id, revision) of a model that was given none: the folder or hub id it was loaded
    from (its config's `_name_or_path`), else its class; the hub commit it was loaded at, else
    "local"."""
    config = getattr(model, "config", None)
    name = str(getattr(config, "_name_or_path", "") or "")
    commit = getattr(config, "_commit_hash", None)
    return name or type(model).__name__, str(commit) if commit else "local"


def _update_corpus_hash(digest: Any, input_ids: Tensor, mask: Tensor | None) -> None:
    """Add one batch's non-padding token ids (row by row) to `digest`: the same texts give the
    same hash however they were padded."""
    ids = input_ids.detach().to("cpu", torch.int64)
    keep = mask.detach().cpu().bool() if mask is not None else torch.ones_like(ids).bool()
    width = ids.shape[-1]
    for row, row_mask in zip(ids.reshape(-1, width), keep.reshape(-1, width), strict=True):
        tokens = row[row_mask].numpy().tobytes()
        digest.update(len(tokens).to_bytes(8, "little") + tokens)


def extract_prior(
    model: nn.Module,
    batches: Iterable[Mapping[str, Tensor]],
    *,
    model_id: str | None = None,
    revision: str | None = None,
    corpus_hash: str | None = None,
    progress: bool = True,
) -> RouterPrior:
    """One no-grad pass of `model` (eval mode) over `batches` of input_ids [+ attention_mask];
    padding tokens (mask 0) are not counted.

    Provenance not given is filled in: `model_id` from the folder or hub id the model was loaded
    from (`config._name_or_path`, else the model's class), `revision` from the hub commit it was
    loaded at (else "local"), `corpus_hash` as "tokens-sha256:" + the sha256 of the batches'
    non-padding token ids (a file's own hash, as the pipeline passes, names the corpus better)."""
    if model_id is None or revision is None:
        found_id, found_revision = _model_provenance(model)
        model_id = found_id if model_id is None else model_id
        revision = found_revision if revision is None else revision
    digest = hashlib.sha256() if corpus_hash is None else None
    handles = find_routers(model)
    first = handles[0]
    for h in handles[1:]:
        if (h.num_experts, h.top_k, h.hidden_size, h.kind) != (
            first.num_experts,
            first.top_k,
            first.hidden_size,
            first.kind,
        ):
            raise ValueError(f"router {h.name} differs in shape or kind from {first.name}")
    n_layers, n_experts = len(handles), first.num_experts
    counter = CoactivationCounter(n_layers, n_experts)
    prob_sums = torch.zeros(n_layers, n_experts, dtype=torch.float64)
    n_tokens = 0
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with RouterControl(model) as control, torch.no_grad():
            total = len(batches) if hasattr(batches, "__len__") else None
            for batch in tqdm(batches, total=total, desc="router prior", disable=not progress):
                if "input_ids" not in batch:
                    raise ValueError("every prior batch needs 'input_ids'")
                input_ids = batch["input_ids"].to(device)
                mask = batch.get("attention_mask")
                mask = mask.to(device) if mask is not None else None
                if digest is not None:
                    _update_corpus_hash(digest, batch["input_ids"], batch.get("attention_mask"))
                control.clear_records()
                model(input_ids=input_ids, attention_mask=mask)
                flat = mask.reshape(-1).bool() if mask is not None else None
                for i, rec in enumerate(control.records):
                    if rec is None:
                        raise RuntimeError(f"router {handles[i].name} did not run in the forward")
                    probs = routing_probs(first.kind, rec.logits)
                    if flat is not None:  # layers may sit on other GPUs (device_map="auto")
                        probs = probs[flat.to(probs.device)]
                    prob_sums[i] += probs.sum(0).double().cpu()
                    counter.update(i, rec.indices, mask=flat)
                n_tokens += int(flat.sum()) if flat is not None else input_ids.numel()
    finally:
        model.train(was_training)
    if n_tokens == 0:
        raise ValueError("router prior extraction saw no (non-padding) tokens")
    if digest is not None:
        corpus_hash = f"tokens-sha256:{digest.hexdigest()}"

    def stored(tensors: list[Tensor | None]) -> list[Tensor] | None:
        if any(t is None for t in tensors):
            return None
        return [t.detach().float().cpu().reshape(-1).clone() for t in tensors]

    return RouterPrior(
        base_weights=[h.weight.detach().float().cpu().clone() for h in handles],
        correction_bias=stored([h.correction_bias for h in handles]),
        router_bias=stored([h.router_bias for h in handles]),
        mean_probs=(prob_sums / n_tokens).float(),
        usage=counter.usage,
        coactivation=counter.counts.clone(),
        model_id=model_id,
        revision=revision,
        model_type=str(getattr(getattr(model, "config", None), "model_type", "")),
        corpus_hash=corpus_hash,
        n_tokens=n_tokens,
        num_layers=n_layers,
        num_experts=n_experts,
        top_k=first.top_k,
        hidden_size=first.hidden_size,
        kind=first.kind,
        decoder_layers=[h.decoder_layer for h in handles],
    )
