"""Synthetic pipeline outputs for the table, claims and run-record tests: eval and analysis
JSONs and co-activation counts laid out as the pipeline writes them (rpb.specs.PATHS); and the
router-swap factorial's planted scores with their Shapley values by definition, shared by the
decomposition's tests and the router-swap table's (tests/test_router_swap.py,
tests/test_router_swap_table.py)."""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from rpb.router_swap import PARTS
from rpb.specs import Run, results_path, run_names, runs_on, torch_seed


def run_names_on(seeds: tuple[int, ...] | list[int], bases: int = 1) -> list[str]:
    """A report spec's `runs`: `seeds` on each of `bases` bases, by name."""
    return run_names(runs_on(bases, seeds))


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload))


N_ITEMS = 40
OOD_ALL = ["addition", "facts"]
# label -> (in-domain accuracy, OOD accuracy, community NMI) of a "paper-like" world. A level
# tuple may carry two more entries, the p(target) levels (in-domain, OOD) where they differ
# from exact match's (see `p_target_items`).
PAPER_WORLD = {
    "base": (0.0, 0.9, 1.0),
    "none": (0.30, 0.40, 0.20),
    "lbl": (0.35, 0.50, 0.30),
    "rpb": (0.80, 0.80, 0.70),
    "anchor_weight": (0.80, 0.80, 0.69),
    "anchor_logit": (0.80, 0.80, 0.68),
    "anchor_kl": (0.80, 0.80, 0.71),
    "hard": (0.10, 0.40, 0.95),
}


def _block_counts(tokens: int, structured: bool, seed: int = 0) -> np.ndarray:
    """[2 layers, 4 experts, 4 experts] counts of top-2 routing: experts {0,1} / {2,3} always
    together (structured) or every pair equally often (no structure at all). Token t selects
    pair (t + seed) mod the number of pairs."""
    return _block_counts_cached(tokens, structured, seed).copy()


@functools.cache
def _block_counts_cached(tokens: int, structured: bool, seed: int) -> np.ndarray:
    pairs = [(0, 1), (2, 3)] if structured else [(i, j) for i in range(4) for j in range(i + 1, 4)]
    # How many of the tokens select each pair.
    times = np.bincount((np.arange(tokens) + seed) % len(pairs), minlength=len(pairs))
    counts = np.zeros((4, 4))
    for (i, j), n in zip(pairs, times, strict=True):
        counts[[i, j, i, j], [j, i, i, j]] += n
    return np.stack([counts, counts])


@functools.cache
def _base_layers(tokens: int, structured: bool) -> list[dict[str, Any]]:
    """Per-layer rows of the base's analysis, as rpb.pipeline.analysis writes them."""
    from rpb.coactivation import communities, modularity, usage_entropy

    rows = []
    for layer, c in enumerate(_block_counts(tokens, structured)):
        labels = communities(c)
        rows.append(
            {
                "layer": layer,
                "usage_entropy": usage_entropy(np.diag(c)),
                "modularity": modularity(c, labels),
                "n_communities": int(labels.max() + 1),
            }
        )
    return rows


def p_target_items(u: np.ndarray, w: np.ndarray, level: float) -> np.ndarray:
    """Per-item p(target) of a run at p(target) `level`: 0.98 where the item's draw u is below
    the level ("known"), 0.02 otherwise, plus a per-item wobble in (-0.01, 0.01) from the draw w
    that every label of the seed shares. At the exact-match level it is an affine image of the
    exact-match items (0.02 + 0.96 x), so a paired p(target) difference is 0.96 times exact
    match's; at another level it moves on its own (a world where the two measures disagree)."""
    return 0.02 + 0.96 * (u < level) + 0.02 * (w - 0.5)


def write_run(
    root: Path,
    model: str,
    corpus: str,
    label: str,
    run: Run,
    levels: tuple[float, ...],
    *,
    ood: list[str] = OOD_ALL,
    n_items: int = N_ITEMS,
    structured_base: bool = True,
    routing: dict[str, float] | None = None,
) -> None:
    """One (model, corpus, label, run) as the pipeline lays it out: eval JSON with exact-match
    items (`rpb_<task>`) and their loglikelihood twins (`rpb_<task>_ll` with per-item
    `p_target`, as rpb.pipeline.evaluation writes them), analysis JSON with layer means (and, for
    the base, per-layer rows and the probe size) and co-activation counts. Items are coupled across
    labels (item i is right when a fixed per-run uniform draw is below the label's accuracy),
    so paired differences are clean. `levels`: (in-domain, OOD, NMI), and optionally the
    p(target) levels (in-domain, OOD), else exact match's (`p_target_items`). `routing`
    overrides layer-mean analysis entries (usage entropy, drift)."""
    p_in, p_ood, nmi = levels[:3]
    pt_in, pt_ood = levels[3:5] if len(levels) >= 5 else (p_in, p_ood)
    seed = torch_seed(run.base, run.seed)  # one number per run: its draws, jitter and routing
    rng = np.random.default_rng(1000 + seed)
    u, w = rng.random(n_items), rng.random(n_items)
    tasks = {corpus: ((u < p_in).astype(int).tolist(), p_target_items(u, w, pt_in))}
    tasks |= {t: ((u < p_ood).astype(int).tolist(), p_target_items(u, w, pt_ood)) for t in ood}
    fields = {"model": model, "corpus": corpus, "method": label, "run": run}
    payload: dict[str, Any] = {}
    for t, (em, p_target) in tasks.items():
        payload[f"rpb_{t}"] = {"items": em, "metric": "exact_match"}
        ll_sum = np.log(p_target)
        payload[f"rpb_{t}_ll"] = {
            "metric": "ll_per_token",
            "items": (ll_sum / 3).tolist(),  # three target tokens per item
            "ll_sum": ll_sum.tolist(),
            "p_target": p_target.tolist(),
            "p_target_mean": float(p_target.mean()),
        }
    write_json(root / results_path("eval", **fields), {"tasks": payload})
    jitter = 0.01 * seed
    tokens = 600
    base_counts = _block_counts(tokens, structured_base)
    layers = _base_layers(tokens, structured_base)
    mean = {
        "modularity": 0.3 + jitter,
        "community_nmi": nmi + jitter,
        "community_ari": nmi - 0.1 + jitter,
        "coact_cosine": 0.5 + nmi / 2,
        "kl_to_base": 1.0 - nmi,
        "topk_overlap_with_base": nmi,
        "usage_entropy": 0.9 + jitter,
    }
    mean |= routing or {}
    write_json(
        root / results_path("analysis", **fields),
        {"mean": mean, "layers": layers, "probe": {"tokens": tokens}},
    )
    counts = base_counts if label == "base" else _block_counts(tokens, False, seed)
    save_file(
        {
            "counts": torch.from_numpy(counts).long(),
            "base_counts": torch.from_numpy(base_counts).long(),
        },
        str(root / results_path("analysis_counts", **fields)),
    )


def write_world(
    root: Path,
    world: dict[str, tuple[float, ...]],
    *,
    models: tuple[str, ...] = ("tinyA", "tinyB"),
    corpora: tuple[str, ...] = ("math", "math2"),
    seeds: tuple[int, ...] = (0, 1),
    bases: int = 1,
    routing: dict[str, dict[str, float]] | None = None,
    **kwargs: Any,
) -> None:
    """Every label of `world` for every model, corpus and run (`seeds` on each of `bases` bases;
    the base label at each base's seed 0); `routing`: per label, analysis entries to override
    (see `write_run`)."""
    runs = runs_on(bases, seeds)
    for model in models:
        for corpus in corpora:
            for label, levels in world.items():
                for run in runs_on(bases, [0]) if label == "base" else runs:
                    extra = (routing or {}).get(label)
                    write_run(root, model, corpus, label, run, levels, routing=extra, **kwargs)


# --- the router-swap factorial, on planted scores ----------------------------------------------


def shapley_by_orders(v: dict[frozenset, float], names: list[str]) -> dict[str, float]:
    """Each factor's marginal contribution averaged over the k! orders of putting them in (the
    definition, independent of rpb.router_swap's formula)."""
    out = dict.fromkeys(names, 0.0)
    orders = list(itertools.permutations(names))
    for order in orders:
        have: frozenset = frozenset()
        for f in order:
            out[f] += (v[have | {f}] - v[have]) / len(orders)
            have = have | {f}
    return out


def planted_values(base: float, effects: dict[tuple[str, ...], float]) -> dict[frozenset, float]:
    """v(S) = base + the planted effects of every non-empty U in S: the effects are v's by
    construction."""
    return {
        frozenset(s): base + sum(e for u, e in effects.items() if set(u) <= set(s))
        for r in range(len(PARTS) + 1)
        for s in itertools.combinations(PARTS, r)
    }


R, E, T = PARTS
# Per metric: the base's score and the planted effects (exact match in steps of 12.5 points, the
# resolution of 8 items; p(target) as a fraction).
PLANTED = {
    "exact_match": (
        100.0,
        {(R,): -12.5, (E,): -25.0, (T,): -12.5, (R, E): 12.5, (R, T): 0, (E, T): 0, (R, E, T): 0},
    ),
    "p_target": (
        0.8,
        {
            (R,): -0.05,
            (E,): -0.2,
            (T,): -0.1,
            (R, E): 0.03,
            (R, T): 0.0,
            (E, T): 0.02,
            (R, E, T): -0.01,
        },
    ),
}
