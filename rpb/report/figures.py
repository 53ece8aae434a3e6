"""Figures for the co-activation analysis: heatmaps, retention vs accuracy, metric curves.

Every helper writes ``<path_stem>.png`` and ``<path_stem>.pdf`` and returns both paths. Figures
are built with ``matplotlib.figure.Figure`` (Agg canvas, no pyplot), so no global backend state
is touched and nothing leaks between calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from rpb.artifacts import save_figure
from rpb.coactivation import communities

__all__ = [
    "plot_coactivation_heatmaps",
    "plot_curves",
    "plot_retention_vs_accuracy",
    "plot_sweep",
]


def _save(fig: Figure, path_stem: str | Path) -> list[Path]:
    stem = Path(path_stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_name(stem.name + ext) for ext in (".png", ".pdf")]
    for p in paths:
        save_figure(fig, p, dpi=150, bbox_inches="tight")
    return paths


def _require_columns(df: pd.DataFrame, columns: Sequence[str]) -> None:
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ValueError(f"dataframe lacks column(s) {missing}; has {list(df.columns)}")


def plot_coactivation_heatmaps(
    named_counts: Mapping[str, np.ndarray],
    path_stem: str | Path,
    base: str | None = None,
    layers: Sequence[int] | None = None,
    seed: int = 0,
) -> list[Path]:
    """Grid of off-diagonal co-activation heatmaps: rows = layers, columns = models.

    ``named_counts`` maps a name to counts ``[L, E, E]``; ``base`` (default: the first name) fixes
    the expert order of each row — its Louvain communities, then usage — so retained blocks show
    as blocks in every column; white lines mark the base's community boundaries. Each panel is
    scaled to its own maximum. ``layers`` selects rows (default all; pick a few at paper scale).
    """
    if not named_counts:
        raise ValueError("named_counts is empty")
    arrays = {name: np.asarray(c, dtype=np.float64) for name, c in named_counts.items()}
    base = next(iter(arrays)) if base is None else base
    if base not in arrays:
        raise ValueError(f"base {base!r} not among {list(arrays)}")
    shape = arrays[base].shape
    if len(shape) != 3 or shape[1] != shape[2]:
        raise ValueError(f"counts of {base!r} must be [L, E, E], got {shape}")
    for name, a in arrays.items():
        if a.shape != shape:
            raise ValueError(f"counts of {name!r} have shape {a.shape}, expected {shape}")
    rows = list(range(shape[0])) if layers is None else list(layers)
    if not rows or not all(0 <= layer < shape[0] for layer in rows):
        raise ValueError(f"layers must be a non-empty subset of range({shape[0]}), got {rows}")

    names = list(arrays)
    fig = Figure(figsize=(2.4 * len(names) + 1.0, 2.3 * len(rows)), layout="constrained")
    axes = fig.subplots(len(rows), len(names), squeeze=False)
    image = None
    for r, layer in enumerate(rows):
        ref = arrays[base][layer]
        labels = communities(ref, seed=seed)
        order = np.lexsort((-np.diag(ref), labels))
        bounds = np.flatnonzero(np.diff(labels[order])) + 0.5
        for c, name in enumerate(names):
            m = arrays[name][layer][np.ix_(order, order)].copy()
            # The diagonal (usage) is far larger than any pair count and would wash out the blocks.
            np.fill_diagonal(m, 0.0)
            peak = m.max()
            ax = axes[r, c]
            image = ax.imshow(m / peak if peak > 0 else m, vmin=0.0, vmax=1.0, cmap="viridis")
            for b in bounds:
                ax.axhline(b, color="white", lw=0.6)
                ax.axvline(b, color="white", lw=0.6)
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(name)
            if c == 0:
                ax.set_ylabel(f"layer {layer}")
    fig.suptitle(f"Expert co-activation (experts ordered by {base} communities)")
    fig.colorbar(image, ax=axes, shrink=0.8, label="co-activation / panel max")
    return _save(fig, path_stem)


def plot_retention_vs_accuracy(
    df: pd.DataFrame,
    path_stem: str | Path,
    x: str = "community_nmi",
    y: str = "accuracy",
    label: str = "method",
    title: str = "Community retention vs accuracy",
) -> list[Path]:
    """Scatter of community retention (``x``) vs accuracy (``y``), one labelled point per row
    (method/run; the run joins the label as ``b<base>s<seed>`` when there are ``base`` and
    ``seed`` columns, as ``s<seed>`` with a ``seed`` column alone), one colour per ``label``
    value."""
    _require_columns(df, [x, y, label])
    if df.empty:
        raise ValueError("dataframe is empty")
    fig = Figure(figsize=(5.5, 4.2), layout="constrained")
    ax = fig.subplots()
    for name, group in df.groupby(label, sort=True):
        points = ax.scatter(group[x], group[y], label=str(name), alpha=0.85)
        if {"base", "seed"} <= set(group):
            tags = [f"{name} b{b}s{s}" for b, s in zip(group["base"], group["seed"], strict=True)]
        elif "seed" in group:
            tags = [f"{name} s{s}" for s in group["seed"]]
        else:
            tags = [str(name)] * len(group)
        for tag, xv, yv in zip(tags, group[x], group[y], strict=True):
            ax.annotate(
                tag,
                (xv, yv),
                xytext=(3, 3),
                textcoords="offset points",
                fontsize=7,
                color=points.get_facecolor()[0],
            )
    ax.set_xlabel(x.replace("_", " "))
    ax.set_ylabel(y.replace("_", " "))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(title=label, fontsize=8)
    return _save(fig, path_stem)


def plot_curves(
    df: pd.DataFrame, x: str, ys: Sequence[str], hue: str, path_stem: str | Path
) -> list[Path]:
    """One panel per metric in ``ys`` against ``x``, one line per ``hue`` value.

    Rows sharing (hue, x) — e.g. seeds — are averaged, with a ±1 std band where there are several.
    """
    ys = [ys] if isinstance(ys, str) else list(ys)
    if not ys:
        raise ValueError("ys is empty")
    _require_columns(df, [x, hue, *ys])
    if df.empty:
        raise ValueError("dataframe is empty")
    fig = Figure(figsize=(4.2 * len(ys), 3.4), layout="constrained")
    axes = fig.subplots(1, len(ys), squeeze=False)[0]
    for ax, metric in zip(axes, ys, strict=True):
        for name, group in df.groupby(hue, sort=True):
            stats = group.groupby(x, sort=True)[metric].agg(["mean", "std"])
            line = ax.plot(stats.index, stats["mean"], marker="o", ms=3, label=str(name))[0]
            std = stats["std"].fillna(0.0)
            if (std > 0).any():
                ax.fill_between(
                    stats.index,
                    stats["mean"] - std,
                    stats["mean"] + std,
                    color=line.get_color(),
                    alpha=0.2,
                )
        ax.set_xlabel(x.replace("_", " "))
        ax.set_ylabel(metric.replace("_", " "))
        ax.set_title(metric.replace("_", " "))
        ax.grid(alpha=0.3)
    axes[-1].legend(title=hue, fontsize=8)
    return _save(fig, path_stem)


def plot_sweep(
    df: pd.DataFrame,
    path_stem: str | Path,
    ys: Sequence[str],
    curve: str = "curve",
    x: str = "strength",
    protocol: str = "protocol",
) -> list[Path]:
    """Softness sweep: one row per ``curve`` (a method family), one column per metric in ``ys``,
    the metric against the method's strength (mean over rows sharing a strength, e.g. seeds, with
    a ±1 std band). Strength 0 (plain fine-tuning) and ``inf`` (the hard limit) sit at the two
    ends of a symmetric-log axis; each row has its own axis, since strengths of different
    families are not on one scale. Where the frame has a ``protocol`` column, the line joins the
    points evaluated with the model's own router only; points whose steering is kept at
    evaluation (``kept_at_eval``, e.g. ``hard``) are drawn apart as crosses (one protocol per
    line)."""
    ys = [ys] if isinstance(ys, str) else list(ys)
    if not ys:
        raise ValueError("ys is empty")
    _require_columns(df, [x, curve, *ys])
    if df.empty:
        raise ValueError("dataframe is empty")
    strengths = pd.to_numeric(df[x], errors="raise").astype(float)
    if (strengths < 0).any() or strengths.isna().any():
        raise ValueError(f"column {x!r} must hold strengths >= 0 (inf for the hard limit)")
    names = list(dict.fromkeys(df[curve]))
    fig = Figure(figsize=(3.6 * len(ys), 2.8 * len(names)), layout="constrained")
    axes = fig.subplots(len(names), len(ys), squeeze=False)
    for r, name in enumerate(names):
        group = df[df[curve] == name].assign(**{x: strengths[df[curve] == name]})
        finite = group.loc[np.isfinite(group[x]), x]
        positive = finite[finite > 0]
        lin = float(positive.min()) if len(positive) else 1.0
        top = float(finite.max()) if len(finite) and finite.max() > 0 else lin
        # The hard limit is drawn one decade past the largest finite strength.
        at_inf = top * 10.0
        pos = group[x].where(np.isfinite(group[x]), at_inf)
        ticks = sorted(set(pos))
        labels = ["∞" if t == at_inf and np.isinf(group[x]).any() else f"{t:g}" for t in ticks]
        kept = (
            group[protocol].eq("kept_at_eval")
            if protocol in group
            else pd.Series(False, index=group.index)
        )
        for c, metric in enumerate(ys):
            ax = axes[r, c]
            placed = group.assign(_pos=pos)
            stats = placed[~kept].groupby("_pos", sort=True)[metric].agg(["mean", "std"])
            ax.plot(stats.index, stats["mean"], marker="o", ms=3, label="own router")
            std = stats["std"].fillna(0.0)
            if (std > 0).any():
                ax.fill_between(stats.index, stats["mean"] - std, stats["mean"] + std, alpha=0.2)
            if kept.any():
                apart = placed[kept].groupby("_pos", sort=True)[metric].mean()
                ax.plot(
                    apart.index, apart.values, "x", ms=6, color="C3", label="kept at evaluation"
                )
                if r == 0 and c == 0:
                    ax.legend(fontsize=7)
            ax.set_xscale("symlog", linthresh=lin)
            ax.set_xticks(ticks)
            ax.set_xticklabels(labels, rotation=45, fontsize=7)
            ax.minorticks_off()
            ax.grid(alpha=0.3)
            ax.set_title(f"{name}: {metric.replace('_', ' ')}", fontsize=9)
            if r == len(names) - 1:
                ax.set_xlabel(f"{x} (0 = none)")
    fig.suptitle("Softness sweep (mean ± std over seeds)")
    return _save(fig, path_stem)
