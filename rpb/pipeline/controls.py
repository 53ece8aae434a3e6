"""Controls for the claims audit: a base router prior with its experts permuted per layer.

The permuted prior has the base router's exact weights, correction bias, usage histogram and
co-activation counts, but expert i of every layer gets the router row (and statistics) of another
expert: RPB trained with it pulls tokens toward experts that never learned them. If RPB's effect
comes from the base prior, RPB beats its permuted twin (claim P2, docs/claims.md).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from rpb.artifacts import write_text
from rpb.prior import RouterPrior

__all__ = ["derangement", "permute_prior", "write_permuted_prior"]


def derangement(n: int, generator: torch.Generator) -> torch.Tensor:
    """A uniformly random permutation of range(n) without fixed points (rejection sampling:
    about e draws), so every expert is pointed away from its own row. n >= 2."""
    if n < 2:
        raise ValueError(f"a permutation without fixed points needs >= 2 experts, got {n}")
    while True:
        perm = torch.randperm(n, generator=generator)
        if not (perm == torch.arange(n)).any():
            return perm


def permute_prior(prior: RouterPrior, seed: int = 0) -> tuple[RouterPrior, list[list[int]]]:
    """The prior with a fixed random expert permutation per layer applied to every per-expert
    tensor (router rows, correction bias, mean routing, usage, co-activation rows and columns):
    new expert i carries old expert perm[i]. Returns the permuted prior and the permutations."""
    gen = torch.Generator().manual_seed(seed)
    perms = [derangement(prior.num_experts, gen) for _ in range(prior.num_layers)]
    weights = [w[p].clone() for w, p in zip(prior.base_weights, perms, strict=True)]
    bias = None
    if prior.correction_bias is not None:
        bias = [b[p].clone() for b, p in zip(prior.correction_bias, perms, strict=True)]
    mean_probs = torch.stack([row[p] for row, p in zip(prior.mean_probs, perms, strict=True)])
    usage = torch.stack([row[p] for row, p in zip(prior.usage, perms, strict=True)])
    coact = torch.stack([c[p][:, p] for c, p in zip(prior.coactivation, perms, strict=True)])
    permuted = replace(
        prior,
        base_weights=weights,
        correction_bias=bias,
        mean_probs=mean_probs,
        usage=usage,
        coactivation=coact,
        source=None,
    )
    return permuted, [p.tolist() for p in perms]


def write_permuted_prior(prior_path: Path, out: Path, seed: int = 0) -> Path:
    """Load `prior_path`, permute it (`permute_prior`), save it to `out` with RouterPrior.save,
    and record the permutations beside it in `<out stem>.permutation.json`."""
    prior = RouterPrior.load(prior_path)
    permuted, perms = permute_prior(prior, seed)
    out = Path(out)
    permuted.save(out)
    record = {"source": str(prior_path), "seed": seed, "permutation_per_layer": perms}
    write_text(out.with_name(f"{out.stem}.permutation.json"), json.dumps(record, indent=2) + "\n")
    return out
