"""Expert co-activation analysis: streaming counts of experts chosen together, and the metrics on
them (usage entropy, Louvain communities, modularity, partition retention, routing drift).

Counts are per layer E x E: entry (i, j), i != j, is the number of tokens whose top-k contains
both i and j (all pairs, not adjacent ranks); the diagonal is each expert's usage count.

Counting, usage entropy, top-k overlap and KL need only torch and numpy (the core library); the
community metrics (Louvain partitions, modularity, NMI/ARI and what builds on them) need the
`rpb[analysis]` extra (networkx, scikit-learn), imported on first use.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rpb.specs import install_hint

if TYPE_CHECKING:
    import networkx as nx

__all__ = [
    "CoactivationCounter",
    "coactivation_cosine",
    "communities",
    "mean_kl",
    "modularity",
    "partition_ari",
    "partition_nmi",
    "split_half_stability",
    "summarize_layers",
    "topk_overlap",
    "uniform_baseline",
    "usage_entropy",
]

# Tokens per bincount call. Measured (bench/coactivation_throughput.py): the pair-id buffer of a
# 4096-token chunk (4096*k*k int64) stays in cache, which at E=128, k=8 is ~3x faster than one
# bincount over a 64k-token batch.
_CHUNK_TOKENS = 4096


class CoactivationCounter:
    """Streaming per-layer co-activation counts over a probe set.

    ``counts`` is int64 ``[L, E, E]``, symmetric, diagonal = usage counts; ``n_tokens`` is int64
    ``[L]``. Memory is O(L E^2); a batch is counted in fixed-size chunks via ``torch.bincount``
    over pair ids (faster than the multi-hot ``M^T M`` product at E=128, k=8; see the bench).
    """

    def __init__(self, n_layers: int, n_experts: int) -> None:
        if n_layers < 1 or n_experts < 1:
            raise ValueError(f"n_layers and n_experts must be >= 1, got {n_layers}, {n_experts}")
        self.n_layers = int(n_layers)
        self.n_experts = int(n_experts)
        self.counts = torch.zeros(self.n_layers, self.n_experts, self.n_experts, dtype=torch.int64)
        self.n_tokens = torch.zeros(self.n_layers, dtype=torch.int64)

    @property
    def usage(self) -> torch.Tensor:
        """Per-layer expert usage counts ``[L, E]`` (the diagonal of ``counts``)."""
        return self.counts.diagonal(dim1=1, dim2=2).clone()

    def update(
        self, layer: int, top_k_indices: torch.Tensor, mask: torch.Tensor | None = None
    ) -> None:
        """Count one batch of routing decisions ``[..., k]`` for ``layer``.

        ``mask`` (shape ``[...]``, False = padding) drops tokens. Works on any device; only the
        E x E result of each batch is moved to the CPU state.
        """
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.n_layers})")
        idx = torch.as_tensor(top_k_indices)
        if idx.dim() < 1 or idx.dtype.is_floating_point or idx.dtype == torch.bool:
            raise ValueError(
                "top_k_indices must be an integer tensor [..., k], "
                f"got {idx.dtype} {tuple(idx.shape)}"
            )
        k = idx.shape[-1]
        idx = idx.reshape(-1, k)
        if mask is not None:
            mask = torch.as_tensor(mask, device=idx.device)
            if mask.dtype != torch.bool or mask.numel() != idx.shape[0]:
                raise ValueError(
                    f"mask must be bool with one entry per token ({idx.shape[0]}), "
                    f"got {mask.dtype} {tuple(mask.shape)}"
                )
            idx = idx[mask.reshape(-1)]
        n = idx.shape[0]
        if n == 0:
            return
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= self.n_experts:
            raise ValueError(f"expert index out of range [0, {self.n_experts}): min {lo}, max {hi}")
        e = self.n_experts
        idx = idx.long()
        total = torch.zeros(e * e, dtype=torch.int64, device=idx.device)
        for chunk in idx.split(_CHUNK_TOKENS):
            pair_ids = (chunk.unsqueeze(2) * e + chunk.unsqueeze(1)).reshape(-1)
            total += torch.bincount(pair_ids, minlength=e * e)
        total = total.view(e, e).cpu()
        # A token listing an expert twice adds m^2 > m to the trace, so this exact check is free.
        if int(total.trace()) != n * k:
            raise ValueError("top_k_indices has a token that selects the same expert twice")
        self.counts[layer] += total
        self.n_tokens[layer] += n

    def merge(self, other: CoactivationCounter) -> CoactivationCounter:
        """Add another counter's counts (e.g. from another shard) in place; returns self."""
        if other.counts.shape != self.counts.shape:
            raise ValueError(
                f"cannot merge counters of shape {tuple(other.counts.shape)} "
                f"into {tuple(self.counts.shape)}"
            )
        self.counts += other.counts
        self.n_tokens += other.n_tokens
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Plain tensors (safetensors-compatible)."""
        return {"counts": self.counts.clone(), "n_tokens": self.n_tokens.clone()}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, torch.Tensor]) -> CoactivationCounter:
        """Inverse of :meth:`state_dict`."""
        missing = {"counts", "n_tokens"} - set(state)
        if missing:
            raise ValueError(f"state dict lacks {sorted(missing)}")
        counts = torch.as_tensor(state["counts"]).to(torch.int64)
        n_tokens = torch.as_tensor(state["n_tokens"]).to(torch.int64)
        if counts.dim() != 3 or counts.shape[1] != counts.shape[2]:
            raise ValueError(f"counts must be [L, E, E], got {tuple(counts.shape)}")
        if n_tokens.shape != (counts.shape[0],):
            raise ValueError(f"n_tokens must be [{counts.shape[0]}], got {tuple(n_tokens.shape)}")
        out = cls(counts.shape[0], counts.shape[1])
        out.counts.copy_(counts)
        out.n_tokens.copy_(n_tokens)
        return out


# ---------------------------------------------------------------- metrics on one layer's counts


def _analysis_module(name: str) -> ModuleType:
    """`networkx` or `sklearn.metrics`, imported on first use: community detection and partition
    scores are the `analysis` extra, so the core library (`pip install .`) and every
    `import rpb.*` of it load neither (scikit-learn alone brings scipy, ~100 MB)."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ImportError(
            f"rpb.coactivation's community metrics need {name.split('.')[0]}: "
            f"{install_hint('analysis')}"
        ) from err


# log of each positive probability by the C library's log, the one scipy.special.entr uses:
# numpy's vectorised np.log can differ in the last bit, and usage entropies were scipy's.
_c_log = np.frompyfunc(math.log, 1, 1)


def _entropy_nats(u: np.ndarray) -> np.ndarray:
    """scipy.stats.entropy(u, axis=-1), bit for bit, without scipy: the rows normalised to sum
    to one, then the sum of -p log p (0 where p is 0)."""
    p = 1.0 * u / np.sum(u, axis=-1, keepdims=True)
    positive = p > 0
    log_p = np.zeros_like(p)
    log_p[positive] = _c_log(p[positive]).astype(np.float64)
    return np.sum(np.where(positive, -p * log_p, 0.0), axis=-1)


def _square(coact: Any, name: str = "coact") -> np.ndarray:
    a = np.asarray(coact, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"{name} must be a square [E, E] matrix, got shape {a.shape}")
    if not np.allclose(a, a.T):
        raise ValueError(f"{name} is not symmetric")
    if (a < 0).any():
        raise ValueError(f"{name} has negative entries")
    return a


def _graph(coact: np.ndarray) -> nx.Graph:
    # Off-diagonal only: usage on the diagonal would become self-loops and dominate modularity.
    off = coact.copy()
    np.fill_diagonal(off, 0.0)
    return _analysis_module("networkx").from_numpy_array(off)


def usage_entropy(usage: Any, normalized: bool = True) -> float | np.ndarray:
    """Shannon entropy (nats) of usage counts ``[..., E]``; divided by log E if ``normalized``."""
    u = np.asarray(usage, dtype=np.float64)
    if u.ndim < 1 or u.shape[-1] < 2:
        raise ValueError(f"usage must be [..., E] with E >= 2, got shape {u.shape}")
    if (u < 0).any() or (u.sum(axis=-1) <= 0).any():
        raise ValueError("usage must be non-negative with a positive total")
    h = _entropy_nats(u)
    if normalized:
        h = h / math.log(u.shape[-1])
    return float(h) if np.ndim(h) == 0 else h


def communities(coact: Any, seed: int = 0, resolution: float = 1.0) -> np.ndarray:
    """Louvain partition of the off-diagonal co-activation graph -> int labels ``[E]``.

    Deterministic for a fixed seed. Labels are canonical (numbered by each community's lowest
    expert), so equal partitions give equal arrays. Isolated experts form singleton communities.
    """
    a = _square(coact)
    nx = _analysis_module("networkx")
    parts = nx.community.louvain_communities(
        _graph(a), weight="weight", resolution=resolution, seed=seed
    )
    labels = np.empty(a.shape[0], dtype=np.int64)
    for label, members in enumerate(sorted(parts, key=min)):
        labels[list(members)] = label
    return labels


def modularity(coact: Any, labels: Any, resolution: float = 1.0) -> float:
    """Weighted modularity of a partition of the off-diagonal graph (NaN if it has no edges)."""
    a = _square(coact)
    lab = np.asarray(labels)
    if lab.shape != (a.shape[0],):
        raise ValueError(f"labels must have shape ({a.shape[0]},), got {lab.shape}")
    g = _graph(a)
    if g.size(weight="weight") == 0:
        return float("nan")
    parts = [set(np.flatnonzero(lab == c).tolist()) for c in np.unique(lab)]
    nx = _analysis_module("networkx")
    return float(nx.community.modularity(g, parts, weight="weight", resolution=resolution))


def _check_pair(a: Any, b: Any) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"partitions must be 1-D of equal length, got {a.shape} and {b.shape}")
    return a, b


def partition_nmi(a: Any, b: Any) -> float:
    """Normalised mutual information between two label arrays (1 = same partition)."""
    a, b = _check_pair(a, b)
    return float(_analysis_module("sklearn.metrics").normalized_mutual_info_score(a, b))


def partition_ari(a: Any, b: Any) -> float:
    """Adjusted Rand index between two label arrays (1 = same, ~0 = chance)."""
    a, b = _check_pair(a, b)
    return float(_analysis_module("sklearn.metrics").adjusted_rand_score(a, b))


def coactivation_cosine(a: Any, b: Any) -> float:
    """Cosine similarity of the off-diagonal upper triangles of two co-activation matrices.

    Unlike NMI/ARI it needs no partition, so it stays meaningful when communities are unstable.
    NaN if either matrix has no off-diagonal weight.
    """
    a, b = _square(a, "a"), _square(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    iu = np.triu_indices(a.shape[0], k=1)
    x, y = a[iu], b[iu]
    denom = np.linalg.norm(x) * np.linalg.norm(y)
    return float(x @ y / denom) if denom > 0 else float("nan")


def split_half_stability(
    coact_a: Any, coact_b: Any, seed: int = 0, resolution: float = 1.0
) -> float:
    """Community stability: NMI between Louvain partitions of two disjoint probe halves.

    Count the halves with two counters (e.g. alternate sequences via ``update(..., mask=...)``);
    split by interleaving rather than first/second half, since probe sets are often ordered by
    domain. NaN when neither half shows any structure (both one community): sklearn would call
    that a perfect 1.0, which reads as stability where there is nothing to be stable.
    """
    a = communities(coact_a, seed, resolution)
    b = communities(coact_b, seed, resolution)
    if a.max() == 0 and b.max() == 0:
        return float("nan")
    return partition_nmi(a, b)


def uniform_baseline(
    n_experts: int, k: int, n_tokens: int, seed: int = 0, resolution: float = 1.0
) -> dict[str, float]:
    """Metrics of uniformly random top-k routing with the same E, k and token count.

    Louvain finds some "communities" in pure sampling noise; this is the chance level a base
    router's modularity and split-half NMI must be read against. Returns usage_entropy,
    modularity and split_half_nmi (halves interleaved token by token).
    """
    if not 1 <= k <= n_experts or n_tokens < 2:
        raise ValueError(f"need 1 <= k <= n_experts and n_tokens >= 2, got {k=}, {n_experts=}")
    gen = torch.Generator().manual_seed(seed)
    # Layers 0 and 1 of one counter serve as the two halves.
    counter = CoactivationCounter(2, n_experts)
    done = 0
    while done < n_tokens:
        t = min(65536, n_tokens - done)
        # Top-k of i.i.d. uniform scores is a uniformly random k-subset.
        idx = torch.rand(t, n_experts, generator=gen).topk(k, dim=1).indices
        half = (torch.arange(done, done + t) % 2).bool()
        counter.update(0, idx, ~half)
        counter.update(1, idx, half)
        done += t
    total = counter.counts.sum(0).numpy()
    halves = counter.counts.numpy()
    return {
        "usage_entropy": usage_entropy(np.diag(total)),
        "modularity": modularity(total, communities(total, seed, resolution)),
        "split_half_nmi": split_half_stability(halves[0], halves[1], seed, resolution),
    }


# ---------------------------------------------------------------- per-token routing drift


def topk_overlap(idx_a: Any, idx_b: Any, mask: Any = None) -> float:
    """Mean over tokens of |A ∩ B| / k for two top-k index sets ``[..., k]``."""
    a = torch.as_tensor(idx_a)
    b = torch.as_tensor(idx_b, device=a.device)
    if a.shape != b.shape or a.dim() < 1:
        raise ValueError(f"index shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    k = a.shape[-1]
    a, b = a.reshape(-1, k), b.reshape(-1, k)
    if mask is not None:
        m = torch.as_tensor(mask, device=a.device).reshape(-1).bool()
        a, b = a[m], b[m]
    if a.shape[0] == 0:
        raise ValueError("topk_overlap got no tokens")
    shared = (a.unsqueeze(2) == b.unsqueeze(1)).any(dim=2).sum(dim=1)
    return float(shared.double().mean() / k)


def mean_kl(p_ref: Any, p: Any, mask: Any = None, eps: float = 1e-12) -> float:
    """Per-token mean of KL(p_ref || p) for routing distributions ``[..., E]`` (nats).

    Zero entries of ``p_ref`` contribute nothing; ``p`` is clamped at ``eps`` so a zero where
    ``p_ref`` has mass gives a large finite value instead of inf.
    """
    q, r = torch.as_tensor(p_ref), torch.as_tensor(p)
    if q.shape != r.shape or q.dim() < 1:
        raise ValueError(f"distribution shapes differ: {tuple(q.shape)} vs {tuple(r.shape)}")
    q = q.reshape(-1, q.shape[-1]).double()
    r = r.to(q.device).reshape(-1, q.shape[-1]).double()
    if mask is not None:
        m = torch.as_tensor(mask, device=q.device).reshape(-1).bool()
        q, r = q[m], r[m]
    if q.shape[0] == 0:
        raise ValueError("mean_kl got no tokens")
    kl = (torch.special.xlogy(q, q) - torch.special.xlogy(q, r.clamp_min(eps))).sum(dim=1)
    return float(kl.mean())


# ---------------------------------------------------------------- per-layer summary


def summarize_layers(
    counts_live: Any, counts_ref: Any = None, seed: int = 0, resolution: float = 1.0
) -> list[dict[str, Any]]:
    """Per-layer structure metrics of ``counts_live [L, E, E]``, optionally against a reference.

    Each row: layer, usage_entropy (normalised), n_communities, modularity (of the layer's own
    Louvain partition); with ``counts_ref`` also community_nmi / community_ari (live vs reference
    partition), ref_partition_modularity (live graph scored under the reference partition: how
    much of the base's structure survives, without re-clustering noise) and coact_cosine. A final
    row with layer="mean" averages every metric over layers (ignoring NaN). NMI/ARI are NaN for
    a layer whose reference partition is a single community.
    """
    nan = float("nan")
    live = np.asarray(counts_live, dtype=np.float64)
    if live.ndim != 3 or live.shape[1] != live.shape[2]:
        raise ValueError(f"counts_live must be [L, E, E], got shape {live.shape}")
    ref = None if counts_ref is None else np.asarray(counts_ref, dtype=np.float64)
    if ref is not None and ref.shape != live.shape:
        raise ValueError(f"counts_ref shape {ref.shape} differs from counts_live {live.shape}")
    rows: list[dict[str, Any]] = []
    for layer in range(live.shape[0]):
        c = live[layer]
        labels = communities(c, seed, resolution)
        row: dict[str, Any] = {
            "layer": layer,
            "usage_entropy": usage_entropy(np.diag(c)),
            "n_communities": int(labels.max() + 1),
            "modularity": modularity(c, labels, resolution),
        }
        if ref is not None:
            ref_labels = communities(ref[layer], seed, resolution)
            # A reference with a single community has no structure to retain.
            trivial = ref_labels.max() == 0
            row |= {
                "community_nmi": nan if trivial else partition_nmi(labels, ref_labels),
                "community_ari": nan if trivial else partition_ari(labels, ref_labels),
                "ref_partition_modularity": modularity(c, ref_labels, resolution),
                "coact_cosine": coactivation_cosine(c, ref[layer]),
            }
        rows.append(row)
    keys = [k for k in rows[0] if k != "layer"]
    rows.append({"layer": "mean"} | {k: _nanmean([r[k] for r in rows]) for k in keys})
    return rows


def _nanmean(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return float(np.mean(finite)) if finite else float("nan")
