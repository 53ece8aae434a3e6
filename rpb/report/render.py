"""Writing a table: its CSV, side CSVs, Markdown, HTML page, provenance side file and
co-activation heatmaps, the same way for every table (the build_* entry points of
rpb.report.table1 ... table5 and rpb.report.exploratory compute frames and hand them here).

CSVs carry 4 decimals; Markdown is `<title>. <note>` followed by each section's table; the HTML
page (`rpb.report.report_html`, the report's rendering) has the same title, note as its caption and
sections.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from rpb.artifacts import atomic_path, remove_artifact, write_text
from rpb.report.run_records import coactivation_counts
from rpb.specs import Run, spec_runs

__all__ = [
    "TABLE_SUFFIXES",
    "clear_table",
    "coactivation_figure",
    "run_figures",
    "side_path",
    "table_figures",
    "write_csv",
    "write_markdown",
    "write_table",
]


def write_csv(frame: pd.DataFrame, path: Path) -> None:
    with atomic_path(path) as tmp:  # a full disk leaves no partial table (rpb.artifacts)
        frame.to_csv(tmp, index=False, float_format="%.4f")


# A table's own files beside its CSV: one group, written together by `write_table`.
# `.landing.html`: table 1's landing page (rpb.report.table1.write_landing).
TABLE_SUFFIXES = (".csv", ".md", ".html", ".meta.json", ".landing.html")


def clear_table(out_csv: Path) -> list[Path]:
    """Delete a table's files (`TABLE_SUFFIXES`) before its job builds it again, so that a job that
    fails leaves none of the old ones beside a missing CSV. Snakemake deletes the declared ones
    itself, but not `<stem>.meta.json` and `<stem>.landing.html` (no rule declares them), and
    nothing does for a job run by hand. Returns the files deleted."""
    out_csv = Path(out_csv)
    paths = [out_csv.with_suffix(suffix) for suffix in TABLE_SUFFIXES]
    return [path for path in paths if remove_artifact(path)]


def side_path(out_csv: Path, part: str) -> Path:
    """`<stem>_<part>.csv` beside the table's CSV (its runs, pairs, ...)."""
    return out_csv.with_name(f"{out_csv.stem}_{part}.csv")


def write_markdown(
    path: Path,
    title: str,
    note: str,
    sections: Sequence[tuple[str, pd.DataFrame]],
    floatfmt: str = ".3g",
) -> None:
    """`<title>. <note>`, then each section (an empty heading: the table alone)."""
    text = f"{title}. {note}\n"
    for heading, frame in sections:
        body = frame.to_markdown(index=False, floatfmt=floatfmt) if len(frame) else "(no rows)"
        text += f"\n{heading}\n\n{body}\n" if heading else f"\n{body}\n"
    write_text(path, text)


def write_table(
    out_csv: Path,
    table: pd.DataFrame,
    *,
    title: str | None = None,
    note: str = "",
    sections: Sequence[tuple[str, pd.DataFrame]] | None = None,
    side: Mapping[str, pd.DataFrame] | None = None,
    meta: Mapping[str, Any] | None = None,
    floatfmt: str = ".3g",
) -> Path:
    """Write `table` to `out_csv`, each `side` frame to `<stem>_<part>.csv`, with a `title` the
    Markdown `<stem>.md` and the HTML page `<stem>.html` (`sections`, default the table alone;
    the note is the page's caption) and with `meta` the provenance `<stem>.meta.json`. Returns
    the stem (for figure names)."""
    out_csv = Path(out_csv)
    write_csv(table, out_csv)
    for part, frame in (side or {}).items():
        write_csv(frame, side_path(out_csv, part))
    if meta is not None:
        write_text(out_csv.with_suffix(".meta.json"), json.dumps(meta, indent=2) + "\n")
    if title is not None:
        from rpb.report.report_html import write_table_html

        parts = sections or [("", table)]
        write_markdown(out_csv.with_suffix(".md"), title, note, parts, floatfmt)
        write_table_html(out_csv.with_suffix(".html"), title, note, parts, floatfmt)
    return out_csv.with_suffix("")


def coactivation_figure(
    results: Path, model: str, corpus: str, methods: Sequence[str], run: Run, path_stem: Path
) -> list[Path]:
    """Heatmaps of the base and each method (on run `run`) of one model and corpus."""
    from rpb.report.figures import plot_coactivation_heatmaps

    named = coactivation_counts(results, model, corpus, methods, run)
    path_stem.parent.mkdir(parents=True, exist_ok=True)
    return plot_coactivation_heatmaps(named, path_stem, base="base")


def run_figures(
    results: Path,
    model: str,
    corpora: Sequence[str],
    methods: Sequence[str],
    runs: Sequence[Run],
    folder: Path,
) -> list[Path]:
    """Every run's heatmaps, not the first run's alone: per corpus and run the base and each
    method on that run, `<folder>/<corpus>_base<b>_seed<s>.{png,pdf}` (the report shows the
    folder, workflow/rules/tables.smk)."""
    paths: list[Path] = []
    for corpus in corpora:
        for run in runs:
            stem = Path(folder) / f"{corpus}_{run.name.replace('/', '_')}"
            paths += coactivation_figure(results, model, corpus, methods, run, stem)
    return paths


def table_figures(results: Path, spec: dict, stem: Path) -> list[Path]:
    """A method table's heatmaps: `<stem>.{png,pdf}` for its first corpus and run (the figure
    beside the table) and every run's in `<stem>_runs/` (`run_figures`); the spec names one
    `corpus` or several `corpora`."""
    model, methods, runs = spec["model"], spec["methods"], spec_runs(spec)
    corpora = spec.get("corpora") or [spec["corpus"]]
    paths = coactivation_figure(results, model, corpora[0], methods, runs[0], stem)
    return paths + run_figures(
        results, model, corpora, methods, runs, stem.with_name(f"{stem.name}_runs")
    )
