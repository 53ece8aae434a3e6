"""Tables 1-5 built from synthetic pipeline outputs (tests/result_worlds.py): columns, rows,
the numbers against the inputs, intervals, paired comparisons, ranks, retention and the base;
p(target) beside exact match in every table (columns `<score>_p`), absent at paper scale."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import skip_table_figures
from result_worlds import N_ITEMS, OOD_ALL, PAPER_WORLD, run_names_on, write_json, write_world
from safetensors.torch import save_file
from scipy import stats

from rpb.report.table1 import (
    PAPER_ROW,
    PAPER_TABLE1,
    build_table1,
    build_table2,
    headline_frame,
    per_task_frame,
)
from rpb.report.table3 import build_table3
from rpb.report.table4 import build_table4
from rpb.report.table5 import build_table5
from rpb.report.tables import Cell
from rpb.specs import Run, analysis_path, eval_path, spec_runs

# The tests that look at the heatmaps; every other one builds its tables without drawing them.
DRAWS_FIGURES = {
    "test_table1_columns_and_rows",
    "test_table2_is_table1_for_another_model",
    "test_table5_correlation_hard_and_base",
}


@pytest.fixture(autouse=True)
def _figures_where_looked_at(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    if request.node.originalname not in DRAWS_FIGURES:
        skip_table_figures(monkeypatch)


# --- build_table1 -----------------------------------------------------------------------------

OOD = ["addition", "facts"]
SPEC: dict[str, Any] = {
    "model": "tinyA",
    "corpus": "math",
    "methods": ["none", "lbl", "rpb"],
    "runs": run_names_on([0, 1]),
    "in_domain": ["math"],
    "ood": OOD,
    "scale": "smoke",
}
# Per label: probability of a correct in-domain item, of a correct OOD item, and a modularity.
LEVELS = {"base": (0.0, 0.9, 0.30), "none": (0.7, 0.3, 0.20), "lbl": (0.6, 0.4, 0.22)}
LEVELS["rpb"] = (0.8, 0.6, 0.28)


def _fake_results(root: Path, spec: dict) -> dict[str, dict[int, dict]]:
    """Eval and analysis JSONs laid out as the pipeline writes them; returns what was written:
    per label and seed (on base 0) the exact-match items (`tasks`), the p(target) items of their
    loglikelihood twins (`p_target`, drawn independently of them) and the layer means."""
    rng = np.random.default_rng(0)
    p_rng = np.random.default_rng(1)  # its own stream: exact match's draws stay as they were
    written: dict[str, dict[int, dict]] = {}
    for label in ["base", *spec["methods"]]:
        p_in, p_ood, modularity = LEVELS[label]
        written[label] = {}
        for run in [Run(0, 0)] if label == "base" else spec_runs(spec):
            seed = run.seed
            tasks = {"math": (rng.random(25) < p_in).astype(int).tolist()}
            tasks |= {t: (rng.random(10) < p_ood).astype(int).tolist() for t in spec["ood"]}
            p_target = {t: p_rng.random(len(v)).tolist() for t, v in tasks.items()}
            mean = {
                "modularity": modularity + 0.01 * seed,
                "community_nmi": 0.5 + 0.1 * seed,
                "coact_cosine": 0.9 - 0.05 * seed,
            }
            fields = (root, spec["model"], spec["corpus"], label, run)
            payload = {f"rpb_{t}": {"items": v, "metric": "exact_match"} for t, v in tasks.items()}
            payload |= {f"rpb_{t}_ll": {"p_target": v} for t, v in p_target.items()}
            write_json(eval_path(*fields), {"tasks": payload})
            write_json(analysis_path(*fields), {"mean": mean})
            # The analysis job's co-activation counts [layers, experts, experts] beside its JSON.
            counts = rng.integers(0, 50, size=(2, 4, 4))
            counts = torch.from_numpy(counts + counts.transpose(0, 2, 1))
            counts_path = analysis_path(*fields).with_suffix(".safetensors")
            save_file({"counts": counts}, str(counts_path))
            written[label][seed] = {"tasks": tasks, "p_target": p_target, "mean": mean}
    return written


@pytest.fixture
def table(tmp_path: Path) -> tuple[pd.DataFrame, dict, Path]:
    written = _fake_results(tmp_path / "results", SPEC)
    out = tmp_path / "results" / "table1.csv"
    return build_table1(tmp_path / "results", SPEC, out), written, out


def test_table1_columns_and_rows(table: tuple[pd.DataFrame, dict, Path]) -> None:
    df, _, out = table
    assert list(df.columns) == [
        "model",
        "method",
        "n_seeds",
        "in_domain",
        "in_domain_ci_low",
        "in_domain_ci_high",
        "in_domain_p",
        "in_domain_p_ci_low",
        "in_domain_p_ci_high",
        "ood_addition",
        "ood_addition_p",
        "ood_facts",
        "ood_facts_p",
        "ood_mean",
        "ood_mean_p",
        "modularity",
        "community_nmi",
        "coact_cosine",
        "paper_in_domain",
    ]
    assert list(df["method"]) == ["base", "none", "lbl", "rpb"]
    assert list(df["n_seeds"]) == [1, 2, 2, 2]
    assert set(df["model"]) == {"tinyA"}
    on_disk = pd.read_csv(out)
    assert list(on_disk.columns) == list(df.columns)
    np.testing.assert_allclose(on_disk["in_domain"], df["in_domain"], atol=1e-4)
    md = out.with_suffix(".md").read_text()
    assert "Table 1" in md
    # The Markdown says which measure each column is.
    assert "columns without a suffix are exact match" in md and "are p(target)" in md
    meta = json.loads(out.with_suffix(".meta.json").read_text())
    assert meta["runs"] == ["base0/seed0", "base0/seed1"]
    assert meta["measures"] == ["exact_match", "p_target"]
    assert list((out.parent / "figures").glob("table1_coactivation*"))


def test_smoke_table1_says_its_numbers_carry_no_meaning(tmp_path: Path) -> None:
    """A smoke run's table 1 (config `scale: smoke`) says first, in its caption and on its landing
    page, that its numbers carry no meaning; a tiny-scale table 1 says nothing of the kind, its
    caption as it was."""
    from rpb.report.table1 import SMOKE_NOTE

    written = {}
    for scale in ("smoke", "tiny"):
        results = tmp_path / scale
        _fake_results(results, SPEC)
        build_table1(results, SPEC | {"scale": scale}, results / "table1.csv", verdicts=["C1: x"])
        md = (results / "table1.md").read_text()
        landing = (results / "table1.landing.html").read_text()
        meta = json.loads((results / "table1.meta.json").read_text())
        written[scale] = (md, landing, meta["note"], (results / "table1.html").read_text())
    md, landing, note, html = written["smoke"]
    assert "carry no meaning" in SMOKE_NOTE
    assert note.startswith(SMOKE_NOTE + " C1: x") and SMOKE_NOTE in md
    assert "carry no meaning" in html
    # On the landing page, right under its title: the report's first screen.
    head = landing.split("</h2>", 1)[1].lstrip()
    assert head.startswith('<p class="banner"') and "carry no meaning" in head.split("</p>")[0]
    tiny = written["tiny"]
    assert not any("carry no meaning" in text or "Smoke run" in text for text in tiny)
    assert tiny[2].startswith("C1: x ") and 'class="banner"' not in tiny[1]


def test_table1_is_one_link_from_the_landing_in_the_columns_a_reader_needs(
    table: tuple[pd.DataFrame, dict, Path],
) -> None:
    """The report's first screen (table 1's landing) links table 1 itself, under its title: a
    page of the columns a reader needs (`READER_COLUMNS`, 10 of the CSV's 19 here), the rest left
    to the CSV; table1.html keeps every column."""
    import base64

    from rpb.report.table1 import READER_COLUMNS

    df, _, out = table
    landing = out.with_suffix(".landing.html").read_text()
    head = landing.split("</h2>", 1)[1]
    link = re.search(
        r'<a class="rpb-open-table" href="#" data-view="([^"]+)" onclick="([^"]+)"', head
    )
    assert link and head.index("rpb-open-table") < head.index("<table"), "no link above the table"
    assert "app.setView" in link.group(2)
    uri = link.group(1)
    assert uri.startswith("data:text/html;base64,")
    view = base64.b64decode(uri.split(",", 1)[1]).decode()
    heads = re.findall(r"<th>([^<]*)</th>", view)
    assert heads == list(READER_COLUMNS) and len(heads) < len(df.columns)
    assert "table1.csv" in view and "Smoke run" in view  # SPEC is a smoke spec
    assert all(f"<th>{c}</th>" in out.with_suffix(".html").read_text() for c in df.columns)


def test_make_smoke_ends_saying_its_numbers_carry_no_meaning() -> None:
    """`make smoke`'s last lines (its recipe's last commands) say that smoke numbers carry no
    meaning and name the command that gives table 1's."""
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    recipe = makefile.split("\nsmoke: install\n", 1)[1].split("\n\n", 1)[0].splitlines()
    tail = " ".join(line for line in recipe[-4:])
    assert all(line.lstrip().startswith("@echo") for line in recipe[-4:]), recipe
    assert "smoke run" in tail and "no meaning" in tail and "make table1" in tail


def test_table1_numbers_are_percentages_of_the_inputs(
    table: tuple[pd.DataFrame, dict, Path],
) -> None:
    df, written, _ = table
    for label, per_seed in written.items():
        row = df.set_index("method").loc[label]
        math_items = np.concatenate([np.array(s["tasks"]["math"]) for s in per_seed.values()])
        assert row["in_domain"] == pytest.approx(100 * math_items.mean())
        ood = {t: 100 * np.mean([np.mean(s["tasks"][t]) for s in per_seed.values()]) for t in OOD}
        for task, value in ood.items():
            assert row[f"ood_{task}"] == pytest.approx(value)
        assert row["ood_mean"] == pytest.approx(np.mean(list(ood.values())))
        for key in ("modularity", "community_nmi", "coact_cosine"):
            assert row[key] == pytest.approx(np.mean([s["mean"][key] for s in per_seed.values()]))
        assert row["in_domain_ci_low"] <= row["in_domain"] <= row["in_domain_ci_high"]
        assert row["in_domain_ci_low"] >= 0 and row["in_domain_ci_high"] <= 100
        # p(target): the same two-level means of the planted per-item p_target values.
        p_math = [np.mean(s["p_target"]["math"]) for s in per_seed.values()]
        assert row["in_domain_p"] == pytest.approx(100 * np.mean(p_math))
        p_ood = {
            t: 100 * np.mean([np.mean(s["p_target"][t]) for s in per_seed.values()]) for t in OOD
        }
        for task, value in p_ood.items():
            assert row[f"ood_{task}_p"] == pytest.approx(value)
        assert row["ood_mean_p"] == pytest.approx(np.mean(list(p_ood.values())))
        assert row["in_domain_p"] != pytest.approx(row["in_domain"])  # not exact match's numbers
        if label != "base":  # the t-interval over the runs' scores, cut to [0, 100]
            for column, key in (("in_domain", "tasks"), ("in_domain_p", "p_target")):
                runs = [100 * np.mean(s[key]["math"]) for s in per_seed.values()]
                ci = stats.ttest_1samp(runs, 0.0).confidence_interval(0.95)
                assert row[f"{column}_ci_low"] == pytest.approx(max(0.0, ci.low))
                assert row[f"{column}_ci_high"] == pytest.approx(min(100.0, ci.high))
        else:  # one run: the normal interval of its items, their variance, not a binomial's
            items = np.array(per_seed[0]["p_target"]["math"])
            half = stats.norm.ppf(0.975) * items.std() / np.sqrt(items.size)
            assert row["in_domain_p_ci_low"] == pytest.approx(100 * (items.mean() - half))
            assert row["in_domain_p_ci_high"] == pytest.approx(100 * (items.mean() + half))


def test_table1_honours_the_confidence_level(tmp_path: Path) -> None:
    _fake_results(tmp_path, SPEC)
    wide = build_table1(tmp_path, SPEC | {"confidence": 0.99}, tmp_path / "a.csv")
    narrow = build_table1(tmp_path, SPEC | {"confidence": 0.5}, tmp_path / "b.csv")
    width = {
        n: (f["in_domain_ci_high"] - f["in_domain_ci_low"]) for n, f in (("w", wide), ("n", narrow))
    }
    assert (width["w"] >= width["n"]).all() and (width["w"][1:] > width["n"][1:]).all()
    assert "99% t-interval" in (tmp_path / "a.meta.json").read_text()


def test_paper_scale_reads_standard_tasks_named_by_corpus_tasks(tmp_path: Path) -> None:
    """At paper scale the eval outputs hold lm-eval's own task names (gsm8k, ...), and a corpus is
    scored in-domain on the items of every task `corpus_tasks` lists for it, pooled; the standard
    tasks have no p(target), and the table has no `_p` column."""
    results = tmp_path / "results"
    written = _fake_results(results, SPEC)
    bench = {"gsm8k": [1, 1, 0, 0], "minerva_math500": [1, 0]}
    for label, seeds in written.items():
        for seed, entry in seeds.items():
            path = eval_path(results, "tinyA", "math", label, Run(0, seed))
            tasks = {t: {"items": v} for t, v in entry["tasks"].items() if t != "math"}
            write_json(path, {"tasks": tasks | {t: {"items": v} for t, v in bench.items()}})
    spec = SPEC | {"corpus_tasks": {"math": ["gsm8k", "minerva_math500"]}, "scale": "paper"}
    out = results / "table1.csv"
    table = build_table1(results, spec, out).set_index("method")
    assert not [c for c in table.columns if c.endswith("_p") or "_p_" in c]
    assert "p(target) is measured on the tiny testbed" in out.with_suffix(".md").read_text()
    # Per benchmark, and their mean (not the pooled items, 3 / 6): each benchmark weighs the same.
    assert table.loc["rpb", "in_domain_gsm8k"] == pytest.approx(50.0)
    assert table.loc["rpb", "in_domain_minerva_math500"] == pytest.approx(50.0)
    bench["minerva_math500"] = [1, 1]
    for label, seeds in written.items():
        for seed in seeds:
            path = eval_path(results, "tinyA", "math", label, Run(0, seed))
            result = json.loads(path.read_text())
            result["tasks"]["minerva_math500"]["items"] = [1, 1]
            path.write_text(json.dumps(result))
    table = build_table1(results, spec, out).set_index("method")
    assert table.loc["rpb", "in_domain"] == pytest.approx((50.0 + 100.0) / 2)  # pooled: 4/6
    assert "paper does not say" in out.with_suffix(".meta.json").read_text()
    ood = np.mean([np.mean(written["rpb"][s]["tasks"][t]) for s in (0, 1) for t in OOD])
    assert table.loc["rpb", "ood_mean"] == pytest.approx(100 * ood)
    assert "gsm8k, minerva_math500" in out.with_suffix(".meta.json").read_text()
    with pytest.raises(ValueError, match="no task 'rpb_math' or 'math'"):
        build_table1(results, SPEC | {"scale": "paper"}, out)


def test_several_benchmarks_have_their_p_target_beside_exact_match(tmp_path: Path) -> None:
    """corpus_tasks with two of our eval sets: in_domain_<task>_p per benchmark and in_domain_p
    their mean (each benchmark weighs the same), as exact match."""
    results = tmp_path / "results"
    written = _fake_results(results, SPEC)
    for label, seeds in written.items():
        for seed in seeds:
            path = eval_path(results, "tinyA", "math", label, Run(0, seed))
            result = json.loads(path.read_text())
            result["tasks"]["rpb_math2"] = {"items": [1, 0]}
            result["tasks"]["rpb_math2_ll"] = {"p_target": [0.9, 0.7]}
            path.write_text(json.dumps(result))
    spec = SPEC | {"corpus_tasks": {"math": ["math", "math2"]}}
    table = build_table1(results, spec, results / "t.csv")
    columns = list(table.columns)
    i = columns.index("in_domain_math")
    assert columns[i : i + 4] == [
        "in_domain_math",
        "in_domain_math_p",
        "in_domain_math2",
        "in_domain_math2_p",
    ]
    rpb = table.set_index("method").loc["rpb"]
    assert rpb["in_domain_math2_p"] == pytest.approx(80.0)
    p_math = 100 * np.mean([np.mean(written["rpb"][s]["p_target"]["math"]) for s in (0, 1)])
    assert rpb["in_domain_math_p"] == pytest.approx(p_math)
    assert rpb["in_domain_p"] == pytest.approx((p_math + 80.0) / 2)


def test_an_output_without_p_target_names_file_and_task(tmp_path: Path) -> None:
    """At tiny scale p(target) is required: an eval output from before it is an error naming
    the file and the loglikelihood task, not a table without it."""
    _fake_results(tmp_path, SPEC)
    path = eval_path(tmp_path, "tinyA", "math", "rpb", Run(0, 1))
    result = json.loads(path.read_text())
    del result["tasks"]["rpb_facts_ll"]
    path.write_text(json.dumps(result))
    with pytest.raises(
        ValueError, match=re.escape(f"{path}: no p_target items of task 'rpb_facts_ll'")
    ):
        build_table1(tmp_path, SPEC | {"scale": "tiny"}, tmp_path / "t.csv")


def test_paper_numbers_only_for_family_a(tmp_path: Path) -> None:
    _fake_results(tmp_path, SPEC)
    df_a = build_table1(tmp_path, SPEC, tmp_path / "a.csv").set_index("method")
    for label, paper in PAPER_TABLE1.items():
        assert df_a.loc[label, "paper_in_domain"] == paper
    assert math.isnan(df_a.loc["base", "paper_in_domain"])
    df_b = build_table1(tmp_path, {**SPEC, "family": "B"}, tmp_path / "b.csv")
    assert df_b["paper_in_domain"].isna().all()


def test_missing_input_names_the_file(tmp_path: Path) -> None:
    _fake_results(tmp_path, SPEC)
    missing = analysis_path(tmp_path, "tinyA", "math", "rpb", Run(0, 1))
    missing.unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        build_table1(tmp_path, SPEC, tmp_path / "t.csv")


def test_missing_task_names_file_and_task(tmp_path: Path) -> None:
    _fake_results(tmp_path, SPEC)
    path = eval_path(tmp_path, "tinyA", "math", "lbl", Run(0, 0))
    result = json.loads(path.read_text())
    del result["tasks"]["rpb_facts"]
    path.write_text(json.dumps(result))
    with pytest.raises(ValueError, match=re.escape(f"{path}: no task 'rpb_facts'")):
        build_table1(tmp_path, SPEC, tmp_path / "t.csv")


# --- tables 2-5 from synthetic pipeline outputs (tests/result_worlds.py) --------------------

STAT = {"confidence": 0.95, "n_resamples": 300, "scale": "smoke", "ood": OOD_ALL}


def test_table2_is_table1_for_another_model(tmp_path: Path) -> None:
    write_world(tmp_path, PAPER_WORLD, corpora=("math",))
    spec = {**SPEC, "model": "tinyB", "family": "B", "ood": OOD_ALL}
    df = build_table2(tmp_path, spec, tmp_path / "table2.csv")
    assert list(df["method"]) == ["base", "none", "lbl", "rpb"] and set(df["model"]) == {"tinyB"}
    assert df["paper_in_domain"].isna().all()
    assert df.set_index("method").loc["rpb", "in_domain"] == pytest.approx(
        100 * np.mean([(np.random.default_rng(1000 + s).random(N_ITEMS) < 0.8) for s in (0, 1)])
    )
    assert (tmp_path / "table2.md").read_text().startswith("Table 2")
    # Its own heatmap; table 1's is not overwritten.
    assert (tmp_path / "figures" / "table2_coactivation.png").is_file()
    assert not (tmp_path / "figures" / "table1_coactivation.png").exists()


def test_table3_paired_difference_per_model(tmp_path: Path) -> None:
    seeds = (0, 1, 2, 3, 4)
    write_world(tmp_path, PAPER_WORLD, corpora=("math2",), seeds=seeds, n_items=400)
    spec = {**STAT, "models": ["tinyA", "tinyB"], "corpus": "math2", "runs": run_names_on(seeds)}
    spec |= {"method": "rpb", "reference": "lbl", "families": {"tinyA": "A", "tinyB": "B"}}
    df = build_table3(tmp_path, spec, tmp_path / "table3.csv")
    assert list(zip(df["model"], df["metric"], strict=True)) == [
        ("tinyA", "in_domain"),
        ("tinyA", "ood"),
        ("tinyB", "in_domain"),
        ("tinyB", "ood"),
    ]
    row = df.iloc[0]
    assert row["diff"] == pytest.approx(row["method_score"] - row["reference_score"])
    assert 0 < row["diff_ci_low"] <= row["diff"] <= row["diff_ci_high"]
    assert row["p_value"] < 0.05 and row["n_items"] == 400 and row["n_seeds"] == 5
    # The run-level t-interval: the paired t-test of the per-run differences, or wider where
    # the items' own noise exceeds the runs' spread (the floor).
    a = [100 * np.mean(np.random.default_rng(1000 + s).random(400) < 0.8) for s in seeds]
    b = [100 * np.mean(np.random.default_rng(1000 + s).random(400) < 0.35) for s in seeds]
    ci = stats.ttest_rel(a, b).confidence_interval(0.95)
    assert row["diff_ci_low"] <= ci.low + 1e-9 and row["diff_ci_high"] >= ci.high - 1e-9
    assert row["diff_sd"] >= np.std(np.subtract(a, b), ddof=1) - 1e-9
    assert row["mde"] < 5.0
    ood = df.iloc[1]
    assert ood["n_items"] == 400 * len(OOD_ALL)  # the items of every OOD task per run
    on_disk = pd.read_csv(tmp_path / "table3.csv")
    assert list(on_disk.columns) == list(df.columns)
    # p(target) beside exact match: the world's p_target items are 0.02 + 0.96 x exact match plus
    # a wobble every label shares, so each paired p(target) difference is 0.96 times exact
    # match's, and each score the planted items' two-level mean.
    p_columns = ["method_score_p", "reference_score_p", "diff_p", "diff_p_ci_low"]
    p_columns += ["diff_p_ci_high", "p_value_p", "diff_p_sd", "mde_p", "mde_equivalence_p"]
    assert list(df.columns[-len(p_columns) :]) == p_columns
    for _, r in df.iterrows():
        assert r["diff_p"] == pytest.approx(0.96 * r["diff"])
        assert r["diff_p"] == pytest.approx(r["method_score_p"] - r["reference_score_p"])
        assert r["diff_p_ci_low"] <= r["diff_p"] <= r["diff_p_ci_high"] and r["mde_p"] > 0
    p_rpb = [
        np.mean(json.loads(path.read_text())["tasks"]["rpb_math2_ll"]["p_target"])
        for path in sorted((tmp_path / "eval/tinyA/math2/rpb/base0").glob("seed*.json"))
    ]
    assert len(p_rpb) == 5 and row["method_score_p"] == pytest.approx(100 * np.mean(p_rpb))
    assert "are p(target)" in (tmp_path / "table3.md").read_text()


def test_table4_ranks_and_consistency(tmp_path: Path) -> None:
    # A fixed order everywhere: weight > logit > kl > rpb.
    world = {
        "rpb": (0.2, 0.5, 0.5),
        "anchor_weight": (0.9, 0.5, 0.5),
        "anchor_logit": (0.7, 0.5, 0.5),
        "anchor_kl": (0.5, 0.5, 0.5),
    }
    write_world(tmp_path, {**world, "base": PAPER_WORLD["base"]}, models=("tinyA",))
    methods = list(world)
    spec = {**STAT, "model": "tinyA", "corpora": ["math", "math2"], "runs": run_names_on([0, 1])}
    spec["methods"] = methods
    df = build_table4(tmp_path, spec, tmp_path / "table4.csv")
    assert len(df) == 2 * 2 * 4
    assert list(df.columns) == [
        *["model", "corpus", "base", "seed", "method", "in_domain", "in_domain_p", "ood_mean"],
        *["ood_mean_p", "rank_in_domain", "rank_in_domain_p", "rank_ood_mean", "rank_ood_mean_p"],
    ]
    best = df[df["rank_in_domain"] == 1]
    assert set(best["method"]) == {"anchor_weight"} and len(best) == 4
    # p(target) follows the same planted order: its ranks are exact match's.
    assert (df["rank_in_domain_p"] == df["rank_in_domain"]).all()
    # OOD is a four-way tie in every block: average rank 2.5.
    assert (df["rank_ood_mean"] == 2.5).all()
    consistency = pd.read_csv(tmp_path / "table4_consistency.csv").set_index("metric")
    assert list(consistency.index) == ["in_domain", "in_domain_p", "ood_mean", "ood_mean_p"]
    assert consistency.loc["in_domain_p", "same_best"] == "anchor_weight"
    assert consistency.loc["in_domain", "identical_ranking"]
    assert consistency.loc["in_domain", "consistent_ordering"]
    assert consistency.loc["in_domain", "same_best"] == "anchor_weight"
    assert not consistency.loc["ood_mean", "consistent_ordering"]
    pairs = pd.read_csv(tmp_path / "table4_pairs.csv")
    assert len(pairs) == 6 * 2
    first = pairs[(pairs["method"] == "rpb") & (pairs["other"] == "anchor_weight")]
    assert first[first["metric"] == "in_domain"]["diff_ci_high"].item() < 0
    # One paired run per (corpus, seed): 2 corpora x 2 seeds, N_ITEMS items each.
    assert first[first["metric"] == "in_domain"]["n_seeds"].item() == 4
    assert first[first["metric"] == "in_domain"]["n_items"].item() == N_ITEMS
    in_domain = first[first["metric"] == "in_domain"].iloc[0]
    assert in_domain["diff_p"] == pytest.approx(0.96 * in_domain["diff"])
    assert in_domain["diff_p_ci_high"] < 0
    summary = pd.read_csv(tmp_path / "table4_summary.csv")
    assert set(summary["metric"]) == {"in_domain", "in_domain_p", "ood_mean", "ood_mean_p"}
    assert "Is any ordering consistent?" in (tmp_path / "table4.md").read_text()


def test_table5_correlation_hard_and_base(tmp_path: Path) -> None:
    write_world(tmp_path, PAPER_WORLD, models=("tinyA",), corpora=("math",))
    spec = {**STAT, "model": "tinyA", "corpus": "math", "runs": run_names_on([0, 1])}
    spec |= {"methods": ["none", "lbl", "rpb", "hard"], "kinds": {"hard": "hard"}}
    spec["correlate"] = ["none", "lbl", "rpb", "anchor_weight", "anchor_logit", "anchor_kl"]
    df = build_table5(tmp_path, spec, tmp_path / "table5.csv")
    assert list(df["method"]) == ["base", "none", "lbl", "rpb", "hard"]
    accuracy = ["in_domain", "in_domain_ci_low", "in_domain_ci_high", "in_domain_p"]
    accuracy += ["in_domain_p_ci_low", "in_domain_p_ci_high", "ood_mean", "ood_mean_p"]
    assert [c for c in df.columns if c.startswith(("in_domain", "ood"))] == accuracy
    hard = df.set_index("method").loc["hard"]
    assert hard["community_nmi"] == pytest.approx(0.955)  # mean over seeds 0 and 1
    assert hard["in_domain_p_ci_low"] <= hard["in_domain_p"] <= hard["in_domain_p_ci_high"]
    corr = pd.read_csv(tmp_path / "table5_correlation.csv").set_index(["retention", "accuracy"])
    row = corr.loc[("community_nmi", "in_domain")]
    assert row["n_runs"] == 12 and row["spearman_rho"] > 0.7 and row["rho_ci_low"] > 0
    p_row = corr.loc[("community_nmi", "in_domain_p")]
    assert p_row["n_runs"] == 12 and p_row["spearman_rho"] > 0.7
    assert len(corr) == 3 * 4  # every retention metric with each accuracy column
    comparisons = pd.read_csv(tmp_path / "table5_hard.csv")
    vs_rpb = comparisons[(comparisons["other"] == "rpb")].set_index("metric")
    assert vs_rpb.loc["in_domain", "diff_ci_high"] < 0
    assert vs_rpb.loc["community_nmi", "diff"] == pytest.approx(0.25)
    assert vs_rpb.loc["in_domain", "diff_p"] == pytest.approx(
        0.96 * vs_rpb.loc["in_domain", "diff"]
    )
    # With the trunk frozen, the caption says hard is handicapped by construction; else not.
    assert "handicapped" not in (tmp_path / "table5.md").read_text()
    build_table5(tmp_path, spec | {"trunk_frozen": True}, tmp_path / "table5.csv")
    assert "Hard is handicapped by construction" in (tmp_path / "table5.md").read_text()
    assert math.isnan(vs_rpb.loc["community_nmi", "diff_p"])  # NMI has no p(target) twin
    base = pd.read_csv(tmp_path / "table5_base.csv").set_index("layer")
    assert base.loc["mean", "modularity"] > base.loc["mean", "uniform_modularity"]
    assert base.loc["mean", "top_k"] == 2 and base.loc["mean", "experts"] == 4
    for name in ("retention_vs_in_domain", "retention_vs_ood_mean", "table5_coactivation"):
        assert (tmp_path / "figures" / f"{name}.png").is_file()


def test_one_method_row_feeds_tables_1_2_and_5(tmp_path: Path) -> None:
    """The rows of tables 1, 2 and 5 are `method_row`'s, each table a choice of its columns."""
    from rpb.report.table5 import table5_frames
    from rpb.report.tables import TableContext

    write_world(tmp_path, PAPER_WORLD, models=("tinyA",), corpora=("math",))
    spec = {**STAT, "model": "tinyA", "corpus": "math", "runs": run_names_on([0, 1]), "family": "B"}
    spec |= {"methods": ["none", "rpb", "hard"], "correlate": ["none", "rpb"]}
    row = TableContext.of(tmp_path, spec).method_row("math", "rpb", [Run(0, 0), Run(0, 1)])
    assert row["n_seeds"] == 2 and row["ood_mean"] == pytest.approx(
        np.mean([row[f"ood_{t}"] for t in OOD_ALL])
    )
    assert row["kl_to_base"] == pytest.approx(0.3)  # write_run's 1 - NMI level, both seeds
    for table in (
        build_table1(tmp_path, spec, tmp_path / "t1.csv"),
        build_table2(tmp_path, spec, tmp_path / "t2.csv"),
        table5_frames(tmp_path, spec)["table"],
    ):
        mine = table.set_index("method").loc["rpb"]
        for column in mine.index.drop(["model", "paper_in_domain"], errors="ignore"):
            assert mine[column] == row[column], column


def test_a_failed_table_job_leaves_none_of_the_old_table(
    tmp_path: Path, empty_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 47 (7e): a table job that fails leaves none of its old files. Before, the undeclared
    table1.meta.json (and, run by hand, the .md and .html too) stayed beside a missing
    table1.csv; Snakemake deletes only the declared outputs."""
    from conftest import new_store

    from rpb.pipeline.cli import main
    from rpb.pipeline.results_folder import RESULTS_ENV

    results = tmp_path / "results"
    _fake_results(results, SPEC)
    monkeypatch.setenv(RESULTS_ENV, str(results))
    out = results / "table1.csv"
    argv = ["pipeline", "table1", "--results", str(results), "--spec", json.dumps(SPEC)]
    argv += ["--out", str(out)]
    argv += ["--tracking-uri", new_store(empty_store, tmp_path / "m.db"), "--experiment", "t"]
    assert main(argv) == 0
    group = [out.with_suffix(s) for s in (".csv", ".md", ".html", ".meta.json")]
    assert all(p.is_file() for p in group)
    assert (results / ".integrity" / "table1.meta.json.json").is_file()
    # An input the table needs goes missing (as after a deleted run): the rebuild fails.
    eval_path(results, "tinyA", "math", "rpb", Run(0, 1)).unlink()
    assert main(argv) == 2
    assert [p.name for p in group if p.exists()] == []
    assert not (results / ".integrity" / "table1.meta.json.json").exists()


def test_a_table_job_whose_store_is_full_leaves_none_of_its_table(
    tmp_path: Path,
    empty_store: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    """Issue 59, item 7: a full disk in the MLflow store while the table job logged its outputs
    left table1.meta.json (and the landing page) beside the table1.csv Snakemake deleted: the job
    had written them before it failed. Now a table job that fails after writing its files deletes
    them, and says so in one line naming the store."""
    import mlflow
    from conftest import new_store

    import rpb.pipeline.tracking as tracking
    from rpb.pipeline.cli import main
    from rpb.pipeline.results_folder import RESULTS_ENV

    results = tmp_path / "results"
    _fake_results(results, SPEC)
    monkeypatch.setenv(RESULTS_ENV, str(results))
    out = results / "table1.csv"
    uri = new_store(empty_store, tmp_path / "m.db")
    argv = ["pipeline", "table1", "--results", str(results), "--spec", json.dumps(SPEC)]
    argv += ["--out", str(out), "--tracking-uri", uri, "--experiment", "t"]

    def full(*args: object, **kwargs: object) -> None:
        raise mlflow.exceptions.MlflowException(
            "(sqlite3.OperationalError) database or disk is full"
        )

    monkeypatch.setattr(tracking, "log_table_run", full)
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    (line,) = [x for x in err if not x.startswith("20")]  # but MLflow's own INFO lines
    assert (
        line == f"rpb pipeline table1: error: tracking store {tmp_path / 'm.db'}: disk full; "
        "free space, then rerun"
    )
    group = [out.with_suffix(s) for s in (".csv", ".md", ".html", ".meta.json", ".landing.html")]
    assert [p.name for p in group if p.exists()] == []


# --- table 1's landing page ---------------------------------------------------------------------


def test_landing_headline_gives_the_ood_mean_its_interval_over_runs(
    table: tuple[pd.DataFrame, dict, Path],
) -> None:
    """The headline's OOD mean carries the t-interval of the runs' OOD means (table 1 has none),
    beside table 1's own in-domain cell; a wrong pooling (items, or tasks as runs) fails."""
    frame, written, out = table
    headline = headline_frame(out.parent, SPEC, frame).set_index("method")
    assert list(headline.columns) == [
        "runs",
        "in-domain exact match",
        "in-domain p(target)",
        "OOD mean exact match",
        "OOD mean p(target)",
    ]
    runs = [np.mean([100 * np.mean(written["rpb"][s]["tasks"][t]) for t in OOD]) for s in (0, 1)]
    low, high = stats.t.interval(0.95, 1, loc=np.mean(runs), scale=stats.sem(runs))
    low, high = max(0.0, low), min(100.0, high)
    assert headline.loc["rpb", "OOD mean exact match"] == (
        f"{np.mean(runs):.2f} [{low:.2f}, {high:.2f}]"
    )
    row = frame.set_index("method").loc["rpb"]
    assert (
        headline.loc["rpb", "in-domain exact match"]
        == Cell(row["in_domain"], row["in_domain_ci_low"], row["in_domain_ci_high"]).text()
    )
    # The base row is one run per base: its interval is over that run's items, not [x, x].
    cell = headline.loc["base", "OOD mean exact match"]
    estimate, low, high = map(float, re.findall(r"[\d.]+", cell))
    assert low < estimate < high


def test_landing_per_task_table_puts_methods_in_columns(
    table: tuple[pd.DataFrame, dict, Path],
) -> None:
    frame, _, out = table
    per_task = per_task_frame(SPEC, frame).set_index("")
    assert list(per_task.columns) == ["base", "none", "lbl", "rpb"]
    assert list(per_task.index) == [
        "in-domain math",
        "OOD addition",
        "OOD facts",
        "modularity",
        "community NMI with the base",
        "co-activation cosine with the base",
        PAPER_ROW,
    ]
    row = frame.set_index("method").loc["lbl"]
    assert per_task.loc["OOD facts", "lbl"] == f"{row['ood_facts']:.2f} / {row['ood_facts_p']:.2f}"
    assert per_task.loc[PAPER_ROW, "base"] == ""  # the paper reports no base number
    landing = out.with_suffix(".landing.html").read_text()
    assert "OOD mean exact match" in landing and "OOD facts" in landing


def test_a_cell_without_an_interval_shows_its_value_alone() -> None:
    assert Cell(12.345, 10.0, 15.0).text() == "12.35 [10.00, 15.00]"
    assert Cell(12.345, math.nan, math.nan).text() == "12.35"
    assert Cell(12.345).text(1) == "12.3"
