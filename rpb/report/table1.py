"""Tables 1 and 2: one row per method (base first) on one model and corpus, beside the paper's
reported numbers (`PAPER_TABLE1`, the only constants, in their own column), and table 1's landing
page (the verdicts, the headline, the checks, the tasks).

Table 1 (`build_table1`) is family A's model, table 2 (`build_table2`) the same rows for the
family-B model, and the diagnostic table 1 table 1's rows in the diagnostic regime. Each row is
`rpb.report.tables.TableContext.method_row`'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from rpb.artifacts import write_text
from rpb.report.registry import TABLE1_HEADLINE, ReportJob, Shape, table_outputs
from rpb.report.render import table_figures, write_table
from rpb.report.run_records import (
    ACCURACY,
    base_runs,
    in_domain_tasks,
    numeric_paths,
    runs_text,
)
from rpb.report.stats import ITEM_INTERVAL
from rpb.report.tables import (
    EXACT_MATCH,
    MEASURE_NAMES,
    P_TARGET,
    SUFFIX,
    Cell,
    TableContext,
    in_domain_text,
    interval_text,
    measures,
    measures_text,
    number_text,
    primary_measure,
    row_accuracy_columns,
    score_cell,
)
from rpb.specs import spec_runs

# The report jobs this module builds (rpb.report.registry reads them from this source).
REPORT_ENTRIES = (
    ReportJob(
        "table1",
        None,
        "table 1: each method's accuracy and structure retention (family A)",
        headline=TABLE1_HEADLINE,
    ),
    ReportJob(
        "table2",
        "build_table2",
        "table 2: table 1's rows for the family-B model",
        "Table 2",
        table_outputs("table2"),
        TABLE1_HEADLINE,
        Shape(
            base="every corpus",
            spec=("family",),
            audited=True,
            lists_claims=("method", "reference"),
        ),
    ),
    ReportJob(
        "diagnostic_table1",
        "build_table1",
        "table 1's rows in the diagnostic regime (posttrain.trainable; results/diagnostic)",
        headline=TABLE1_HEADLINE,
    ),
)

# Moonlight-16B-A3B math post-training, in-domain accuracy (%), as the paper's abstract reports.
PAPER_TABLE1 = {"rpb": 45.77, "lbl": 31.91, "none": 29.44}
PAPER_FAMILY = "A"

TABLE1_STRUCTURE = ["modularity", "community_nmi", "coact_cosine"]


def method_table_frame(results: Path, spec: dict[str, Any]) -> pd.DataFrame:
    """One row per method (base first) on `spec`'s model and corpus, with the paper's number
    (family A only)."""
    context, corpus = TableContext.of(results, spec), spec["corpus"]
    runs = spec_runs(spec)
    labels = [("base", base_runs(runs)), *((label, runs) for label in spec["methods"])]
    rows = [context.method_row(corpus, label, of) for label, of in labels]
    for row in rows:
        paper = PAPER_TABLE1.get(row["method"])
        paper = paper if spec.get("family", PAPER_FAMILY) == PAPER_FAMILY else None
        row["paper_in_domain"] = paper if paper is not None else math.nan
    columns = ["model", "method", "n_seeds", *row_accuracy_columns(spec, corpus)]
    return pd.DataFrame(rows)[[*columns, *TABLE1_STRUCTURE, "paper_in_domain"]]


def build_method_table(
    results: Path,
    spec: dict[str, Any],
    out_csv: Path,
    title: str = "Table 1",
    verdicts: Sequence[str] = (),
) -> pd.DataFrame:
    """One row per method (base first) on one model and corpus: CSV, Markdown, HTML, provenance
    side file and the co-activation heatmaps `figures/<csv stem>_coactivation.{png,pdf}` (the
    first seed), every run's in `figures/<csv stem>_coactivation_runs/`. `verdicts` (lines of
    `rpb.report.claims.table_verdicts`) open the caption, so the table cannot be read without
    them."""
    table = method_table_frame(results, spec)
    out_csv = Path(out_csv)
    tasks = in_domain_tasks(spec, spec["corpus"])
    over_runs = interval_text(spec, "the method's runs")
    provenance = {
        "scale": spec.get("scale"),
        "model": spec["model"],
        "corpus": spec["corpus"],
        "runs": list(spec["runs"]),
        "measures": measures(spec),
        "verdicts": list(verdicts),
        # Which CPU numeric paths trained the runs and their bases (rpb.numerics), with counts.
        "numeric_paths": numeric_paths(results, spec),
        "note": (
            "".join(f"{line} " for line in [smoke_note(spec)] if line)
            + "".join(f"{line} " for line in verdicts)
            + f"{measures_text(spec)} in_domain: {in_domain_text(tasks)}, "
            f"{over_runs} (a run is a base and a seed; the base row, one run per base; a single "
            f"run: the {interval_text(spec, 'its items', ITEM_INTERVAL)})"
            + ("; in_domain_p the same for p(target). " if P_TARGET in measures(spec) else ". ")
            + "paper_in_domain: Moonlight-16B-A3B in-domain accuracy reported by "
            "arXiv:2609.08115 (family A only)"
            + (
                ", beside the mean of the benchmarks: the paper does not say whether its number "
                "is a benchmark mean or pooled items (pooling weights benchmarks by size)"
                if len(tasks) > 1
                else ""
            )
            + "; all other columns measured by this run."
        ),
    }
    write_table(
        out_csv,
        table,
        title=_title(title, spec),
        note=provenance["note"],
        meta=provenance,
        floatfmt=".2f",
    )
    table_figures(results, spec, out_csv.parent / "figures" / f"{out_csv.stem}_coactivation")
    return table


def build_table1(
    results: Path,
    spec: dict[str, Any],
    out_csv: Path,
    verdicts: Sequence[str] = (),
    lead: Sequence[str] = (),
    checks: Sequence[Any] = (),
    comparisons: Sequence[str] = (),
) -> pd.DataFrame:
    """Write table1 (CSV, Markdown, and a provenance side file) from this run's outputs, its
    caption opened by `verdicts`; a spec's `title` names another table of the same rows (the
    diagnostic table 1). Beside them its landing page `<stem>.landing.html` (`write_landing`):
    `lead` (a sentence per verdict), the headline table, `checks` (rpb.report.audit.Check) and
    `comparisons` (the parts behind the verdicts), and the per-task table
    (`rpb.report.claims.TableJudgement.landing` gives the three)."""
    title = spec.get("title", "Table 1")
    table = build_method_table(results, spec, out_csv, title, verdicts)
    write_landing(
        Path(out_csv).with_suffix(LANDING_SUFFIX),
        _title(title, spec),
        headline_frame(results, spec, table),
        per_task_frame(spec, table),
        lead=lead,
        checks=checks,
        comparisons=comparisons,
        notes=(headline_note(spec), per_task_note(spec)),
        banner=smoke_note(spec),
        view=table_view_page(table, _title(title, spec), spec),
    )
    return table


# Table 1 as the report shows it (issue 58: at 1400 px 9 of its 25 columns showed): a row per
# method in the columns a reader needs, accuracy in both measures and the structure columns;
# the intervals, the per-task columns and every other column are in the CSV and its caption.
READER_COLUMNS = (
    "method",
    "n_seeds",
    *(f"{column}{SUFFIX[m]}" for column in ACCURACY for m in (EXACT_MATCH, P_TARGET)),
    *TABLE1_STRUCTURE,
    "paper_in_domain",
)


def table_view_page(table: pd.DataFrame, title: str, spec: dict[str, Any]) -> str:
    """The report's page of table 1 (`READER_COLUMNS` of `table`, 2 decimals), its note naming
    the columns and where the rest are."""
    from rpb.report.report_html import page, table_html

    columns = [c for c in READER_COLUMNS if c in table.columns]
    note = (
        "".join(f"{line} " for line in [smoke_note(spec)] if line)
        + "The columns a reader needs; the intervals, the per-task columns and the full caption "
        "are in table1.csv and table1.html (the menu's Table 1, then Table). "
        f"{measures_text(spec)} modularity, community_nmi, coact_cosine: co-activation "
        "structure (unitless; the last two against the base); paper_in_domain: the paper's "
        "in-domain accuracy (Moonlight-16B-A3B, family A only)."
    )
    # Narrow: the text column at its content's width, headers wrapped at their underscores.
    narrow = (
        "<style>table.rpb td.text { min-width: 0; } table.rpb th { word-break: break-word; "
        "max-width: 7em; }</style>\n</head>"
    )
    html = page(title, note, [("", table_html(table[columns], ".2f"))])
    return html.replace("</head>", narrow, 1)


# --- table 1's landing page: the verdicts, the headline, the checks, the tasks ------------------

LANDING_SUFFIX = ".landing.html"  # beside the table's CSV (rpb.report.render.TABLE_SUFFIXES)
HEADLINE_METRICS = {"in_domain": "in-domain", "ood_mean": "OOD mean"}
STRUCTURE_NAMES = {
    "modularity": "modularity",
    "community_nmi": "community NMI with the base",
    "coact_cosine": "co-activation cosine with the base",
}
PAPER_ROW = "paper in-domain (Moonlight-16B-A3B)"


# What a smoke run's outputs say first (config `scale: smoke`, config/smoke.yaml): its models are
# trained for seconds on a few hundred tokens to check that every rule runs, so its numbers, its
# verdicts and its checks' outcomes carry no meaning (issue 58).
SMOKE_NOTE = (
    "Smoke run (config scale: smoke): a few seconds of training on tiny models, to check that the "
    'pipeline runs end to end. Its numbers carry no meaning: 0.00 accuracies, verdicts "not '
    'testable" and checks "not met" are expected here and say nothing about the paper\'s claims; '
    "table 1's numbers come from `make table1`."
)


def smoke_note(spec: dict[str, Any]) -> str:
    """`SMOKE_NOTE` for a smoke run's spec (`scale: smoke`), else nothing."""
    return SMOKE_NOTE if spec.get("scale") == "smoke" else ""


def _title(title: str, spec: dict[str, Any]) -> str:
    return (
        f"{title} ({spec.get('scale')} scale, model {spec['model']}, corpus {spec['corpus']}, "
        f"{runs_text(spec_runs(spec))})"
    )


def headline_frame(results: Path, spec: dict[str, Any], table: pd.DataFrame) -> pd.DataFrame:
    """Table 1's headline columns, one row per method of `table` (its frame): the runs, then in
    each measure in-domain and the OOD mean, each with its interval as text. In-domain's is
    table 1's own; the OOD mean's is computed here the same way (`score_cell`: a t-interval
    over the runs' OOD means, a single run's over its items), table 1 having none."""
    context = TableContext.of(results, spec)
    rows = []
    runs = spec_runs(spec)
    for _, row in table.iterrows():
        label = str(row["method"])
        of = base_runs(runs) if label == "base" else runs
        evals = context.evals(spec["corpus"], label, of)
        cells: dict[str, Any] = {"method": label, "runs": int(row["n_seeds"])}
        for column, name in HEADLINE_METRICS.items():
            for measure in measures(spec):
                s = SUFFIX[measure]
                if column == "in_domain":
                    low, high = row[f"in_domain{s}_ci_low"], row[f"in_domain{s}_ci_high"]
                else:
                    ood = score_cell(evals, spec["ood"], measure, context.level)
                    low, high = ood.low, ood.high
                cell = Cell(float(row[f"{column}{s}"]), float(low), float(high))
                cells[f"{name} {MEASURE_NAMES[measure]}"] = cell.text()
        rows.append(cells)
    return pd.DataFrame(rows)


def headline_note(spec: dict[str, Any]) -> str:
    tasks = in_domain_tasks(spec, spec["corpus"])
    judged = MEASURE_NAMES[primary_measure(spec)]
    return (
        f"Percent; {interval_text(spec, 'runs')} (a run is a base and a seed; the base row, one "
        f"run per base; a single run: the {interval_text(spec, 'its items', ITEM_INTERVAL)}). "
        f"In-domain: {in_domain_text(tasks)}; OOD mean: the mean of {', '.join(spec['ood'])}. "
        f"Claims are judged on {judged}."
    )


def per_task_frame(spec: dict[str, Any], table: pd.DataFrame) -> pd.DataFrame:
    """Table 1's other columns turned on their side, one column per method: a row per in-domain
    benchmark and per OOD task (its measures' means as "exact match / p(target)"), the structure
    metrics, and the paper's in-domain number where table 1 has one."""
    tasks = in_domain_tasks(spec, spec["corpus"])
    suffixes = [SUFFIX[m] for m in measures(spec)]
    stems = [
        ("in-domain " + t, "in_domain" if len(tasks) == 1 else f"in_domain_{t}") for t in tasks
    ]
    stems += [(f"OOD {t}", f"ood_{t}") for t in spec["ood"]]
    methods = [str(m) for m in table["method"]]
    rows = []
    for name, stem in stems:
        cells = [
            " / ".join(number_text(r[f"{stem}{s}"]) for s in suffixes) for _, r in table.iterrows()
        ]
        rows.append({"": name, **dict(zip(methods, cells, strict=True))})
    for column, name in STRUCTURE_NAMES.items():
        if column in table.columns:
            cells = map(number_text, table[column])
            rows.append({"": name, **dict(zip(methods, cells, strict=True))})
    if "paper_in_domain" in table.columns and table["paper_in_domain"].notna().any():
        paper = map(number_text, table["paper_in_domain"])
        rows.append({"": PAPER_ROW, **dict(zip(methods, paper, strict=True))})
    return pd.DataFrame(rows, columns=["", *methods])


def per_task_note(spec: dict[str, Any]) -> str:
    shown = " / ".join(MEASURE_NAMES[m] for m in measures(spec))
    return (
        f"Each task's mean over the method's runs, in percent ({shown}); the structure metrics "
        "are the layer means of the runs' co-activation analysis; the paper's number is the "
        "in-domain accuracy arXiv:2609.08115 reports (family A only)."
    )


def write_landing(
    path: Path,
    title: str,
    headline: pd.DataFrame,
    per_task: pd.DataFrame,
    *,
    lead: Sequence[str] = (),
    checks: Sequence[Any] = (),
    comparisons: Sequence[str] = (),
    notes: tuple[str, str] = ("", ""),
    banner: str = "",
    view: str = "",
) -> Path:
    """The landing page's HTML fragment (`rpb.report.report_html.landing_html`) at `path`."""
    from rpb.report.report_html import landing_html

    shown = [(c.id, c.outcome(), c.value, c.passed) for c in checks]
    text = landing_html(title, lead, headline, per_task, shown, comparisons, notes, banner, view)
    return write_text(Path(path), text)


def build_table2(results: Path, spec: dict[str, Any], out_csv: Path) -> pd.DataFrame:
    """Table 2: table 1's rows for the family-B model (the paper reports no numbers for it)."""
    return build_method_table(results, spec, out_csv, "Table 2")
