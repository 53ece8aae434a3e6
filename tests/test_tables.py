"""The seeds x items bootstrap CI and table 1 built from synthetic pipeline outputs."""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import save_file
from scipy import stats

from rpb.stats import two_way_bootstrap_ci
from rpb.tables import PAPER_TABLE1, build_table1

# --- two_way_bootstrap_ci ---------------------------------------------------------------------


def test_mean_is_exact_and_ci_brackets_it() -> None:
    scores = np.random.default_rng(0).random((3, 40))
    mean, low, high = two_way_bootstrap_ci(scores, n_resamples=500)
    assert mean == scores.mean()
    assert low < mean < high


def test_one_seed_is_the_item_bootstrap_of_scipy() -> None:
    items = np.random.default_rng(1).normal(0.6, 0.2, size=300)
    _, low, high = two_way_bootstrap_ci(items[None, :], n_resamples=4000, seed=3)
    ref = stats.bootstrap(
        (items,),
        np.mean,
        confidence_level=0.95,
        n_resamples=4000,
        method="percentile",
        random_state=np.random.default_rng(4),
    ).confidence_interval
    width = ref.high - ref.low
    # Different random draws: agreement to a few percent of the width is what Monte Carlo allows.
    assert low == pytest.approx(ref.low, abs=0.06 * width)
    assert high == pytest.approx(ref.high, abs=0.06 * width)


def test_ci_narrows_with_more_items() -> None:
    rng = np.random.default_rng(2)
    few = two_way_bootstrap_ci(rng.random((2, 50)), n_resamples=1000)
    many = two_way_bootstrap_ci(rng.random((2, 800)), n_resamples=1000)
    # Width scales as 1/sqrt(items): 16x the items, about 1/4 the width.
    assert (many[2] - many[1]) < 0.4 * (few[2] - few[1])


def test_seed_to_seed_variation_widens_the_ci() -> None:
    """Resampling seeds, not only items: rows that disagree must widen the interval."""
    items = np.random.default_rng(5).random(200)
    same = np.stack([items] * 4)
    spread = same + np.array([-0.2, -0.1, 0.1, 0.2])[:, None]
    _, low_same, high_same = two_way_bootstrap_ci(same, n_resamples=1000)
    mean, low_spread, high_spread = two_way_bootstrap_ci(spread, n_resamples=1000)
    assert mean == pytest.approx(same.mean())
    assert (high_spread - low_spread) > 2 * (high_same - low_same)


def test_bootstrap_is_deterministic_per_seed() -> None:
    scores = np.random.default_rng(6).random((3, 30))
    assert two_way_bootstrap_ci(scores, seed=7) == two_way_bootstrap_ci(scores, seed=7)
    assert two_way_bootstrap_ci(scores, seed=7) != two_way_bootstrap_ci(scores, seed=8)


@pytest.mark.parametrize("bad", [np.zeros(5), np.zeros((0, 4)), np.zeros((2, 3, 4))])
def test_bootstrap_rejects_non_matrices(bad: np.ndarray) -> None:
    with pytest.raises(ValueError, match="seeds x items"):
        two_way_bootstrap_ci(bad)


# --- build_table1 -----------------------------------------------------------------------------

OOD = ["addition", "facts"]
SPEC: dict[str, Any] = {
    "model": "tinyA",
    "corpus": "math",
    "methods": ["none", "lbl", "rpb"],
    "seeds": [0, 1],
    "in_domain": ["math"],
    "ood": OOD,
    "scale": "smoke",
}
# Per label: probability of a correct in-domain item, of a correct OOD item, and a modularity.
LEVELS = {"base": (0.0, 0.9, 0.30), "none": (0.7, 0.3, 0.20), "lbl": (0.6, 0.4, 0.22)}
LEVELS["rpb"] = (0.8, 0.6, 0.28)


def _write(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload))


def _fake_results(root: Path, spec: dict) -> dict[str, dict[int, dict]]:
    """Eval and analysis JSONs laid out as the pipeline writes them; returns what was written."""
    rng = np.random.default_rng(0)
    written: dict[str, dict[int, dict]] = {}
    for label in ["base", *spec["methods"]]:
        p_in, p_ood, modularity = LEVELS[label]
        written[label] = {}
        for seed in [0] if label == "base" else spec["seeds"]:
            tasks = {"math": (rng.random(25) < p_in).astype(int).tolist()}
            tasks |= {t: (rng.random(10) < p_ood).astype(int).tolist() for t in spec["ood"]}
            mean = {
                "modularity": modularity + 0.01 * seed,
                "community_nmi": 0.5 + 0.1 * seed,
                "coact_cosine": 0.9 - 0.05 * seed,
            }
            where = Path(spec["model"], spec["corpus"], label, f"seed{seed}.json")
            payload = {f"rpb_{t}": {"items": v, "metric": "exact_match"} for t, v in tasks.items()}
            _write(root / "eval" / where, {"tasks": payload})
            _write(root / "analysis" / where, {"mean": mean})
            # The analysis job's co-activation counts [layers, experts, experts] beside its JSON.
            counts = rng.integers(0, 50, size=(2, 4, 4))
            counts = torch.from_numpy(counts + counts.transpose(0, 2, 1))
            counts_path = (root / "analysis" / where).with_suffix(".safetensors")
            save_file({"counts": counts}, str(counts_path))
            written[label][seed] = {"tasks": tasks, "mean": mean}
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
        "ood_addition",
        "ood_facts",
        "ood_mean",
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
    assert "Table 1" in out.with_suffix(".md").read_text()
    assert json.loads(out.with_suffix(".meta.json").read_text())["seeds"] == [0, 1]
    assert list((out.parent / "figures").glob("table1_coactivation*"))


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
        if label != "base":  # the t-interval over the runs' scores, cut to [0, 100]
            runs = [100 * np.mean(s["tasks"]["math"]) for s in per_seed.values()]
            ci = stats.ttest_1samp(runs, 0.0).confidence_interval(0.95)
            assert row["in_domain_ci_low"] == pytest.approx(max(0.0, ci.low))
            assert row["in_domain_ci_high"] == pytest.approx(min(100.0, ci.high))


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
    scored in-domain on the items of every task `corpus_tasks` lists for it, pooled."""
    results = tmp_path / "results"
    written = _fake_results(results, SPEC)
    bench = {"gsm8k": [1, 1, 0, 0], "minerva_math500": [1, 0]}
    for label, seeds in written.items():
        for seed, entry in seeds.items():
            path = results / "eval" / "tinyA" / "math" / label / f"seed{seed}.json"
            tasks = {t: {"items": v} for t, v in entry["tasks"].items() if t != "math"}
            _write(path, {"tasks": tasks | {t: {"items": v} for t, v in bench.items()}})
    spec = SPEC | {"corpus_tasks": {"math": ["gsm8k", "minerva_math500"]}}
    out = results / "table1.csv"
    table = build_table1(results, spec, out).set_index("method")
    # Per benchmark, and their mean (not the pooled items, 3 / 6): each benchmark weighs the same.
    assert table.loc["rpb", "in_domain_gsm8k"] == pytest.approx(50.0)
    assert table.loc["rpb", "in_domain_minerva_math500"] == pytest.approx(50.0)
    bench["minerva_math500"] = [1, 1]
    for label, seeds in written.items():
        for seed in seeds:
            path = results / "eval" / "tinyA" / "math" / label / f"seed{seed}.json"
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
        build_table1(results, SPEC, out)


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
    missing = tmp_path / "analysis" / "tinyA" / "math" / "rpb" / "seed1.json"
    missing.unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        build_table1(tmp_path, SPEC, tmp_path / "t.csv")


def test_missing_task_names_file_and_task(tmp_path: Path) -> None:
    _fake_results(tmp_path, SPEC)
    path = tmp_path / "eval" / "tinyA" / "math" / "lbl" / "seed0.json"
    result = json.loads(path.read_text())
    del result["tasks"]["rpb_facts"]
    path.write_text(json.dumps(result))
    with pytest.raises(ValueError, match=re.escape(f"{path}: no task 'rpb_facts'")):
        build_table1(tmp_path, SPEC, tmp_path / "t.csv")


# --- paired differences, bootstrap p-values, Spearman and rank consistency (rpb.stats) --------

from rpb.stats import (  # noqa: E402
    bootstrap_p_value,
    paired_difference,
    rank_consistency,
    spearman_ci,
)


def test_paired_difference_matches_scipy_paired_bootstrap_for_one_seed() -> None:
    rng = np.random.default_rng(10)
    a = rng.normal(0.5, 0.3, 300)
    b = a - 0.05 + rng.normal(0, 0.2, 300)
    diff = paired_difference(a[None], b[None], n_resamples=4000, seed=1)
    ref = stats.bootstrap(
        (a, b),
        lambda x, y: np.mean(x - y),
        paired=True,
        vectorized=False,
        n_resamples=4000,
        method="percentile",
        rng=np.random.default_rng(2),
    ).confidence_interval
    width = ref.high - ref.low
    assert diff.estimate == pytest.approx(np.mean(a - b))
    assert diff.low == pytest.approx(ref.low, abs=0.06 * width)
    assert diff.high == pytest.approx(ref.high, abs=0.06 * width)
    assert (diff.n_seeds, diff.n_items) == (1, 300)


def test_paired_difference_keeps_the_pairing() -> None:
    """Items vary a lot but both methods move together: the paired CI must be narrow."""
    base = np.random.default_rng(11).random((2, 200)) * 100
    diff = paired_difference(base + 1.0, base)
    assert diff.estimate == pytest.approx(1.0)
    assert diff.low == pytest.approx(1.0) and diff.high == pytest.approx(1.0)
    assert diff.p_value < 0.01


@pytest.mark.parametrize("shift", [0.0, 0.04, 0.08])
def test_bootstrap_p_value_agrees_with_the_paired_t_test(shift: float) -> None:
    rng = np.random.default_rng(12)
    a = rng.normal(0.0, 0.3, 400)
    b = a - shift + rng.normal(0, 0.3, 400)
    diff = paired_difference(a[None], b[None], n_resamples=4000, seed=3)
    ref = stats.ttest_rel(a, b).pvalue
    # Large n: the bootstrap and t reference distributions agree; the rest is Monte Carlo error.
    assert diff.p_value == pytest.approx(ref, abs=0.03 + 0.15 * ref)
    # p < 0.05 exactly when the 95% CI excludes zero: both come from the same replicates.
    assert (diff.p_value < 0.05) == (diff.low > 0 or diff.high < 0)


def test_bootstrap_p_value_edges() -> None:
    assert bootstrap_p_value(np.zeros(99)) == 1.0
    assert bootstrap_p_value(np.ones(99)) == pytest.approx(2 / 100)
    assert bootstrap_p_value(np.r_[-np.ones(10), np.ones(89)]) == pytest.approx(2 * 11 / 100)
    with pytest.raises(ValueError, match="finite"):
        bootstrap_p_value(np.array([np.nan, 1.0]))


def test_paired_difference_of_one_cell_has_no_interval() -> None:
    diff = paired_difference(np.array([[0.9]]), np.array([[0.4]]))
    assert diff.estimate == pytest.approx(0.5)
    assert math.isnan(diff.low) and math.isnan(diff.high) and math.isnan(diff.p_value)


def test_paired_difference_rejects_unpaired_shapes() -> None:
    with pytest.raises(ValueError, match="differ in shape"):
        paired_difference(np.zeros((2, 5)), np.zeros((2, 6)))
    with pytest.raises(ValueError, match="NaN"):
        paired_difference(np.full((1, 3), np.nan), np.zeros((1, 3)))


def test_spearman_matches_scipy_and_its_ci_brackets_rho() -> None:
    rng = np.random.default_rng(13)
    x = rng.random(30)
    y = x + rng.normal(0, 0.3, 30)
    corr = spearman_ci(x, y, n_resamples=1000)
    ref = stats.spearmanr(x, y)
    assert corr.rho == pytest.approx(ref.statistic)
    assert corr.p_value == pytest.approx(ref.pvalue)
    assert corr.low < corr.rho < corr.high and corr.n == 30
    boot = stats.bootstrap(
        (x, y),
        lambda u, v: stats.spearmanr(u, v).statistic,
        paired=True,
        vectorized=False,
        n_resamples=1000,
        method="percentile",
        rng=np.random.default_rng(4),
    ).confidence_interval
    assert corr.low == pytest.approx(boot.low, abs=0.08)
    assert corr.high == pytest.approx(boot.high, abs=0.08)


def test_spearman_monotone_and_degenerate() -> None:
    x = np.arange(8.0)
    perfect = spearman_ci(x, x**3, n_resamples=200)
    assert (perfect.rho, perfect.low, perfect.high) == pytest.approx((1.0, 1.0, 1.0))
    flat = spearman_ci(x, np.ones(8))
    assert math.isnan(flat.rho) and math.isnan(flat.low)
    assert math.isnan(spearman_ci([1.0, 2.0], [2.0, 1.0]).rho)


def test_spearman_ci_survives_constant_resamples() -> None:
    """Four of five units share x: many replicates are constant and have no rho."""
    x, y = np.array([0.0, 0.0, 0.0, 0.0, 1.0]), np.array([0.1, 0.3, 0.2, 0.4, 0.9])
    corr = spearman_ci(x, y, n_resamples=500)
    assert corr.rho == pytest.approx(stats.spearmanr(x, y).statistic)
    assert -1.0 <= corr.low <= corr.high <= 1.0


def test_rank_consistency_identical_vs_shuffled_orderings() -> None:
    methods = ["a", "b", "c", "d"]
    same = np.tile([4.0, 3.0, 2.0, 1.0], (6, 1))
    check = rank_consistency(same, methods)
    assert check.identical_ranking and check.same_best == "a"
    assert check.kendall_w == pytest.approx(1.0)
    # scipy's Friedman test on the same blocks.
    assert check.friedman_p == pytest.approx(stats.friedmanchisquare(*same.T).pvalue)
    assert check.friedman_p < 0.01 and check.mean_rank == {"a": 1, "b": 2, "c": 3, "d": 4}
    # Every method wins some blocks: no ordering.
    latin = np.array([np.roll([4.0, 3.0, 2.0, 1.0], i) for i in range(4)])
    check = rank_consistency(latin, methods)
    assert not check.identical_ranking and check.same_best is None
    assert check.kendall_w == pytest.approx(0.0) and check.friedman_p == pytest.approx(1.0)
    ties = rank_consistency(np.ones((3, 4)), methods)
    assert math.isnan(ties.friedman_p) and ties.same_best is None
    with pytest.raises(ValueError, match="blocks x methods"):
        rank_consistency(np.ones((3, 4)), methods[:3])


# --- tables 2-5 from synthetic pipeline outputs -----------------------------------------------

N_ITEMS = 40
OOD_ALL = ["addition", "facts"]
# label -> (in-domain accuracy, OOD accuracy, community NMI) of a "paper-like" world.
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
    together (structured) or every pair equally often (no structure at all)."""
    pairs = [(0, 1), (2, 3)] if structured else [(i, j) for i in range(4) for j in range(i + 1, 4)]
    counts = np.zeros((4, 4))
    for t in range(tokens):
        i, j = pairs[(t + seed) % len(pairs)]
        counts[[i, j, i, j], [j, i, i, j]] += 1
    return np.stack([counts, counts])


@functools.cache
def _base_layers(tokens: int, structured: bool) -> list[dict[str, Any]]:
    """Per-layer rows of the base's analysis, as rpb.analysis writes them."""
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


def write_run(
    root: Path,
    model: str,
    corpus: str,
    label: str,
    seed: int,
    levels: tuple[float, float, float],
    *,
    ood: list[str] = OOD_ALL,
    n_items: int = N_ITEMS,
    structured_base: bool = True,
    routing: dict[str, float] | None = None,
) -> None:
    """One (model, corpus, label, seed) as the pipeline lays it out: eval JSON with exact-match
    items, analysis JSON with layer means (and, for the base, per-layer rows and the probe size)
    and co-activation counts. Items are coupled across labels (item i is right when a fixed
    per-seed uniform draw is below the label's accuracy), so paired differences are clean.
    `routing` overrides layer-mean analysis entries (usage entropy, drift)."""
    p_in, p_ood, nmi = levels
    u = np.random.default_rng(1000 + seed).random(n_items)
    tasks = {corpus: (u < p_in).astype(int).tolist()}
    tasks |= {t: (u < p_ood).astype(int).tolist() for t in ood}
    where = Path(model, corpus, label, f"seed{seed}.json")
    payload = {f"rpb_{t}": {"items": v, "metric": "exact_match"} for t, v in tasks.items()}
    _write(root / "eval" / where, {"tasks": payload})
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
    _write(
        root / "analysis" / where,
        {"mean": mean, "layers": layers, "probe": {"tokens": tokens}},
    )
    counts = base_counts if label == "base" else _block_counts(tokens, False, seed)
    save_file(
        {
            "counts": torch.from_numpy(counts).long(),
            "base_counts": torch.from_numpy(base_counts).long(),
        },
        str((root / "analysis" / where).with_suffix(".safetensors")),
    )


def write_world(
    root: Path,
    world: dict[str, tuple[float, float, float]],
    *,
    models: tuple[str, ...] = ("tinyA", "tinyB"),
    corpora: tuple[str, ...] = ("math", "math2"),
    seeds: tuple[int, ...] = (0, 1),
    routing: dict[str, dict[str, float]] | None = None,
    **kwargs: Any,
) -> None:
    """Every label of `world` for every model, corpus and seed (the base at seed 0); `routing`:
    per label, analysis entries to override (see `write_run`)."""
    for model in models:
        for corpus in corpora:
            for label, levels in world.items():
                for seed in [0] if label == "base" else seeds:
                    extra = (routing or {}).get(label)
                    write_run(root, model, corpus, label, seed, levels, routing=extra, **kwargs)


STAT = {"confidence": 0.95, "n_resamples": 300, "scale": "smoke", "ood": OOD_ALL}


def test_table2_is_table1_for_another_model(tmp_path: Path) -> None:
    from rpb.tables import build_table2

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
    from rpb.tables import build_table3

    seeds = (0, 1, 2, 3, 4)
    write_world(tmp_path, PAPER_WORLD, corpora=("math2",), seeds=seeds, n_items=400)
    spec = {**STAT, "models": ["tinyA", "tinyB"], "corpus": "math2", "seeds": list(seeds)}
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


def test_table4_ranks_and_consistency(tmp_path: Path) -> None:
    from rpb.tables import build_table4

    # A fixed order everywhere: weight > logit > kl > rpb.
    world = {
        "rpb": (0.2, 0.5, 0.5),
        "anchor_weight": (0.9, 0.5, 0.5),
        "anchor_logit": (0.7, 0.5, 0.5),
        "anchor_kl": (0.5, 0.5, 0.5),
    }
    write_world(tmp_path, {**world, "base": PAPER_WORLD["base"]}, models=("tinyA",))
    methods = list(world)
    spec = {**STAT, "model": "tinyA", "corpora": ["math", "math2"], "seeds": [0, 1]}
    spec["methods"] = methods
    df = build_table4(tmp_path, spec, tmp_path / "table4.csv")
    assert len(df) == 2 * 2 * 4
    best = df[df["rank_in_domain"] == 1]
    assert set(best["method"]) == {"anchor_weight"} and len(best) == 4
    # OOD is a four-way tie in every block: average rank 2.5.
    assert (df["rank_ood_mean"] == 2.5).all()
    consistency = pd.read_csv(tmp_path / "table4_consistency.csv").set_index("metric")
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
    assert "Is any ordering consistent?" in (tmp_path / "table4.md").read_text()


def test_table5_correlation_hard_and_base(tmp_path: Path) -> None:
    from rpb.tables import build_table5

    write_world(tmp_path, PAPER_WORLD, models=("tinyA",), corpora=("math",))
    spec = {**STAT, "model": "tinyA", "corpus": "math", "seeds": [0, 1]}
    spec |= {"methods": ["none", "lbl", "rpb", "hard"], "kinds": {"hard": "hard"}}
    spec["correlate"] = ["none", "lbl", "rpb", "anchor_weight", "anchor_logit", "anchor_kl"]
    df = build_table5(tmp_path, spec, tmp_path / "table5.csv")
    assert list(df["method"]) == ["base", "none", "lbl", "rpb", "hard"]
    hard = df.set_index("method").loc["hard"]
    assert hard["community_nmi"] == pytest.approx(0.955)  # mean over seeds 0 and 1
    corr = pd.read_csv(tmp_path / "table5_correlation.csv").set_index(["retention", "accuracy"])
    row = corr.loc[("community_nmi", "in_domain")]
    assert row["n_runs"] == 12 and row["spearman_rho"] > 0.7 and row["rho_ci_low"] > 0
    comparisons = pd.read_csv(tmp_path / "table5_hard.csv")
    vs_rpb = comparisons[(comparisons["other"] == "rpb")].set_index("metric")
    assert vs_rpb.loc["in_domain", "diff_ci_high"] < 0
    assert vs_rpb.loc["community_nmi", "diff"] == pytest.approx(0.25)
    base = pd.read_csv(tmp_path / "table5_base.csv").set_index("layer")
    assert base.loc["mean", "modularity"] > base.loc["mean", "uniform_modularity"]
    assert base.loc["mean", "top_k"] == 2 and base.loc["mean", "experts"] == 4
    for name in ("retention_vs_in_domain", "retention_vs_ood_mean", "table5_coactivation"):
        assert (tmp_path / "figures" / f"{name}.png").is_file()
