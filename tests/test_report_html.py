"""The report's HTML renderings (rpb.report.report_html) and their captions: a caption names the
interval the code computed (kind and confidence, recomputed here from the synthetic runs' items with
the function of that name), the claims pages carry every verdict and premise check of claims.csv,
and the workflow/report/*.rst captions claim no interval of their own; every table the report lists
is also rendered as HTML, and every run has its figure."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from conftest import skip_table_figures
from result_worlds import OOD_ALL, PAPER_WORLD, run_names_on, write_json, write_run, write_world

import rpb.report.tables
from rpb.report import stats
from rpb.report.audit import Check, Part
from rpb.report.claims import build_claims, claims_frame
from rpb.report.report_html import CLAIMS_BY_TABLE, table_html, verdict_class, write_table_html
from rpb.report.table1 import build_table1
from rpb.report.table3 import build_table3
from rpb.report.verdicts import EXPLORATORY, INCONCLUSIVE, NOT_TESTABLE, SUPPORTED
from rpb.specs import Run, eval_path

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "workflow" / "report"


class _Page(HTMLParser):
    """The captions (`p.caption`) and tables (header and rows of cell texts) of a page."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.captions: list[str] = []
        self.tables: list[pd.DataFrame] = []
        self._caption: list[str] | None = None
        self._rows: list[list[str]] | None = None
        self._cell: list[str] | None = None
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "p" and ("class", "caption") in attrs:
            self._caption = []
        elif tag == "table":
            self._rows = []
        elif tag == "tr" and self._rows is not None:
            self._rows.append([])
        elif tag in ("td", "th") and self._rows is not None:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "p" and self._caption is not None:
            self.captions.append("".join(self._caption))
            self._caption = None
        elif tag in ("td", "th") and self._cell is not None and self._rows is not None:
            self._rows[-1].append("".join(self._cell))
            self._cell = None
        elif tag == "table" and self._rows is not None:
            head, *body = self._rows
            self.tables.append(pd.DataFrame(body, columns=head))
            self._rows = None

    def handle_data(self, data: str) -> None:
        for part in (self._caption, self._cell):
            if part is not None:
                part.append(data)


@pytest.fixture(autouse=True)
def _no_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages and captions only: the tables are built without their heatmaps."""
    skip_table_figures(monkeypatch)


def _number(text: str) -> float:
    return float(text) if text else float("nan")


# --- a table's caption against its computation --------------------------------------------------

SEEDS = [0, 1, 2]
METHODS = ["none", "lbl", "rpb"]
# The function each interval kind a caption may name stands for (rpb.report.stats): a caption naming
# any other kind ("bootstrap CI", ...) fails.
INTERVALS = {stats.RUN_INTERVAL: "t_interval", stats.ITEM_INTERVAL: "item_interval"}
STATED = re.compile(r"(\d+(?:\.\d+)?)% (.+?) over (the method's runs|its items)")


def _world(root: Path) -> dict[str, Any]:
    """Table 1's runs (the base once, each method at 3 seeds); returns table 1's spec."""
    for label in ["base", *METHODS]:
        for seed in [0] if label == "base" else SEEDS:
            write_run(root, "tinyA", "math", label, Run(0, seed), PAPER_WORLD[label])
    return {
        "model": "tinyA",
        "corpus": "math",
        "methods": METHODS,
        "runs": run_names_on(SEEDS),
        "in_domain": ["math"],
        "ood": OOD_ALL,
        "scale": "tiny",
    }


def _item_scores(root: Path, label: str, seed: int, key: str) -> np.ndarray:
    """A run's in-domain items (fractions) in one measure, read back from its eval output."""
    import json

    tasks = json.loads(eval_path(root, "tinyA", "math", label, Run(0, seed)).read_text())["tasks"]
    if key == "items":
        return np.asarray(tasks["rpb_math"]["items"], dtype=float)
    return np.asarray(tasks["rpb_math_ll"]["p_target"], dtype=float)


def check_table1_caption(text: str, root: Path) -> None:
    """Table 1's page states each interval (kind, confidence, what it is over); recomputing
    that interval from the runs' items with the function of the stated kind at the stated
    confidence gives the page's cells. Raises AssertionError where they disagree."""
    page = _Page(text)
    caption = " ".join(page.captions)
    stated = {over: (float(level) / 100, kind) for level, kind, over in STATED.findall(caption)}
    assert set(stated) == {"the method's runs", "its items"}, caption
    (shown,) = page.tables
    shown = shown.set_index("method")
    for suffix, key in (("", "items"), ("_p", "p_target")):
        for label in ["base", *METHODS]:
            seeds = [0] if label == "base" else SEEDS
            over = "its items" if len(seeds) == 1 else "the method's runs"
            confidence, kind = stated[over]
            assert kind in INTERVALS, f"the caption names a {kind!r}, computed: {set(INTERVALS)}"
            function = getattr(stats, INTERVALS[kind])
            items = [_item_scores(root, label, s, key) for s in seeds]
            if function is stats.item_interval:
                _, low, high = stats.item_interval(items, confidence)
            else:
                scores = [100 * v.mean() for v in items]
                _, low, high, _ = (float(x) for x in function(scores, confidence=confidence))
                low, high = max(0.0, low), min(100.0, high)
            row = shown.loc[label]
            cells = (
                _number(row[f"in_domain{suffix}_ci_low"]),
                _number(row[f"in_domain{suffix}_ci_high"]),
            )
            assert cells == pytest.approx((low, high), abs=0.006), (label, suffix, kind, confidence)


@pytest.mark.parametrize("confidence", [0.95, 0.9])
def test_table1_caption_names_the_interval_the_code_computes(
    tmp_path: Path, confidence: float
) -> None:
    spec = _world(tmp_path) | {"confidence": confidence}
    build_table1(tmp_path, spec, tmp_path / "table1.csv")
    text = (tmp_path / "table1.html").read_text()
    assert stats.describe_interval(confidence, "the method's runs") in text
    check_table1_caption(text, tmp_path)
    # The page is the Markdown's title, caption and table, rendered (a <table>, not a download).
    md = (tmp_path / "table1.md").read_text()
    title = md.split(". ", 1)[0]
    assert f"<h1>{title}</h1>" in text and "<table" in text and "data:text/csv" not in text


@pytest.fixture(scope="module")
def table1_at_90(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Table 1's runs and its page at 90% confidence, shared (only read)."""
    root = tmp_path_factory.mktemp("table1_at_90")
    with pytest.MonkeyPatch.context() as monkeypatch:
        skip_table_figures(monkeypatch)
        build_table1(root, _world(root) | {"confidence": 0.9}, root / "table1.csv")
    return root


@pytest.mark.parametrize(
    ("stated", "claimed"),
    [
        ("90% t-interval over the method's runs", "95% t-interval over the method's runs"),
        ("90% t-interval over the method's runs", "90% bootstrap CI over the method's runs"),
        ("90% normal interval over its items", "99% normal interval over its items"),
    ],
)
def test_a_caption_that_disagrees_with_the_computation_fails(
    table1_at_90: Path, stated: str, claimed: str
) -> None:
    """The check above catches a caption claiming another kind or confidence."""
    text = (table1_at_90 / "table1.html").read_text()
    check_table1_caption(text, table1_at_90)
    assert stated in text
    with pytest.raises(AssertionError):
        check_table1_caption(text.replace(stated, claimed), table1_at_90)


def test_a_computation_that_drifts_from_its_caption_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The computation at a level the caption does not state (the spec says 90%, the intervals
    are computed at 95%): the page's cells and its caption disagree."""
    level = rpb.report.tables.run_level
    monkeypatch.setattr(
        rpb.report.tables, "run_level", lambda spec: level(spec) | {"confidence": 0.95}
    )
    build_table1(tmp_path, _world(tmp_path) | {"confidence": 0.9}, tmp_path / "table1.csv")
    text = (tmp_path / "table1.html").read_text()
    assert "90% t-interval over the method's runs" in text
    with pytest.raises(AssertionError):
        check_table1_caption(text, tmp_path)


def test_table3_caption_names_the_paired_interval(tmp_path: Path) -> None:
    """Table 3's caption: its stated interval is the t-interval of the per-run differences."""
    world = {k: PAPER_WORLD[k] for k in ("lbl", "rpb")}
    write_world(tmp_path, world, models=("tinyA",), corpora=("math2",), seeds=tuple(SEEDS))
    spec = {
        "models": ["tinyA"],
        "corpus": "math2",
        "method": "rpb",
        "reference": "lbl",
        "runs": run_names_on(SEEDS),
        "ood": OOD_ALL,
        "scale": "tiny",
        "confidence": 0.9,
    }
    build_table3(tmp_path, spec, tmp_path / "table3.csv")
    page = _Page((tmp_path / "table3.html").read_text())
    level, kind, _ = re.search(r"(\d+)% (.+?) over (runs)", " ".join(page.captions)).groups()
    assert kind == stats.RUN_INTERVAL
    table = page.tables[0]
    row = table[table["metric"] == "in_domain"].iloc[0]
    diffs = [100 * (_items(tmp_path, "rpb", s) - _items(tmp_path, "lbl", s)).mean() for s in SEEDS]
    _, low, high, _ = stats.t_interval(diffs, confidence=float(level) / 100)
    # The item-level floor of the spread (stats.run_interval's min_sd) only widens it; the page
    # shows 3 significant digits.
    assert _number(row["diff_ci_low"]) <= float(low) + 0.06
    assert _number(row["diff_ci_high"]) >= float(high) - 0.06
    assert _number(row["diff"]) == pytest.approx(np.mean(diffs), abs=0.06)


def _items(root: Path, label: str, seed: int) -> np.ndarray:
    import json

    path = eval_path(root, "tinyA", "math2", label, Run(0, seed))
    return np.asarray(json.loads(path.read_text())["tasks"]["rpb_math2"]["items"], dtype=float)


def test_describe_interval_names_only_computed_kinds() -> None:
    assert stats.describe_interval(0.95) == "95% t-interval over runs"
    assert stats.describe_interval(0.9, "its items", stats.ITEM_INTERVAL) == (
        "90% normal interval over its items"
    )
    with pytest.raises(ValueError, match="unknown interval kind"):
        stats.describe_interval(0.95, kind="bootstrap CI")
    with pytest.raises(ValueError, match="confidence"):
        stats.describe_interval(95)


# --- rendering ----------------------------------------------------------------------------------


def test_table_html_formats_escapes_and_leaves_nan_empty(tmp_path: Path) -> None:
    frame = pd.DataFrame(
        {"method": ["<b>x</b>", "y"], "n": [2, 3], "score": [45.678, float("nan")], "ok": [1, 0]}
    )
    frame["ok"] = frame["ok"].astype(bool)
    page = _Page(table_html(frame, ".2f"))
    (shown,) = page.tables
    assert list(shown.columns) == ["method", "n", "score", "ok"]
    assert shown.values.tolist() == [["<b>x</b>", "2", "45.68", "True"], ["y", "3", "", "False"]]
    assert "<b>" not in table_html(frame)
    assert "(no rows)" in table_html(frame.iloc[:0])
    path = write_table_html(tmp_path / "t.html", "T", "a `col` note", [("Part", frame)])
    text = path.read_text()
    assert "<code>col</code>" in text and "<h2>Part</h2>" in text
    assert _Page(text).captions == ["a col note"]


def test_verdict_classes() -> None:
    assert verdict_class("supported") == "supported"
    assert verdict_class("inconclusive (underpowered: MDE 6.1 pp, needs 9 runs)") == "inconclusive"
    assert verdict_class("positive, below the margin (above 0, ...)") == "positive-below-the-margin"
    assert verdict_class("not testable: M1 lbl flattens routing failed, x") == "not-testable"
    assert verdict_class("not supported") == "not-supported"


# --- the claims pages -----------------------------------------------------------------------------


def _parts() -> tuple[dict[str, list[Part]], list[Check]]:
    m1 = Check("M1", "lbl flattens routing vs none (tinyA)", False, "entropy +0.05")
    m4 = Check("M4", "anchor_kl reduces router drift vs none", True, "KL -0.3")
    c1 = Part(SUPPORTED, "rpb - none: +40 pp", name="rpb - none", rule="direction", checks=())
    c1b = Part(NOT_TESTABLE, "rpb - lbl: +1 pp", name="rpb - lbl", checks=(m1,), note="M1 failed")
    c5 = Part(INCONCLUSIVE, "rpb - anchor_kl", name="rpb - anchor_kl", checks=(m4,))
    return {"C1": [c1, c1b], "C5": [c5]}, [m1, m4]


def test_claims_pages_carry_every_verdict_and_check(tmp_path: Path) -> None:
    from rpb.report.report_html import write_claims_html

    parts, checks = _parts()
    table = claims_frame(parts)
    summary = [f"Verdict rules: the {stats.describe_interval(0.9, '(base, seed) runs')}."]
    written = write_claims_html(tmp_path / "claims.csv", table, checks, "Claims audit", summary)
    assert [p.relative_to(tmp_path).as_posix() for p in written] == [
        "claims.html",
        f"{CLAIMS_BY_TABLE}/table1_claims.html",
        f"{CLAIMS_BY_TABLE}/table4_claims.html",
    ]
    page = _Page((tmp_path / "claims.html").read_text())
    assert page.captions == summary
    claims, outcomes, shown = page.tables
    assert dict(zip(claims["claim"], claims["claim_verdict"], strict=True)) == {
        "C1": NOT_TESTABLE,
        "C5": INCONCLUSIVE,
    }
    assert outcomes[["check", "outcome"]].values.tolist() == [["M1", "not met"], ["M4", "met"]]
    assert list(shown["part"]) == list(table["part"])
    assert list(shown["verdict_detail"]) == list(table["verdict_detail"])
    # A part names its checks by premise and outcome (their values: the checks' table).
    assert list(shown["checks"]) == [
        "",
        "M1 not met: lbl flattens routing vs none (tinyA)",
        "M4 met: anchor_kl reduces router drift vs none",
    ]
    text = (tmp_path / "claims.html").read_text()
    assert 'class="text not-testable"' in text and 'class="text supported"' in text
    # Per table: its claims and only the checks they depend on.
    t1 = _Page((tmp_path / CLAIMS_BY_TABLE / "table1_claims.html").read_text())
    assert "Table 1 (C1)" in t1.captions[0] and summary[0] in t1.captions
    claims1, outcomes1, parts1 = t1.tables
    assert list(claims1["claim"]) == ["C1"] and list(outcomes1["check"]) == ["M1"]
    assert list(parts1["part"]) == ["C1.1", "C1.2"]
    t4 = _Page((tmp_path / CLAIMS_BY_TABLE / "table4_claims.html").read_text())
    assert list(t4.tables[0]["claim"]) == ["C5"] and list(t4.tables[1]["check"]) == ["M4"]
    assert EXPLORATORY not in set(t4.tables[0]["kind"])


def test_build_claims_renders_the_audit_with_its_computed_level(tmp_path: Path) -> None:
    """End to end on a small world: claims.html and one page per table, their verdicts those of
    claims.csv, the caption's interval at the audit's confidence."""
    seeds = [0, 1, 2]
    anchors = ["anchor_weight", "anchor_logit", "anchor_kl"]
    write_world(tmp_path, PAPER_WORLD, seeds=tuple(seeds))
    layers = [{"layer": i, "split_half_nmi": 0.8} for i in range(2)]
    entry = {"structure": {"layers": layers, "uniform": {"split_half_nmi": 0.1}}}
    write_json(tmp_path / "testbed.json", {"tinyA": entry, "tinyB": entry})
    runs = run_names_on(seeds)
    t1 = {"model": "tinyA", "corpus": "math", "methods": METHODS, "runs": runs}
    spec = {
        "scale": "tiny",
        "ood": OOD_ALL,
        "method": "rpb",
        "reference": "lbl",
        "margin": 5.0,
        "nmi_margin": 0.05,
        "rho_margin": 0.5,
        "confidence": 0.9,
        "power": 0.8,
        "min_split_half_nmi": 0.5,
        "n_resamples": 100,
        "table1": t1,
        "table2": t1 | {"model": "tinyB"},
        "table3": {"models": ["tinyA"], "corpus": "math2", "runs": runs},
        "table4": {"model": "tinyA", "corpora": ["math"], "runs": runs, "methods": anchors},
        "table5": {"model": "tinyA", "corpus": "math", "runs": runs}
        | {"correlate": [*METHODS, *anchors], "methods": [*METHODS, "hard"]}
        | {"kinds": {"hard": "hard"}},
    }
    table = build_claims(tmp_path, spec, tmp_path / "claims.csv")
    page = _Page((tmp_path / "claims.html").read_text())
    assert stats.describe_interval(0.9, "(base, seed) runs") in page.captions[0]
    md = (tmp_path / "claims.md").read_text()
    # The same caption as claims.md's (there `code` keeps its backticks).
    assert all(caption in md.replace("`", "") for caption in page.captions)
    _, outcomes, parts, *_ = page.tables
    csv = pd.read_csv(tmp_path / "claims.csv", keep_default_na=False)
    assert list(parts["verdict_detail"]) == list(csv["verdict_detail"])
    assert set(outcomes["outcome"]) <= {"met", "not met", "undetermined"} and len(outcomes)
    # Every premise check of claims.md, with its outcome.
    listed = md.split("## Manipulation checks")[1].split("\n## ")[0].splitlines()
    items = [line for line in listed if line.startswith("- ")]
    assert len(items) == len(outcomes)
    for line, (c, p, o, v) in zip(items, outcomes.itertuples(index=False), strict=True):
        # A check that holds is stated as its premise; one that does not, as what that means.
        assert line.startswith(f"- {c} {o}: ") and line.endswith(f"({v})")
        assert o != "met" or line == f"- {c} met: {p} ({v})"
    pages = sorted(p.name for p in (tmp_path / CLAIMS_BY_TABLE).iterdir())
    assert pages == sorted({f"{m.split()[0]}_claims.html" for m in table["measured_by"]})
    for name in pages:
        shown = _Page((tmp_path / CLAIMS_BY_TABLE / name).read_text()).tables[2]
        mine = csv[csv["measured_by"].str.split().str[0] == name.removesuffix("_claims.html")]
        assert list(shown["verdict_detail"]) == list(mine["verdict_detail"])


# --- the workflow's report declarations and captions ----------------------------------------------

# A caption claiming an interval or a level of its own (they come from the code, not the .rst).
INTERVAL_CLAIM = re.compile(
    r"\d+(?:\.\d+)?\s*%|bootstrap|t-interval|normal interval|confidence interval|\bCIs?\b|"
    r"config\[.claims.\]",
    re.IGNORECASE,
)


def _report_items() -> list[tuple[str, str, str]]:
    """(path, caption, category) of every output the Snakemake report shows, as Snakemake parsed
    the workflow's `all` (its report() flags, recorded by tests/test_plan_snapshot.py, which
    checks that the workflow still plans exactly these)."""
    snapshot = json.loads(
        (ROOT / "tests" / "data" / "plan_snapshot" / "default-all.json").read_text()
    )
    items = []
    for job in snapshot["jobs"]:
        for path, shown in job["report"].items():
            relative = path.removeprefix("<results>/")
            items.append((relative, Path(shown["caption"]).name, shown["category"]))
    assert items, "the snapshot records no report item"
    return sorted(items)


def test_captions_claim_no_interval_of_their_own() -> None:
    captions = sorted(REPORT.glob("*.rst"))
    assert captions
    for path in captions:
        found = INTERVAL_CLAIM.findall(path.read_text())
        assert not found, f"{path.name} states {found}: captions come from the code"
    used = {caption for _, caption, _ in _report_items()} | {"workflow.rst"}
    assert used == {p.name for p in captions}, "a caption no report item uses, or a missing one"


def test_every_reported_table_is_rendered_and_every_run_has_its_figure() -> None:
    items = _report_items()
    paths = {path for path, _, _ in items}
    pages = {p.removesuffix(".html") for p in paths if p.endswith(".html")}
    for path, caption, category in items:
        if path.endswith(".csv"):
            stem = path.removesuffix(".csv")
            # The CSV is a download beside its rendered table (table4_pairs.csv: table4.html).
            assert any(stem == p or stem.startswith(f"{p}_") for p in pages), path
            assert caption == "data.rst", path
            assert any(p in pages and c == category for p, _, c in _page_items(items)), path
        if path.endswith("_coactivation_runs"):
            assert caption == "coactivation.rst"
    # Per-run heatmaps wherever a table draws them (no first-seed figure alone).
    for name in ("table1", "table2", "table4", "table5"):
        assert f"figures/{name}_coactivation_runs" in paths, name
        assert f"figures/{name}_coactivation.png" not in paths, name
    assert "claims_by_table" in paths and "claims.html" in paths


def _page_items(items: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    return [(p.removesuffix(".html"), c, cat) for p, c, cat in items if p.endswith(".html")]


def test_landing_html_leads_with_the_verdicts_and_lists_the_checks() -> None:
    from rpb.report.report_html import landing_html

    headline = pd.DataFrame({"method": ["none", "rpb<"], "in-domain": ["1.00 [0.50, 1.50]", "2"]})
    per_task = pd.DataFrame({"": ["OOD facts"], "none": ["5.00 / 0.08"], "rpb<": ["1 / 2"]})
    checks = [
        ("M1", "not met: lbl did not flatten routing", "entropy +0.05", False),
        ("M2", "undetermined: the rpb reading anchors", "undetermined: `snakemake all`", False),
        ("M5", "met: headroom above none", "0.0%", True),
    ]
    lead = ["C1 (RPB beats LBL): not testable here.", "C2 (RPB keeps more): not testable here."]
    text = landing_html("Table 1 (smoke)", lead, headline, per_task, checks, ["C1 rpb - none"])
    page = _Page(text)
    assert text.index("C1 (RPB beats LBL)") < text.index("<table") < text.index("M1")
    assert text.index("M1") < text.index("OOD facts")  # the per-task table last
    assert "rpb&lt;" in text and "FAILED" not in text
    for kind in ("not-met", "undetermined", "met"):
        assert f'<li class="{kind}">' in text
    assert "<b>M1 not met:</b> lbl did not flatten routing" in text
    assert "<code>snakemake all</code>" in text
    assert list(page.tables[0].columns) == ["method", "in-domain"]
    assert page.tables[0].iloc[1].tolist() == ["rpb<", "2"]
    assert not text.lstrip().startswith("<!DOCTYPE"), "a fragment, included in the report's page"
    assert "No claim is judged" in landing_html("T", [], headline, per_task)
