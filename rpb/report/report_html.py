"""HTML renderings of the tables and of the claims audit, the items the Snakemake report shows
inline (workflow/rules/tables.smk registers them with `report()`; a CSV there is a download).

Each page is a title, its caption and its tables. No caption is written by hand:

- A table's page (`write_table_html`, called by `rpb.report.render.write_table` beside the Markdown)
has   the note its `build_*` function generates from the spec and from the constants of the
  computation: the measures, and the interval's kind, confidence and what it is over, named by
  `rpb.report.stats.describe_interval`, the names of the intervals `rpb.report.stats` computes.
- The claims audit (`write_claims_html`, called by `rpb.report.claims.build_claims`): `claims.html`
with   the audit's rules, each manipulation check (premise) with its outcome and each part with its
  verdict; and per table a page of the claims measured on it
  (`claims_by_table/<table>_claims.html`), which the report shows in that table's category.

The workflow/report/*.rst captions only point at these (tests/test_report_html.py).
"""

from __future__ import annotations

import base64
import html as _html
import math
import numbers
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pandas as pd

from rpb.artifacts import write_text

__all__ = [
    "CLAIMS_BY_TABLE",
    "claims_pages",
    "landing_html",
    "page",
    "table_html",
    "verdict_class",
    "write_claims_html",
    "write_table_html",
]


def _escape(text: str) -> str:
    """Text content escaped (&, <, >; quotes stay readable: no attribute holds text)."""
    return _html.escape(text, quote=False)


# The folder beside claims.csv with one page per table: the claims measured on it.
CLAIMS_BY_TABLE = "claims_by_table"

STYLE = """<style>
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; font-size: 14px;
  margin: 1.2em; color: #1f2328; }
h1 { font-size: 1.4em; margin: 0 0 0.4em; }
h2 { font-size: 1.15em; margin: 1.4em 0 0.4em; }
p.caption { max-width: 75em; line-height: 1.45; margin: 0.3em 0; }
div.scroll { overflow-x: auto; }
table.rpb { border-collapse: collapse; margin: 0.4em 0 1em; }
table.rpb th, table.rpb td { border: 1px solid #d0d7de; padding: 3px 7px; vertical-align: top; }
table.rpb th { background: #f6f8fa; position: sticky; top: 0; text-align: center; }
table.rpb td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
table.rpb td.text { max-width: 40em; min-width: 8em; }
table.rpb tr:nth-child(even) td { background: #fafbfc; }
table.rpb td.supported { background: #dafbe1 !important; }
table.rpb td.not-supported { background: #ffebe9 !important; }
table.rpb td.inconclusive { background: #fff8c5 !important; }
table.rpb td.not-testable, table.rpb td.premise-not-met { background: #eaeef2 !important; }
table.rpb td.passed { background: #dafbe1 !important; }
table.rpb td.failed { background: #ffebe9 !important; }
code { font-size: 0.95em; background: #f6f8fa; padding: 0 2px; }
</style>"""


def _inline(text: str) -> str:
    """Escaped text with `code` spans (the notes mark column names with backticks)."""
    parts = str(text).split("`")
    if len(parts) % 2 == 0:  # an unpaired backtick: plain text
        return _escape(str(text))
    return "".join(
        f"<code>{_escape(p)}</code>" if i % 2 else _escape(p) for i, p in enumerate(parts)
    )


def _cell(value: Any, floatfmt: str) -> tuple[str, str]:
    """(text, class) of one cell: floats in `floatfmt`, NaN and None empty, text escaped."""
    if value is None:
        return "", "num"
    if isinstance(value, bool | np.bool_):
        return str(bool(value)), "text"
    if isinstance(value, numbers.Integral):
        return str(int(value)), "num"
    if isinstance(value, numbers.Real):
        v = float(value)
        return ("" if math.isnan(v) else format(v, floatfmt)), "num"
    return _escape(str(value)), "text"


def table_html(
    frame: pd.DataFrame,
    floatfmt: str = ".3g",
    css: Callable[[str, Any], str] | None = None,
) -> str:
    """`frame` as an HTML table (no index): floats in `floatfmt` (the Markdown's), NaN empty,
    text escaped; `css(column, value)` adds a class to a cell (verdicts, check outcomes)."""
    if not len(frame.columns):
        return "<p>(no columns)</p>"
    if not len(frame):
        return "<p>(no rows)</p>"
    head = "".join(f"<th>{_escape(str(c))}</th>" for c in frame.columns)
    rows = []
    for values in frame.itertuples(index=False, name=None):
        cells = []
        for column, value in zip(frame.columns, values, strict=True):
            text, kind = _cell(value, floatfmt)
            extra = css(str(column), value) if css else ""
            cells.append(f'<td class="{kind}{" " + extra if extra else ""}">{text}</td>')
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return (
        '<div class="scroll"><table class="rpb">\n<thead><tr>'
        + head
        + "</tr></thead>\n<tbody>\n"
        + "\n".join(rows)
        + "\n</tbody></table></div>"
    )


def page(title: str, caption: str | Sequence[str], sections: Sequence[tuple[str, str]]) -> str:
    """A standalone HTML page: `title`, the caption paragraphs, then each (heading, HTML)
    section (an empty heading: the content alone)."""
    paragraphs = [caption] if isinstance(caption, str) else list(caption)
    body = [f"<h1>{_escape(title)}</h1>"]
    body += [f'<p class="caption">{_inline(p)}</p>' for p in paragraphs if p]
    for heading, content in sections:
        if heading:
            body.append(f"<h2>{_escape(heading)}</h2>")
        body.append(content)
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{_escape(title)}</title>\n{STYLE}\n</head>\n<body>\n"
        + "\n".join(body)
        + "\n</body>\n</html>\n"
    )


def write_table_html(
    path: Path,
    title: str,
    note: str,
    sections: Sequence[tuple[str, pd.DataFrame]],
    floatfmt: str = ".3g",
) -> Path:
    """A table's page: `title`, its generated `note` as the caption, each (heading, frame)
    section as a table (the same sections and number format as its Markdown)."""
    rendered = [(h, table_html(frame, floatfmt)) for h, frame in sections]
    return write_text(Path(path), page(title, note, rendered))


# --- table 1's landing page ----------------------------------------------------------------------

# The fragment is the Snakemake report's first screen (workflow/report/workflow.rst includes it).
# Snakemake 9 shows that text in a box 32rem wide (`prose max-w-lg`) beside the rule graph, in a
# pane that centres its content vertically (a tall page's top is then out of reach): the first
# two rules widen the box and start the pane at its top, the code rule drops the backticks that
# the box's typography draws around code.
LANDING_STYLE = """<style>
.prose:has(.rpb-landing) { max-width: none; }
.items-center:has(.rpb-landing) { align-items: flex-start; }
.rpb-landing code::before, .rpb-landing code::after { content: none; }
.rpb-landing { max-width: 62rem; font-size: 14px; line-height: 1.45; color: #1f2328; }
.rpb-landing h2 { font-size: 1.3em; margin: 0 0 0.4em; }
.rpb-landing h3 { font-size: 1.05em; margin: 1em 0 0.3em; }
.rpb-landing p, .rpb-landing ul { margin: 0.3em 0; }
.rpb-landing p.lead { font-size: 1.05em; }
.rpb-landing p.note { color: #57606a; font-size: 0.92em; }
.rpb-landing table { border-collapse: collapse; margin: 0.4em 0; width: auto; }
.rpb-landing th, .rpb-landing td { border: 1px solid #d0d7de; padding: 2px 7px; }
.rpb-landing th { background: #f6f8fa; text-align: center; }
.rpb-landing td.num { text-align: right; white-space: nowrap; font-variant-numeric: tabular-nums; }
.rpb-landing li .value { color: #57606a; font-size: 0.92em; }
.rpb-landing li.met::marker { color: #1a7f37; }
.rpb-landing li.not-met::marker { color: #cf222e; }
.rpb-landing li.undetermined::marker { color: #9a6700; }
</style>"""


# Inline, so that a landing page without a banner keeps its bytes.
BANNER_STYLE = (
    "background: #fff8c5; border: 1px solid #d4a72c; padding: 6px 10px; font-weight: 600; "
    "color: #1f2328"
)


VIEW_LINK_TEXT = "Open table 1 (the columns a reader needs; every column is in table1.csv)"


def view_link(view: str) -> str:
    """A link that shows the page `view` in the Snakemake report's content pane (its `app`, as
    the report's eye icon does), carried as a data URI: table 1 one click from the first screen."""
    uri = "data:text/html;base64," + base64.b64encode(view.encode()).decode()
    show = (
        "if (typeof app !== 'undefined') { app.setView({content: 'html', "
        "contentPath: this.dataset.view}); return false; }"
    )
    return (
        f'<p class="open"><a class="rpb-open-table" href="#" data-view="{uri}" '
        f'onclick="{show}"><b>{_escape(VIEW_LINK_TEXT)}</b></a></p>'
    )


def _landing_table(frame: pd.DataFrame, css_class: str) -> str:
    """A small table of text cells: the first column names the row, the others are numbers."""
    head = "".join(f"<th>{_escape(str(c))}</th>" for c in frame.columns)
    rows = []
    for values in frame.itertuples(index=False, name=None):
        cells = [
            f"<td>{_escape(str(v))}</td>" if i == 0 else f'<td class="num">{_escape(str(v))}</td>'
            for i, v in enumerate(values)
        ]
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return (
        f'<table class="{css_class}">\n<thead><tr>{head}</tr></thead>\n<tbody>\n'
        + "\n".join(rows)
        + "\n</tbody></table>"
    )


def landing_html(
    title: str,
    lead: Sequence[str],
    headline: pd.DataFrame,
    per_task: pd.DataFrame,
    checks: Sequence[tuple[str, str, str, bool]] = (),
    comparisons: Sequence[str] = (),
    notes: tuple[str, str] = ("", ""),
    banner: str = "",
    view: str = "",
) -> str:
    """Table 1's landing page, an HTML fragment (no <html>: it is included in another page):
    its title, a `banner` under it where given (a smoke run's: its numbers carry no meaning),
    the `lead` (one sentence per verdict), the headline table and its note, the checks
    as a list (id, outcome as `rpb.report.audit.Check.outcome` words it, the numbers, passed),
    the comparisons behind the verdicts, and the per-task table with its note. With `view` (a
    page, `table_view_page`), a link under the title opens it in Snakemake's report, one click."""
    body = [f'<div class="rpb-landing">\n{LANDING_STYLE}', f"<h2>{_escape(title)}</h2>"]
    if banner:
        body.append(f'<p class="banner" style="{BANNER_STYLE}">{_inline(banner)}</p>')
    if view:
        body.append(view_link(view))
    if lead:
        body.append('<p class="lead">' + " ".join(_inline(s) for s in lead) + "</p>")
    else:
        body.append(
            '<p class="lead">No claim is judged on this table (the config has no claims).</p>'
        )
    body.append(_landing_table(headline, "headline"))
    if notes[0]:
        body.append(f'<p class="note">{_inline(notes[0])}</p>')
    if checks:
        body.append('<h3>Checks (the premises the verdicts depend on)</h3>\n<ul class="checks">')
        for check_id, outcome, value, passed in checks:
            kind = "met" if passed else outcome.split(":", 1)[0].replace(" ", "-")
            word, _, rest = outcome.partition(": ")
            body.append(
                f'<li class="{kind}"><b>{_escape(check_id)} {_escape(word)}:</b> '
                f'{_escape(rest)} <span class="value">({_inline(value)})</span></li>'
            )
        body.append("</ul>")
    if comparisons:
        body.append('<h3>The comparisons behind the verdicts</h3>\n<ul class="comparisons">')
        body += [f"<li>{_inline(c)}</li>" for c in comparisons]
        body.append("</ul>")
    body.append("<h3>Per task</h3>")
    body.append(_landing_table(per_task, "per-task"))
    if notes[1]:
        body.append(f'<p class="note">{_inline(notes[1])}</p>')
    body.append("</div>")
    return "\n".join(body) + "\n"


# --- the claims audit ----------------------------------------------------------------------------


class CheckLike(Protocol):
    """A manipulation check as `rpb.report.audit.Check` has it."""

    id: str
    premise: str
    passed: bool
    value: str

    @property
    def state(self) -> str: ...

    def outcome(self) -> str: ...

    def text(self) -> str: ...


def verdict_class(verdict: Any) -> str:
    """The CSS class of a verdict cell: its verdict without its reason ("inconclusive
    (underpowered: ...)" -> inconclusive, "not testable: ..." -> not-testable)."""
    base = re.split(r" \(|:", str(verdict), maxsplit=1)[0].strip()
    return base.replace(",", "").replace(" ", "-") if base else ""


def _claims_css(column: str, value: Any) -> str:
    if column.startswith(("verdict", "claim_verdict")) or column == "verdict_detail":
        return verdict_class(value)
    if column == "outcome":
        return "passed" if value == "passed" else "failed"
    return ""


# claims.csv's columns a page shows, in this order (the CSV keeps all).
CLAIM_COLUMNS = ["claim", "kind", "statement", "claim_verdict", "measured_by", "paper"]
# A part's columns are claims.csv's own, less the claim-level ones and the raw verdicts (the page
# shows `verdict_detail`), so a column the audit adds appears without a second list here.
PART_HIDDEN = {*CLAIM_COLUMNS, "verdict", "verdict_checks_waived"} - {"part"}


def _table_of(measured_by: str) -> str:
    """The table a claim is measured on: `table1` of "table1 runs + claims.placebo"."""
    return str(measured_by).split()[0] if str(measured_by).strip() else ""


def _claims_sections(
    table: pd.DataFrame, checks: Sequence[CheckLike], floatfmt: str
) -> list[tuple[str, str]]:
    claims = table.drop_duplicates("claim")[[c for c in CLAIM_COLUMNS if c in table.columns]]
    parts = table[[c for c in table.columns if c not in PART_HIDDEN]].copy()
    # A part's checks by premise and outcome; their values are in the checks' own table.
    short = {c.text(): f"{c.id} {c.outcome()}" for c in checks}
    if "checks" in parts:
        parts["checks"] = [
            "; ".join(short.get(t, t) for t in str(v).split(" | ") if t)
            for v in parts["checks"].fillna("")
        ]
    per_base = [c for c in table.columns if re.fullmatch(r"verdict(_checks_waived)?_base\d+", c)]
    outcomes = pd.DataFrame(
        [
            {
                "check": c.id,
                "premise": c.premise,
                "outcome": c.state,
                "value": c.value,
            }
            for c in checks
        ],
        columns=["check", "premise", "outcome", "value"],
    )
    sections = [
        ("Claims and their verdicts", table_html(claims, floatfmt, _claims_css)),
        (
            "Manipulation checks (the premises, judged before any accuracy verdict)",
            table_html(outcomes, floatfmt, _claims_css),
        ),
        ("Parts: each one interval, judged by its rule", table_html(parts, floatfmt, _claims_css)),
    ]
    if per_base:
        by_base = table[["part", "verdict", *per_base]]
        sections.append(("Per-base verdicts", table_html(by_base, floatfmt, _claims_css)))
    return sections


def claims_pages(
    table: pd.DataFrame,
    checks: Sequence[CheckLike],
    title: str,
    summary: Sequence[str],
    floatfmt: str = ".3g",
) -> dict[str, str]:
    """The audit's pages: "claims" (every claim, check and part) and per table measured on
    (claims.csv's `measured_by`: table1, ...) its claims, their parts and the checks those
    depend on. `summary`: the audit's generated caption (its rules, the measure, the counts)."""
    pages = {"claims": page(title, summary, _claims_sections(table, checks, floatfmt))}
    tables = table["measured_by"].map(_table_of)
    for name in dict.fromkeys(t for t in tables if t):
        rows = table[tables == name]
        used = " | ".join(rows["checks"].fillna("").astype(str))
        own = [c for c in checks if c.text() in used]
        label = re.sub(r"^table(\d+)$", r"Table \1", name)
        caption = [
            f"The claims measured on {label} ({', '.join(dict.fromkeys(rows['claim']))}): "
            "each claim's verdict combines its parts' verdicts; a part whose premise "
            "(manipulation check) failed is not testable.",
            *summary,
        ]
        pages[name] = page(f"{title}: {label}", caption, _claims_sections(rows, own, floatfmt))
    return pages


def write_claims_html(
    out_csv: Path,
    table: pd.DataFrame,
    checks: Sequence[CheckLike],
    title: str,
    summary: Sequence[str],
) -> list[Path]:
    """`<stem>.html` beside the claims CSV and `claims_by_table/<table>_claims.html` (see
    `claims_pages`); returns the paths written."""
    out_csv = Path(out_csv)
    folder = out_csv.parent / CLAIMS_BY_TABLE
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in claims_pages(table, checks, title, summary).items():
        path = out_csv.with_suffix(".html") if name == "claims" else folder / f"{name}_claims.html"
        written.append(write_text(path, text))
    return written
