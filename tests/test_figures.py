"""Tests for rpb.report.figures: every helper writes a real, non-blank PNG and a PDF."""

import numpy as np
import pandas as pd
import pytest
from matplotlib.image import imread

from rpb.report.figures import (
    plot_coactivation_heatmaps,
    plot_curves,
    plot_retention_vs_accuracy,
    plot_sweep,
)


def _check_outputs(paths, stem):
    assert [p.name for p in paths] == [stem.name + ".png", stem.name + ".pdf"]
    png, pdf = paths
    assert pdf.read_bytes().startswith(b"%PDF") and pdf.stat().st_size > 1000
    pixels = imread(png)
    assert pixels.shape[0] > 100 and pixels.std() > 0.01  # something was drawn


def _counts(seed: int, layers: int = 2, e: int = 8) -> np.ndarray:
    rng = np.random.default_rng(seed)
    block = (np.arange(e)[:, None] // 4 == np.arange(e)[None, :] // 4) * 20.0
    out = np.empty((layers, e, e))
    for layer in range(layers):
        m = rng.integers(0, 10, (e, e)) + block
        out[layer] = m + m.T
    return out


def test_heatmaps_write_png_and_pdf(tmp_path):
    stem = tmp_path / "sub" / "heat"
    named = {"base": _counts(0), "rpb": _counts(1), "none": _counts(2)}
    _check_outputs(plot_coactivation_heatmaps(named, stem, layers=[1]), stem)


def test_heatmaps_reject_bad_input(tmp_path):
    with pytest.raises(ValueError, match="'lbl' have shape"):
        plot_coactivation_heatmaps(
            {"base": _counts(0), "lbl": _counts(1, layers=3)}, tmp_path / "h"
        )
    with pytest.raises(ValueError, match="base 'x'"):
        plot_coactivation_heatmaps({"base": _counts(0)}, tmp_path / "h", base="x")
    with pytest.raises(ValueError, match="layers"):
        plot_coactivation_heatmaps({"base": _counts(0)}, tmp_path / "h", layers=[5])


def test_retention_vs_accuracy(tmp_path):
    df = pd.DataFrame(
        {
            "method": ["none", "none", "rpb", "rpb", "hard"],
            "seed": [0, 1, 0, 1, 0],
            "community_nmi": [0.3, 0.35, 0.7, 0.65, 0.95],
            "accuracy": [0.9, 0.88, 0.92, 0.93, 0.5],
        }
    )
    stem = tmp_path / "retention"
    _check_outputs(plot_retention_vs_accuracy(df, stem), stem)
    with pytest.raises(ValueError, match="lacks column"):
        plot_retention_vs_accuracy(df.drop(columns="accuracy"), stem)


def test_curves_average_seeds(tmp_path):
    df = pd.DataFrame(
        {
            "step": [0, 100, 200] * 4,
            "method": ["none"] * 6 + ["kl"] * 6,
            "seed": ([0] * 3 + [1] * 3) * 2,
            "kl_to_base": np.linspace(0, 1, 12),
            "topk_overlap": np.linspace(1, 0.5, 12),
        }
    )
    stem = tmp_path / "drift"
    _check_outputs(plot_curves(df, "step", ["kl_to_base", "topk_overlap"], "method", stem), stem)
    with pytest.raises(ValueError, match="missing_metric"):
        plot_curves(df, "step", ["missing_metric"], "method", stem)


def test_plot_sweep_rejects_bad_strengths(tmp_path):
    df = pd.DataFrame({"curve": ["a", "a"], "strength": [-1.0, 1.0], "in_domain": [1.0, 2.0]})
    with pytest.raises(ValueError, match="strengths >= 0"):
        plot_sweep(df, tmp_path / "s", ["in_domain"])
    with pytest.raises(ValueError, match="lacks column"):
        plot_sweep(df, tmp_path / "s", ["ood_mean"])
