"""Statistics helpers for the tables: bootstrap confidence intervals over seeds and items."""

from __future__ import annotations

import numpy as np

DEFAULT_RESAMPLES = 2000


def two_way_bootstrap_ci(
    scores: np.ndarray,
    *,
    confidence: float = 0.95,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> tuple[float, float, float]:
    """Mean of a seeds x items score matrix and its percentile CI, resampling both axes.

    Seeds and evaluation items are both random draws (training noise and test-set noise), so each
    replicate resamples seeds and items independently with replacement and averages the selected
    cells; a single seed degenerates to the usual item bootstrap. Returns (mean, low, high).
    """
    scores = np.asarray(scores, dtype=float)
    if scores.ndim != 2 or scores.size == 0:
        raise ValueError(f"expected a non-empty seeds x items matrix, got shape {scores.shape}")
    n_seeds, n_items = scores.shape
    rng = np.random.default_rng(seed)
    means = np.empty(n_resamples)
    for r in range(n_resamples):
        rows = rng.integers(0, n_seeds, n_seeds)
        cols = rng.integers(0, n_items, n_items)
        means[r] = scores[np.ix_(rows, cols)].mean()
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return float(scores.mean()), float(low), float(high)
