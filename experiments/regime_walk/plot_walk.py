"""The regime walk's figure (regime.md's images in img/): `none`'s final dev accuracy against
post-training steps. Archived with the walk; it was `rpb.report.figures.plot_regime_walk` until the
walk left the product (last run there: commit 0e5c1da)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from regime import task_name  # beside this file

from rpb.artifacts import save_figure


def _save(fig: Figure, path_stem: str | Path) -> list[Path]:
    """<stem>.png and <stem>.pdf, as rpb.report.figures writes its figures."""
    stem = Path(path_stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_name(stem.name + ext) for ext in (".png", ".pdf")]
    for p in paths:
        save_figure(fig, p, dpi=150, bbox_inches="tight")
    return paths


def plot_regime_walk(
    tried: Sequence[Mapping],
    path_stem: str | Path,
    accuracy_range: tuple[float, float] = (0.40, 0.85),
) -> list[Path]:
    """The regime rule's calibration runs (`regime.py`, rows of `CandidateResult.row`): `none`'s
    final dev accuracy against post-training steps, one panel per (model, lr fraction), one line
    per task (difficulty level and post-training pairs; the seed mean), each seed a dot, R2's
    range shaded."""
    if not tried:
        raise ValueError("no calibration candidate tried")
    df = pd.DataFrame(list(tried))
    missing = [c for c in ("model", "lr_fraction", "level", "steps", "finals") if c not in df]
    if missing:
        raise ValueError(f"dataframe lacks column(s) {missing}; has {list(df.columns)}")
    panels = list(dict.fromkeys(zip(df["model"], df["lr_fraction"], strict=True)))
    fig = Figure(figsize=(3.6 * len(panels), 3.2))
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    for ax, (model, frac) in zip(axes, panels, strict=True):
        ax.axhspan(*accuracy_range, color="0.9", zorder=0)
        sub = df[(df["model"] == model) & (df["lr_fraction"] == frac)]
        none = pd.Series(None, index=sub.index)
        pairs, holdouts = sub.get("post_pairs", none), sub.get("post_holdout", none)
        tasks = [
            task_name(lv, None if pd.isna(n) else int(n), None if pd.isna(h) else h)
            for lv, n, h in zip(sub["level"], pairs, holdouts, strict=True)
        ]
        for task, rows in sub.groupby(tasks, sort=False):
            rows = rows.sort_values("steps")
            line = ax.plot(rows["steps"], [np.mean(f) for f in rows["finals"]], marker="o")[0]
            line.set_label(task)
            for steps, finals in zip(rows["steps"], rows["finals"], strict=True):
                ax.scatter([steps] * len(finals), finals, s=8, color=line.get_color(), alpha=0.5)
        ax.set_xscale("log", base=2)
        ticks = sorted(sub["steps"].unique())
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_title(f"{model}, lr {frac:.3g} x pretraining peak", fontsize=9)
        ax.set_xlabel("post-training steps")
        ax.legend(fontsize=7, loc="upper left")
    axes[0].set_ylabel("none: final dev accuracy")
    axes[0].set_ylim(-0.03, 1.03)
    return _save(fig, path_stem)
